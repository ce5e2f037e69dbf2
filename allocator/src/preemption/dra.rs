//! gpuledger's preemption for DRA pods, on the leader. A pod whose claims ask gpuledger's
//! DeviceClass and that kube-scheduler left Unschedulable ([`plan::may_preempt`]) is looked at
//! every pass: what its unallocated claims ask ([`plan::request`]) is searched for among the
//! DRA nodes its selectors and tolerations allow ([`plan::node_allows`]) with the same pure
//! [`preempt::choose_among`] the device-plugin path uses, claim grants counting as the pods
//! they are reserved for (the pods of a shared claim evicted together). When evicting
//! lower-priority pods frees room, the leader commits a `Nominated` event and evicts them
//! through the Eviction API (PodDisruptionBudgets respected). The certification then refuses
//! the room to the claims of pods that do not outrank the preemptor, grants it to the
//! preemptor's claim and ends the nomination; the sweep ends it when the pod is gone or the
//! deadline passes.

use std::sync::Arc;
use std::time::Duration;

use gpuledger_ledger::placement::{PodRequest, Policy};
use gpuledger_ledger::{Command, Reply, pb};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::DynamicObject;
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use super::Preemption;
use crate::runtime::Runtime;
use crate::shared::Shared;
use crate::writer::Writer;

pub mod plan;

/// How often the leader looks for DRA pods to preempt for.
const EVERY: Duration = Duration::from_secs(1);
/// Preemptions decided in one pass at most (the highest priorities first).
const MAX_PER_PASS: usize = 16;

/// What the DRA preemption reads and writes through.
pub struct DraPreemption {
    /// The preemption's bounds, Events and metrics.
    pub preemption: Arc<Preemption>,
    /// The replica's committed state.
    pub shared: Arc<Shared>,
    /// Where nominations are written.
    pub writer: Writer,
    /// The pod watch.
    pub pods: Store<Pod>,
    /// The node watch: a pod preempts only on nodes its selectors and tolerations allow.
    pub nodes: Store<Node>,
    /// The claim watch's ResourceClaims.
    pub claims: Store<DynamicObject>,
    /// The API server.
    pub client: kube::Client,
    /// The unit claims state `cores` in (`--dra-cores`).
    pub cores: gpuledger_request::dra::CoresUnit,
}

/// Start the DRA preemption's passes on `tasks` (on the leader only: `rt`'s passes).
pub fn spawn(tasks: &mut JoinSet<()>, rt: Runtime, p: DraPreemption) {
    let p = Arc::new(p);
    tasks.spawn(rt.clone().passes(EVERY, None, move |_| {
        let (p, rt) = (p.clone(), rt.clone());
        async move { p.pass(&rt).await }
    }));
}

impl DraPreemption {
    /// Preempt for the waiting DRA pods, highest priority first.
    async fn pass(&self, rt: &Runtime) {
        let mut waiting: Vec<Arc<Pod>> = self
            .pods
            .state()
            .into_iter()
            .filter(|p| plan::may_preempt(p))
            .collect();
        if waiting.is_empty() {
            return;
        }
        let prio = |p: &Pod| p.spec.as_ref().and_then(|s| s.priority).unwrap_or(0);
        waiting.sort_by_key(|p| std::cmp::Reverse(prio(p)));
        let mut decided = 0;
        for pod in waiting {
            if decided >= MAX_PER_PASS {
                break;
            }
            let Some(req) = self.request(&pod) else {
                continue;
            };
            let live = self
                .shared
                .view()
                .await
                .nominations()
                .get(&req.pod.uid)
                .cloned();
            if let Some(n) = live {
                // Victims still running (a leader that died between its commit and the
                // evictions) are evicted again; evicting is harmless when they are gone.
                if self.victims_running(&n) {
                    super::evict(&self.preemption, &self.writer, &self.pods, &self.client, &n)
                        .await;
                }
                continue;
            }
            decided += 1;
            self.preempt(rt, &pod, &req).await;
        }
    }

    /// What `pod` asks of gpuledger's GPUs through its unallocated claims, as the ledger
    /// places it; None when it asks nothing or is not waiting for GPU room.
    fn request(&self, pod: &Pod) -> Option<PodRequest> {
        let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
        let ar = kube::api::ApiResource::erase::<ResourceClaim>(&());
        let claims: Vec<_> = plan::pod_claims(pod)
            .into_iter()
            .map(|pc| {
                let rc = pc
                    .claim
                    .as_deref()
                    .and_then(|n| {
                        self.claims
                            .get(&ObjectRef::new_with(n, ar.clone()).within(ns))
                    })
                    .and_then(|o| {
                        k8s_openapi::serde_json::to_value(&*o)
                            .and_then(k8s_openapi::serde_json::from_value::<ResourceClaim>)
                            .ok()
                    });
                (pc, rc)
            })
            .collect();
        let name = super::pod_name(Some(&pb::PodRef {
            uid: String::new(),
            namespace: ns.into(),
            name: pod.metadata.name.clone().unwrap_or_default(),
        }));
        match plan::request(pod, &claims, self.cores).and_then(|r| {
            r.map(|r| PodRequest::from_pb(r, Policy::default()))
                .transpose()
        }) {
            Ok(r) => r,
            Err(e) => {
                debug!(pod = %name, error = %e, "a DRA pod's claims are not placed by gpuledger; not preempting for it");
                None
            }
        }
    }

    /// Whether a victim of `n` still runs, as the watch has it.
    fn victims_running(&self, n: &pb::Nominated) -> bool {
        n.victims.iter().filter_map(|v| v.pod.as_ref()).any(|v| {
            self.pods
                .get(&ObjectRef::new(&v.name).within(&v.namespace))
                .is_some_and(|p| {
                    p.metadata.uid.as_deref() == Some(v.uid.as_str())
                        && p.metadata.deletion_timestamp.is_none()
                })
        })
    }

    /// Choose, nominate and evict for `req` (of `pod`) among the DRA nodes that its node
    /// selector, required node affinity and tolerations allow, as the node watch has them.
    async fn preempt(&self, rt: &Runtime, pod: &Pod, req: &PodRequest) {
        let nodes: Vec<String> = {
            let v = self.shared.view().await;
            v.nodes()
                .iter()
                .filter(|(_, n)| n.mode == pb::NodeMode::Dra)
                .map(|(name, _)| name.clone())
                .filter(|name| {
                    self.nodes
                        .get(&ObjectRef::new(name))
                        .is_some_and(|n| plan::node_allows(pod, &n))
                })
                .collect()
        };
        let pods = self.pods.state();
        let who = super::pod_name(Some(&req.pod));
        let (plan, leaving) = match super::choose(&self.shared, &self.client, &pods, req, &nodes)
            .await
        {
            Ok(Some(p)) => p,
            Ok(None) => {
                debug!(pod = %who, "no eviction frees GPU room for this DRA pod");
                return;
            }
            Err(e) => {
                warn!(pod = %who, error = %e, "planning a DRA preemption failed; retried at the next pass");
                return;
            }
        };
        if plan.victims.is_empty() && leaving.is_empty() {
            // It fits now: what keeps it pending is not GPU room (or kube-scheduler has not
            // retried since room was freed).
            return;
        }
        let by_uid = super::names(&pods);
        let deadline = self.shared.clock.now_ms() + self.preemption.ttl().as_millis() as i64;
        let nomination = plan.nomination(req, deadline, &|u| by_uid.get(u).cloned());
        let cmd = Command::Nominate {
            nomination: nomination.clone(),
            leaving,
        };
        match rt.write(cmd, &format!("nominate DRA pod {who}")).await {
            Ok(c) => {
                if matches!(c.reply, Reply::Done { changed: true }) {
                    self.preemption.outcome("nominated");
                    info!(pod = %who, node = %nomination.node, victims = nomination.victims.len(), "DRA pod nominated; evicting");
                }
                super::evict(
                    &self.preemption,
                    &self.writer,
                    &self.pods,
                    &self.client,
                    &nomination,
                )
                .await;
            }
            Err(_) => self.preemption.outcome("refused"),
        }
    }
}
