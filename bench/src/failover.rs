//! `gpuledger-bench failover`: SIGKILL the leader while clients reserve; how long until a
//! reservation succeeds again.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use gpuledger_auth::identity::Role;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::workload::{inventory, pod, reserve_retry_via};
use gpuledger_testkit::{Allocators, EtcdCluster};

use crate::common::{run_dir, title};

/// Flags of `gpuledger-bench failover`.
#[derive(clap::Args)]
pub struct Args {
    /// Number of leader kills (at least 1).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    trials: u32,
    /// Allocator replicas.
    #[arg(long, default_value_t = 3)]
    replicas: usize,
    /// Leader lease TTL (seconds) given to the allocators.
    #[arg(long, default_value_t = 2)]
    lease_ttl: u64,
}

/// Run the benchmark.
pub async fn run(a: Args) -> Result<()> {
    let dir = run_dir("failover")?;
    title("starting a 3-member etcd and the allocators");
    let etcd = EtcdCluster::start_in(&dir.path().join("etcd"), 3).await?;
    let ttl = format!("--lease-ttl={}", a.lease_ttl);
    let mut allocs = Allocators::start(dir.path(), &etcd, a.replicas, "failover", &[&ttl])?;
    let l = allocs.wait_leader(Duration::from_secs(30)).await?;
    // Reservations of 1 MiB are never released: the node must outlast any run. 1 TiB per GPU is
    // the most the allocator accepts by default (`--max-gpu-memory-mib`), 8 Mi reservations.
    allocs
        .node_agent(l, "n1")?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("n1", 8, 1 << 20, "A100")),
        })
        .await?;

    // Clients reserve continuously through every replica; each success records when it was
    // sent (ms since `t0`).
    let t0 = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let last_ok_sent = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    let clients = Arc::new(allocs.pool_as(&Role::Extender)?);
    for w in 0..8usize {
        let (stop, last, clients) = (stop.clone(), last_ok_sent.clone(), clients.clone());
        workers.push(tokio::spawn(async move {
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let sent = t0.elapsed().as_millis() as u64;
                let req = api::ReserveRequest {
                    request: Some(pod(&format!("f{w}-{i}"), 1, 0)),
                    node: "n1".into(),
                    ttl_ms: 0,
                };
                // Short per-try deadline: a client that waits on a dead replica retries elsewhere.
                if reserve_retry_via(
                    &clients,
                    w + i,
                    req,
                    Instant::now() + Duration::from_millis(200),
                )
                .await
                .is_ok()
                {
                    last.fetch_max(sent, Ordering::Relaxed);
                }
                i += 1;
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut times = Vec::new();
    println!(
        "\n{:>5} {:>8} {:>12} {:>14}",
        "trial", "killed", "new leader", "failover ms"
    );
    for trial in 0..a.trials {
        let leader = allocs.wait_leader(Duration::from_secs(30)).await?;
        // Make sure reservations flow before the kill.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let kill_at = t0.elapsed().as_millis() as u64;
        allocs.procs[leader].kill();
        let ms = loop {
            let last = last_ok_sent.load(Ordering::Relaxed);
            if last > kill_at {
                break t0.elapsed().as_millis() as u64 - kill_at;
            }
            if t0.elapsed().as_millis() as u64 - kill_at > 30_000 {
                anyhow::bail!("no reservation succeeded within 30 s of killing the leader");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let new = allocs
            .wait_leader_except(Duration::from_secs(30), Some(leader))
            .await?;
        println!(
            "{:>5} {:>8} {:>12} {:>14}",
            trial + 1,
            format!("alloc{leader}"),
            format!("alloc{new}"),
            ms
        );
        times.push(ms);
        allocs.procs[leader].start()?;
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.await;
    }
    times.sort_unstable();
    let p50 = *times
        .get(times.len() / 2)
        .context("no trial ran (--trials must be at least 1)")?;
    let max = *times.last().unwrap_or(&0);
    println!(
        "\nleader lease TTL {} s; kube-scheduler's default leader election takes ~15 s for the same event",
        a.lease_ttl
    );
    println!("failover_ms p50={p50} max={max}");
    Ok(())
}
