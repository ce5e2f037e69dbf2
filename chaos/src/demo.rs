//! `gpuledger-chaos demo`: a local cluster on this machine, a workload, a leader kill, then
//! what an operator would look at: the inspect table, placements, failovers, utilization, and
//! `gpuledger verify`.
//!
//! Today the demo drives the allocator API the way the scheduler extender does (filter → reserve
//! → confirm bound → release); node agents and the extender join it as they land.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use gpuledger_proto::allocator::v1 as api;
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::Mutex;

use crate::allocators::{Allocators, client};
use crate::etcd::EtcdCluster;
use crate::process::bin_path;
use crate::workload::{inventory, retryable};

/// Flags of `gpuledger-chaos demo`.
#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// Simulated GPU nodes.
    #[arg(long, default_value_t = 8)]
    pub nodes: usize,
    /// GPUs per node.
    #[arg(long, default_value_t = 4)]
    pub gpus: u32,
    /// Pods to schedule.
    #[arg(long, default_value_t = 300)]
    pub pods: usize,
    /// Allocator replicas.
    #[arg(long, default_value_t = 3)]
    pub replicas: usize,
    /// Seed of the workload.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// A smaller, faster run (for CI): 4 nodes x 2 GPUs, 60 pods.
    #[arg(long)]
    pub small: bool,
    /// Keep the run directory (logs of every process) instead of deleting it.
    #[arg(long)]
    pub keep: bool,
}

#[derive(Clone)]
struct PodSpec {
    name: String,
    mem_mib: u64,
    core_pct: u32,
    slices: u32,
    life: Duration,
}

/// Sizes seen in shared inference/training clusters: mostly small slices, some whole GPUs.
fn workload(n: usize, seed: u64) -> Vec<PodSpec> {
    let mut rng = StdRng::seed_from_u64(seed);
    let shapes: [(u64, u32, u32, u32); 7] = [
        // (mem MiB, core %, slices, weight)
        (2_048, 10, 1, 25),
        (4_096, 20, 1, 25),
        (8_192, 30, 1, 20),
        (12_288, 50, 1, 12),
        (20_480, 50, 1, 8),
        (0, 0, 1, 6), // a whole GPU
        (16_384, 50, 2, 4),
    ];
    let total: u32 = shapes.iter().map(|s| s.3).sum();
    (0..n)
        .map(|i| {
            let mut pick = rng.random_range(0..total);
            let s = shapes
                .iter()
                .find(|s| {
                    if pick < s.3 {
                        true
                    } else {
                        pick -= s.3;
                        false
                    }
                })
                .expect("weights cover the range");
            PodSpec {
                name: format!("job-{i:03}"),
                mem_mib: s.0,
                core_pct: s.1,
                slices: s.2,
                life: Duration::from_millis(rng.random_range(1_500..6_000)),
            }
        })
        .collect()
}

fn request(p: &PodSpec) -> api::PodRequest {
    api::PodRequest {
        pod: Some(gpuledger_proto::ledger::v1::PodRef {
            uid: format!("uid-{}", p.name),
            namespace: "demo".into(),
            name: p.name.clone(),
        }),
        containers: vec![api::ContainerRequest {
            name: "main".into(),
            slices: p.slices,
            mem_mib: p.mem_mib,
            mem_percent: 0,
            core_milli: p.core_pct * 10,
        }],
        placement: None,
        cpu_milli: 0,
        memory_mib: 0,
    }
}

#[derive(Default)]
struct Outcome {
    placed: usize,
    failed: BTreeMap<String, usize>,
    mem_mib_seconds: f64,
    whole_gpu_seconds: f64,
}

/// Run the demo.
pub async fn run(mut a: DemoArgs) -> Result<()> {
    if a.small {
        a.nodes = a.nodes.min(4);
        a.gpus = a.gpus.min(2);
        a.pods = a.pods.min(60);
    }
    let tmp = tempfile::Builder::new()
        .prefix("gpuledger-demo-")
        .tempdir()?;
    let dir: PathBuf = if a.keep {
        tmp.keep()
    } else {
        tmp.path().to_path_buf()
    };
    println!(
        "gpuledger demo — run directory {} (logs of every process)",
        dir.display()
    );
    println!(
        "starting a 3-member etcd and {} allocator replicas…",
        a.replicas
    );
    let etcd = EtcdCluster::start_in(&dir.join("etcd"), 3).await?;
    let mut allocs = Allocators::start(&dir, &etcd.endpoints_flag(), a.replicas, "demo", &[])?;
    let leader = allocs.wait_leader(Duration::from_secs(30)).await?;
    let addrs = allocs.addrs.clone();
    let mut c = client(&addrs[leader])?;
    let mut capacity_mib = 0u64;
    let mut gpu_mem: HashMap<String, u64> = HashMap::new();
    for n in 0..a.nodes {
        let (model, mem) = if n % 2 == 0 {
            ("NVIDIA A100-SXM4-40GB", 40_960)
        } else {
            ("Tesla T4", 15_360)
        };
        let inv = inventory(&format!("gpu-node-{n}"), a.gpus, mem, model);
        for g in &inv.gpus {
            gpu_mem.insert(g.uuid.clone(), g.memory_mib);
        }
        c.register_node(api::RegisterNodeRequest {
            inventory: Some(inv),
        })
        .await
        .context("registering nodes")?;
        capacity_mib += mem * u64::from(a.gpus);
    }
    println!(
        "{} nodes x {} GPUs registered ({} GiB of GPU memory); scheduling {} pods…",
        a.nodes,
        a.gpus,
        capacity_mib / 1024,
        a.pods
    );

    let pods = workload(a.pods, a.seed);
    let bar = ProgressBar::new(pods.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} pods  {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let done = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let ctx = Arc::new(Ctx {
        addrs: addrs.clone(),
        nodes: a.nodes,
        outcome: Mutex::new(Outcome::default()),
        last_ok_ms: AtomicU64::new(0),
        started,
        gpu_mem,
    });
    let queue = Arc::new(Mutex::new(pods.clone()));
    let mut workers = Vec::new();
    for w in 0..32usize {
        let (queue, done, bar, ctx) = (queue.clone(), done.clone(), bar.clone(), ctx.clone());
        workers.push(tokio::spawn(async move {
            let mut k = w;
            loop {
                let Some(p) = queue.lock().await.pop() else {
                    break;
                };
                schedule_one(&p, &mut k, &ctx).await;
                done.fetch_add(1, Ordering::Relaxed);
                bar.inc(1);
            }
        }));
    }
    // Midway: kill the leader, as a crash would.
    let mut failovers = Vec::new();
    while done.load(Ordering::Relaxed) < pods.len() / 2 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let leader = allocs.wait_leader(Duration::from_secs(30)).await?;
    let ctl = bin_path("gpuledger")?;
    let alloc_flag = format!("--allocator={}", addrs.join(","));
    let peak = tokio::process::Command::new(&ctl)
        .args(["inspect", &alloc_flag])
        .output()
        .await?;
    bar.set_message(format!("SIGKILL allocator leader alloc{leader}"));
    let kill_ms = started.elapsed().as_millis() as u64;
    allocs.procs[leader].kill();
    let new = allocs
        .wait_leader_except(Duration::from_secs(30), Some(leader))
        .await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while ctx.last_ok_ms.load(Ordering::Relaxed) <= kill_ms && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let took = ctx
        .last_ok_ms
        .load(Ordering::Relaxed)
        .saturating_sub(kill_ms);
    failovers.push((leader, new, took));
    bar.set_message(format!(
        "alloc{new} leads after {took} ms; restarting alloc{leader}"
    ));
    allocs.procs[leader].start()?;
    for w in workers {
        w.await?;
    }
    bar.finish_with_message("all pods scheduled and finished");

    // Everything has finished: the ledger must be empty of allocations and consistent.
    let head = allocs
        .status(allocs.wait_leader(Duration::from_secs(30)).await?)
        .await
        .map_or(0, |s| s.seq);
    allocs.wait_seq(head, Duration::from_secs(30)).await?;
    let o = ctx.outcome.lock().await;
    println!("\n== gpuledger inspect, mid-run (just before the leader was killed)");
    print!("{}", String::from_utf8_lossy(&peak.stdout));
    println!("\n== pods");
    println!(
        "placed: {}   failed: {}",
        o.placed,
        o.failed.values().sum::<usize>()
    );
    for (why, n) in &o.failed {
        println!("  {n:>4} x {why}");
    }
    println!("\n== failovers survived");
    for (old, new, ms) in &failovers {
        println!(
            "  alloc{old} killed -> alloc{new} leading; reservations flowed again after {ms} ms"
        );
    }
    println!("\n== GPU memory use vs whole-GPU allocation");
    println!(
        "  fractional: {:.0} GiB-seconds held; whole GPUs would have held {:.0} GiB-seconds ({:.1}x more)",
        o.mem_mib_seconds / 1024.0,
        o.whole_gpu_seconds / 1024.0,
        if o.mem_mib_seconds > 0.0 {
            o.whole_gpu_seconds / o.mem_mib_seconds
        } else {
            0.0
        }
    );
    println!("\n== gpuledger verify");
    let out = std::process::Command::new(&ctl)
        .args(["verify", &alloc_flag])
        .output()?;
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        anyhow::bail!("gpuledger verify failed");
    }
    if o.placed == 0 {
        anyhow::bail!("no pod was placed");
    }
    println!("\ndemo finished in {:.1}s", started.elapsed().as_secs_f64());
    Ok(())
}

/// What every scheduling worker shares.
struct Ctx {
    addrs: Vec<String>,
    nodes: usize,
    outcome: Mutex<Outcome>,
    last_ok_ms: AtomicU64,
    started: Instant,
    gpu_mem: HashMap<String, u64>,
}

async fn schedule_one(p: &PodSpec, k: &mut usize, ctx: &Ctx) {
    let (addrs, nodes, outcome, last_ok, started, gpu_mem) = (
        &ctx.addrs,
        ctx.nodes,
        &ctx.outcome,
        &ctx.last_ok_ms,
        ctx.started,
        &ctx.gpu_mem,
    );
    let req = request(p);
    let uid = format!("uid-{}", p.name);
    let give_up = Instant::now() + Duration::from_secs(20);
    loop {
        *k += 1;
        let Ok(mut c) = client(&addrs[*k % addrs.len()]) else {
            continue;
        };
        let sent = started.elapsed().as_millis() as u64;
        // Filter like the extender, then reserve on the best-scoring fitting node.
        let nodes_all: Vec<String> = (0..nodes).map(|n| format!("gpu-node-{n}")).collect();
        let f = c
            .filter(api::FilterRequest {
                request: Some(req.clone()),
                nodes: nodes_all,
            })
            .await;
        let f = match f {
            Ok(f) => f.into_inner(),
            Err(s) if retryable(&s) && Instant::now() < give_up => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Err(s) => {
                *outcome
                    .lock()
                    .await
                    .failed
                    .entry(s.message().to_string())
                    .or_default() += 1;
                return;
            }
        };
        if f.nodes.is_empty() {
            if !f.failed.is_empty() && Instant::now() < give_up {
                // Full for now: wait for running pods to finish, as a pending pod would.
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            let why = f
                .unresolvable
                .values()
                .chain(f.failed.values())
                .next()
                .cloned()
                .unwrap_or_else(|| "no node".into());
            *outcome
                .lock()
                .await
                .failed
                .entry(format!("unschedulable: {why}"))
                .or_default() += 1;
            return;
        }
        let s = c
            .score(api::ScoreRequest {
                request: Some(req.clone()),
                nodes: f.nodes.clone(),
            })
            .await
            .map(|s| s.into_inner().scores)
            .unwrap_or_default();
        let node = s
            .iter()
            .max_by_key(|s| s.score)
            .map_or(f.nodes[0].clone(), |s| s.node.clone());
        let r = c
            .reserve(api::ReserveRequest {
                request: Some(req.clone()),
                node: node.clone(),
                ttl_ms: 0,
            })
            .await;
        match r {
            Ok(r) => {
                last_ok.fetch_max(sent, Ordering::Relaxed);
                let r = r.into_inner();
                let _ = c
                    .confirm_bound(api::ConfirmBoundRequest {
                        pod_uid: uid.clone(),
                        node,
                    })
                    .await;
                tokio::time::sleep(p.life).await;
                loop {
                    let Ok(mut c) = client(&addrs[*k % addrs.len()]) else {
                        continue;
                    };
                    match c
                        .release(api::ReleaseRequest {
                            pod_uid: uid.clone(),
                            reason: "pod succeeded".into(),
                            ..Default::default()
                        })
                        .await
                    {
                        Ok(_) => break,
                        Err(s) if retryable(&s) => {
                            *k += 1;
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                        Err(_) => break,
                    }
                }
                let mut o = outcome.lock().await;
                o.placed += 1;
                let secs = p.life.as_secs_f64();
                for a in &r.allocations {
                    for sh in &a.shares {
                        o.mem_mib_seconds += sh.mem_mib as f64 * secs;
                    }
                }
                // A whole-GPU system gives every slice a full GPU: charge the GPU's capacity.
                for sh in r.allocations.iter().flat_map(|a| &a.shares) {
                    o.whole_gpu_seconds +=
                        gpu_mem.get(&sh.gpu_uuid).copied().unwrap_or(0) as f64 * secs;
                }
                return;
            }
            Err(s) if retryable(&s) && Instant::now() < give_up => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(s) if s.code() == tonic::Code::ResourceExhausted && Instant::now() < give_up => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(s) => {
                *outcome
                    .lock()
                    .await
                    .failed
                    .entry(s.message().to_string())
                    .or_default() += 1;
                return;
            }
        }
    }
}
