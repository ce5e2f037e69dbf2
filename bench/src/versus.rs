//! `gpuledger-bench versus`: HAMi v2.10.0 and gpuledger on one control plane, the same pods
//! in HAMi's YAML (`nvidia.com/gpu` + `nvidia.com/gpumem` + `nvidia.com/gpucores`), each
//! system on kubelet-less nodes of its own of the same shape:
//!
//! - **throughput**: a batch of pods through HAMi's scheduler-extender (its own kube-scheduler
//!   profile, as its chart runs it), then the same batch through gpuledger's (the shipped
//!   default-scheduler configuration): pods/s, create→bound p50/p99, CPU ms per pod by process;
//! - **churn**: per system, a burst of pods of which a share is deleted while in flight, the
//!   peer's scheduler (HAMi) or the allocator leader and the extender (gpuledger) SIGKILLed and
//!   restarted every few seconds; every second the state is sampled from where each system
//!   keeps it (HAMi: the pods' allocation annotations; gpuledger: a replica's ledger) and every
//!   GPU granted beyond its memory or cores is counted; afterwards, grants held for pods that
//!   no longer exist (HAMi: its `/metrics` against its live pods' annotations; gpuledger: the
//!   ledger against the API server's pods) and `gpuledger verify`. Meanwhile a one-GPU node per
//!   system holds a whole-GPU pod that is deleted and replaced, over and over: the time from the
//!   delete until the replacement is bound is how soon a deleted pod's room is usable again.
//!
//! - **the DRA twin**, on a second cluster in DRA mode: the same pods through gpuledger's
//!   webhook (claims the allocator certifies) against claim pods of dra-example-driver, whose
//!   controller sets their binding conditions at once: pods/s and create→bound p50.
//!
//! Needs what `gpuledger-bench e2e` needs, and the peers (`e2e/peers/build.sh`). Method and
//! fairness: docs/benchmarks.md, "Versus HAMi and dra-example-driver".

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use futures::StreamExt;
use gpuledger_e2e::draex::{self, Draex};
use gpuledger_e2e::gpuledger::{counter, verify};
use gpuledger_e2e::hami::{self, Hami};
use gpuledger_e2e::lone_agent::LoneAgent;
use gpuledger_e2e::nodes::NodeShape;
use gpuledger_e2e::{E2e, Options, pods};
use gpuledger_proto::allocator::v1 as api;
use hdrhistogram::Histogram;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::common::{histogram, q_ms, record, title};
use crate::e2e::{Batch, cpu_by_process, cpu_per_pod, schedule};

/// Memory of every GPU of both systems, MiB.
const GPU_MIB: u64 = 16_384;
/// Longest wait for one replacement pod of the room probe.
const ROOM_WAIT: Duration = Duration::from_secs(60);
/// The PriorityClass of the room probe's pods, both systems': ahead of the churn's burst in
/// kube-scheduler's queue, so that the probe times the room coming back, not the queue of a
/// burst of thousands in front of it; `preemptionPolicy: Never`, so it evicts nothing.
const ROOM_PRIORITY: &str = "versus-room-probe";

/// Create [`ROOM_PRIORITY`].
async fn room_priority(client: &kube::Client) -> Result<()> {
    let pcs: Api<PriorityClass> = Api::all(client.clone());
    let pc: PriorityClass = serde_json::from_value(json!({
        "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
        "metadata": {"name": ROOM_PRIORITY},
        "value": 1000, "preemptionPolicy": "Never",
        "description": "gpuledger-bench versus: the room probe's pods, ahead of the churn's burst",
    }))?;
    pcs.create(&PostParams::default(), &pc)
        .await
        .context("creating the room probe's PriorityClass")?;
    Ok(())
}

/// Longest wait for the room probe's first pod, bound while the churn's burst floods the
/// system's scheduler (HAMi's, killed every `--kill-every-s`, took more than a minute once).
const ROOM_FIRST_WAIT: Duration = Duration::from_secs(600);

/// Flags of `gpuledger-bench versus`.
#[derive(clap::Args)]
pub struct Args {
    /// Kubelet-less nodes per system (each system gets nodes of its own, of the same shape).
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
    /// GPUs per node (16 GiB each).
    #[arg(long, default_value_t = 8)]
    gpus_per_node: u32,
    /// Pods per system in the throughput batch, and again in the churn burst.
    #[arg(long, default_value_t = 2000)]
    pods: usize,
    /// Pod creations in flight.
    #[arg(long, default_value_t = 32)]
    parallel: usize,
    /// Each pod's `nvidia.com/gpumem`, MiB.
    #[arg(long, default_value_t = 4096)]
    pod_mib: u64,
    /// Each pod's `nvidia.com/gpucores`, percent of the GPU.
    #[arg(long, default_value_t = 25)]
    pod_cores: u32,
    /// kube-scheduler's client QPS, both schedulers', and HAMi's scheduler's own (`--kube-qps`;
    /// burst twice that). Default: the shipped configurations' (kube-scheduler's 50, HAMi's
    /// client-go 5); gpuledger's components' clients have no client-side limit.
    #[arg(long)]
    scheduler_qps: Option<u32>,
    /// Share of the churn burst deleted while in flight, percent.
    #[arg(long, default_value_t = 30)]
    delete_pct: u32,
    /// Seconds between SIGKILLs during the churn (HAMi's scheduler; gpuledger's allocator
    /// leader and extender); each is restarted at once, as its Deployment would restart it.
    #[arg(long, default_value_t = 20)]
    kill_every_s: u64,
    /// Deleted pods' rooms timed per system during the churn (the churn lasts at least as long).
    #[arg(long, default_value_t = 20)]
    room_probes: usize,
    /// Kills the churn lasts for at least, however soon its pods are bound (the room probe
    /// goes on meanwhile).
    #[arg(long, default_value_t = 2)]
    min_kills: usize,
    /// Measure throughput only (no churn, no room probe).
    #[arg(long)]
    no_churn: bool,
    /// Skip the DRA twin (gpuledger's DRA mode against dra-example-driver, a second cluster).
    #[arg(long)]
    no_dra: bool,
    /// Run only the DRA twin (no HAMi, no churn): its figures and the closing line, the HAMi
    /// fields `na`.
    #[arg(long, conflicts_with = "no_dra")]
    dra_only: bool,
    /// Run one system only (its throughput and churn; the ratios `na`): to look at one
    /// system's figures without waiting for the other's.
    #[arg(long, value_enum, conflicts_with = "dra_only")]
    only: Option<System>,
    /// kube-controller-manager's client QPS per controller in the DRA twin (its resource-claim
    /// controller makes two calls per claim pod, for both drivers). Default: its own (20).
    #[arg(long)]
    controller_manager_qps: Option<u32>,
}

impl Args {
    /// The systems to run, HAMi first.
    fn systems(&self) -> Vec<System> {
        [System::Hami, System::Gpuledger]
            .into_iter()
            .filter(|s| self.only.is_none_or(|o| o == *s))
            .collect()
    }
}

/// One of the two systems.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum System {
    Hami,
    Gpuledger,
}

impl System {
    fn name(self) -> &'static str {
        match self {
            System::Hami => "hami",
            System::Gpuledger => "gpuledger",
        }
    }

    /// The label value of the system's kubelet-less nodes (`gpuledger.io/e2e`).
    fn pool(self) -> &'static str {
        match self {
            System::Hami => hami::NODE_LABEL.1,
            System::Gpuledger => "kubelet-less",
        }
    }

    /// The node whose one GPU the room probe uses.
    fn room_node(self) -> String {
        format!("room-{}", self.name())
    }

    /// A pod in HAMi's YAML for this system: HAMi's pods name its scheduler (its webhook, which
    /// would set it, is not run); gpuledger's go to the default scheduler unchanged otherwise.
    fn pod(self, name: &str, mib: u64, cores: u32) -> Value {
        let mut p = hami::pod(name, 1, mib, cores);
        if self == System::Gpuledger
            && let Some(spec) = p["spec"].as_object_mut()
        {
            spec.remove("schedulerName");
        }
        p
    }

    /// A pod of the benchmark's size on the system's nodes, never on its room node.
    fn bench_pod(self, name: &str, a: &Args) -> Value {
        let mut p = self.pod(name, a.pod_mib, a.pod_cores);
        p["spec"]["affinity"] = json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": hami::NODE_LABEL.0, "operator": "In", "values": [self.pool()]},
            {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": [self.room_node()]},
        ]}]}}});
        p
    }

    /// A whole-GPU pod on the system's room node.
    fn room_pod(self, name: &str) -> Value {
        let mut p = self.pod(name, GPU_MIB, 100);
        p["spec"]["nodeSelector"] = json!({"kubernetes.io/hostname": self.room_node()});
        p["spec"]["priorityClassName"] = json!(ROOM_PRIORITY);
        p
    }
}

/// What the churn measured for one system.
#[derive(Default)]
struct Churn {
    /// Samples taken (about one a second).
    samples: usize,
    /// (sample, GPU) pairs granted beyond the GPU's memory or cores.
    overcommit: usize,
    /// Most MiB granted beyond one GPU's memory in one sample.
    worst_mib: u64,
    /// Grants held for pods that no longer exist, once the churn settled.
    stranded: usize,
    /// How long after the churn settled the last stranded grant went, if any did.
    stranded_cleared: Option<Duration>,
    /// SIGKILLs sent.
    kills: usize,
    /// Pods created, of them deleted in flight.
    created: usize,
    deleted: usize,
    /// The burst's first create to the last surviving pod bound.
    settle: Duration,
    /// Delete of the room's holder to its replacement bound.
    room: Option<Histogram<u64>>,
    /// Replacements not bound within [`ROOM_WAIT`].
    room_timeouts: usize,
    /// [`Churn::room`] of the probes with no kill from [`NEAR_KILL`] before their delete to
    /// their replacement bound: the room as it comes back when nothing is restarting.
    room_calm: Option<Histogram<u64>>,
    /// The slowest probes, said (see [`slowest`]).
    room_slowest: Vec<String>,
    /// `gpuledger verify`'s verdict (gpuledger only).
    verify: Option<String>,
    /// Restarts of the node agent (gpuledger only; SIGKILL with each kill).
    agent_restarts: usize,
    /// Registrations of the node agent's inventory its log records (one per start).
    agent_registrations: usize,
    /// Bound pods of the churn holding no grant, of the bound pods, once settled (gpuledger
    /// only).
    lost: Option<(usize, usize)>,
}

/// One GPU's grants in one sample: (capacity MiB, MiB granted, cores granted in thousandths).
type Usage = HashMap<String, (u64, u64, u64)>;

/// (GPUs over their memory or cores, most MiB over) in one sample.
fn over(usage: &Usage) -> (usize, u64) {
    let mut n = 0;
    let mut worst = 0;
    for (cap, mib, cores) in usage.values() {
        if mib > cap || *cores > 1000 {
            n += 1;
            worst = worst.max(mib.saturating_sub(*cap));
        }
    }
    (n, worst)
}

/// What HAMi has granted, as its pods' annotations say (every pod that carries one, bound or
/// still being bound), per GPU, against the registered capacity; and the live pods' UIDs.
async fn hami_usage(client: &kube::Client) -> Result<Usage> {
    let pods: Api<Pod> = Api::all(client.clone());
    let mut usage = Usage::new();
    for p in pods.list(&ListParams::default()).await? {
        let annos = p.metadata.annotations.unwrap_or_default();
        let Some(a) = annos.get(hami::ALLOCATED) else {
            continue;
        };
        for g in hami::parse_allocation(a)?.into_iter().flatten() {
            let u = usage.entry(g.uuid).or_insert((GPU_MIB, 0, 0));
            u.1 += g.mem_mib;
            u.2 += u64::from(g.cores) * 10;
        }
    }
    Ok(usage)
}

/// The ledger of the first replica that answers.
async fn ledger(
    viewers: &[gpuledger_testkit::allocators::Client],
) -> Result<gpuledger_ledger::Ledger> {
    let mut last = None;
    for v in viewers {
        match v.clone().dump(api::DumpRequest {}).await {
            Ok(d) => {
                let snap = d
                    .into_inner()
                    .snapshot
                    .context("a dump without a snapshot")?;
                return gpuledger_ledger::Ledger::from_snapshot(&snap).map_err(anyhow::Error::msg);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(anyhow::anyhow!("no replica answered a dump: {last:?}"))
}

/// What gpuledger has granted, per GPU, from its allocations' shares (not from the ledger's
/// own running sums, which a fold bug would get wrong the same way).
fn gpuledger_usage(l: &gpuledger_ledger::Ledger) -> Usage {
    let mut usage = Usage::new();
    for n in l.nodes().values() {
        for g in &n.gpus {
            usage.insert(g.uuid.clone(), (g.memory_mib, 0, 0));
        }
    }
    for a in l.allocs().values() {
        for s in &a.shares {
            let u = usage.entry(s.gpu_uuid.clone()).or_insert((0, 0, 0));
            u.1 += s.mem_mib;
            u.2 += u64::from(s.core_milli);
        }
    }
    usage
}

/// UIDs of every pod the API server holds.
async fn live_uids(client: &kube::Client) -> Result<HashSet<String>> {
    let pods: Api<Pod> = Api::all(client.clone());
    Ok(pods
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter_map(|p| p.metadata.uid)
        .collect())
}

/// gpuledger's pods in `ns` bound to a node but holding no grant in the ledger (one a node
/// agent's re-registration or a failover dropped): the opposite fault of a stranded grant,
/// and as bad, for the GPU it leaves looks free.
async fn lost(
    client: &kube::Client,
    ns: &str,
    viewers: &[gpuledger_testkit::allocators::Client],
) -> Result<(usize, usize)> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let bound: Vec<String> = pods
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some())
        .filter_map(|p| p.metadata.uid)
        .collect();
    let l = ledger(viewers).await?;
    let n = bound
        .iter()
        .filter(|uid| l.allocs_of_pod(uid).is_empty())
        .count();
    Ok((n, bound.len()))
}

/// Grants held for pods that no longer exist. gpuledger: allocations in the ledger whose pod
/// UID the API server no longer has (the dump is read first, so a pod created after it cannot
/// count). HAMi: per GPU, the memory its scheduler counts as allocated (`/metrics`, from its
/// cache) beyond what its live pods' annotations grant.
async fn stranded(
    sys: System,
    client: &kube::Client,
    viewers: &[gpuledger_testkit::allocators::Client],
    hami_metrics: &str,
) -> Result<usize> {
    match sys {
        System::Gpuledger => {
            let l = ledger(viewers).await?;
            let live = live_uids(client).await?;
            Ok(l.allocs()
                .values()
                .filter(|a| !live.contains(&a.pod.uid))
                .count())
        }
        System::Hami => {
            let (code, text) = gpuledger_testkit::http::get(hami_metrics).await?;
            ensure!(code == 200, "HAMi's /metrics answered {code}");
            let usage = hami_usage(client).await?;
            let mut n = 0;
            for l in text
                .lines()
                .filter(|l| l.starts_with("hami_gpu_memory_allocated_bytes{"))
            {
                let Some(uuid) = l
                    .split("device_uuid=\"")
                    .nth(1)
                    .and_then(|r| r.split('"').next())
                else {
                    continue;
                };
                let counted = counter(
                    &text,
                    "hami_gpu_memory_allocated_bytes",
                    &[("device_uuid", uuid)],
                );
                let granted = usage.get(uuid).map_or(0, |u| u.1) as f64 * 1024.0 * 1024.0;
                if counted > granted {
                    n += 1;
                }
            }
            Ok(n)
        }
    }
}

/// Create `pod` in `ns`, retrying for up to a minute while the API server refuses it (gpuledger's
/// admission webhook is down for a moment after each extender kill).
async fn create_retrying(client: &kube::Client, ns: &str, pod: &Value) -> Result<Instant> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let at = Instant::now();
        match pods::create(client, ns, pod).await {
            Ok(_) => return Ok(at),
            // A create that timed out on the way back may have been stored.
            Err(e)
                if matches!(e.downcast_ref::<kube::Error>(),
                    Some(kube::Error::Api(s)) if s.code == 409) =>
            {
                return Ok(at);
            }
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Wait until pod `ns/name` is bound, polling it every 50 ms; false after `timeout`.
async fn bound(client: &kube::Client, ns: &str, name: &str, timeout: Duration) -> Result<bool> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Some(p) = api.get_opt(name).await?
            && p.spec.and_then(|s| s.node_name).is_some()
        {
            return Ok(true);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(false)
}

/// The room probe: the room node's one GPU is held by a whole-GPU pod; again and again, the
/// holder is deleted and a replacement created at once, and the time until the replacement
/// is bound recorded: `probes` times, and on until `stop` when that comes later.
async fn rooms(
    client: kube::Client,
    ns: String,
    sys: System,
    probes: usize,
    stop: CancellationToken,
) -> Result<(Histogram<u64>, usize, Vec<Probe>)> {
    let mut h = histogram();
    let mut timeouts = 0;
    let mut taken = Vec::new();
    let first = "room-0".to_string();
    let ns = ns.as_str();
    create_retrying(&client, ns, &sys.room_pod(&first)).await?;
    ensure!(
        bound(&client, ns, &first, ROOM_FIRST_WAIT).await?,
        "the room probe's first pod {ns}/{first} was not bound within {ROOM_FIRST_WAIT:?}"
    );
    let mut holder = first;
    let mut i = 1;
    while i <= probes || !stop.is_cancelled() {
        let t = Instant::now();
        pods::force_delete(&client, ns, &holder).await?;
        let next = format!("room-{i}");
        create_retrying(&client, ns, &sys.room_pod(&next)).await?;
        let created = t.elapsed();
        if bound(&client, ns, &next, ROOM_WAIT).await? {
            record(&mut h, t.elapsed());
            taken.push(Probe {
                at: t,
                created,
                took: t.elapsed(),
            });
        } else {
            timeouts += 1;
        }
        holder = next;
        i += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok((h, timeouts, taken))
}

/// How long before a room probe's delete a kill still counts as the probe's: the killed
/// component's restart and, for gpuledger, the leader's failover (about 2 s) and the
/// extender's replica catching up.
const NEAR_KILL: Duration = Duration::from_secs(5);

/// One room probe.
#[derive(Clone, Copy, Debug)]
struct Probe {
    /// When the holder was deleted.
    at: Instant,
    /// Delete to the replacement's create accepted (the admission webhook among the rest).
    created: Duration,
    /// Delete to the replacement bound.
    took: Duration,
}

impl Probe {
    /// Whether a kill at `k` came near it: from [`NEAR_KILL`] before its delete to its bind.
    fn near(&self, k: Instant) -> bool {
        k + NEAR_KILL >= self.at && k <= self.at + self.took
    }
}

/// The probes of `probes` that no kill of `kills` came near.
fn calm(probes: &[Probe], kills: &[Instant]) -> Histogram<u64> {
    let mut h = histogram();
    for p in probes {
        if !kills.iter().any(|&k| p.near(k)) {
            record(&mut h, p.took);
        }
    }
    h
}

/// The `n` slowest probes, each said with where its time went and the kill nearest before
/// its bind: what the room's tail is made of.
fn slowest(probes: &[Probe], kills: &[Instant], n: usize) -> Vec<String> {
    let mut by = probes.to_vec();
    by.sort_by_key(|p| std::cmp::Reverse(p.took));
    by.iter()
        .take(n)
        .map(|p| {
            let kill = kills
                .iter()
                .filter(|&&k| k <= p.at + p.took)
                .max()
                .map(|&k| {
                    if k >= p.at {
                        format!("a kill {:.1} s after the delete", (k - p.at).as_secs_f64())
                    } else {
                        format!("a kill {:.1} s before the delete", (p.at - k).as_secs_f64())
                    }
                })
                .unwrap_or_else(|| "no kill before it".into());
            format!(
                "{:.2} s = create accepted {:.2} s + bound {:.2} s later; {kill}",
                p.took.as_secs_f64(),
                p.created.as_secs_f64(),
                (p.took - p.created).as_secs_f64()
            )
        })
        .collect()
}

/// The churn for one system: burst, deletes in flight, kills, samples, room probe; then the
/// stranded grants and (gpuledger) `verify`.
async fn churn(
    e: &mut E2e,
    h: &mut Hami,
    agent: Option<&mut LoneAgent>,
    a: &Args,
    sys: System,
) -> Result<Churn> {
    let mut agent = agent.filter(|_| sys == System::Gpuledger);
    let ns = format!("churn-{}", sys.name());
    match sys {
        System::Hami => h.namespace(e, &ns).await?,
        System::Gpuledger => e.namespace(&ns).await?,
    }
    let client = e.client.clone();
    let viewers = (0..e.gl.allocs.addrs.len())
        .map(|i| e.gl.allocs.viewer(i))
        .collect::<Result<Vec<_>>>()?;
    // `settled`: the burst's survivors are bound (the room probe ends once it has its count);
    // `done`: the probe has ended too (the sampler ends).
    let (settled_tok, done) = (CancellationToken::new(), CancellationToken::new());
    let mut out = Churn::default();

    let room = tokio::spawn(rooms(
        client.clone(),
        ns.clone(),
        sys,
        a.room_probes,
        settled_tok.clone(),
    ));

    // Samples, about one a second, until the churn settles.
    let sampler = tokio::spawn({
        let (client, viewers, stop) = (client.clone(), viewers.clone(), done.clone());
        async move {
            let (mut samples, mut n, mut worst) = (0, 0, 0);
            while !stop.is_cancelled() {
                let t = Instant::now();
                let usage = match sys {
                    System::Hami => hami_usage(&client).await,
                    System::Gpuledger => ledger(&viewers).await.map(|l| gpuledger_usage(&l)),
                };
                // A sample missed while the replica it asked was being killed is no sample.
                if let Ok(u) = usage {
                    let (o, w) = over(&u);
                    samples += 1;
                    n += o;
                    worst = worst.max(w);
                }
                tokio::time::sleep(Duration::from_secs(1).saturating_sub(t.elapsed())).await;
            }
            (samples, n, worst)
        }
    });

    // The burst: every pod created, `delete_pct` of them deleted right after their create,
    // while the scheduler has them in flight.
    let names: Vec<String> = (0..a.pods).map(|i| format!("c-{i}")).collect();
    // Exactly ⌊pods × pct / 100⌋ of them, spread evenly over the burst.
    let pct = a.delete_pct as usize;
    let doomed = move |i: usize| (i + 1) * pct / 100 > i * pct / 100;
    let t0 = Instant::now();
    let burst = {
        let (client, ns) = (client.clone(), ns.clone());
        let specs: Vec<(usize, Value)> = names
            .iter()
            .enumerate()
            .map(|(i, n)| (i, sys.bench_pod(n, a)))
            .collect();
        let parallel = a.parallel;
        tokio::spawn(async move {
            futures::stream::iter(specs.into_iter().map(|(i, p)| {
                let (client, ns) = (client.clone(), ns.clone());
                async move {
                    create_retrying(&client, &ns, &p).await?;
                    if doomed(i) {
                        // Spread the deletes over the first half second of the pod's life.
                        tokio::time::sleep(Duration::from_millis((i as u64 * 37) % 500)).await;
                        let name = p["metadata"]["name"]
                            .as_str()
                            .unwrap_or_default()
                            .to_string();
                        pods::force_delete(&client, &ns, &name).await?;
                    }
                    anyhow::Ok(())
                }
            }))
            .buffer_unordered(parallel)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<Vec<_>>>()
        })
    };

    // Kills every `kill_every_s` until the burst is created and its survivors bound.
    let survivors: Vec<String> = names
        .iter()
        .enumerate()
        .filter(|(i, _)| !doomed(*i))
        .map(|(_, n)| n.clone())
        .collect();
    let settled = {
        let (client, ns, survivors) = (client.clone(), ns.clone(), survivors.clone());
        tokio::spawn(async move {
            pods::wait_bound(&client, &ns, &survivors, Duration::from_secs(1800)).await
        })
    };
    let mut next_kill = Instant::now() + Duration::from_secs(a.kill_every_s);
    let mut kills: Vec<Instant> = Vec::new();
    let mut settle = None;
    while !room.is_finished() {
        if settled.is_finished() && settle.is_none() {
            settle = Some(t0.elapsed());
        }
        if settle.is_some() && out.kills >= a.min_kills {
            settled_tok.cancel();
        }
        if Instant::now() >= next_kill {
            match sys {
                System::Hami => {
                    h.scheduler.kill();
                    h.scheduler.start()?;
                }
                System::Gpuledger => {
                    let leader = e.gl.allocs.wait_leader(Duration::from_secs(30)).await?;
                    e.gl.allocs.procs[leader].kill();
                    e.gl.extender.kill();
                    e.gl.allocs.procs[leader].start()?;
                    e.gl.extender.start()?;
                    if let Some(ag) = agent.as_deref_mut() {
                        ag.proc.kill();
                        ag.proc.start()?;
                        out.agent_restarts += 1;
                    }
                }
            }
            out.kills += 1;
            kills.push(Instant::now());
            next_kill = Instant::now() + Duration::from_secs(a.kill_every_s);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    burst.await??;
    settled
        .await?
        .with_context(|| format!("the churn's surviving pods on {}", sys.name()))?;
    out.settle = settle.unwrap_or_else(|| t0.elapsed());
    out.created = names.len();
    out.deleted = names.len() - survivors.len();
    done.cancel();
    let (h_room, timeouts, probes) = room.await??;
    out.room = Some(h_room);
    out.room_timeouts = timeouts;
    out.room_calm = Some(calm(&probes, &kills));
    out.room_slowest = slowest(&probes, &kills, 3);
    let (samples, n, worst) = sampler.await?;
    (out.samples, out.overcommit, out.worst_mib) = (samples, n, worst);

    // Stranded grants: read until none is left or a minute has passed; the last count stands.
    let settled_at = Instant::now();
    let mut seen = false;
    loop {
        let n = stranded(sys, &client, &viewers, &h.metrics_url).await?;
        out.stranded = n;
        if n == 0 {
            if seen {
                out.stranded_cleared = Some(settled_at.elapsed());
            }
            break;
        }
        seen = true;
        if settled_at.elapsed() > Duration::from_secs(60) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    if sys == System::Gpuledger {
        e.gl.allocs.wait_leader(Duration::from_secs(30)).await?;
        out.lost = Some(lost(&client, &ns, &viewers).await?);
        if let Some(ag) = agent.as_deref() {
            // Each start registers once it has read the ledger; the last one may still be at it.
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                out.agent_registrations = std::fs::read_to_string(ag.proc.log_path())
                    .unwrap_or_default()
                    .matches("inventory registered")
                    .count();
                if out.agent_registrations > out.agent_restarts || Instant::now() > deadline {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        out.verify = Some(loop {
            match verify(&e.gl, &e.gl.allocs.addrs) {
                Ok(v) => {
                    break v
                        .lines()
                        .find(|l| l.contains("verify:"))
                        .unwrap_or("verify: OK")
                        .to_string();
                }
                // A restarted replica may still be catching up.
                Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_secs(1)).await
                }
                Err(err) => break format!("FAILED: {err:#}"),
            }
        });
    }
    Ok(out)
}

/// Run the benchmark.
pub async fn run(a: Args) -> Result<()> {
    let version = gpuledger_e2e::bins::KubeBins::get()?.version()?;
    let per_gpu = (GPU_MIB / a.pod_mib.max(1))
        .min(u64::from(100 / a.pod_cores.clamp(1, 100)))
        .min(10);
    let capacity = a.nodes as u64 * u64::from(a.gpus_per_node) * per_gpu;
    let needed = a.pods as u64 * if a.no_churn { 1 } else { 2 };
    ensure!(
        a.pod_mib > 0 && a.pod_mib <= GPU_MIB && (1..=100).contains(&a.pod_cores),
        "--pod-mib must be 1..={GPU_MIB} and --pod-cores 1..=100"
    );
    ensure!(
        needed <= capacity,
        "{needed} pods of {} MiB / {} % do not fit {} nodes x {} GPUs of {GPU_MIB} MiB ({capacity} places per system): give more --nodes or fewer --pods",
        a.pod_mib,
        a.pod_cores,
        a.nodes,
        a.gpus_per_node
    );
    ensure!(
        a.delete_pct <= 100 && a.pods > 0 && a.parallel > 0,
        "--delete-pct is 0..=100, --pods and --parallel above 0"
    );
    if a.dra_only {
        let dra = dra_twin(&a).await?;
        report(&a, &version, &[], &[], &dra);
        return Ok(());
    }
    title(&format!(
        "versus: HAMi v2.10.0 and gpuledger on one kube-apiserver + kube-scheduler {version}; {} kubelet-less nodes x {} GPUs of {GPU_MIB} MiB per system; {} pods of {} MiB / {} % cores per system",
        a.nodes, a.gpus_per_node, a.pods, a.pod_mib, a.pod_cores
    ));
    let mut e = E2e::start(Options {
        scheduler_qps: a.scheduler_qps,
        ..Options::default()
    })
    .await?;
    let mut h = Hami::start_with_qps(&e, a.scheduler_qps).await?;
    room_priority(&e.client).await?;
    let t = Instant::now();
    let gl_nodes: Vec<String> = (0..a.nodes).map(|i| format!("gl-{i:05}")).collect();
    let gl_shape = NodeShape {
        gpus: a.gpus_per_node,
        gpu_mem_mib: GPU_MIB,
        ..NodeShape::default()
    };
    e.add_nodes(&gl_nodes, &gl_shape).await?;
    // A real node agent on gpuledger's first node, restarted with each kill of the churn.
    let mut agent = match a.no_churn || !a.systems().contains(&System::Gpuledger) {
        true => None,
        false => Some(e.lone_agent(&gl_nodes[0], &gl_shape)?),
    };
    e.add_nodes(
        &[System::Gpuledger.room_node()],
        &NodeShape {
            gpus: 1,
            gpu_mem_mib: GPU_MIB,
            ..NodeShape::default()
        },
    )
    .await?;
    let hami_nodes: Vec<String> = (0..a.nodes).map(|i| format!("hami-{i:05}")).collect();
    let shape = hami::NodeShape {
        gpus: a.gpus_per_node,
        gpu_mem_mib: GPU_MIB as u32,
        ..hami::NodeShape::default()
    };
    // HAMi's scheduler runs either way (it is cheap); its nodes only when it is measured.
    if a.systems().contains(&System::Hami) {
        h.add_nodes(&e, &hami_nodes, &shape).await?;
        h.add_nodes(
            &e,
            &[System::Hami.room_node()],
            &hami::NodeShape {
                gpus: 1,
                ..shape.clone()
            },
        )
        .await?;
    }
    println!(
        "{} + 1 nodes per system created and registered in {:.1} s",
        a.nodes,
        t.elapsed().as_secs_f64()
    );

    // Throughput: HAMi's batch, then gpuledger's, each in a namespace of its own.
    let mut batches: Vec<(System, Batch, BTreeMap<String, f64>)> = Vec::new();
    for sys in a.systems() {
        let ns = format!("tp-{}", sys.name());
        match sys {
            System::Hami => h.namespace(&e, &ns).await?,
            System::Gpuledger => e.namespace(&ns).await?,
        }
        title(&format!(
            "throughput: {} pods through {}",
            a.pods,
            sys.name()
        ));
        let specs: Vec<Value> = (0..a.pods)
            .map(|i| sys.bench_pod(&format!("p-{i}"), &a))
            .collect();
        let cpu0 = cpu_by_process();
        let b = schedule(&e, &ns, specs, a.parallel)
            .await
            .with_context(|| h.log_tails(20))?;
        let cpu1 = cpu_by_process();
        println!("{}: {}", sys.name(), said(&b));
        batches.push((sys, b, cpu_per_pod(&cpu0, &cpu1, a.pods)));
    }

    let mut churns: Vec<(System, Churn)> = Vec::new();
    if !a.no_churn {
        for sys in a.systems() {
            title(&format!(
                "churn: {} pods through {}, {} % deleted in flight, a SIGKILL every {} s, {} rooms timed",
                a.pods,
                sys.name(),
                a.delete_pct,
                a.kill_every_s,
                a.room_probes
            ));
            let c = churn(&mut e, &mut h, agent.as_mut(), &a, sys)
                .await
                .with_context(|| h.log_tails(20))?;
            churns.push((sys, c));
        }
    }
    drop(agent);
    drop(h);
    drop(e);
    let dra = match a.no_dra {
        true => Vec::new(),
        false => dra_twin(&a).await?,
    };
    report(&a, &version, &batches, &churns, &dra);
    Ok(())
}

/// The DRA twin, on a cluster of its own in DRA mode (the `dra` overlay, its scheduler):
/// the same pods in HAMi's YAML through gpuledger's webhook, which turns them into claims
/// that the allocator certifies (binding conditions), against claim pods of
/// dra-example-driver asking the same memory and compute of its shared devices, whose binding
/// conditions its controller's plugin sets at once (done by a stand-in with the result's
/// `shareID`, which the plugin omits and 1.36+ requires: `gpuledger_e2e::draex`). Both go through the same kube-scheduler
/// (`gpuledger-scheduler`, DynamicResources; the extender is not called for the driver's
/// pods, which ask none of its resources) and kube-controller-manager.
async fn dra_twin(a: &Args) -> Result<Vec<(&'static str, Batch, BTreeMap<String, f64>)>> {
    title("DRA twin: starting a DRA-mode cluster with dra-example-driver beside gpuledger");
    let e = E2e::start(Options {
        dra: true,
        scheduler_qps: a.scheduler_qps,
        controller_manager_qps: a.controller_manager_qps,
        ..Options::default()
    })
    .await?;
    let d = Draex::start(&e)?;
    let gl_nodes: Vec<String> = (0..a.nodes).map(|i| format!("gl-{i:05}")).collect();
    let shape = NodeShape {
        gpus: a.gpus_per_node,
        gpu_mem_mib: GPU_MIB,
        dra: true,
        ..NodeShape::default()
    };
    e.add_nodes(&gl_nodes, &shape).await?;
    let dx_nodes: Vec<String> = (0..a.nodes).map(|i| format!("draex-{i:05}")).collect();
    d.add_nodes(&e, &dx_nodes, a.gpus_per_node).await?;
    let mut out = Vec::new();
    let gib = a.pod_mib.div_ceil(1024);
    for who in ["gpuledger", "dra-example-driver"] {
        let ns = format!("dra-{}", if who == "gpuledger" { "gl" } else { "draex" });
        e.namespace(&ns).await?;
        let specs: Vec<Value> = match who {
            "gpuledger" => (0..a.pods)
                .map(|i| {
                    let mut p = System::Gpuledger.pod(&format!("p-{i}"), a.pod_mib, a.pod_cores);
                    p["spec"]["nodeSelector"] = json!({hami::NODE_LABEL.0: "kubelet-less"});
                    p
                })
                .collect(),
            _ => {
                let templates: Api<DynamicObject> = Api::namespaced_with(
                    e.client.clone(),
                    &ns,
                    &draex::resource("ResourceClaimTemplate", "resourceclaimtemplates"),
                );
                let t: DynamicObject =
                    serde_json::from_value(draex::claim_template("gpu", gib, a.pod_cores))?;
                templates.create(&PostParams::default(), &t).await?;
                (0..a.pods)
                    .map(|i| {
                        let mut p = draex::pod(&format!("p-{i}"), "gpu");
                        p["spec"]["schedulerName"] = json!("gpuledger-scheduler");
                        p
                    })
                    .collect()
            }
        };
        title(&format!("DRA twin: {} claim pods through {who}", a.pods));
        let cpu0 = cpu_by_process();
        let b = schedule(&e, &ns, specs, a.parallel)
            .await
            .with_context(|| d.log_tail(20) + &e.log_tails(20))?;
        let cpu1 = cpu_by_process();
        println!("{who}: {}", said(&b));
        out.push((who, b, cpu_per_pod(&cpu0, &cpu1, a.pods)));
    }
    Ok(out)
}

/// One batch in words, as it ends.
fn said(b: &Batch) -> String {
    format!(
        "{:.1} pods/s steady, all bound in {:.1} s, create->bound p50 {:.0} ms p99 {:.0} ms",
        b.steady,
        b.total.as_secs_f64(),
        q_ms(&b.bound, 0.5),
        q_ms(&b.bound, 0.99)
    )
}

/// One batch as a table row: pods/s, all bound in s, create->bound p50 and p99 ms.
fn row(b: &Batch) -> String {
    format!(
        "{:>10.1} {:>10.1} {:>14.0} {:>14.0}",
        b.steady,
        b.total.as_secs_f64(),
        q_ms(&b.bound, 0.5),
        q_ms(&b.bound, 0.99)
    )
}

/// The tables and the closing line.
fn report(
    a: &Args,
    version: &str,
    batches: &[(System, Batch, BTreeMap<String, f64>)],
    churns: &[(System, Churn)],
    dra: &[(&'static str, Batch, BTreeMap<String, f64>)],
) {
    if !batches.is_empty() {
        report_throughput(a, version, batches);
    }
    report_churn_and_dra(a, version, batches, churns, dra);
}

/// The throughput tables of HAMi and gpuledger.
fn report_throughput(a: &Args, version: &str, batches: &[(System, Batch, BTreeMap<String, f64>)]) {
    println!(
        "\nthroughput: {} pods per system in HAMi's YAML through kube-scheduler {version} (client QPS {})",
        a.pods,
        a.scheduler_qps
            .map_or("50, the default".into(), |q| q.to_string())
    );
    println!(
        "{:<10} {:>10} {:>10} {:>14} {:>14}",
        "system", "pods/s", "all in s", "bound p50 ms", "bound p99 ms"
    );
    for (sys, b, _) in batches {
        println!("{:<10} {}", sys.name(), row(b));
    }
    println!(
        "\nCPU ms per pod, by process (kube-scheduler: both schedulers' processes; bench: the client and HAMi's device-plugin stand-in)"
    );
    let names: std::collections::BTreeSet<&String> =
        batches.iter().flat_map(|(_, _, c)| c.keys()).collect();
    print!("  {:<27}", "");
    for (sys, _, _) in batches {
        print!(" {:>10}", sys.name());
    }
    println!();
    for n in names {
        print!("  {n:<27}");
        for (_, _, c) in batches {
            print!(" {:>10.2}", c.get(n).copied().unwrap_or(0.0));
        }
        println!();
    }
    print!("  {:<27}", "all");
    for (_, _, c) in batches {
        print!(" {:>10.2}", c.values().sum::<f64>());
    }
    println!();
}

/// The churn and DRA-twin tables, and the closing line of everything.
fn report_churn_and_dra(
    a: &Args,
    version: &str,
    batches: &[(System, Batch, BTreeMap<String, f64>)],
    churns: &[(System, Churn)],
    dra: &[(&'static str, Batch, BTreeMap<String, f64>)],
) {
    if !churns.is_empty() {
        println!(
            "\nchurn: {} pods per system, {} % deleted in flight, SIGKILL every {} s (HAMi: its scheduler; gpuledger: allocator leader + extender), state sampled every second",
            a.pods, a.delete_pct, a.kill_every_s
        );
        println!(
            "{:<10} {:>6} {:>8} {:>8} {:>11} {:>9} {:>9} {:>10} {:>10} {:>9}",
            "system",
            "kills",
            "settle s",
            "samples",
            "overcommit",
            "worst MiB",
            "stranded",
            "room p50",
            "room p99",
            "timeouts"
        );
        for (sys, c) in churns {
            let room = c.room.as_ref();
            println!(
                "{:<10} {:>6} {:>8.1} {:>8} {:>11} {:>9} {:>9} {:>10.0} {:>10.0} {:>9}",
                sys.name(),
                c.kills,
                c.settle.as_secs_f64(),
                c.samples,
                c.overcommit,
                c.worst_mib,
                c.stranded,
                room.map_or(0.0, |h| q_ms(h, 0.5)),
                room.map_or(0.0, |h| q_ms(h, 0.99)),
                c.room_timeouts
            );
            if let Some(h) = c.room_calm.as_ref().filter(|h| !h.is_empty()) {
                println!(
                    "  {}: room p50 {:.0} ms, p99 {:.0} ms over the {} probes no kill came near (none from {} s before the delete to the bind)",
                    sys.name(),
                    q_ms(h, 0.5),
                    q_ms(h, 0.99),
                    h.len(),
                    NEAR_KILL.as_secs()
                );
            }
            for p in &c.room_slowest {
                println!("  {}: a slow room: {p}", sys.name());
            }
            if let Some(d) = c.stranded_cleared {
                println!(
                    "  {}: stranded grants gone {:.1} s after the churn settled",
                    sys.name(),
                    d.as_secs_f64()
                );
            }
            if let Some(v) = &c.verify {
                println!("  {}: {v}", sys.name());
            }
            if let Some((n, of)) = c.lost {
                println!(
                    "  {}: {n} of the {of} bound pods hold no grant (lost grants)",
                    sys.name()
                );
            }
            if c.agent_restarts > 0 {
                println!(
                    "  {}: the node agent of gl-00000 SIGKILLed and restarted {} times; its inventory registered {} times",
                    sys.name(),
                    c.agent_restarts,
                    c.agent_registrations
                );
            }
            println!(
                "  {}: {} created, {} deleted in flight, room probes {}",
                sys.name(),
                c.created,
                c.deleted,
                room.map_or(0, |h| h.len())
            );
        }
    }

    if !dra.is_empty() {
        println!(
            "\nDRA twin: {} claim pods each through kube-scheduler {version}'s DynamicResources (gpuledger-scheduler), binding conditions set by the ledger's certification / as dra-example-driver's controller sets them",
            a.pods
        );
        println!(
            "{:<20} {:>10} {:>10} {:>14} {:>14} {:>12}",
            "driver", "pods/s", "all in s", "bound p50 ms", "bound p99 ms", "CPU ms/pod"
        );
        for (who, b, cpu) in dra {
            println!("{who:<20} {} {:>12.2}", row(b), cpu.values().sum::<f64>());
        }
        let names: std::collections::BTreeSet<&String> =
            dra.iter().flat_map(|(_, _, c)| c.keys()).collect();
        for n in names {
            print!("  {n:<27}");
            for (_, _, c) in dra {
                print!(" {:>10.2}", c.get(n).copied().unwrap_or(0.0));
            }
            println!();
        }
    }

    let dra_by = |w: &str| dra.iter().find(|(x, _, _)| *x == w).map(|(_, b, _)| b);
    let (dra_ratio, dra_delta) = match (dra_by("gpuledger"), dra_by("dra-example-driver")) {
        (Some(g), Some(x)) => (
            format!("{:.2}", g.steady / x.steady.max(1e-9)),
            format!("{:.0}", q_ms(&g.bound, 0.5) - q_ms(&x.bound, 0.5)),
        ),
        _ => ("na".into(), "na".into()),
    };
    let by = |s: System| batches.iter().find(|(x, _, _)| *x == s).map(|(_, b, _)| b);
    let (g, p) = (by(System::Gpuledger), by(System::Hami));
    let ratio = |f: &dyn Fn(&Batch) -> f64| match (g, p) {
        (Some(g), Some(p)) => format!("{:.2}", f(g) / f(p).max(1e-9)),
        _ => "na".into(),
    };
    let churn_of = |s: System| churns.iter().find(|(x, _)| *x == s).map(|(_, c)| c);
    let field = |s: System, f: &dyn Fn(&Churn) -> String| churn_of(s).map_or("na".into(), f);
    println!(
        "versus=hami pods_per_s_ratio={} bound_p99_ratio={} overcommit_gpuledger={} overcommit_hami={} stranded_gpuledger={} stranded_hami={} room_p99_ms={} dra_pods_per_s_ratio={dra_ratio} dra_start_p50_delta_ms={dra_delta} lost_gpuledger={}",
        ratio(&|b| b.steady),
        ratio(&|b| q_ms(&b.bound, 0.99)),
        field(System::Gpuledger, &|c| c.overcommit.to_string()),
        field(System::Hami, &|c| c.overcommit.to_string()),
        field(System::Gpuledger, &|c| c.stranded.to_string()),
        field(System::Hami, &|c| c.stranded.to_string()),
        field(System::Gpuledger, &|c| c
            .room
            .as_ref()
            .map_or("na".into(), |h| format!("{:.0}", q_ms(h, 0.99)))),
        field(System::Gpuledger, &|c| c
            .lost
            .map_or("na".into(), |(n, _)| n.to_string())),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(at: Instant, took: Duration) -> Probe {
        Probe {
            at,
            created: took / 4,
            took,
        }
    }

    #[test]
    fn a_probe_counts_as_calm_only_when_no_kill_came_near_it() {
        let t0 = Instant::now() + Duration::from_secs(100);
        let s = Duration::from_secs;
        let probes = [
            probe(t0, Duration::from_millis(100)), // a kill 2 s before: near
            probe(t0 + s(10), Duration::from_millis(200)), // 12 s after the kill: calm
            probe(t0 + s(20), s(8)),               // a kill during it: near
            probe(t0 + s(30), Duration::from_millis(300)), // calm
        ];
        let kills = [t0 - s(2), t0 + s(23)];
        let h = calm(&probes, &kills);
        assert_eq!(h.len(), 2);
        assert!(q_ms(&h, 0.99) < 400.0, "{}", q_ms(&h, 0.99));
        // Without kills every probe is calm.
        assert_eq!(calm(&probes, &[]).len(), 4);

        // The slowest first, each with its split and its kill.
        let said = slowest(&probes, &kills, 2);
        assert_eq!(said.len(), 2);
        assert_eq!(
            said[0],
            "8.00 s = create accepted 2.00 s + bound 6.00 s later; a kill 3.0 s after the delete"
        );
        assert!(
            said[1].starts_with("0.30 s ") && said[1].ends_with("a kill 7.0 s before the delete"),
            "{}",
            said[1]
        );
        assert_eq!(
            slowest(&probes, &[], 1)[0],
            "8.00 s = create accepted 2.00 s + bound 6.00 s later; no kill before it"
        );
    }
}
