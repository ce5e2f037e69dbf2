//! The allocator's Kubernetes side: pod and node watchers that release allocations, and the
//! reconcile of reservations against what the API server says. Every replica watches; only
//! the leader writes (its [`Writer`] answers `NotLeader` elsewhere), and a periodic pass on the leader
//! catches up with whatever happened while another replica led or the watch was down. What
//! the reconcile decides is in [`plan`]; this shell gathers its inputs and applies its fixes.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use futures::StreamExt;
use gpuledger_ledger::{Command, Ledger};
use gpuledger_ops::events::{Kind, PodEvent, Recorder};
use gpuledger_ops::kube_client::KubeClientError;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::Api;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use self::plan::{Expiry, Fix, Held, Missing, PodFacts};
use crate::authz::Authz;
use crate::budget_watch::GuardSlot;
use crate::claim_templates::Templates;
use crate::runtime::Runtime;
use crate::shared::Shared;
use crate::writer::Writer;

pub mod plan;

/// Flags of the Kubernetes watchers.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct KubeArgs {
    /// kubeconfig file of the cluster whose pods and nodes free allocations. Default: the
    /// in-cluster service account when running in a pod; without either the watchers are off.
    #[arg(long = "kubeconfig", env = "GPULEDGER_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Turn the Kubernetes watchers off even when running in a cluster.
    #[arg(long = "no-kube", env = "GPULEDGER_NO_KUBE")]
    pub no_kube: bool,

    /// How often the leader compares the ledger with the cluster (expired reservations,
    /// missed deletions), in milliseconds.
    #[arg(long, env = "GPULEDGER_RECONCILE_INTERVAL_MS", default_value_t = 500)]
    pub reconcile_interval_ms: u64,

    /// A ledger node absent from Kubernetes this many seconds is removed (deletions seen by
    /// the watch act at once; this catches the ones no replica saw).
    #[arg(long, env = "GPULEDGER_NODE_GONE_GRACE", default_value_t = 30)]
    pub node_gone_grace_s: u64,

    /// GPUBudget objects into the ledger (which namespace holds the cluster default).
    #[command(flatten)]
    pub budgets: crate::budget_watch::BudgetArgs,

    /// DRA ResourceClaims certified against the ledger.
    #[command(flatten)]
    pub claims: crate::claim_watch::ClaimArgs,
}

/// How many deleted pods' UIDs the watch remembers, and for how long ([`Watch::deleted`]):
/// longer than any failover, a few MiB at most.
const DELETED_KEPT: u64 = 100_000;
const DELETED_FOR: Duration = Duration::from_secs(600);

/// Node capacity updates submitted at once by one reconcile pass.
const SYNC_CONCURRENCY: usize = 64;

/// Whether the watchers run (a kubeconfig, or in a cluster, and not --no-kube).
pub fn enabled(args: &KubeArgs) -> bool {
    !args.no_kube && (args.kubeconfig.is_some() || gpuledger_ops::kube_client::in_cluster())
}

/// The parts of the replica the watchers read from, write through and keep informed.
#[derive(Clone)]
pub struct Ties {
    /// The committed state and the role.
    pub shared: Arc<Shared>,
    /// Where the watchers' decisions are written (on the leader).
    pub writer: Writer,
    /// Authorization, which checks the extender's writes against the pod watch.
    pub authz: Arc<Authz>,
    /// Where the budget RPCs find what the GPUBudget watch knows.
    pub budget_guard: GuardSlot,
    /// gpuledger's preemption (its DRA side runs beside the claim watch).
    pub preemption: Arc<crate::preemption::Preemption>,
}

/// Start the watchers, if configured, as tasks of `tasks` that end when `stop` is cancelled.
pub fn spawn(ties: Ties, args: &KubeArgs, tasks: &TaskTracker, stop: &CancellationToken) {
    if args.no_kube {
        return;
    }
    if args.kubeconfig.is_none() && !gpuledger_ops::kube_client::in_cluster() {
        info!("no --kubeconfig and not in a cluster: Kubernetes watchers are off");
        return;
    }
    let args = args.clone();
    tasks.spawn(stop.clone().run_until_cancelled_owned(async move {
        let backoff = ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(200))
            .with_max_delay(Duration::from_secs(10))
            .without_max_times();
        let connected = (|| client(&args))
            .retry(backoff)
            .notify(|e, _| warn!(error = %e, "Kubernetes client not ready; retrying"))
            .await;
        if let Ok(client) = connected {
            run(ties, client, args).await;
        }
    }));
}

/// Why the watchers have no Kubernetes client (yet: they keep trying).
#[derive(Debug, thiserror::Error)]
enum ClientError {
    /// The configuration names a cluster, but no client can be made from it.
    #[error(transparent)]
    Kube(#[from] KubeClientError),
    /// Neither --kubeconfig nor an in-cluster configuration is there any more.
    #[error("no --kubeconfig and no in-cluster config")]
    NoConfig,
}

async fn client(args: &KubeArgs) -> Result<kube::Client, ClientError> {
    gpuledger_ops::kube_client::client(args.kubeconfig.as_deref())
        .await?
        .ok_or(ClientError::NoConfig)
}

/// The watchers' view and the writes they make.
struct Watch {
    rt: Runtime,
    shared: Arc<Shared>,
    pods_api: Api<Pod>,
    pods: Store<Pod>,
    nodes: Store<Node>,
    pods_ready: AtomicBool,
    nodes_ready: AtomicBool,
    /// UIDs of the pods this replica's watch saw deleted, leading or not, for a while: a new
    /// leader's reconcile releases their grants at once (the deletion may have reached it
    /// while the old leader was dying).
    deleted: moka::sync::Cache<String, ()>,
    events: Recorder,
    demoted: crate::budget_watch::DemotedPods,
    /// The templates of converted DRA pods (with the claim watch).
    templates: Option<Arc<Templates>>,
}

impl Watch {
    fn leading(&self) -> bool {
        self.rt.leading()
    }

    /// Submit `cmd` when leading (the runtime logs the outcome). True when the ledger took it.
    async fn act(&self, cmd: Command, what: &str) -> bool {
        self.rt.write(cmd, what).await.is_ok()
    }

    /// Read a view of the committed state.
    async fn read<T>(&self, f: impl FnOnce(&Ledger) -> T) -> T {
        f(&*self.shared.view().await)
    }

    async fn holds(&self, uid: &str) -> bool {
        self.read(|l| !l.allocs_of_pod(uid).is_empty()).await
    }

    async fn release(&self, uid: &str, reason: &str) -> bool {
        if !self.holds(uid).await {
            return false;
        }
        self.act(
            Command::Release {
                pod_uid: uid.to_string(),
                container: String::new(),
                allocation_id: 0,
                reason: reason.to_string(),
            },
            &format!("release pod {uid}: {reason}"),
        )
        .await
    }

    async fn confirm(&self, uid: &str, node: &str, reason: &str) {
        self.act(
            Command::ConfirmBound {
                pod_uid: uid.to_string(),
                node: node.to_string(),
                reason: reason.to_string(),
            },
            &format!("confirm pod {uid} bound to {node}"),
        )
        .await;
    }

    /// Tell a pod whose reservation expired (it still exists, unbound) why its GPUs went.
    fn tell_expired(&self, uid: &str, a: &Held) {
        let waited_s = (a.deadline_ms - a.reserved_ms).max(0) / 1000;
        self.events.emit(PodEvent {
            namespace: a.ns.clone(),
            name: a.name.clone(),
            uid: uid.to_string(),
            kind: Kind::Warning,
            reason: "GpuReservationExpired",
            message: format!(
                "the GPU reservation on {} expired: the pod was not bound there within {waited_s} s (--reserve-ttl); the GPUs are free again and the scheduler will place the pod anew",
                a.node
            ),
        });
    }

    /// React to a pod as the watch shows it.
    async fn on_pod(&self, pod: &Pod) {
        if !self.leading() {
            return;
        }
        if let Some(t) = &self.templates {
            t.on_pod(pod).await;
        }
        let Some(facts) = PodFacts::of(pod) else {
            return;
        };
        if let Some(ev) = self.demoted.event_for(pod) {
            self.events.emit(ev);
        }
        // Only a bound pod needs its allocations read: a finished one's are released anyway.
        let held = if facts.finished.is_none() && facts.node.is_some() {
            self.read(|l| plan::held_of(l, &facts.uid)).await
        } else {
            Vec::new()
        };
        if let Some(fix) = plan::on_pod(&facts, &held) {
            self.apply(fix).await;
        }
    }

    /// Apply one fix of the reconcile, and the fixes that what it reads from the API server
    /// leads to.
    async fn apply(&self, fix: Fix) {
        let mut todo = vec![fix];
        while let Some(fix) = todo.pop() {
            match fix {
                Fix::Release { uid, reason } => {
                    self.release(&uid, &reason).await;
                }
                Fix::Confirm { uid, node, reason } => self.confirm(&uid, &node, reason).await,
                Fix::Read { uid, held, expired } => {
                    let Some(first) = held.first() else { continue };
                    let read = match self.pods_api_ns(&first.ns).get_opt(&first.name).await {
                        Ok(read) => read,
                        Err(e) => {
                            debug!(error = %e, "reading a pod for reconcile failed");
                            continue;
                        }
                    };
                    let facts = read.as_ref().and_then(PodFacts::of);
                    if let Some(p) = &read
                        && facts.as_ref().is_some_and(|f| f.uid == uid)
                        && let Some(ev) = self.demoted.event_for(p)
                    {
                        self.events.emit(ev);
                    }
                    let next = plan::after_read(&uid, &held, expired, facts.as_ref());
                    todo.extend(next.into_iter().rev());
                }
                Fix::CheckExpired { uid, held } => {
                    match self.pods_api_ns(&held.ns).get_opt(&held.name).await {
                        Ok(read) => {
                            let facts = read.as_ref().and_then(PodFacts::of);
                            todo.push(plan::after_expiry_read(&uid, &held, facts.as_ref()));
                        }
                        Err(e) => debug!(error = %e, "reading a pod for expiry failed"),
                    }
                }
                Fix::ReleaseExpired { uid, held } => {
                    if self.release(&uid, "expired").await {
                        self.tell_expired(&uid, &held);
                    }
                }
                Fix::RemoveNode { node, reason } => {
                    self.act(
                        Command::RemoveNode {
                            node: node.clone(),
                            reason: reason.into(),
                        },
                        &format!("remove node {node}"),
                    )
                    .await;
                }
                Fix::SyncCapacity {
                    node,
                    cpu_milli,
                    memory_mib,
                } => self.sync_capacity(&node, (cpu_milli, memory_mib)).await,
            }
        }
    }

    /// Compare the ledger with the cluster; fix what the watch did not (leader only).
    async fn reconcile(&self, missing: &mut Missing, expiry: &mut Expiry, grace: Duration) {
        if !self.leading() || !self.pods_ready.load(Ordering::Relaxed) {
            return;
        }
        let held = self.read(plan::held_by_pod).await;
        let clock = self.shared.clock.clone();
        let cached = |ns: &str, name: &str| {
            self.pods
                .get(&ObjectRef::new(name).within(ns))
                .and_then(|p| PodFacts::of(&p))
        };
        let deleted = |uid: &str| self.deleted.contains_key(uid);
        for fix in plan::plan_pods(&held, cached, deleted, expiry, clock.now()) {
            self.apply(fix).await;
        }
        if !self.nodes_ready.load(Ordering::Relaxed) {
            return;
        }
        // One read for every node: its name and the CPU/memory the ledger has for it.
        let ledger_nodes: Vec<(String, (u64, u64))> = self
            .read(|l| {
                l.nodes()
                    .values()
                    .map(|n| (n.name.clone(), (n.cpu_milli, n.memory_mib)))
                    .collect()
            })
            .await;
        let kube = |n: &str| {
            self.nodes
                .get(&ObjectRef::new(n))
                .map(|k| plan::allocatable(&k))
        };
        let now = clock.now().into_std();
        let fixes = plan::plan_nodes(&ledger_nodes, kube, missing, now, grace);
        let (syncs, removals): (Vec<Fix>, Vec<Fix>) = fixes
            .into_iter()
            .partition(|f| matches!(f, Fix::SyncCapacity { .. }));
        for fix in removals {
            self.apply(fix).await;
        }
        // Many at once (a fresh allocator in a large cluster), so that group commit puts them
        // in few etcd transactions instead of one transaction per node.
        futures::stream::iter(syncs)
            .for_each_concurrent(SYNC_CONCURRENCY, |fix| self.apply(fix))
            .await;
    }

    /// Set the ledger's CPU and host memory of `name` to the node's allocatable (for node-level
    /// fit and FGD). GPUs stay as the node agent registered them.
    async fn sync_capacity(&self, name: &str, (cpu_milli, memory_mib): (u64, u64)) {
        let Some(mut inv) = self.read(|l| l.node(name).map(|n| n.inventory())).await else {
            return;
        };
        inv.cpu_milli = cpu_milli;
        inv.memory_mib = memory_mib;
        self.act(
            Command::RegisterNode(inv),
            &format!("node {name}: allocatable cpu {cpu_milli}m, memory {memory_mib} MiB"),
        )
        .await;
    }

    fn pods_api_ns(&self, ns: &str) -> Api<Pod> {
        Api::namespaced(self.pods_api.clone().into_client(), ns)
    }
}

async fn run(ties: Ties, client: kube::Client, args: KubeArgs) {
    let (pods, pod_writer) = reflector::store::<Pod>();
    let (nodes, node_writer) = reflector::store::<Node>();
    // The extender's writes are checked against the same pods.
    ties.authz.set_pods(pods.clone(), client.clone());
    // The watchers live as long as this task: dropping the set ends them.
    let mut watchers = JoinSet::new();
    crate::budget_watch::spawn(
        &mut watchers,
        ties.shared.clone(),
        ties.writer.clone(),
        &ties.budget_guard,
        client.clone(),
        &args.budgets,
    );
    let claims = crate::claim_watch::spawn(
        &mut watchers,
        ties.shared.clone(),
        ties.writer.clone(),
        client.clone(),
        pods.clone(),
        &args.claims,
    );
    let events = Recorder::new(client.clone(), "gpuledger-allocator", None);
    let templates = args.claims.claim_watch.then(|| {
        Arc::new(Templates::new(
            client.clone(),
            ties.shared.metrics.claim_templates.clone(),
            events.clone(),
            Duration::from_secs(args.claims.claim_template_collect_after_s),
            args.claims.dra_cores,
        ))
    });
    let preemption_writer = ties.writer.clone();
    let rt = Runtime::new("pods-and-nodes", ties.shared.clone(), ties.writer);
    let w = Arc::new(Watch {
        rt: rt.clone(),
        shared: ties.shared,
        pods_api: Api::all(client.clone()),
        pods,
        nodes,
        pods_ready: AtomicBool::new(false),
        nodes_ready: AtomicBool::new(false),
        deleted: moka::sync::Cache::builder()
            .max_capacity(DELETED_KEPT)
            .time_to_live(DELETED_FOR)
            .build(),
        events,
        demoted: Default::default(),
        templates,
    });
    info!("Kubernetes watchers started (pods, nodes, GPUBudgets, ResourceClaims)");

    let wp = w.clone();
    let pod_stream = reflector::reflector(
        pod_writer,
        watcher(Api::<Pod>::all(client.clone()), watcher::Config::default()),
    )
    .default_backoff();
    watchers.spawn(async move {
        let mut s = std::pin::pin!(pod_stream);
        while let Some(ev) = s.next().await {
            match ev {
                Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => wp.on_pod(&p).await,
                Ok(watcher::Event::Delete(p)) => {
                    if let Some(uid) = p.metadata.uid.as_deref() {
                        wp.demoted.forget(uid);
                        wp.deleted.insert(uid.to_string(), ());
                    }
                    if let Some(uid) = p.metadata.uid.as_deref()
                        && wp.leading()
                    {
                        wp.release(uid, "pod deleted").await;
                    }
                }
                Ok(watcher::Event::InitDone) => wp.pods_ready.store(true, Ordering::Relaxed),
                Ok(watcher::Event::Init) => {}
                Err(e) => warn!(error = %e, "pod watch error; retrying"),
            }
        }
    });

    crate::requeue::spawn(
        &mut watchers,
        rt.named("requeue"),
        w.shared.clone(),
        w.pods.clone(),
        client.clone(),
    );
    if let Some(claims) = claims {
        crate::preemption::dra::spawn(
            &mut watchers,
            rt.named("dra-preemption"),
            crate::preemption::dra::DraPreemption {
                preemption: ties.preemption.clone(),
                shared: w.shared.clone(),
                writer: preemption_writer,
                pods: w.pods.clone(),
                nodes: w.nodes.clone(),
                claims,
                client: client.clone(),
                cores: args.claims.dra_cores,
            },
        );
    }

    let wn = w.clone();
    let node_stream = reflector::reflector(
        node_writer,
        watcher(Api::<Node>::all(client), watcher::Config::default()),
    )
    .default_backoff();
    watchers.spawn(async move {
        let mut s = std::pin::pin!(node_stream);
        while let Some(ev) = s.next().await {
            match ev {
                Ok(watcher::Event::Delete(n)) => {
                    let Some(name) = n.metadata.name.clone() else {
                        continue;
                    };
                    let known = wn.read(|l| l.node(&name).is_some()).await;
                    if known && wn.leading() {
                        wn.act(
                            Command::RemoveNode {
                                node: name.clone(),
                                reason: "node deleted from Kubernetes".into(),
                            },
                            &format!("remove node {name}"),
                        )
                        .await;
                    }
                }
                Ok(watcher::Event::InitDone) => wn.nodes_ready.store(true, Ordering::Relaxed),
                Ok(_) => {}
                Err(e) => warn!(error = %e, "node watch error; retrying"),
            }
        }
    });

    if let Some(t) = w.templates.clone() {
        let wt = w.clone();
        let every = Duration::from_secs(args.claims.claim_reconcile_interval_s);
        let passes = wt.rt.named("claim-templates");
        watchers.spawn(passes.passes(every, None, move |p| {
            let (wt, t) = (wt.clone(), t.clone());
            async move {
                if p.elected {
                    t.forget();
                }
                if wt.pods_ready.load(Ordering::Relaxed) {
                    t.pass(&wt.pods).await;
                }
            }
        }));
    }

    let interval = Duration::from_millis(if args.reconcile_interval_ms == 0 {
        500
    } else {
        args.reconcile_interval_ms
    });
    let grace = Duration::from_secs(args.node_gone_grace_s);
    let mut missing = Missing::default();
    let mut expiry = Expiry::default();
    let mut passes = rt.pass_clock(interval, None);
    while passes.next().await.is_some() {
        w.reconcile(&mut missing, &mut expiry, grace).await;
    }
}
