//! `gpuledger-chaos run`: the whole local cluster (3 etcd members, allocator replicas,
//! extender replicas, the fake API server, the scheduler emulator, nodes each with a kubelet
//! emulator, a fake NVML and a node agent) runs a pod workload end to end while faults chosen
//! by a seed hit it; then a quiet phase and a history check.
//!
//! Run as root, the run puts itself in a network namespace of its own (`ip netns`, loopback
//! up) so it can partition the allocator leader from etcd with iptables: every allocator
//! reaches etcd through its own loopback address (127.0.1.x), and a DROP rule on that address
//! cuts exactly one allocator off. The rules die with the namespace; the host's network is
//! never touched. Not root (or no `ip`/`iptables`): partitions are skipped with a note, the
//! schedule stays the same.
//!
//! Every client-visible operation (the scheduler's binds, the kubelets' Allocate calls, how
//! each pod ended) is recorded with its outcome, timeouts as `unknown`, in `history.jsonl`.
//! The check: no GPU over capacity and one live allocation per pod container on replay of the
//! log; gapless seq; epochs never decrease; every acknowledged bind and Allocate is in the
//! ledger; no pod acknowledged two allocations; every replica equals the replayed log; every
//! node agent's view equals the ledger; every running pod has an allocation and every
//! allocation a running pod; every pod finished.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use nix::sys::signal::Signal;
use prost::Message;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::Value;

use crate::workload::{PodSpec, feed, mixed_pods, trace_pods};
use gpuledger_testkit::cluster::{ClusterOptions, LocalCluster, allocator_etcd_host, pod_phase};
use gpuledger_testkit::history::{Op, Outcome};

/// Set inside the network namespace a run created for itself (its name).
const NETNS_ENV: &str = "GPULEDGER_CHAOS_NETNS";

/// Flags of `gpuledger-chaos run`.
#[derive(clap::Args, Debug, Clone)]
pub struct RunArgs {
    /// Seed: the same seed gives the same workload and the same fault schedule.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Pods in the workload (each scheduled, admitted, run for a few seconds, released).
    #[arg(long, default_value_t = 1000)]
    pub pods: usize,
    /// Faults to inject while the workload runs.
    #[arg(long, default_value_t = 20)]
    pub faults: usize,
    /// Simulated GPU nodes (kubelet emulator, fake NVML, node agent process each).
    #[arg(long, default_value_t = 8)]
    pub nodes: usize,
    /// GPUs per node (even nodes: A100 40 GB, odd nodes: T4 15 GB).
    #[arg(long, default_value_t = 4)]
    pub gpus: u32,
    /// Allocator replicas.
    #[arg(long, default_value_t = 3)]
    pub replicas: usize,
    /// Extender replicas.
    #[arg(long, default_value_t = 2)]
    pub extenders: usize,
    /// At most this many created pods wait to be scheduled at once.
    #[arg(long, default_value_t = 32)]
    pub max_pending: usize,
    /// Give up on the workload after this many seconds; unfinished pods are violations.
    #[arg(long, default_value_t = 480)]
    pub timeout: u64,
    /// Do not enter a network namespace even as root (partitions are then skipped).
    #[arg(long)]
    pub no_netns: bool,
    /// Keep the run directory (logs of every process, history.jsonl) instead of deleting it.
    #[arg(long)]
    pub keep: bool,
    /// The pods: `synthetic` (a mix of slice sizes and resource names, 1.5–6 s each) or
    /// `openb` (GPU pods of the --trace file with their sizes and compressed lifetimes).
    #[arg(long, value_enum, default_value_t = Workload::Synthetic)]
    pub workload: Workload,
    /// The openb pod list for `--workload openb`.
    #[arg(
        long,
        default_value = "testdata/traces/openb/openb_pod_list_default.csv"
    )]
    pub trace: PathBuf,
    /// Trace seconds per second of run for `--workload openb` (lifetimes kept within 0.5–12 s).
    #[arg(long, default_value_t = 200.0)]
    pub time_scale: f64,
}

/// Where the pods of a run come from.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    /// A mix of slice sizes and resource names (gpuledger, gpushare, HAMi).
    Synthetic,
    /// Pod sizes and lifetimes from the openb production trace.
    Openb,
}

/// The faults a run draws from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL the allocator leader, restart it.
    KillLeader,
    /// SIGSTOP the leader past its lease, then SIGCONT.
    PauseLeader,
    /// SIGKILL a follower, restart it.
    KillFollower,
    /// SIGKILL one etcd member, restart it.
    KillEtcdMember,
    /// SIGKILL an extender replica, restart it.
    KillExtender,
    /// SIGKILL a node agent, restart it.
    KillNodeAgent,
    /// Drop all traffic between the allocator leader and etcd until another replica leads.
    PartitionLeader,
}

impl Fault {
    const ALL: [Fault; 7] = [
        Fault::KillLeader,
        Fault::PauseLeader,
        Fault::KillFollower,
        Fault::KillEtcdMember,
        Fault::KillExtender,
        Fault::KillNodeAgent,
        Fault::PartitionLeader,
    ];
}

/// The fault schedule of a seed: which faults, at which fraction of the workload. Every kind
/// of fault comes once (as far as `faults` allows), the rest are drawn at random, and the
/// order is shuffled: all by the seed.
pub fn schedule(seed: u64, faults: usize) -> Vec<(f64, Fault)> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
    let mut kinds: Vec<Fault> = Fault::ALL.to_vec();
    kinds.shuffle(&mut rng);
    kinds.truncate(faults);
    while kinds.len() < faults {
        kinds.push(Fault::ALL[rng.random_range(0..Fault::ALL.len())]);
    }
    kinds.shuffle(&mut rng);
    kinds
        .into_iter()
        .enumerate()
        .map(|(i, f)| {
            let at = (i as f64 + rng.random_range(0.2..0.8)) / faults.max(1) as f64;
            (at, f)
        })
        .collect()
}

/// One injected fault.
struct Injected {
    /// Since the workload started.
    at: Duration,
    /// Until the fault was over (process restarted, partition healed).
    until: Duration,
    what: String,
}

/// Run the workload with faults and check the history. Returns Err on any violation.
pub async fn run(a: RunArgs) -> Result<()> {
    let netns = std::env::var(NETNS_ENV).ok();
    if netns.is_none() && !a.no_netns {
        match can_netns() {
            Ok(()) => return in_own_netns(&a).await,
            Err(why) => println!("partitions skipped: {why}"),
        }
    } else if netns.is_none() {
        println!("partitions skipped: --no-netns");
    }
    let partitions = netns.is_some();

    let (dir, _tmp) = gpuledger_testkit::process::run_dir("gpuledger-chaos-", a.keep)?;
    println!(
        "chaos run seed={} pods={} faults={} — {} nodes x {} GPUs, {} allocators, {} extenders{} — run directory {}",
        a.seed,
        a.pods,
        a.faults,
        a.nodes,
        a.gpus,
        a.replicas,
        a.extenders,
        netns
            .as_deref()
            .map_or(String::new(), |n| format!(", network namespace {n}")),
        dir.display()
    );
    let mut c = LocalCluster::start(ClusterOptions {
        nodes: a.nodes,
        gpus: a.gpus,
        allocators: a.replicas.max(2),
        extenders: a.extenders.max(1),
        admit_timeout: Duration::from_secs(30),
        dir: Some(dir.clone()),
        etcd_alias_per_allocator: true,
        ..Default::default()
    })
    .await?;
    let res = drive(&mut c, &a, partitions).await;
    if let Err(e) = &res
        && e.downcast_ref::<Violations>().is_none()
    {
        println!("{}", reproduce(&a));
    }
    if partitions {
        heal_all();
    }
    res
}

/// The history check found violations (already reported).
#[derive(Debug)]
struct Violations(usize);

impl std::fmt::Display for Violations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} violation(s)", self.0)
    }
}

impl std::error::Error for Violations {}

/// The command that runs `a` again with its logs kept.
fn reproduce(a: &RunArgs) -> String {
    let workload = match a.workload {
        Workload::Synthetic => String::new(),
        Workload::Openb => format!(
            " --workload openb --trace {} --time-scale {}",
            a.trace.display(),
            a.time_scale
        ),
    };
    format!(
        "reproduce: gpuledger-chaos run --seed {} --pods {} --faults {} --nodes {} --gpus {} --replicas {} --extenders {}{workload} --keep",
        a.seed, a.pods, a.faults, a.nodes, a.gpus, a.replicas, a.extenders
    )
}

/// Why this process cannot put a run in a network namespace of its own, if it cannot.
fn can_netns() -> Result<(), String> {
    if !nix::unistd::geteuid().is_root() {
        return Err("not root (partitions need a network namespace and iptables)".into());
    }
    for (tool, version) in [("ip", "-V"), ("iptables", "--version")] {
        let found = std::process::Command::new(tool)
            .arg(version)
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            return Err(format!(
                "`{tool}` not found (apt-get install -y iproute2 iptables)"
            ));
        }
    }
    Ok(())
}

fn sh(args: &[&str]) -> Result<()> {
    let out = std::process::Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("running {}", args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "`{}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Create a network namespace with loopback up, run this same command inside it, delete the
/// namespace (also on Ctrl-C), and end as the inner run ended.
async fn in_own_netns(a: &RunArgs) -> Result<()> {
    let name = format!("gpuledger-chaos-{}", std::process::id());
    if let Err(e) = sh(&["ip", "netns", "add", &name])
        .and_then(|()| sh(&["ip", "-n", &name, "link", "set", "lo", "up"]))
    {
        let _ = sh(&["ip", "netns", "del", &name]);
        println!("partitions skipped: cannot create a network namespace: {e:#}");
        let mut inner = a.clone();
        inner.no_netns = true;
        return Box::pin(run(inner)).await;
    }
    let exe = std::env::current_exe().context("finding this executable")?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut child = tokio::process::Command::new("ip")
        .args(["netns", "exec", &name])
        .arg(&exe)
        .args(&args)
        .env(NETNS_ENV, &name)
        .spawn()
        .context("starting the run inside its network namespace")?;
    let status = tokio::select! {
        s = child.wait() => s,
        _ = tokio::signal::ctrl_c() => {
            // The inner run got the same SIGINT; let it stop its processes.
            child.wait().await
        }
    };
    let _ = sh(&["ip", "netns", "del", &name]);
    let status = status.context("waiting for the run")?;
    if status.success() {
        Ok(())
    } else {
        bail!("the run failed ({status})")
    }
}

/// iptables rules that cut loopback address `host` off.
fn partition_rules(host: &str) -> [Vec<String>; 2] {
    ["-s", "-d"].map(|dir| {
        ["INPUT", dir, host, "-j", "DROP"]
            .iter()
            .map(|s| (*s).to_string())
            .collect()
    })
}

fn iptables(op: &str, rule: &[String]) -> Result<()> {
    let mut args = vec!["iptables", "-w", op];
    args.extend(rule.iter().map(String::as_str));
    sh(&args)
}

/// Remove every partition rule this run may have left (it runs in its own namespace).
fn heal_all() {
    let _ = sh(&["iptables", "-w", "-F", "INPUT"]);
}

/// Pods of the workload: (ended, running, created and not bound yet, bound).
fn progress(c: &LocalCluster) -> (usize, usize, usize, usize) {
    let pods = c.api.store.objects("v1", "pods");
    let ended = pods
        .iter()
        .filter(|p| matches!(pod_phase(p), "Succeeded" | "Failed"))
        .count();
    let running = pods.iter().filter(|p| pod_phase(p) == "Running").count();
    let bound = pods
        .iter()
        .filter(|p| p["spec"]["nodeName"].is_string())
        .count();
    (ended, running, pods.len() - bound, bound)
}

/// The run's pods.
fn pods(a: &RunArgs) -> Result<Vec<PodSpec>> {
    Ok(match a.workload {
        Workload::Synthetic => mixed_pods(a.pods, a.seed),
        Workload::Openb => {
            let (pods, too_big) = trace_pods(&a.trace, a.pods, a.seed, a.time_scale, a.gpus)
                .with_context(|| format!("reading the trace {}", a.trace.display()))?;
            println!(
                "workload: {} GPU pods of {} (lifetimes / {}){}",
                pods.len(),
                a.trace.display(),
                a.time_scale,
                if too_big > 0 {
                    format!(
                        "; {too_big} trace pods want more than {} GPUs and are left out",
                        a.gpus
                    )
                } else {
                    String::new()
                }
            );
            pods
        }
    })
}

async fn drive(c: &mut LocalCluster, a: &RunArgs, partitions: bool) -> Result<()> {
    let pods = pods(a)?;
    let started = Instant::now();
    let feeder = feed(c.api.store.clone(), pods, a.max_pending);
    let plan = schedule(a.seed, a.faults);
    let mut injected: Vec<Injected> = Vec::new();
    let deadline = started + Duration::from_secs(a.timeout);
    let mut converged_s = 0.0;
    let mut next = 0;
    let mut last_report = Instant::now();
    loop {
        let (ended, running, pending, bound) = progress(c);
        // Every planned fault is injected, even when the workload ends first.
        let all_ended = ended >= a.pods && next == plan.len();
        if all_ended || Instant::now() > deadline {
            break;
        }
        if last_report.elapsed() > Duration::from_secs(10) {
            last_report = Instant::now();
            println!(
                "  {:>7.1}s  {ended}/{} pods done, {running} running, {pending} pending",
                started.elapsed().as_secs_f64(),
                a.pods
            );
        }
        // Faults at fractions of the pods scheduled so far, so pods still run after the last.
        if next < plan.len() && (bound as f64 >= plan[next].0 * a.pods as f64 || ended >= a.pods) {
            let at = started.elapsed();
            let what = inject(c, plan[next].1, a.seed, next, partitions)
                .await
                .with_context(|| format!("injecting fault {}", next + 1))?;
            let until = started.elapsed();
            println!(
                "  {:>7.1}s  fault {}/{}: {what} ({:.1}s)",
                at.as_secs_f64(),
                next + 1,
                plan.len(),
                (until - at).as_secs_f64()
            );
            injected.push(Injected { at, until, what });
            next += 1;
            if next == plan.len() {
                // The last fault: how long until everything is healthy again.
                healthy(c, Duration::from_secs(60)).await?;
                converged_s = (started.elapsed() - until).as_secs_f64();
                println!(
                    "  {:>7.1}s  converged {converged_s:.1}s after the last fault",
                    started.elapsed().as_secs_f64()
                );
            }
            continue;
        }
        if let Err(e) = c.check_processes() {
            return Err(e.context("a component died by itself"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    feeder.abort();
    let workload = started.elapsed();
    println!(
        "  {:>7.1}s  workload over; quiet phase",
        workload.as_secs_f64()
    );

    // Quiet phase: everything converges, every ended pod's allocation released.
    healthy(c, Duration::from_secs(60)).await?;
    let release_deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < release_deadline {
        let live_pods: BTreeSet<String> = live_pod_uids(c);
        let held = c.dump().await.map_or(usize::MAX, |s| {
            s.allocations
                .iter()
                .filter(|x| x.pod.as_ref().is_none_or(|p| !live_pods.contains(&p.uid)))
                .count()
        });
        if held == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    c.allocs.wait_caught_up(Duration::from_secs(30)).await?;
    check(c, a, &injected, started, workload, converged_s).await
}

/// UIDs of pods bound or pending that have not ended.
fn live_pod_uids(c: &LocalCluster) -> BTreeSet<String> {
    c.api
        .store
        .objects("v1", "pods")
        .iter()
        .filter(|p| !matches!(pod_phase(p), "Succeeded" | "Failed"))
        .filter_map(|p| p.pointer("/metadata/uid").and_then(Value::as_str))
        .map(String::from)
        .collect()
}

/// Wait until the cluster is whole again: etcd answers, one allocator leads and every replica
/// has caught up with it, every extender and node agent is ready.
async fn healthy(c: &mut LocalCluster, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let why = not_healthy(c).await;
        let Some(why) = why else { return Ok(()) };
        if Instant::now() > deadline {
            bail!("the cluster did not converge within {timeout:?}: {why}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn not_healthy(c: &mut LocalCluster) -> Option<String> {
    if let Err(e) = c.etcd().wait_ready(Duration::from_millis(500)).await {
        return Some(format!("etcd: {e:#}"));
    }
    let mut leader_seq = None;
    let mut seqs = Vec::new();
    for i in 0..c.allocs.addrs.len() {
        let Some(s) = c.allocs.status(i).await else {
            return Some(format!("alloc{i} does not answer Status"));
        };
        if s.role == "leader" && s.ready {
            if leader_seq.is_some() {
                return Some("two replicas call themselves leader".into());
            }
            leader_seq = Some(s.seq);
        }
        seqs.push(s.seq);
    }
    let Some(head) = leader_seq else {
        return Some("no allocator leads".into());
    };
    if let Some(i) = seqs.iter().position(|s| *s + 64 < head) {
        return Some(format!("alloc{i} at seq {}, the leader at {head}", seqs[i]));
    }
    for i in 0..c.extenders.len() {
        let ok = gpuledger_testkit::http::get(&format!("{}/readyz", c.extender_url(i)))
            .await
            .is_ok_and(|(code, _)| code == 200);
        if !ok {
            return Some(format!("extender{i} not ready"));
        }
    }
    for n in &c.nodes {
        let ok = gpuledger_testkit::http::get(&format!("{}/readyz", n.health_url()))
            .await
            .is_ok_and(|(code, _)| code == 200);
        if !ok {
            return Some(format!("node agent of {} not ready", n.name));
        }
    }
    None
}

async fn inject(
    c: &mut LocalCluster,
    fault: Fault,
    seed: u64,
    n: usize,
    partitions: bool,
) -> Result<String> {
    let leader = c.allocs.wait_leader(Duration::from_secs(30)).await?;
    let pick = |len: usize| (seed as usize).wrapping_add(n) % len.max(1);
    Ok(match fault {
        Fault::KillLeader => {
            let t = Instant::now();
            c.allocs.procs[leader].kill();
            let new = c
                .allocs
                .wait_leader_except(Duration::from_secs(30), Some(leader))
                .await?;
            let ms = t.elapsed().as_millis();
            c.allocs.procs[leader].start()?;
            format!("SIGKILL allocator leader alloc{leader}; alloc{new} leading after {ms} ms")
        }
        Fault::PauseLeader => {
            let t = Instant::now();
            c.allocs.procs[leader].signal(Signal::SIGSTOP)?;
            let new = c
                .allocs
                .wait_leader_except(Duration::from_secs(30), Some(leader))
                .await?;
            let ms = t.elapsed().as_millis();
            tokio::time::sleep(Duration::from_millis(500)).await;
            c.allocs.procs[leader].signal(Signal::SIGCONT)?;
            format!(
                "SIGSTOP allocator leader alloc{leader} past its lease; alloc{new} leading after {ms} ms; SIGCONT"
            )
        }
        Fault::KillFollower => {
            let k = c.allocs.addrs.len();
            let f = (leader + 1 + pick(k - 1)) % k;
            c.allocs.procs[f].kill();
            tokio::time::sleep(Duration::from_millis(500)).await;
            c.allocs.procs[f].start()?;
            format!("SIGKILL allocator follower alloc{f}, restarted after 0.5 s")
        }
        Fault::KillEtcdMember => {
            let m = pick(3);
            c.etcd().kill(m);
            tokio::time::sleep(Duration::from_millis(1500)).await;
            c.etcd().restart(m)?;
            format!("SIGKILL etcd member etcd{m}, restarted after 1.5 s")
        }
        Fault::KillExtender => {
            let e = pick(c.extenders.len());
            c.extenders[e].kill();
            tokio::time::sleep(Duration::from_secs(1)).await;
            c.extenders[e].start()?;
            format!("SIGKILL extender{e}, restarted after 1 s")
        }
        Fault::KillNodeAgent => {
            let i = pick(c.nodes.len());
            let running = c
                .runs
                .running()
                .iter()
                .filter(|r| r.node == c.nodes[i].name)
                .count();
            let back = c.restart_agent(i, Duration::from_secs(1)).await?;
            format!(
                "SIGKILL node agent of {} ({running} pods running there), restarted after 1 s, ready after {} ms",
                c.nodes[i].name,
                back.as_millis()
            )
        }
        Fault::PartitionLeader if !partitions => {
            "partition of the allocator leader from etcd skipped (no network namespace)".into()
        }
        Fault::PartitionLeader => {
            let host = allocator_etcd_host(leader);
            let rules = partition_rules(&host);
            let t = Instant::now();
            for r in &rules {
                iptables("-I", r)?;
            }
            let new = c
                .allocs
                .wait_leader_except(Duration::from_secs(30), Some(leader))
                .await;
            let ms = t.elapsed().as_millis();
            // Hold it a little longer: the deposed leader tries (and fails) to write.
            tokio::time::sleep(Duration::from_millis(1000)).await;
            for r in &rules {
                iptables("-D", r)?;
            }
            let new = new?;
            format!(
                "partition alloc{leader} from etcd (iptables DROP {host}); alloc{new} leading after {ms} ms; healed after {} ms",
                t.elapsed().as_millis()
            )
        }
    })
}

/// What the ledger log says, read from etcd and replayed.
pub struct Replay {
    ledger: gpuledger_ledger::Ledger,
    /// Allocation id -> every pod UID that owned it (identity corrections move them).
    owners: HashMap<u64, BTreeSet<String>>,
    /// Allocation ids claimed by a node agent (Assigned).
    assigned: BTreeSet<u64>,
    /// Pod UID -> nodes it was reserved on.
    reserved_on: HashMap<String, BTreeSet<String>>,
    violations: Vec<String>,
    double: usize,
}

/// The whole log: etcd's tail, then the archive (read second: whatever was trimmed from etcd
/// before the first read is in the archive by then, because batches leave etcd only after
/// they are archived).
async fn replay_log(c: &mut LocalCluster) -> Result<Replay> {
    let client = c.etcd().client().await?;
    let mut kv = client
        .kv_client()
        .max_decoding_message_size(512 * 1024 * 1024);
    let resp = kv
        .get(
            "/gpuledger/local/log/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .context("reading the ledger log from etcd")?;
    let mut tail = Vec::with_capacity(resp.kvs().len());
    for kvp in resp.kvs() {
        tail.push(pb::EventBatch::decode(kvp.value()).context("decoding a log batch")?);
    }
    let archive = gpuledger_ops::archive::Archive::open(&c.dir.join("archive"))?;
    let mut batches = Vec::new();
    archive
        .read(1, 0, |b| {
            batches.push(b);
            true
        })
        .context("reading the log archive")?;
    let archived = batches.last().map_or(0, gpuledger_ops::archive::last_seq);
    batches.extend(
        tail.into_iter()
            .filter(|b| gpuledger_ops::archive::last_seq(b) > archived),
    );
    Ok(Replay::from_batches(batches))
}

impl Replay {
    /// Replay `batches` (in key order) from an empty ledger, noting every invariant broken on
    /// the way: an apply error (capacity, seq gap, unknown allocation…), an epoch lower than
    /// the batch before, a pod container holding two allocations at once.
    pub fn from_batches(batches: impl IntoIterator<Item = pb::EventBatch>) -> Replay {
        let mut r = Replay {
            ledger: gpuledger_ledger::Ledger::new(),
            owners: HashMap::new(),
            assigned: BTreeSet::new(),
            reserved_on: HashMap::new(),
            violations: Vec::new(),
            double: 0,
        };
        let mut last_epoch = 0;
        for b in batches {
            if b.epoch < last_epoch {
                r.violations.push(format!(
                    "epoch went down at seq {}: {} after {last_epoch}",
                    b.first_seq, b.epoch
                ));
            }
            last_epoch = b.epoch;
            for e in &b.events {
                r.apply(e);
            }
        }
        if let Err(e) = r.ledger.check() {
            r.violations.push(format!("replayed state: {e}"));
        }
        r
    }

    fn apply(&mut self, e: &pb::Event) {
        if let Err(err) = self.ledger.apply(e) {
            self.violations.push(format!("replay: {err}"));
            return;
        }
        let touched: Vec<u64> = match &e.body {
            Some(pb::event::Body::Reserved(x)) => {
                if let Some(p) = &x.pod {
                    self.reserved_on
                        .entry(p.uid.clone())
                        .or_default()
                        .insert(x.node.clone());
                }
                vec![x.allocation_id]
            }
            Some(pb::event::Body::Assigned(x)) => {
                self.assigned.insert(x.allocation_id);
                Vec::new()
            }
            Some(pb::event::Body::IdentityCorrected(x)) => {
                vec![x.from_allocation_id, x.to_allocation_id]
            }
            _ => Vec::new(),
        };
        for id in touched {
            let Some(al) = self.ledger.allocs().get(&id) else {
                continue;
            };
            let uid = al.pod.uid.clone();
            self.owners.entry(id).or_default().insert(uid.clone());
            let mut per_container: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
            for x in self.ledger.allocs_of_pod(&uid) {
                per_container.entry(&x.container).or_default().push(x.id);
            }
            for (container, ids) in per_container {
                if ids.len() > 1 {
                    self.double += 1;
                    self.violations.push(format!(
                        "double grant in the ledger at seq {}: pod {uid} container {container} holds allocations {ids:?}",
                        e.seq
                    ));
                }
            }
        }
    }
}

/// What the acknowledged operations say against the ledger.
#[derive(Debug, Default)]
pub struct GrantCheck {
    /// What is wrong.
    pub violations: Vec<String>,
    /// Acknowledged grants missing from the ledger.
    pub lost: usize,
    /// Pods answered two different allocations.
    pub double: usize,
}

/// Every acknowledged bind has its reservation on that node in the ledger; every acknowledged
/// Allocate names an allocation the ledger gave that pod and shows claimed; no pod was
/// answered two different allocations.
pub fn check_grants(ops: &[Op], r: &Replay) -> GrantCheck {
    let mut g = GrantCheck::default();
    let mut acked: BTreeMap<&str, BTreeSet<u64>> = BTreeMap::new();
    for o in ops.iter().filter(|o| o.outcome == Outcome::Ok) {
        match o.op {
            "bind" => {
                let there = r
                    .reserved_on
                    .get(&o.uid)
                    .is_some_and(|n| n.contains(&o.node));
                if !there {
                    g.lost += 1;
                    g.violations.push(format!(
                        "lost grant: bind of {} to {} was acknowledged, no reservation there in the ledger",
                        o.pod, o.node
                    ));
                }
            }
            "allocate" => {
                let Some(id) = o.allocation else {
                    g.violations.push(format!(
                        "Allocate for {} on {} answered without GPULEDGER_ALLOCATION_ID",
                        o.pod, o.node
                    ));
                    continue;
                };
                acked.entry(&o.uid).or_default().insert(id);
                let owned = r.owners.get(&id).is_some_and(|u| u.contains(&o.uid));
                if !owned || !r.assigned.contains(&id) {
                    g.lost += 1;
                    g.violations.push(format!(
                        "lost grant: Allocate for {} on {} answered allocation {id}, which the ledger {}",
                        o.pod,
                        o.node,
                        if owned {
                            "never shows claimed (Assigned)"
                        } else {
                            "never gave to that pod"
                        }
                    ));
                }
            }
            _ => {}
        }
    }
    for (uid, ids) in &acked {
        if ids.len() > 1 {
            g.double += 1;
            g.violations.push(format!(
                "double grant: pod {uid} was answered allocations {ids:?}"
            ));
        }
    }
    g
}

async fn check(
    c: &mut LocalCluster,
    a: &RunArgs,
    injected: &[Injected],
    started: Instant,
    workload: Duration,
    converged_s: f64,
) -> Result<()> {
    // The history, in time order.
    let mut ops: Vec<Op> = c.scheduler.stats.history.all();
    ops.extend(c.runs.history.all());
    ops.sort_by_key(|o| o.at_ms);
    let hist_path = c.dir.join("history.jsonl");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&hist_path)?);
    for o in &ops {
        writeln!(f, "{}", o.to_json())?;
    }
    f.flush()?;

    let mut r = replay_log(c).await?;
    let mut violations = std::mem::take(&mut r.violations);
    let g = check_grants(&ops, &r);
    violations.extend(g.violations);
    let lost = g.lost;
    let double = r.double + g.double;
    // Every replica equals the replayed log.
    let mut replay_equal = true;
    for i in 0..c.allocs.addrs.len() {
        let d = c
            .allocs
            .client(i)?
            .dump(api::DumpRequest {})
            .await
            .with_context(|| format!("Dump of alloc{i}"))?
            .into_inner();
        let live = gpuledger_ledger::Ledger::from_snapshot(&d.snapshot.unwrap_or_default())
            .map_err(anyhow::Error::msg)?;
        if !live.same_state(&r.ledger) {
            replay_equal = false;
            violations.push(format!(
                "replica alloc{i} (seq {}) differs from the replayed log (seq {})",
                live.seq(),
                r.ledger.seq()
            ));
        }
    }
    // Every node agent's view equals the ledger.
    for v in c.check_agent_views(Duration::from_secs(20)).await {
        if !v.agree {
            violations.push(format!(
                "node agent of {} differs from the ledger: {}",
                v.node, v.detail
            ));
        }
    }
    // Pods and allocations match; every pod finished.
    let pods = c.api.store.objects("v1", "pods");
    let mut by_uid: HashMap<String, (&Value, &str)> = HashMap::new();
    for p in &pods {
        if let Some(uid) = p.pointer("/metadata/uid").and_then(Value::as_str) {
            by_uid.insert(uid.to_string(), (p, pod_phase(p)));
        }
    }
    let mut failed: BTreeMap<String, usize> = BTreeMap::new();
    let mut succeeded = 0;
    for (p, ph) in by_uid.values() {
        let name = p.pointer("/metadata/name").and_then(Value::as_str);
        match *ph {
            "Succeeded" => succeeded += 1,
            "Failed" => {
                let why = p
                    .pointer("/status/message")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .split(':')
                    .next()
                    .unwrap_or("")
                    .to_string();
                *failed.entry(why).or_default() += 1;
            }
            "Running" => {
                if !r.ledger.allocs().values().any(|x| {
                    Some(x.pod.uid.as_str()) == p.pointer("/metadata/uid").and_then(Value::as_str)
                }) {
                    violations.push(format!(
                        "pod {} is running without an allocation",
                        name.unwrap_or("?")
                    ));
                }
                violations.push(format!(
                    "pod {} still running {}s after the workload began",
                    name.unwrap_or("?"),
                    a.timeout
                ));
            }
            other => violations.push(format!(
                "pod {} never finished (phase {other})",
                name.unwrap_or("?")
            )),
        }
    }
    for x in r.ledger.allocs().values() {
        let live = by_uid
            .get(&x.pod.uid)
            .is_some_and(|(_, ph)| !matches!(*ph, "Succeeded" | "Failed"));
        if !live {
            violations.push(format!(
                "allocation {} of pod {}/{} on {} has no running pod",
                x.id, x.pod.namespace, x.pod.name, x.node
            ));
        }
    }

    // The report.
    let unknown = ops.iter().filter(|o| o.outcome == Outcome::Unknown).count();
    println!();
    println!(
        "seed {}: {} pods ({succeeded} succeeded, {} failed), {} client operations ({unknown} with unknown outcome), {} faults",
        a.seed,
        a.pods,
        failed.values().sum::<usize>(),
        ops.len(),
        injected.len()
    );
    for (why, n) in &failed {
        println!("  failed: {n} x {why}");
    }
    println!(
        "workload {:.1}s ({:.1} pods/s); ledger seq {}, epochs up to {}",
        workload.as_secs_f64(),
        a.pods as f64 / workload.as_secs_f64(),
        r.ledger.seq(),
        r.ledger.epoch()
    );
    let mut admit: Vec<Duration> = c
        .runs
        .all()
        .iter()
        .filter_map(|r| r.started.map(|s| s.saturating_duration_since(r.seen)))
        .collect();
    admit.sort();
    if let (Some(p50), Some(max)) = (admit.get(admit.len() / 2), admit.last()) {
        println!(
            "admission on the node (bound to container started): p50 {:.2}s, max {:.2}s",
            p50.as_secs_f64(),
            max.as_secs_f64()
        );
    }
    print_phases(c, injected, started, workload);
    println!("history: {}", hist_path.display());
    for v in &violations {
        println!("VIOLATION {v}");
    }
    if !violations.is_empty() {
        println!("{}", reproduce(a));
    }
    println!(
        "violations={} lost_grants={lost} double_grants={double} replay_equal={replay_equal} converged_s={converged_s:.1}",
        violations.len()
    );
    if !violations.is_empty() {
        return Err(Violations(violations.len()).into());
    }
    Ok(())
}

/// Pods finished per second in each phase between faults.
fn print_phases(c: &LocalCluster, injected: &[Injected], started: Instant, workload: Duration) {
    let mut bounds: Vec<(Duration, String)> = vec![(Duration::ZERO, "start".into())];
    for (i, f) in injected.iter().enumerate() {
        bounds.push((f.at, format!("fault {}", i + 1)));
    }
    let ends: Vec<Duration> = c
        .runs
        .all()
        .iter()
        .filter_map(|r| r.ended.map(|e| e.saturating_duration_since(started)))
        .collect();
    println!("phase            from      to   pods done   pods/s");
    for (k, (from, label)) in bounds.iter().enumerate() {
        let to = bounds.get(k + 1).map_or(workload, |b| b.0);
        if to <= *from {
            continue;
        }
        let n = ends.iter().filter(|e| **e >= *from && **e < to).count();
        println!(
            "{label:<14} {:>6.1}s {:>6.1}s {n:>11} {:>8.1}",
            from.as_secs_f64(),
            to.as_secs_f64(),
            n as f64 / (to - *from).as_secs_f64()
        );
    }
    for (i, f) in injected.iter().enumerate() {
        println!(
            "fault {:>2} at {:>6.1}s, over at {:>6.1}s: {}",
            i + 1,
            f.at.as_secs_f64(),
            f.until.as_secs_f64(),
            f.what
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuledger_ledger::{Command, ContainerRequest, Ledger, PodRequest, Reply};
    use gpuledger_testkit::history::now_ms;

    /// A log written by a real ledger: node n1 (2 GPUs), pods a and b reserved on it, a's
    /// allocation claimed by the agent. Each command is one batch of `epoch`.
    fn log(epoch: u64) -> (Vec<pb::EventBatch>, u64, u64) {
        let mut l = Ledger::new();
        let mut batches = Vec::new();
        let mut run = |l: &mut Ledger, cmd: Command| {
            let (events, reply) = l.execute(cmd, epoch, 0).expect("command");
            batches.push(pb::EventBatch {
                version: 1,
                first_seq: events[0].seq,
                epoch,
                events,
            });
            reply
        };
        run(
            &mut l,
            Command::RegisterNode(gpuledger_testkit::workload::inventory(
                "n1", 2, 16_000, "T4",
            )),
        );
        let mut reserve = |l: &mut Ledger, uid: &str| {
            let request = PodRequest {
                pod: pb::PodRef {
                    uid: uid.into(),
                    namespace: "default".into(),
                    name: uid.into(),
                },
                containers: vec![ContainerRequest {
                    name: "main".into(),
                    slices: 1,
                    mem_mib: 4_000,
                    ..Default::default()
                }],
                ..Default::default()
            };
            let cmd = Command::Reserve {
                request,
                node: "n1".into(),
                deadline_ms: 0,
            };
            match run(l, cmd) {
                Reply::Reserved { allocations, .. } => allocations[0].id,
                other => panic!("reserve answered {other:?}"),
            }
        };
        let a = reserve(&mut l, "a");
        let b = reserve(&mut l, "b");
        run(
            &mut l,
            Command::Assign {
                node: "n1".into(),
                allocation_id: a,
                device_ids: vec!["d0".into()],
            },
        );
        (batches, a, b)
    }

    fn op(op: &'static str, uid: &str, allocation: Option<u64>) -> Op {
        Op {
            at_ms: now_ms(),
            op,
            pod: format!("default/{uid}"),
            uid: uid.into(),
            node: "n1".into(),
            outcome: Outcome::Ok,
            allocation,
            detail: String::new(),
        }
    }

    #[test]
    fn a_clean_history_passes() {
        let (batches, a, _) = log(7);
        let r = Replay::from_batches(batches);
        assert!(r.violations.is_empty(), "{:?}", r.violations);
        let g = check_grants(&[op("bind", "a", None), op("allocate", "a", Some(a))], &r);
        assert!(g.violations.is_empty(), "{:?}", g.violations);
        assert_eq!((g.lost, g.double), (0, 0));
    }

    #[test]
    fn acknowledged_grants_missing_from_the_ledger_are_lost() {
        let (batches, a, b) = log(7);
        let r = Replay::from_batches(batches);
        // A bind acknowledged for a pod the ledger never reserved.
        assert_eq!(check_grants(&[op("bind", "zz", None)], &r).lost, 1);
        // An Allocate answered with another pod's allocation, or one never claimed.
        assert_eq!(check_grants(&[op("allocate", "b", Some(a))], &r).lost, 1);
        let g = check_grants(&[op("allocate", "b", Some(b))], &r);
        assert_eq!(g.lost, 1);
        assert!(g.violations[0].contains("never shows claimed"), "{g:?}");
        // Unknown outcomes are not acknowledgements.
        let mut unknown = op("bind", "zz", None);
        unknown.outcome = Outcome::Unknown;
        assert_eq!(check_grants(&[unknown], &r).lost, 0);
    }

    #[test]
    fn one_pod_answered_two_allocations_is_a_double_grant() {
        let (batches, a, b) = log(7);
        let r = Replay::from_batches(batches);
        let g = check_grants(
            &[op("allocate", "a", Some(a)), op("allocate", "a", Some(b))],
            &r,
        );
        assert_eq!(g.double, 1, "{g:?}");
    }

    #[test]
    fn broken_logs_are_caught_on_replay() {
        // Epochs going down.
        let (mut batches, _, _) = log(7);
        batches[2].epoch = 3;
        let r = Replay::from_batches(batches);
        assert!(r.violations.iter().any(|v| v.contains("epoch went down")));
        // A gap in the seq.
        let (mut batches, _, _) = log(7);
        batches.remove(1);
        let r = Replay::from_batches(batches);
        assert!(
            r.violations.iter().any(|v| v.contains("seq gap")),
            "{:?}",
            r.violations
        );
        // A GPU over capacity.
        let (mut batches, _, _) = log(7);
        if let Some(pb::event::Body::Reserved(x)) = &mut batches[1].events[0].body {
            x.shares[0].mem_mib = 1_000_000;
        }
        let r = Replay::from_batches(batches);
        assert!(!r.violations.is_empty());
    }

    #[test]
    fn same_seed_same_schedule() {
        assert_eq!(schedule(7, 20), schedule(7, 20));
        assert_ne!(schedule(7, 20), schedule(8, 20));
        let s = schedule(1, 20);
        assert!(s.windows(2).all(|w| w[0].0 < w[1].0));
        assert!(s.iter().all(|(at, _)| *at > 0.0 && *at < 1.0));
        for faults in [7, 20] {
            let kinds: BTreeSet<String> = schedule(3, faults)
                .iter()
                .map(|(_, f)| format!("{f:?}"))
                .collect();
            assert_eq!(kinds.len(), Fault::ALL.len(), "{faults} faults: {kinds:?}");
        }
    }
}
