//! Authorization of every RPC: the one table in `gpuledger_auth::rules`, applied with the facts
//! this replica knows — its committed state (whose node an allocation is on, whether it is only
//! reserved) and, for the extender's writes, the pod as the API server has it.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use gpuledger_auth::identity::Caller;
use gpuledger_auth::rules::{self, Call, Condition, Denied, Facts, PodFacts};
use gpuledger_auth::server::Authenticated;
use gpuledger_ledger::{AllocState, Ledger};

use crate::shared::Shared;
use gpuledger_proto::allocator::v1 as api;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{ObjectRef, Store};
use tonic::{Request, Status};
use tracing::warn;

/// How long a call waits for the first list of pods after the allocator started.
const PODS_READY_WAIT: Duration = Duration::from_secs(5);

/// What decides whether a caller may make a call, besides the table.
pub struct Authz {
    /// Whether this replica has a Kubernetes API (its pod watch sets `pods`).
    kube: bool,
    pods: OnceLock<(Store<Pod>, kube::Client)>,
    scheduler_names: Vec<String>,
    denied: AtomicU64,
}

impl Authz {
    /// `kube`: whether pods can be looked up (they are, once the pod watch started);
    /// `scheduler_names`: the `spec.schedulerName`s whose pods the extender may place.
    pub fn new(kube: bool, scheduler_names: Vec<String>) -> Self {
        Authz {
            kube,
            pods: OnceLock::new(),
            scheduler_names,
            denied: AtomicU64::new(0),
        }
    }

    /// The pod watch's store, once it runs, and the client that reads a pod the watch has not
    /// delivered yet.
    pub fn set_pods(&self, pods: Store<Pod>, client: kube::Client) {
        let _ = self.pods.set((pods, client));
    }

    /// The pod watch's store and the API client, once the watch runs.
    pub fn pods(&self) -> Option<&(Store<Pod>, kube::Client)> {
        self.pods.get()
    }

    /// Calls refused so far.
    pub fn denied(&self) -> u64 {
        self.denied.load(Ordering::Relaxed)
    }

    /// The caller of `req` if it may make `call`; PERMISSION_DENIED naming the rule otherwise.
    /// Conditions on nodes and allocations read `shared`'s committed state (only then: most
    /// calls need no view). A request that reached the service unauthenticated is refused.
    pub async fn check<Q: Touches>(
        &self,
        req: &Request<Q>,
        call: Call,
        shared: &Shared,
    ) -> Result<Caller, Status> {
        let Some(auth) = req.extensions().get::<Authenticated>() else {
            return Err(Status::unauthenticated(
                "no verified identity on this request",
            ));
        };
        let caller = auth.caller.clone();
        let q = req.get_ref();
        let condition = rules::rule_for(&caller.role, call).map(|r| r.condition);
        let mut pod = None;
        let facts = match condition {
            Some(Condition::OwnNode | Condition::ReservationsOnly) => {
                q.facts(&*shared.view().await)
            }
            Some(Condition::AdmissiblePod) => {
                let (facts, found) = self.pod_facts(q, shared).await?;
                pod = found;
                Facts {
                    pod: Some(facts),
                    ..Facts::default()
                }
            }
            Some(Condition::None) | None => Facts::default(),
        };
        let verdict = rules::authorize(&caller, call, &facts, q.target_node()).and_then(|r| {
            // The table admits the pod; the call must also say of it what the API server
            // says (a reservation's sizes, a confirmed binding).
            match pod.as_ref().and_then(|p| q.disagrees(p)) {
                Some(d) => Err(d),
                None => Ok(r),
            }
        });
        match verdict {
            Ok(_) => Ok(caller),
            Err(d) => {
                self.denied.fetch_add(1, Ordering::Relaxed);
                shared.metrics.denied(d.rule, caller.role.kind());
                warn!(caller = %caller, call = call.name(), rule = d.rule, why = %d.why, "call denied");
                Err(Status::permission_denied(format!(
                    "{caller} may not call {}: {d}",
                    call.name()
                )))
            }
        }
    }

    /// The pod `q` is for as the API server has it: the facts the table needs, and the pod.
    async fn pod_facts<Q: Touches>(
        &self,
        q: &Q,
        shared: &Shared,
    ) -> Result<(PodFacts, Option<Pod>), Status> {
        if !self.kube {
            return Ok((PodFacts::NoApiServer, None));
        }
        let pod = match q.pod() {
            PodOf::Named(key) => Some(key),
            // Named by UID only: its namespace and name are the ledger's.
            PodOf::Uid(uid) => shared
                .view()
                .await
                .allocs_of_pod(uid)
                .first()
                .map(|a| PodKey {
                    namespace: a.pod.namespace.clone(),
                    name: a.pod.name.clone(),
                    uid: uid.to_string(),
                }),
            PodOf::Nothing => None,
        };
        let Some((store, client)) = self.pods.get() else {
            return Err(Status::unavailable(
                "the pod watch has not started yet: cannot check the pod; retry",
            ));
        };
        if tokio::time::timeout(PODS_READY_WAIT, store.wait_until_ready())
            .await
            .is_err()
        {
            return Err(Status::unavailable(
                "the pod watch has not listed the pods yet: cannot check the pod; retry",
            ));
        }
        let Some(key) = pod else {
            return Ok((PodFacts::Missing, None));
        };
        let same = |p: &Pod| p.metadata.uid.as_deref() == Some(key.uid.as_str());
        // A call that says the pod is bound may follow the Binding faster than the watch:
        // a cached pod that is not bound there yet is read again.
        let current = |p: &Pod| {
            !q.needs_binding()
                || p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == q.target_node()
        };
        let cached = store
            .get(&ObjectRef::new(&key.name).within(&key.namespace))
            .filter(|p| same(p) && current(p))
            .map(|p| (*p).clone());
        let found = match cached {
            Some(p) => Some(p),
            // The scheduler may have seen the pod before this replica's watch did: ask.
            None => {
                let api: kube::Api<Pod> = kube::Api::namespaced(client.clone(), &key.namespace);
                match api.get_opt(&key.name).await {
                    Ok(p) => p.filter(same),
                    Err(e) => {
                        return Err(Status::unavailable(format!(
                            "cannot read pod {}/{} from the API server: {e}",
                            key.namespace, key.name
                        )));
                    }
                }
            }
        };
        Ok(match found {
            None => (PodFacts::Missing, None),
            Some(p) => {
                let spec = p.spec.as_ref();
                let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
                let facts = PodFacts::Found {
                    gpuledger_scheduler: spec
                        .and_then(|s| s.scheduler_name.as_deref())
                        .is_some_and(|n| self.scheduler_names.iter().any(|m| m == n)),
                    node: spec.and_then(|s| s.node_name.clone()),
                    ended: p.metadata.deletion_timestamp.is_some()
                        || matches!(phase, Some("Succeeded" | "Failed")),
                };
                (facts, Some(p))
            }
        })
    }
}

/// How a call names the pod it is for.
pub enum PodOf<'a> {
    /// By namespace, name and UID.
    Named(PodKey),
    /// By UID alone (the ledger knows the rest).
    Uid(&'a str),
    /// It names none.
    Nothing,
}

/// A pod named by a call.
pub struct PodKey {
    namespace: String,
    name: String,
    uid: String,
}

/// What a request touches, for the conditions of the table.
pub trait Touches {
    /// The nodes it touches and what it would release.
    fn facts(&self, _ledger: &Ledger) -> Facts {
        Facts::default()
    }
    /// The node it places on (Reserve, ConfirmBound).
    fn target_node(&self) -> Option<&str> {
        None
    }
    /// The pod it is for (Reserve, ConfirmBound).
    fn pod(&self) -> PodOf<'_> {
        PodOf::Nothing
    }
    /// Whether it says the pod is bound to [`Touches::target_node`] (ConfirmBound).
    fn needs_binding(&self) -> bool {
        false
    }
    /// Where it contradicts the pod as the API server has it (the rule that refuses, and
    /// why), if it does.
    fn disagrees(&self, _pod: &Pod) -> Option<Denied> {
        None
    }
}

/// Facts of a call that names `nodes` directly and the allocations `ids` (0 = none).
fn on_nodes(ledger: &Ledger, nodes: &[&str], ids: &[u64]) -> Facts {
    let mut f = Facts::default();
    for n in nodes.iter().filter(|n| !n.is_empty()) {
        f.nodes.push((*n).to_string());
    }
    for &id in ids.iter().filter(|&&id| id != 0) {
        match ledger.alloc(id) {
            Some(a) => f.nodes.push(a.node.clone()),
            None => f.unknown_allocation = true,
        }
    }
    f
}

impl Touches for api::RegisterNodeRequest {
    fn facts(&self, l: &Ledger) -> Facts {
        let node = self.inventory.as_ref().map_or("", |i| i.node.as_str());
        // An empty name still touches "a node": never the caller's own.
        let mut f = on_nodes(l, &[node], &[]);
        if node.is_empty() {
            f.nodes.push(String::new());
        }
        f
    }
}

impl Touches for api::RemoveNodeRequest {
    fn facts(&self, l: &Ledger) -> Facts {
        on_nodes(l, &[&self.node], &[])
    }
}

impl Touches for api::SetDeviceHealthRequest {
    fn facts(&self, l: &Ledger) -> Facts {
        on_nodes(l, &[&self.node], &[])
    }
}

impl Touches for api::AssignRequest {
    fn facts(&self, l: &Ledger) -> Facts {
        on_nodes(l, &[&self.node], &[self.allocation_id])
    }
}

impl Touches for api::CorrectIdentityRequest {
    fn facts(&self, l: &Ledger) -> Facts {
        on_nodes(
            l,
            &[&self.node],
            &[self.from_allocation_id, self.to_allocation_id],
        )
    }
}

impl Touches for api::PrepareClaimRequest {
    fn facts(&self, l: &Ledger) -> Facts {
        on_nodes(l, &[&self.node], &self.allocation_ids)
    }
}

impl Touches for api::UnprepareClaimRequest {
    fn facts(&self, l: &Ledger) -> Facts {
        // A grant already released is skipped by the ledger: its node no longer matters.
        let live: Vec<u64> = (self.allocation_ids.iter().copied())
            .filter(|&id| l.alloc(id).is_some())
            .collect();
        on_nodes(l, &[&self.node], &live)
    }
}

impl Touches for api::ReportViolationRequest {
    fn facts(&self, l: &Ledger) -> Facts {
        match &self.violation {
            Some(v) => on_nodes(l, &[&v.node], &[v.allocation_id]),
            None => Facts::default(),
        }
    }
}

impl Touches for api::SubscribeRequest {
    fn facts(&self, l: &Ledger) -> Facts {
        on_nodes(l, &[&self.node], &[])
    }
}

impl Touches for api::ReleaseRequest {
    fn facts(&self, l: &Ledger) -> Facts {
        let mut f = Facts::default();
        let released: Vec<_> = if self.allocation_id != 0 {
            match l.alloc(self.allocation_id) {
                Some(a) => vec![a],
                None => {
                    f.unknown_allocation = true;
                    vec![]
                }
            }
        } else {
            l.allocs_of_pod(&self.pod_uid)
                .into_iter()
                .filter(|a| self.container.is_empty() || a.container == self.container)
                .collect()
        };
        f.only_reservations = released.iter().all(|a| a.state == AllocState::Reserved);
        f.nodes = released.iter().map(|a| a.node.clone()).collect();
        f
    }
}

/// The pod a request's `PodRequest` names.
fn requested(r: Option<&api::PodRequest>) -> PodOf<'_> {
    match r.and_then(|r| r.pod.as_ref()) {
        Some(p) => PodOf::Named(PodKey {
            namespace: p.namespace.clone(),
            name: p.name.clone(),
            uid: p.uid.clone(),
        }),
        None => PodOf::Nothing,
    }
}

impl Touches for api::ReserveRequest {
    fn target_node(&self) -> Option<&str> {
        Some(&self.node)
    }
    fn disagrees(&self, pod: &Pod) -> Option<Denied> {
        let deny = |why: String| {
            Some(Denied {
                rule: "extender-reserve-pod-request",
                why,
            })
        };
        let own = match gpuledger_request::pod_request(pod) {
            Ok(Some(r)) => r,
            Ok(None) => return deny("the pod asks for no gpuledger resource".into()),
            Err(e) => return deny(format!("the pod's own request is invalid: {e}")),
        };
        let asked = self.request.as_ref()?;
        let key = |c: &api::ContainerRequest| {
            (
                c.name.clone(),
                c.slices,
                c.mem_mib,
                c.mem_percent,
                c.core_milli,
            )
        };
        let mut mine: Vec<_> = asked.containers.iter().map(key).collect();
        let mut theirs: Vec<_> = own.containers.iter().map(key).collect();
        mine.sort();
        theirs.sort();
        if mine != theirs {
            return deny(format!(
                "the reservation's sizes (container, slices, MiB, memory %, compute per mille) \
                 {mine:?} are not what the pod asks for: {theirs:?}"
            ));
        }
        if (asked.cpu_milli, asked.memory_mib) != (own.cpu_milli, own.memory_mib) {
            return deny(format!(
                "the reservation counts {}m CPU and {} MiB memory; the pod requests {}m and {} MiB",
                asked.cpu_milli, asked.memory_mib, own.cpu_milli, own.memory_mib
            ));
        }
        None
    }
    fn pod(&self) -> PodOf<'_> {
        requested(self.request.as_ref())
    }
}

impl Touches for api::ConfirmBoundRequest {
    fn target_node(&self) -> Option<&str> {
        Some(&self.node)
    }
    fn needs_binding(&self) -> bool {
        true
    }
    fn disagrees(&self, pod: &Pod) -> Option<Denied> {
        let bound = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
        (bound != Some(self.node.as_str())).then(|| Denied {
            rule: "extender-confirm-bound-pod",
            why: match bound {
                None => format!("the pod is not bound to any node yet, not to {}", self.node),
                Some(n) => format!("the pod is bound to node {n}, not {}", self.node),
            },
        })
    }
    fn pod(&self) -> PodOf<'_> {
        PodOf::Uid(&self.pod_uid)
    }
}

impl Touches for api::PreemptRequest {
    fn pod(&self) -> PodOf<'_> {
        requested(self.request.as_ref())
    }
}

impl Touches for api::FilterRequest {}
impl Touches for api::ScoreRequest {}
impl Touches for api::StatusRequest {}
impl Touches for api::DumpRequest {}
impl Touches for api::ReadLogRequest {}
impl Touches for api::ReadSnapshotsRequest {}
impl Touches for api::ReplicateRequest {}
impl Touches for api::SetBudgetRequest {}
impl Touches for api::SetQuotaRequest {}
impl Touches for api::GrantClaimRequest {}
impl Touches for api::RefuseClaimRequest {}
impl Touches for api::AdoptRequest {}
