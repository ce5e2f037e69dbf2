//! `gpuledger-chaos run`: a workload against the allocator replicas while faults chosen by a
//! seed hit them, then a quiet phase and a history check.
//!
//! Every client-visible operation is recorded (JSONL in the run directory) with its result;
//! timeouts are recorded as "unknown". After the run the checker reads the log from etcd and
//! the state of every replica and reports: acknowledged grants missing from the ledger (lost),
//! pods granted two different allocations (double), invariant violations on replay (capacity,
//! one allocation per container, gapless seq, epochs never decreasing), replicas that differ
//! from the replayed log, and allocations left without a pod.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use nix::sys::signal::Signal;
use prost::Message;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::Mutex;

use crate::allocators::{Allocators, client};
use crate::etcd::EtcdCluster;
use crate::workload::{inventory, pod, retryable};

/// Flags of `gpuledger-chaos run`.
#[derive(clap::Args, Debug, Clone)]
pub struct RunArgs {
    /// Seed: the same seed gives the same workload and the same fault schedule.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Pods in the workload (each reserved, held briefly, released).
    #[arg(long, default_value_t = 1000)]
    pub pods: usize,
    /// Faults to inject while the workload runs.
    #[arg(long, default_value_t = 20)]
    pub faults: usize,
    /// Allocator replicas.
    #[arg(long, default_value_t = 3)]
    pub replicas: usize,
    /// Keep the run directory (logs, history.jsonl) instead of deleting it.
    #[arg(long)]
    pub keep: bool,
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
}

impl Fault {
    const ALL: [Fault; 4] = [
        Fault::KillLeader,
        Fault::PauseLeader,
        Fault::KillFollower,
        Fault::KillEtcdMember,
    ];

    fn name(self) -> &'static str {
        match self {
            Fault::KillLeader => "SIGKILL allocator leader",
            Fault::PauseLeader => "SIGSTOP allocator leader past its lease, then SIGCONT",
            Fault::KillFollower => "SIGKILL allocator follower",
            Fault::KillEtcdMember => "SIGKILL an etcd member, then restart it",
        }
    }
}

/// The fault schedule of a seed: which faults, at which fraction of the workload.
pub fn schedule(seed: u64, faults: usize) -> Vec<(f64, Fault)> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
    (0..faults)
        .map(|i| {
            let at = (i as f64 + rng.random_range(0.2..0.8)) / faults.max(1) as f64;
            (at, Fault::ALL[rng.random_range(0..Fault::ALL.len())])
        })
        .collect()
}

#[derive(Default)]
struct History {
    lines: Vec<String>,
    /// pod uid -> allocation ids acknowledged by reserve answers.
    acked: BTreeMap<String, BTreeSet<u64>>,
    /// pod uids whose release was acknowledged.
    released: BTreeSet<String>,
    ops: usize,
    unknown: usize,
}

impl History {
    fn record(&mut self, t: Duration, op: &str, pod: &str, result: &str, detail: String) {
        self.ops += 1;
        if result == "unknown" {
            self.unknown += 1;
        }
        self.lines.push(format!(
            r#"{{"t_ms":{},"op":"{op}","pod":"{pod}","result":"{result}","detail":{}}}"#,
            t.as_millis(),
            serde_json_string(&detail)
        ));
    }
}

fn serde_json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

struct Ctx {
    addrs: Vec<String>,
    nodes: usize,
    started: Instant,
    history: Mutex<History>,
    done: AtomicUsize,
}

async fn one_pod(ctx: &Ctx, i: usize, rng_seed: u64) {
    let mut rng = StdRng::seed_from_u64(rng_seed);
    let uid = format!("chaos-{i}");
    let mem = [1_000, 2_000, 4_000, 8_000][rng.random_range(0..4)];
    let node = format!("node-{}", rng.random_range(0..ctx.nodes));
    let req = api::ReserveRequest {
        request: Some(pod(&uid, mem, rng.random_range(0..30))),
        node,
        ttl_ms: 0,
    };
    let mut k = i;
    let give_up = Instant::now() + Duration::from_secs(60);
    let granted = loop {
        k += 1;
        let addr = &ctx.addrs[k % ctx.addrs.len()];
        let r = match client(addr) {
            Ok(mut c) => {
                let mut r = tonic::Request::new(req.clone());
                r.set_timeout(Duration::from_secs(3));
                c.reserve(r).await.map(tonic::Response::into_inner)
            }
            Err(e) => Err(tonic::Status::unavailable(e.to_string())),
        };
        let t = ctx.started.elapsed();
        match r {
            Ok(resp) => {
                let ids: Vec<u64> = resp.allocations.iter().map(|a| a.id).collect();
                let mut h = ctx.history.lock().await;
                h.record(
                    t,
                    "reserve",
                    &uid,
                    "ok",
                    format!("ids={ids:?} epoch={} created={}", resp.epoch, resp.created),
                );
                h.acked.entry(uid.clone()).or_default().extend(ids);
                break true;
            }
            Err(s) if retryable(&s) && Instant::now() < give_up => {
                let result = if matches!(
                    s.code(),
                    tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
                ) {
                    "unknown"
                } else {
                    "fail"
                };
                ctx.history.lock().await.record(
                    t,
                    "reserve",
                    &uid,
                    result,
                    s.message().to_string(),
                );
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
            Err(s) if s.code() == tonic::Code::ResourceExhausted && Instant::now() < give_up => {
                ctx.history.lock().await.record(
                    t,
                    "reserve",
                    &uid,
                    "fail",
                    s.message().to_string(),
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(s) => {
                ctx.history.lock().await.record(
                    t,
                    "reserve",
                    &uid,
                    "fail",
                    s.message().to_string(),
                );
                break false;
            }
        }
    };
    if granted {
        tokio::time::sleep(Duration::from_millis(rng.random_range(50..600))).await;
        let give_up = Instant::now() + Duration::from_secs(60);
        loop {
            k += 1;
            let addr = &ctx.addrs[k % ctx.addrs.len()];
            let rel = api::ReleaseRequest {
                pod_uid: uid.clone(),
                reason: "pod succeeded".into(),
                ..Default::default()
            };
            let r = match client(addr) {
                Ok(mut c) => {
                    let mut r = tonic::Request::new(rel);
                    r.set_timeout(Duration::from_secs(3));
                    c.release(r).await.map(tonic::Response::into_inner)
                }
                Err(e) => Err(tonic::Status::unavailable(e.to_string())),
            };
            let t = ctx.started.elapsed();
            match r {
                Ok(w) => {
                    let mut h = ctx.history.lock().await;
                    h.record(
                        t,
                        "release",
                        &uid,
                        "ok",
                        format!("seq={} changed={}", w.seq, w.changed),
                    );
                    h.released.insert(uid.clone());
                    break;
                }
                Err(s) if Instant::now() < give_up => {
                    ctx.history.lock().await.record(
                        t,
                        "release",
                        &uid,
                        "unknown",
                        s.message().to_string(),
                    );
                    tokio::time::sleep(Duration::from_millis(30)).await;
                }
                Err(s) => {
                    ctx.history.lock().await.record(
                        t,
                        "release",
                        &uid,
                        "fail",
                        s.message().to_string(),
                    );
                    break;
                }
            }
        }
    }
    ctx.done.fetch_add(1, Ordering::Relaxed);
}

/// Run the workload with faults and check the history. Returns Err on any violation.
pub async fn run(a: RunArgs) -> Result<()> {
    let tmp = tempfile::Builder::new()
        .prefix("gpuledger-chaos-")
        .tempdir()?;
    let dir = if a.keep {
        tmp.keep()
    } else {
        tmp.path().to_path_buf()
    };
    println!(
        "chaos run seed={} pods={} faults={} — run directory {}",
        a.seed,
        a.pods,
        a.faults,
        dir.display()
    );
    let mut etcd = EtcdCluster::start_in(&dir.join("etcd"), 3).await?;
    let mut allocs = Allocators::start(&dir, &etcd.endpoints_flag(), a.replicas, "chaos", &[])?;
    let leader = allocs.wait_leader(Duration::from_secs(30)).await?;
    let nodes = 8;
    let mut c = client(&allocs.addrs[leader])?;
    for n in 0..nodes {
        c.register_node(api::RegisterNodeRequest {
            inventory: Some(inventory(&format!("node-{n}"), 4, 40_960, "A100")),
        })
        .await
        .context("registering nodes")?;
    }
    let ctx = Arc::new(Ctx {
        addrs: allocs.addrs.clone(),
        nodes,
        started: Instant::now(),
        history: Mutex::new(History::default()),
        done: AtomicUsize::new(0),
    });
    // Workload: 16 pods in flight at a time.
    let next = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for _ in 0..16 {
        let (ctx, next, seed, pods) = (ctx.clone(), next.clone(), a.seed, a.pods);
        workers.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= pods {
                    break;
                }
                one_pod(&ctx, i, seed.wrapping_mul(1_000_003).wrapping_add(i as u64)).await;
            }
        }));
    }
    // Faults at fractions of the workload.
    let plan = schedule(a.seed, a.faults);
    let mut injected: Vec<(Duration, String)> = Vec::new();
    let mut last_fault = ctx.started.elapsed();
    for (at, fault) in &plan {
        let target = (*at * a.pods as f64) as usize;
        while ctx.done.load(Ordering::Relaxed) < target && ctx.done.load(Ordering::Relaxed) < a.pods
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if ctx.done.load(Ordering::Relaxed) >= a.pods {
            break;
        }
        let t = ctx.started.elapsed();
        let what = inject(*fault, &mut allocs, &mut etcd, a.seed, injected.len()).await?;
        println!("  {:>7.1}s  {}", t.as_secs_f64(), what);
        injected.push((t, what));
        last_fault = ctx.started.elapsed();
    }
    for w in workers {
        w.await?;
    }
    let workload_s = ctx.started.elapsed().as_secs_f64();
    // Quiet phase: everything must converge.
    let quiet = Instant::now();
    let leader = allocs.wait_leader(Duration::from_secs(30)).await?;
    let head = allocs.status(leader).await.map_or(0, |s| s.seq);
    allocs.wait_seq(head, Duration::from_secs(30)).await?;
    let converged_s = (ctx.started.elapsed() - last_fault).as_secs_f64();
    let _ = quiet;

    // The check.
    let h = ctx.history.lock().await;
    let mut f = std::fs::File::create(dir.join("history.jsonl"))?;
    for l in &h.lines {
        writeln!(f, "{l}")?;
    }
    let mut violations: Vec<String> = Vec::new();
    let client_etcd = etcd.client().await?;
    let mut kv = client_etcd
        .kv_client()
        .max_decoding_message_size(256 * 1024 * 1024);
    let resp = kv
        .get(
            "/gpuledger/chaos/log/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await?;
    let mut replayed = gpuledger_ledger::Ledger::new();
    let mut reserved_in_log: BTreeMap<String, BTreeSet<u64>> = BTreeMap::new();
    let mut last_epoch = 0;
    for kvp in resp.kvs() {
        let b = pb::EventBatch::decode(kvp.value())?;
        if b.epoch < last_epoch {
            violations.push(format!(
                "epoch went down at seq {}: {} after {last_epoch}",
                b.first_seq, b.epoch
            ));
        }
        last_epoch = b.epoch;
        for e in &b.events {
            if let Err(err) = replayed.apply(e) {
                violations.push(format!("replay: {err}"));
            }
            if let Some(pb::event::Body::Reserved(r)) = &e.body
                && let Some(p) = &r.pod
            {
                reserved_in_log
                    .entry(p.uid.clone())
                    .or_default()
                    .insert(r.allocation_id);
            }
        }
    }
    if let Err(e) = replayed.check() {
        violations.push(format!("replayed state: {e}"));
    }
    let mut lost = 0;
    let mut double = 0;
    for (uid, ids) in &h.acked {
        let in_log = reserved_in_log.get(uid).cloned().unwrap_or_default();
        for id in ids {
            if !in_log.contains(id) {
                lost += 1;
                violations.push(format!(
                    "lost grant: pod {uid} was acked allocation {id}, not in the ledger"
                ));
            }
        }
        if ids.len() > 1 {
            double += 1;
            violations.push(format!(
                "double grant: pod {uid} was acked allocations {ids:?}"
            ));
        }
    }
    for (uid, ids) in &reserved_in_log {
        if ids.len() > 1 {
            double += 1;
            violations.push(format!(
                "double grant in the ledger: pod {uid} has allocations {ids:?}"
            ));
        }
    }
    let mut replay_equal = true;
    for i in 0..allocs.addrs.len() {
        let d = client(&allocs.addrs[i])?
            .dump(api::DumpRequest {})
            .await?
            .into_inner();
        let live = gpuledger_ledger::Ledger::from_snapshot(&d.snapshot.unwrap_or_default())
            .map_err(anyhow::Error::msg)?;
        if !live.same_state(&replayed) {
            replay_equal = false;
            violations.push(format!(
                "replica alloc{i} (seq {}) differs from the replayed log (seq {})",
                live.seq(),
                replayed.seq()
            ));
        }
    }
    // Every pod released: no allocation may be left.
    for a in replayed.allocs().values() {
        violations.push(format!(
            "allocation {} of pod {} left behind after the pod ended",
            a.id, a.pod.uid
        ));
    }

    println!();
    println!(
        "seed {}: {} pods, {} operations ({} with unknown outcome), {} faults",
        a.seed,
        a.pods,
        h.ops,
        h.unknown,
        injected.len()
    );
    println!(
        "workload {:.1}s ({:.0} pods/s); ledger seq {}, epochs up to {}",
        workload_s,
        a.pods as f64 / workload_s,
        replayed.seq(),
        replayed.epoch()
    );
    println!("history: {}", dir.join("history.jsonl").display());
    for v in &violations {
        println!("VIOLATION {v}");
    }
    if !violations.is_empty() {
        println!(
            "reproduce: gpuledger-chaos run --seed {} --pods {} --faults {} --keep",
            a.seed, a.pods, a.faults
        );
    }
    println!(
        "violations={} lost_grants={lost} double_grants={double} replay_equal={replay_equal} converged_s={converged_s:.1}",
        violations.len()
    );
    if !violations.is_empty() {
        bail!("{} violation(s)", violations.len());
    }
    Ok(())
}

async fn inject(
    fault: Fault,
    allocs: &mut Allocators,
    etcd: &mut EtcdCluster,
    seed: u64,
    n: usize,
) -> Result<String> {
    let leader = allocs.wait_leader(Duration::from_secs(30)).await?;
    let what = match fault {
        Fault::KillLeader => {
            allocs.procs[leader].kill();
            allocs
                .wait_leader_except(Duration::from_secs(30), Some(leader))
                .await?;
            allocs.procs[leader].start()?;
            format!("{} (alloc{leader})", fault.name())
        }
        Fault::PauseLeader => {
            allocs.procs[leader].signal(Signal::SIGSTOP)?;
            allocs
                .wait_leader_except(Duration::from_secs(30), Some(leader))
                .await?;
            tokio::time::sleep(Duration::from_millis(500)).await;
            allocs.procs[leader].signal(Signal::SIGCONT)?;
            format!("{} (alloc{leader})", fault.name())
        }
        Fault::KillFollower => {
            let f = (leader + 1 + (seed as usize + n) % (allocs.addrs.len() - 1).max(1))
                % allocs.addrs.len();
            allocs.procs[f].kill();
            tokio::time::sleep(Duration::from_millis(500)).await;
            allocs.procs[f].start()?;
            format!("{} (alloc{f})", fault.name())
        }
        Fault::KillEtcdMember => {
            let m = (seed as usize + n) % etcd.len();
            etcd.kill(m);
            tokio::time::sleep(Duration::from_millis(1500)).await;
            etcd.restart(m)?;
            format!("{} (etcd{m})", fault.name())
        }
    };
    Ok(what)
}
