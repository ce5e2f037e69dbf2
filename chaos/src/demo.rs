//! `gpuledger-chaos demo`: the local cluster with every component a real process, pods that
//! go the whole way (API server → scheduler emulator → extender replicas → allocator → binding
//! → kubelet Allocate/PreStartContainer through the node agent → a running process the agent
//! watches through the fake NVML → Succeeded → released), an allocator leader and a node agent
//! SIGKILLed midway, then what an operator would look at: the inspect table, placements,
//! failovers, utilization, `gpuledger verify`, and every agent's view against the ledger.

mod faults;
mod forged;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpuledger_auth::identity::Role;
use indicatif::{ProgressBar, ProgressStyle};

use self::faults::{Failover, kill_agent, kill_leader};
use crate::workload::{feed, mixed_pods};
use gpuledger_testkit::bin_path;
use gpuledger_testkit::cluster::{ClusterOptions, LocalCluster, RunOutcome, pod_phase};
use gpuledger_testkit::promtext::total;

/// Flags of `gpuledger-chaos demo`.
#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// Simulated GPU nodes (each: kubelet emulator, fake NVML, a node agent process).
    #[arg(long, default_value_t = 8)]
    pub nodes: usize,
    /// GPUs per node (even nodes: A100 40 GB, odd nodes: T4 15 GB).
    #[arg(long, default_value_t = 4)]
    pub gpus: u32,
    /// Pods to run.
    #[arg(long, default_value_t = 300)]
    pub pods: usize,
    /// Allocator replicas.
    #[arg(long, default_value_t = 3)]
    pub replicas: usize,
    /// Extender replicas (the scheduler emulator alternates between them).
    #[arg(long, default_value_t = 2)]
    pub extenders: usize,
    /// At most this many created pods wait to be scheduled at once; more are created as
    /// pods get bound (a steady arrival stream rather than one burst).
    #[arg(long, default_value_t = 24)]
    pub max_pending: usize,
    /// Seed of the workload (sizes, lifetimes, resource names).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Give up on pods not finished this many seconds after the start of the workload; they
    /// count as lost.
    #[arg(long, default_value_t = 150)]
    pub timeout: u64,
    /// Skip the faults (allocator leader and node agent SIGKILL).
    #[arg(long)]
    pub no_faults: bool,
    /// A smaller, faster run (for CI): at most 4 nodes x 2 GPUs, 60 pods.
    #[arg(long)]
    pub small: bool,
    /// Keep the run directory (logs of every process) instead of deleting it.
    #[arg(long)]
    pub keep: bool,
}

/// Pods of the demo by phase, from the API server.
fn phases(c: &LocalCluster) -> HashMap<String, (String, bool)> {
    c.api
        .store
        .objects("v1", "pods")
        .iter()
        .filter(|p| p["metadata"]["namespace"] == "default")
        .map(|p| {
            (
                p["metadata"]["name"].as_str().unwrap_or("").to_string(),
                (pod_phase(p).to_string(), p["spec"]["nodeName"].is_string()),
            )
        })
        .collect()
}

/// Run the demo.
pub async fn run(mut a: DemoArgs) -> Result<()> {
    if a.small {
        a.nodes = a.nodes.min(4);
        a.gpus = a.gpus.min(2);
        a.pods = a.pods.min(60);
    }
    let t0 = Instant::now();
    let (dir, _tmp) = gpuledger_testkit::process::run_dir("gpuledger-demo-", a.keep)?;
    println!(
        "gpuledger demo — run directory {} (logs of every process{})",
        dir.display(),
        if a.keep {
            ", kept"
        } else {
            "; --keep keeps it"
        }
    );
    println!(
        "starting etcd x3, {} allocator replicas, {} extender replicas, the API server and scheduler emulator, {} nodes x {} GPUs (kubelet + fake NVML + node agent each)…",
        a.replicas, a.extenders, a.nodes, a.gpus
    );
    let mut c = LocalCluster::start(ClusterOptions {
        nodes: a.nodes,
        gpus: a.gpus,
        allocators: a.replicas,
        extenders: a.extenders,
        dir: Some(dir.clone()),
        ..Default::default()
    })
    .await?;
    let res = drive(&mut c, &a, t0).await;
    if res.is_err() {
        // Say which process died, if one did: often the reason.
        if let Err(e) = c.check_processes() {
            eprintln!("gpuledger-chaos: a process died during the demo:\n{e:#}");
        }
        if !a.keep {
            eprintln!("(run again with --keep to keep the logs)");
        } else {
            eprintln!("logs: {}", dir.display());
        }
    }
    drop(c);
    res
}

async fn drive(c: &mut LocalCluster, a: &DemoArgs, t0: Instant) -> Result<()> {
    let ctl = bin_path("gpuledger")?;
    let alloc_flag = c.allocator_flag();
    let capacity_gib: u64 = c
        .nodes
        .iter()
        .map(|n| n.gpu_mem_mib * u64::from(a.gpus))
        .sum::<u64>()
        / 1024;
    println!(
        "ready after {:.1}s: {} nodes x {} GPUs ({capacity_gib} GiB of GPU memory); running {} pods…",
        t0.elapsed().as_secs_f64(),
        a.nodes,
        a.gpus,
        a.pods
    );

    let pods = mixed_pods(a.pods, a.seed);
    let bar = ProgressBar::new(pods.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} pods done  {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let started = Instant::now();

    // The arrival stream: create pods while few wait to be scheduled.
    let feeder = feed(c.api.store.clone(), pods.clone(), a.max_pending);

    let mut failovers: Vec<Failover> = Vec::new();
    let mut peak: Option<String> = None;
    let mut leader_done = a.no_faults;
    let mut agent_done = a.no_faults;
    let deadline = started + Duration::from_secs(a.timeout);
    let mut agent_check = None;
    loop {
        let ph = phases(c);
        let done = ph
            .values()
            .filter(|(p, _)| p == "Succeeded" || p == "Failed")
            .count();
        let running = ph.values().filter(|(p, _)| p == "Running").count();
        let pending = ph.values().filter(|(_, bound)| !bound).count();
        bar.set_position(done as u64);
        bar.set_message(format!("running {running}, pending {pending}"));
        if done >= pods.len() {
            break;
        }
        if Instant::now() > deadline {
            bar.println(format!(
                "timeout: {} pods not finished after {}s",
                pods.len() - done,
                a.timeout
            ));
            break;
        }
        if let Err(e) = c.check_processes() {
            bar.abandon();
            return Err(e.context("a component died"));
        }
        if !leader_done && done >= pods.len() * 3 / 10 {
            leader_done = true;
            let leader = c.allocs.wait_leader(Duration::from_secs(30)).await?;
            let out = tokio::process::Command::new(&ctl)
                .args(["inspect", &alloc_flag])
                .args(c.ids.flags(&Role::Viewer)?)
                .output()
                .await
                .context("running gpuledger inspect")?;
            peak = Some(String::from_utf8_lossy(&out.stdout).into_owned());
            bar.println(format!(
                "SIGKILL allocator leader alloc{leader} ({running} pods running)"
            ));
            failovers.push(kill_leader(c, leader).await?);
            bar.println(format!("  {}", failovers[failovers.len() - 1].detail));
        } else if !agent_done && done >= pods.len() * 11 / 20 {
            agent_done = true;
            let (f, check) = kill_agent(c, &bar).await?;
            bar.println(format!("  {}", f.detail));
            failovers.push(f);
            agent_check = Some(check);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(feeder);
    let workload_secs = started.elapsed().as_secs_f64();
    bar.finish_with_message(format!("workload done in {workload_secs:.1}s"));

    // Every allocation released: the allocators' pod watchers saw every pod end.
    let release_deadline = Instant::now() + Duration::from_secs(30);
    let mut left = usize::MAX;
    while Instant::now() < release_deadline {
        left = c.dump().await.map_or(usize::MAX, |s| s.allocations.len());
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    c.allocs.wait_caught_up(Duration::from_secs(30)).await?;

    let mut problems: Vec<String> = Vec::new();
    println!("\n== gpuledger inspect, mid-run (just before the leader was killed)");
    match &peak {
        Some(p) => print!("{p}"),
        None => println!("  (no fault injected: --no-faults)"),
    }

    // Pods: what the API server and the kubelets say.
    let ph = phases(c);
    let runs = c.runs.all();
    let mut failed: BTreeMap<String, usize> = BTreeMap::new();
    let mut succeeded = 0;
    for r in &runs {
        match &r.outcome {
            RunOutcome::Succeeded => succeeded += 1,
            RunOutcome::Failed(why) => *failed.entry(why.clone()).or_default() += 1,
            RunOutcome::Deleted => *failed.entry("deleted".into()).or_default() += 1,
            RunOutcome::Running => {}
        }
    }
    let placed = ph.values().filter(|(_, bound)| *bound).count();
    let lost: Vec<String> = pods
        .iter()
        .filter(|p| {
            ph.get(&p.name)
                .is_none_or(|(phase, _)| phase != "Succeeded" && phase != "Failed")
        })
        .map(|p| {
            let (phase, bound) = ph
                .get(&p.name)
                .cloned()
                .unwrap_or(("not created".into(), false));
            let why = c
                .scheduler
                .stats
                .last_error
                .lock()
                .ok()
                .and_then(|m| m.get(&format!("default/{}", p.name)).cloned())
                .unwrap_or_default();
            format!(
                "{} ({phase}{}{})",
                p.name,
                if bound { ", bound" } else { "" },
                if why.is_empty() {
                    String::new()
                } else {
                    format!(": {why}")
                }
            )
        })
        .collect();
    let corrected = c
        .api
        .store
        .objects("v1", "events")
        .iter()
        .filter(|e| e["reason"] == "GpuIdentityCorrected")
        .count();
    let by_ext = c
        .scheduler
        .stats
        .bound_by_extender
        .lock()
        .map(|v| v.clone())
        .unwrap_or_default();
    println!("\n== pods");
    println!(
        "placed: {placed}   succeeded: {succeeded}   failed: {}   lost: {}",
        failed.values().sum::<usize>(),
        lost.len()
    );
    println!(
        "  bound through extender0..{}: {}; attempts that found no room (retried): {}; identities corrected at PreStartContainer: {corrected}",
        by_ext.len().saturating_sub(1),
        by_ext
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(" / "),
        c.scheduler.stats.failed.load(Ordering::Relaxed)
    );
    let mut violations = 0.0;
    for n in &c.nodes {
        if let Ok((200, t)) =
            gpuledger_testkit::http::get(&format!("{}/metrics", n.health_url())).await
        {
            violations += total(&t, "gpuledger_node_agent_violations_total");
        }
    }
    println!(
        "  enforcement: {violations} limit violations or rogue processes seen by the agents (each container uses 75% of its limit in the fake NVML, so 0 is right)"
    );
    for (why, n) in &failed {
        println!("  {n:>4} x failed: {why}");
    }
    for l in lost.iter().take(10) {
        println!("  lost: {l}");
    }
    if lost.len() > 10 {
        println!("  … and {} more lost", lost.len() - 10);
    }
    if !lost.is_empty() {
        problems.push(format!("{} pods lost", lost.len()));
    }

    println!("\n== failovers survived");
    if failovers.is_empty() {
        println!("  (none injected: --no-faults)");
    }
    for f in &failovers {
        println!("  {}: {}", f.what, f.detail);
    }
    if let Some(chk) = &agent_check {
        println!("  {chk}");
        if chk.contains("LOST") || chk.contains("DIFFERS") {
            problems.push("a running pod lost its GPU across the agent restart".into());
        }
    }

    println!("\n== GPU memory use vs whole-GPU allocation");
    let (mut frac, mut whole) = (0.0f64, 0.0f64);
    for r in &runs {
        if let (Some(s), Some(e)) = (r.started, r.ended) {
            let secs = e.saturating_duration_since(s).as_secs_f64();
            for (_, limit, cap) in &r.shares {
                frac += *limit as f64 * secs;
                whole += *cap as f64 * secs;
            }
        }
    }
    println!(
        "  fractional: {:.0} GiB-seconds held; whole GPUs would have held {:.0} GiB-seconds ({:.1}x more)",
        frac / 1024.0,
        whole / 1024.0,
        if frac > 0.0 { whole / frac } else { 0.0 }
    );
    println!(
        "  (from the containers' limits as the node agents returned them, over the time each ran)"
    );

    println!("\n== gpuledger verify");
    let out = tokio::process::Command::new(&ctl)
        .args(["verify", &alloc_flag])
        .args(c.ids.flags(&Role::Viewer)?)
        .output()
        .await
        .context("running gpuledger verify")?;
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        problems.push("gpuledger verify failed".into());
    }
    if left != 0 {
        problems.push(format!(
            "{} allocations still held 30 s after every pod ended",
            if left == usize::MAX {
                "unknown".to_string()
            } else {
                left.to_string()
            }
        ));
    }

    println!("\n== forged calls (every call carries a verified identity; one table decides)");
    for line in forged::forged_calls(c).await? {
        if line.starts_with("ACCEPTED") {
            problems.push(format!("a forged call was accepted: {line}"));
        }
        println!("  {line}");
    }

    println!("\n== node agents vs ledger (agent /metrics vs the ledger's Dump, per node)");
    let views = c.check_agent_views(Duration::from_secs(10)).await;
    for v in &views {
        if v.agree {
            println!(
                "  {}: agent view = ledger ({} allocations, memory per GPU equal)",
                v.node, v.allocations
            );
        } else {
            println!("  {}: DIFFERENT: {}", v.node, v.detail);
            problems.push(format!("{}: agent view differs from the ledger", v.node));
        }
    }
    c.check_processes()?;
    if succeeded == 0 {
        problems.push("no pod ran".into());
    }
    println!(
        "\ndemo finished in {:.1}s (cluster start {:.1}s, workload {workload_secs:.1}s)",
        t0.elapsed().as_secs_f64(),
        (started - t0).as_secs_f64()
    );
    if !problems.is_empty() {
        bail!("demo failed: {}", problems.join("; "));
    }
    Ok(())
}
