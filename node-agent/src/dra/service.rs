//! The `DRAPlugin` v1 service: NodePrepareResources answers a claim with CDI device ids only
//! when the ledger grants its current allocation; NodeUnprepareResources removes the claim's
//! CDI spec and records it, also for claims it never saw or that are gone from the API.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuledger_auth::limit::{Slot, Slots};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::dra::v1 as dra;
use gpuledger_proto::ledger::v1 as pb;
use k8s_openapi::api::resource::v1::ResourceClaim;
use tonic::{Request, Response, Status};
use tracing::{Instrument, info, info_span, warn};

use super::cdi;
use super::prepare::{ClaimResult, Decision, decide};
use crate::agent::Agent;
use crate::config::DeviceListStrategy;
use crate::view::container_response;

/// How long a ClaimPrepared or ClaimUnprepared commit may take, failover included.
const COMMIT_BUDGET: Duration = Duration::from_secs(10);

/// The `limit` label of a claim refused for --dra-max-claims-in-flight.
pub const BITE_CLAIMS: &str = "claims_in_flight";

/// The DRAPlugin service.
pub struct Plugin {
    agent: Arc<Agent>,
    /// The claims being prepared or unprepared now (--dra-max-claims-in-flight).
    claims: Arc<Slots<()>>,
}

/// The time each step of one prepare took, in order.
struct Steps {
    last: Instant,
    took: Vec<(&'static str, Duration)>,
}

impl Steps {
    fn start() -> Steps {
        Steps {
            last: Instant::now(),
            took: Vec::new(),
        }
    }

    /// `step` ended now.
    fn done(&mut self, step: &'static str) {
        let now = Instant::now();
        self.took.push((step, now - self.last));
        self.last = now;
    }
}

impl Plugin {
    /// The service for `agent`.
    pub fn new(agent: Arc<Agent>) -> Plugin {
        let claims = Slots::new(
            (BITE_CLAIMS, BITE_CLAIMS),
            agent.cfg.dra_max_claims_in_flight,
            0,
            agent.dra_bites.clone(),
        );
        Plugin { agent, claims }
    }

    /// A slot for one claim's prepare or unprepare, or the error the kubelet retries.
    fn claim_slot(&self) -> Result<Slot<()>, String> {
        self.claims.try_acquire(()).map_err(|_| {
            format!(
                "node {} prepares or unprepares {} claims already, as many as its \
                 --dra-max-claims-in-flight allows; try again",
                self.agent.cfg.node_name,
                self.claims.in_use()
            )
        })
    }

    /// Prepare one claim: its devices, or the error the kubelet shows the user.
    async fn prepare(&self, c: &dra::Claim) -> Result<Vec<dra::Device>, String> {
        let who = format!("ResourceClaim {}/{} ({})", c.namespace, c.name, c.uid);
        if let Some(why) = self.agent.dra_off() {
            return Err(format!(
                "{who}: gpuledger serves no DRA on node {}: {why}",
                self.agent.cfg.node_name
            ));
        }
        let mut steps = Steps::start();
        let results = self.results(c).await.map_err(|e| format!("{who}: {e}"))?;
        steps.done("claim_read");
        let grants = match self.wait_grant(&c.uid, &results).await {
            Decision::Granted(g) => g,
            Decision::NotYet(why) | Decision::Refused(why) => {
                return Err(format!("{who}: no gpuledger grant: {why}"));
            }
        };
        steps.done("grant_wait");
        let devices = self
            .prepare_granted(&c.uid, grants, &mut steps)
            .await
            .map_err(|e| format!("{who}: {e}"))?;
        for (step, took) in &steps.took {
            self.agent
                .metrics
                .prepare_steps
                .get_or_create(&vec![("step", (*step).to_string())])
                .observe(took.as_secs_f64());
        }
        Ok(devices)
    }

    /// The claim's allocation results for our driver, as the API server has it now.
    async fn results(&self, c: &dra::Claim) -> Result<Vec<ClaimResult>, String> {
        let client = self
            .agent
            .kube
            .get()
            .ok_or("the node agent has no Kubernetes API client (--kubeconfig)")?;
        let api: kube::Api<ResourceClaim> = kube::Api::namespaced(client.clone(), &c.namespace);
        let claim = api
            .get_opt(&c.name)
            .await
            .map_err(|e| format!("reading it from the API server: {e}"))?
            .ok_or("the API server has no such claim")?;
        let uid = claim.metadata.uid.as_deref().unwrap_or_default();
        if uid != c.uid {
            return Err(format!(
                "the API server's claim of that name has uid {uid} (the claim was replaced)"
            ));
        }
        gpuledger_request::dra::claim_results(&claim)
            .ok_or_else(|| "the claim is not allocated".into())
    }

    /// The decision for claim `uid`, waiting up to --prepare-grant-wait for a grant (or a
    /// refusal) the view does not show yet.
    async fn wait_grant(&self, uid: &str, results: &[ClaimResult]) -> Decision {
        let a = &self.agent;
        let node = a.cfg.node_name.as_str();
        let now = a.with_view(|v| decide(uid, results, node, v));
        if a.synced() && !matches!(now, Decision::NotYet(_)) {
            return now;
        }
        // Where the ledger is: a view behind it may still receive the grant.
        let head = a
            .pool
            .call("Status", Duration::from_secs(2), |mut c| async move {
                c.status(api::StatusRequest {}).await
            })
            .await
            .map(|s| s.seq)
            .ok();
        let wait = a.cfg.prepare_grant_wait;
        let found = a
            .wait_view(wait, |v| match decide(uid, results, node, v) {
                Decision::NotYet(_) => None,
                d => Some(d),
            })
            .await;
        if let Some(d) = found {
            return d;
        }
        let (seq, d) = a.with_view(|v| (v.seq, decide(uid, results, node, v)));
        match d {
            Decision::NotYet(why) => {
                let behind = match head {
                    Some(h) if seq < h => {
                        format!("; the agent's ledger view is at seq {seq}, the allocator's at {h}")
                    }
                    Some(_) => String::new(),
                    None => "; the allocator did not answer".into(),
                };
                Decision::NotYet(format!("{why} (waited {wait:?}{behind})"))
            }
            d => d,
        }
    }

    /// Write the claim's CDI spec and record the prepare in the ledger; the devices for the
    /// kubelet. The same grants give the same spec and ids every time.
    async fn prepare_granted(
        &self,
        uid: &str,
        grants: Vec<(ClaimResult, pb::Allocation)>,
        steps: &mut Steps,
    ) -> Result<Vec<dra::Device>, String> {
        let a = &self.agent;
        let gpu_ids = a
            .cfg
            .device_list_strategy
            .contains(&DeviceListStrategy::CdiCri);
        // One CDI device per request, carrying all its results' grants: every allocation id,
        // and the limits indexed per device within the container, as Allocate's are.
        let mut requests: Vec<(String, Vec<&pb::Allocation>)> = Vec::new();
        for (r, g) in &grants {
            match requests.iter_mut().find(|(q, _)| *q == r.request) {
                Some((_, gs)) => gs.push(g),
                None => requests.push((r.request.clone(), vec![g])),
            }
        }
        let edits: Vec<(String, _)> = a.with_view(|v| {
            requests
                .iter()
                .map(|(q, gs)| {
                    (
                        q.clone(),
                        container_response(gs, v.inventory.as_ref(), &a.env),
                    )
                })
                .collect()
        });
        if let Some(h) = &a.env.hami_core {
            for (_, gs) in &requests {
                if let Some(g) = gs.first() {
                    h.make_cache_dir(g.id).map_err(|e| {
                        format!(
                            "creating HAMi-core's cache directory of allocation {}: {e}",
                            g.id
                        )
                    })?;
                }
            }
        }
        let spec = cdi::spec(uid, &edits);
        let bytes =
            serde_json::to_vec_pretty(&spec).map_err(|e| format!("encoding the CDI spec: {e}"))?;
        let path = cdi::spec_path(&a.cfg.cdi_spec_dir, uid);
        let p = path.clone();
        tokio::task::spawn_blocking(move || cdi::write_atomic(&p, &bytes))
            .await
            .map_err(|e| format!("writing the CDI spec: {e}"))?
            .map_err(|e| format!("writing the CDI spec {}: {e}", path.display()))?;
        steps.done("cdi_write");
        let mut devices = Vec::with_capacity(grants.len());
        let mut ours: Vec<String> = Vec::new();
        for (r, g) in &grants {
            let mut ids = Vec::new();
            // The claim device once per request (its first result); each result its GPU.
            let id = cdi::device_id(uid, &r.request);
            if !ours.contains(&id) {
                ours.push(id.clone());
                ids.push(id);
            }
            if gpu_ids {
                ids.extend(
                    g.shares
                        .iter()
                        .map(|s| format!("{}={}", a.cfg.cdi_kind, s.gpu_uuid)),
                );
            }
            devices.push(dra::Device {
                // A container names the main request, never `request/subrequest`.
                request_names: vec![gpuledger_request::dra::main_request(&r.request).to_string()],
                pool_name: r.pool.clone(),
                device_name: r.device.clone(),
                cdi_device_ids: ids,
                share_id: (!r.share_id.is_empty()).then(|| r.share_id.clone()),
            });
        }
        let todo: Vec<u64> = grants
            .iter()
            .filter(|(_, g)| {
                g.claim
                    .as_ref()
                    .is_none_or(|c| !c.prepared || !crate::view::same_set(&c.cdi_device_ids, &ours))
            })
            .map(|(_, g)| g.id)
            .collect();
        if !todo.is_empty() {
            let req = api::PrepareClaimRequest {
                node: a.cfg.node_name.clone(),
                allocation_ids: todo,
                cdi_device_ids: ours.clone(),
            };
            let w = a
                .pool
                .call("PrepareClaim", COMMIT_BUDGET, |mut c| {
                    let r = req.clone();
                    async move { c.prepare_claim(r).await }
                })
                .await
                .map_err(|s| format!("recording the prepare in the ledger: {}", s.message()))?;
            steps.done("commit");
            info!(seq = w.seq, epoch = w.epoch, cdi = ?ours, steps = ?steps.took, "claim prepared");
        }
        Ok(devices)
    }

    /// Unprepare one claim: remove its spec, record it for its grants.
    async fn unprepare(&self, c: &dra::Claim) -> Result<(), String> {
        let a = &self.agent;
        let dir = a.cfg.cdi_spec_dir.clone();
        let uid = c.uid.clone();
        tokio::task::spawn_blocking(move || cdi::remove(&dir, &uid))
            .await
            .map_err(|e| format!("removing the CDI spec: {e}"))?
            .map_err(|e| format!("removing the CDI spec: {e}"))?;
        let prepared: Vec<u64> = a.with_view(|v| {
            v.grants_of_claim(&c.uid)
                .into_iter()
                .filter(|g| g.claim.as_ref().is_some_and(|c| c.prepared))
                .map(|g| g.id)
                .collect()
        });
        if prepared.is_empty() {
            return Ok(());
        }
        let req = api::UnprepareClaimRequest {
            node: a.cfg.node_name.clone(),
            allocation_ids: prepared,
        };
        let w = a
            .pool
            .call("UnprepareClaim", COMMIT_BUDGET, |mut c| {
                let r = req.clone();
                async move { c.unprepare_claim(r).await }
            })
            .await
            .map_err(|s| format!("recording the unprepare in the ledger: {}", s.message()))?;
        info!(seq = w.seq, epoch = w.epoch, "claim unprepared");
        Ok(())
    }
}

fn claim_span(op: &'static str, c: &dra::Claim, node: &str) -> tracing::Span {
    info_span!("dra", op, %node, claim_uid = %c.uid, claim = %format!("{}/{}", c.namespace, c.name))
}

#[tonic::async_trait]
impl dra::dra_plugin_server::DraPlugin for Plugin {
    async fn node_prepare_resources(
        &self,
        req: Request<dra::NodePrepareResourcesRequest>,
    ) -> Result<Response<dra::NodePrepareResourcesResponse>, Status> {
        let node = self.agent.cfg.node_name.clone();
        let each = req.into_inner().claims.into_iter().map(|c| {
            let span = claim_span("NodePrepareResources", &c, &node);
            async move {
                let t0 = Instant::now();
                let r = match self.claim_slot() {
                    Ok(_slot) => self.prepare(&c).await,
                    Err(e) => Err(e),
                };
                let outcome = if r.is_ok() { "ok" } else { "error" };
                self.agent
                    .metrics
                    .prepare_latency
                    .get_or_create(&vec![("outcome", outcome.to_string())])
                    .observe(t0.elapsed().as_secs_f64());
                let answer = match r {
                    Ok(devices) => dra::NodePrepareResourceResponse {
                        devices,
                        error: String::new(),
                    },
                    Err(error) => {
                        warn!("prepare refused: {error}");
                        dra::NodePrepareResourceResponse {
                            devices: Vec::new(),
                            error,
                        }
                    }
                };
                (c.uid, answer)
            }
            .instrument(span)
        });
        let claims: HashMap<String, dra::NodePrepareResourceResponse> =
            futures::future::join_all(each).await.into_iter().collect();
        Ok(Response::new(dra::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        req: Request<dra::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<dra::NodeUnprepareResourcesResponse>, Status> {
        let node = self.agent.cfg.node_name.clone();
        let each = req.into_inner().claims.into_iter().map(|c| {
            let span = claim_span("NodeUnprepareResources", &c, &node);
            async move {
                let r = match self.claim_slot() {
                    Ok(_slot) => self.unprepare(&c).await,
                    Err(e) => Err(e),
                };
                let outcome = if r.is_ok() { "ok" } else { "error" };
                self.agent
                    .metrics
                    .unprepares
                    .get_or_create(&vec![("outcome", outcome.to_string())])
                    .inc();
                let error = r.err().unwrap_or_default();
                if !error.is_empty() {
                    warn!("unprepare failed: {error}");
                }
                (c.uid, dra::NodeUnprepareResourceResponse { error })
            }
            .instrument(span)
        });
        let claims = futures::future::join_all(each).await.into_iter().collect();
        Ok(Response::new(dra::NodeUnprepareResourcesResponse {
            claims,
        }))
    }
}
