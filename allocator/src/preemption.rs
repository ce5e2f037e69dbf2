//! gpuledger's own preemption of GPU slices, for every kube-scheduler.
//!
//! kube-scheduler's DefaultPreemption never asks an extender when only extender-managed
//! resources (GPU memory and compute, `ignoredByScheduler`) conflict: its dry run runs the
//! in-tree filters alone, finds the pod fits once the lower-priority pods are gone, reprieves
//! every one of them and drops the node with "expected at least one victim pod on node"
//! (kubernetes#139270), so the `preempt` verb is never called. The extender's filter, which
//! sees the pod fit on none of the scheduler's nodes, asks the leader instead (`Preempt`). The
//! leader reads the candidate nodes' pods from its pod watch (priorities, which are already
//! terminating) and the PodDisruptionBudgets, chooses the victims with the pure
//! [`preempt::choose_among`] over its state, commits a `Nominated` event (the room is kept for
//! the pod: placement of pods that do not outrank it sees the room taken) and evicts the
//! victims through the Eviction API, so PodDisruptionBudgets hold. The victims' deletion
//! requeues the pod in the scheduler; its filter then finds the room, and its reservation
//! ends the nomination. This module holds the leader's side: the facts, the evictions, the
//! Events, and the sweep that ends nominations whose pod is gone or whose deadline passed.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use gpuledger_ledger::placement::preempt::{self, Evictable, NodePods};
use gpuledger_ledger::{Command, Ledger, pb};
use gpuledger_ops::events::{Kind, PodEvent, Recorder};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::{Eviction, PodDisruptionBudget};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{DeleteOptions, ObjectMeta, Preconditions};
use kube::api::{Api, ListParams, PostParams};
use kube::core::{Selector, SelectorExt};
use kube::runtime::reflector::{ObjectRef, Store};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::authz::Authz;
use crate::runtime::Runtime;
use crate::shared::Shared;
use crate::writer::Writer;

pub mod dra;

/// Flags of gpuledger's own preemption.
#[derive(clap::Args, Debug, Clone)]
pub struct PreemptArgs {
    /// How long the room a preemption frees is kept for the pod that preempted, in
    /// milliseconds: pods that do not outrank it are not placed there until it reserves, is
    /// deleted, or this passes (then the next filter of the pod may preempt again). Cover the
    /// victims' termination grace period.
    #[arg(long, env = "GPULEDGER_NOMINATION_TTL_MS", default_value_t = 60_000)]
    pub nomination_ttl_ms: u64,

    /// Preemptions this replica decides at once (each reads pods and PodDisruptionBudgets and
    /// searches the candidate nodes); more are refused with RESOURCE_EXHAUSTED and retried by
    /// the extender (`gpuledger_allocator_preemptions_total{outcome="busy"}`).
    #[arg(long, env = "GPULEDGER_MAX_PREEMPTIONS_IN_FLIGHT", default_value_t = 4)]
    pub max_preemptions_in_flight: usize,
}

impl Default for PreemptArgs {
    fn default() -> Self {
        PreemptArgs {
            nomination_ttl_ms: 60_000,
            max_preemptions_in_flight: 4,
        }
    }
}

/// The leader's preemption: its bounds, its Events and its metrics.
pub struct Preemption {
    ttl: Duration,
    permits: Arc<Semaphore>,
    events: OnceLock<Recorder>,
    outcomes: Family<Vec<(&'static str, &'static str)>, Counter>,
    evictions: Family<Vec<(&'static str, &'static str)>, Counter>,
}

impl Preemption {
    /// Preemption as `args` bound it, counting into `metrics`.
    pub fn new(args: &PreemptArgs, metrics: &crate::metrics::Metrics) -> Arc<Preemption> {
        Arc::new(Preemption {
            ttl: Duration::from_millis(args.nomination_ttl_ms.max(1)),
            permits: Arc::new(Semaphore::new(args.max_preemptions_in_flight.max(1))),
            events: OnceLock::new(),
            outcomes: metrics.preemptions.clone(),
            evictions: metrics.evictions.clone(),
        })
    }

    /// How long a nomination lasts.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// A place among the preemptions in flight, or None when they are all taken.
    pub fn permit(&self) -> Option<OwnedSemaphorePermit> {
        let p = self.permits.clone().try_acquire_owned().ok();
        if p.is_none() {
            self.outcome("busy");
        }
        p
    }

    /// Count a Preempt call's outcome.
    pub fn outcome(&self, outcome: &'static str) {
        self.outcomes
            .get_or_create(&vec![("outcome", outcome)])
            .inc();
    }

    fn evicted(&self, outcome: &'static str) {
        self.evictions
            .get_or_create(&vec![("outcome", outcome)])
            .inc();
    }

    fn events(&self, client: &kube::Client) -> &Recorder {
        self.events
            .get_or_init(|| Recorder::new(client.clone(), "gpuledger-allocator", None))
    }
}

/// The candidate nodes' pods as Kubernetes has them, for the preemptor `me` of `priority`:
/// on each node, the pods of lower priority holding an allocation there that no
/// PodDisruptionBudget protects (evictable), and those terminating or ended (leaving). Pods the
/// ledger holds nothing for free nothing and are left out.
pub fn node_pods<'a>(
    pods: impl IntoIterator<Item = &'a Pod>,
    pdbs: &[PodDisruptionBudget],
    ledger: &Ledger,
    nodes: &[String],
    priority: i32,
    me: &str,
) -> Vec<NodePods> {
    let mut out: Vec<NodePods> = nodes
        .iter()
        .map(|n| NodePods {
            node: n.clone(),
            ..Default::default()
        })
        .collect();
    let at: HashMap<&str, usize> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), i))
        .collect();
    for p in pods {
        let Some(&i) = p
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_deref())
            .and_then(|n| at.get(n))
        else {
            continue;
        };
        let Some(uid) = p.metadata.uid.as_deref().filter(|u| *u != me) else {
            continue;
        };
        if !ledger.holds_on(&nodes[i], uid) {
            continue;
        }
        let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
        if p.metadata.deletion_timestamp.is_some() || matches!(phase, Some("Succeeded" | "Failed"))
        {
            out[i].leaving.insert(uid.to_string());
            continue;
        }
        let prio = p.spec.as_ref().and_then(|s| s.priority).unwrap_or(0);
        if prio < priority && protected_by(p, pdbs).is_none() {
            out[i].evictable.push(Evictable {
                pod_uid: uid.to_string(),
                priority: prio,
            });
        }
    }
    out
}

/// Why no preemption could be planned.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The PodDisruptionBudgets could not be read (retryable: preemption respects them).
    #[error("cannot read PodDisruptionBudgets ({0}): preemption respects them; retry")]
    Budgets(kube::Error),
    /// The victim search's task failed (a bug).
    #[error("the victim search failed: {0}")]
    Search(tokio::task::JoinError),
}

/// The preemption for `req` (its priority the API server's) on `nodes`, from this replica's
/// view and the watch's `pods`: where, whom to evict, and the pods counted as leaving there;
/// None when evicting pods of lower priority that no PodDisruptionBudget protects frees no
/// room. The budgets are read only when some pod there could be evicted; the search runs off
/// the runtime.
pub async fn choose(
    shared: &Shared,
    client: &kube::Client,
    pods: &[Arc<Pod>],
    req: &gpuledger_ledger::placement::PodRequest,
    nodes: &[String],
) -> Result<Option<(preempt::Plan, Vec<String>)>, PlanError> {
    let uid = req.pod.uid.as_str();
    let on_nodes = |pdbs: &[PodDisruptionBudget], v: &Ledger| {
        node_pods(pods.iter().map(|p| &**p), pdbs, v, nodes, req.priority, uid)
    };
    // Most pods that fit nowhere outrank no GPU pod there: they are answered without asking
    // the API server for the budgets.
    let hopeless = on_nodes(&[], &*shared.view().await)
        .iter()
        .all(|n| n.evictable.is_empty() && n.leaving.is_empty());
    if hopeless {
        return Ok(None);
    }
    let pdbs = budgets(client).await.map_err(PlanError::Budgets)?;
    let (candidates, on_nodes) = {
        let v = shared.view().await;
        let on_nodes = on_nodes(&pdbs, &v);
        (preempt::candidates(&v, req, &on_nodes), on_nodes)
    };
    let request = req.clone();
    let plan = tokio::task::spawn_blocking(move || preempt::choose_among(&request, &candidates))
        .await
        .map_err(PlanError::Search)?;
    Ok(plan.map(|p| {
        let leaving = leaving_on(&on_nodes, &p.node);
        (p, leaving)
    }))
}

/// The PodDisruptionBudget that allows no disruption of `pod` now, if any (`namespace/name`).
pub fn protected_by(pod: &Pod, pdbs: &[PodDisruptionBudget]) -> Option<String> {
    let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    pdbs.iter()
        .filter(|b| b.metadata.namespace.as_deref() == Some(ns))
        .filter(|b| b.status.as_ref().is_none_or(|s| s.disruptions_allowed <= 0))
        .find(|b| {
            // policy/v1: an empty selector selects every pod of the namespace, none selects none.
            b.spec
                .as_ref()
                .and_then(|s| s.selector.clone())
                .and_then(|sel| Selector::try_from(sel).ok())
                .is_some_and(|sel| sel.matches(&labels))
        })
        .map(|b| format!("{ns}/{}", b.metadata.name.as_deref().unwrap_or("")))
}

/// Every PodDisruptionBudget of the cluster.
pub async fn budgets(client: &kube::Client) -> Result<Vec<PodDisruptionBudget>, kube::Error> {
    let api: Api<PodDisruptionBudget> = Api::all(client.clone());
    Ok(api.list(&ListParams::default()).await?.items)
}

/// `pod` as the watch has it, or as the API server has it when the watch has not delivered it.
pub async fn current_pod(
    store: &Store<Pod>,
    client: &kube::Client,
    p: &pb::PodRef,
) -> Result<Option<Arc<Pod>>, kube::Error> {
    let same = |x: &Pod| x.metadata.uid.as_deref() == Some(p.uid.as_str());
    if let Some(x) = store
        .get(&ObjectRef::new(&p.name).within(&p.namespace))
        .filter(|x| same(x))
    {
        return Ok(Some(x));
    }
    let api: Api<Pod> = Api::namespaced(client.clone(), &p.namespace);
    Ok(api.get_opt(&p.name).await?.filter(same).map(Arc::new))
}

/// `ns/name` of a pod reference.
pub fn pod_name(p: Option<&pb::PodRef>) -> String {
    p.map_or_else(|| "?".into(), |p| format!("{}/{}", p.namespace, p.name))
}

/// Evict the victims of `n` that are still running, tell them and the preemptor why, and end
/// the nomination when a PodDisruptionBudget refuses an eviction (the next attempt leaves that
/// pod out, and `writer` writes the end). Victims already terminating or gone are left alone,
/// so repeating it is harmless.
pub async fn evict(
    p: &Preemption,
    writer: &Writer,
    store: &Store<Pod>,
    client: &kube::Client,
    n: &pb::Nominated,
) {
    let events = p.events(client);
    let preemptor = n.pod.clone().unwrap_or_default();
    let mut refused = Vec::new();
    let mut evicting = Vec::new();
    for v in &n.victims {
        let Some(victim) = &v.pod else { continue };
        match current_pod(store, client, victim).await {
            Ok(Some(x)) if x.metadata.deletion_timestamp.is_none() => {}
            Ok(_) => {
                p.evicted("gone");
                continue;
            }
            Err(e) => {
                warn!(victim = %pod_name(Some(victim)), error = %e, "cannot read a preemption victim; evicting it anyway");
            }
        }
        match eviction(client, victim).await {
            Ok(()) => {
                p.evicted("evicted");
                evicting.push(format!(
                    "{} (priority {})",
                    pod_name(Some(victim)),
                    v.priority
                ));
                info!(victim = %pod_name(Some(victim)), preemptor = %pod_name(Some(&preemptor)), node = %n.node, "evicted for a preemption");
                events.emit(PodEvent {
                    namespace: victim.namespace.clone(),
                    name: victim.name.clone(),
                    uid: victim.uid.clone(),
                    kind: Kind::Normal,
                    reason: "Preempted",
                    message: format!(
                        "Preempted by {}/{} on node {}: gpuledger frees this pod's GPU slices for a pod of priority {} (this pod's is {})",
                        preemptor.namespace, preemptor.name, n.node, n.priority, v.priority
                    ),
                });
            }
            Err(kube::Error::Api(s)) if s.code == 404 => p.evicted("gone"),
            Err(kube::Error::Api(s)) if s.code == 429 => {
                p.evicted("refused");
                refused.push(format!("{}: {}", pod_name(Some(victim)), s.message));
            }
            Err(e) => {
                p.evicted("failed");
                warn!(victim = %pod_name(Some(victim)), error = %e, "evicting a preemption victim failed");
                refused.push(format!("{}: {e}", pod_name(Some(victim))));
            }
        }
    }
    let room: Vec<String> = n
        .containers
        .iter()
        .flat_map(|c| &c.shares)
        .map(|s| format!("{} MiB on GPU {}", s.mem_mib, s.gpu_uuid))
        .collect();
    if !evicting.is_empty() {
        let until = k8s_openapi::jiff::Timestamp::from_millisecond(n.deadline_ms)
            .map_or_else(|_| n.deadline_ms.to_string(), |t| t.to_string());
        events.emit(PodEvent {
            namespace: preemptor.namespace.clone(),
            name: preemptor.name.clone(),
            uid: preemptor.uid.clone(),
            kind: Kind::Normal,
            reason: "GpuPreempting",
            message: format!(
                "evicting {} on node {} to free GPU room for this pod ({}); the room is kept for it until {until}",
                evicting.join(", "),
                n.node,
                room.join(", ")
            ),
        });
    }
    if !refused.is_empty() {
        let why = format!("eviction refused: {}", refused.join("; "));
        events.emit(PodEvent {
            namespace: preemptor.namespace.clone(),
            name: preemptor.name.clone(),
            uid: preemptor.uid.clone(),
            kind: Kind::Warning,
            reason: "GpuPreemptionRefused",
            message: format!(
                "{why}; the room on node {} is no longer kept for this pod, and its next attempt leaves those pods out",
                n.node
            ),
        });
        end(writer, &preemptor.uid, why).await;
    }
}

/// POST a policy/v1 Eviction of `victim`, on the condition that it is still the pod of that
/// UID (kube's `Api::evict` sends its delete options under a key the API server ignores).
async fn eviction(client: &kube::Client, victim: &pb::PodRef) -> Result<(), kube::Error> {
    let api: Api<Pod> = Api::namespaced(client.clone(), &victim.namespace);
    let body = Eviction {
        metadata: ObjectMeta {
            name: Some(victim.name.clone()),
            namespace: Some(victim.namespace.clone()),
            ..Default::default()
        },
        delete_options: Some(DeleteOptions {
            preconditions: Some(Preconditions {
                uid: Some(victim.uid.clone()),
                ..Default::default()
            }),
            ..Default::default()
        }),
    };
    api.create_subresource::<_, kube::core::Status>(
        "eviction",
        &victim.name,
        &PostParams::default(),
        &body,
    )
    .await
    .map(|_| ())
}

/// End `uid`'s nomination (leader only); logs the outcome.
pub(crate) async fn end(writer: &Writer, uid: &str, reason: String) {
    let cmd = Command::EndNomination {
        pod_uid: uid.to_string(),
        reason: reason.clone(),
    };
    let what = format!("end the nomination of pod {uid}: {reason}");
    let _ = crate::runtime::write("preemption", writer, cmd, &what).await;
}

/// What the sweep of nominations reads and writes through.
pub struct Sweep {
    /// The preemption's bounds, Events and metrics.
    pub preemption: Arc<Preemption>,
    /// The replica's committed state: its nominations, its role and its clock.
    pub shared: Arc<Shared>,
    /// Where the ends of nominations are written.
    pub writer: Writer,
    /// Where the pod watch is found once the Kubernetes watchers run.
    pub authz: Arc<Authz>,
}

/// On the leader, every `interval`: end the nominations whose deadline passed, and those whose
/// pod is gone, has ended, or is bound without a reservation (it no longer waits for the
/// room).
pub fn spawn(sweep: Sweep, interval: Duration, tasks: &TaskTracker, stop: &CancellationToken) {
    let rt = Runtime::new("preemption", sweep.shared.clone(), sweep.writer.clone());
    let sweep = Arc::new(sweep);
    let passes = rt.passes(interval.max(Duration::from_millis(50)), None, move |_| {
        let sweep = sweep.clone();
        async move { sweep.pass().await }
    });
    tasks.spawn(stop.clone().run_until_cancelled_owned(passes));
}

impl Sweep {
    /// End what is due now.
    async fn pass(&self) {
        let now = self.shared.clock.now_ms();
        let live: Vec<pb::Nominated> = self
            .shared
            .view()
            .await
            .nominations()
            .iter()
            .cloned()
            .collect();
        for n in live {
            let p = n.pod.clone().unwrap_or_default();
            if n.deadline_ms <= now {
                end(
                    &self.writer,
                    &p.uid,
                    "expired: the pod did not reserve the room in time (--nomination-ttl-ms)"
                        .into(),
                )
                .await;
                if let Some((_, client)) = self.authz.pods() {
                    self.preemption.events(client).emit(PodEvent {
                    namespace: p.namespace.clone(),
                    name: p.name.clone(),
                    uid: p.uid.clone(),
                    kind: Kind::Warning,
                    reason: "GpuNominationExpired",
                    message: format!(
                        "the GPU room freed on node {} was kept for this pod until its deadline; it is offered to every pod again",
                        n.node
                    ),
                });
                }
                continue;
            }
            let Some((store, client)) = self.authz.pods() else {
                continue;
            };
            let gone = match current_pod(store, client, &p).await {
                Ok(None) => Some("pod deleted"),
                Ok(Some(x)) => {
                    let phase = x.status.as_ref().and_then(|s| s.phase.as_deref());
                    if x.metadata.deletion_timestamp.is_some()
                        || matches!(phase, Some("Succeeded" | "Failed"))
                    {
                        Some("pod ended or is being deleted")
                    } else if x.spec.as_ref().is_some_and(|s| s.node_name.is_some()) {
                        Some("pod bound without a GPU reservation")
                    } else {
                        None
                    }
                }
                Err(e) => {
                    debug!(error = %e, "reading a nominated pod failed");
                    None
                }
            };
            if let Some(why) = gone {
                end(&self.writer, &p.uid, why.into()).await;
            }
        }
    }
}

/// The watch's pods by UID, as the ledger names pods.
pub fn names(pods: &[Arc<Pod>]) -> HashMap<String, pb::PodRef> {
    pods.iter()
        .filter_map(|p| {
            let uid = p.metadata.uid.clone()?;
            Some((
                uid.clone(),
                pb::PodRef {
                    uid,
                    namespace: p.metadata.namespace.clone().unwrap_or_default(),
                    name: p.metadata.name.clone().unwrap_or_default(),
                },
            ))
        })
        .collect()
}

/// The UIDs counted as leaving on `node` among `candidates`.
pub fn leaving_on(candidates: &[NodePods], node: &str) -> Vec<String> {
    candidates
        .iter()
        .filter(|c| c.node == node)
        .flat_map(|c| c.leaving.iter().cloned())
        .collect::<BTreeSet<String>>()
        .into_iter()
        .collect()
}

#[cfg(test)]
mod tests;
