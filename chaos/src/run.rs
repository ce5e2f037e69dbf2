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

mod check;
mod faults;
mod netns;
mod report;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpuledger_testkit::cluster::{ClusterOptions, LocalCluster, pod_phase};
use serde_json::Value;

use crate::workload::{PodSpec, feed, mixed_pods, trace_pods};
use faults::{Injected, inject, schedule};
use netns::{NETNS_ENV, can_netns, heal_all, in_own_netns};

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
pub(super) fn reproduce(a: &RunArgs) -> String {
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
    drop(feeder);
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
    let v = check::verdict(c, a).await?;
    report::print(c, a, &v, &injected, (started, workload, converged_s));
    if !v.violations.is_empty() {
        return Err(Violations(v.violations.len()).into());
    }
    Ok(())
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
