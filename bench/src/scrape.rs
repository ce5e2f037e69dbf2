//! `gpuledger-bench scrape`: what one Prometheus scrape of an allocator holding a large cluster
//! costs — latency and bytes of `/metrics` — next to `/healthz` (the HTTP round trip alone,
//! the baseline) and `/api/v1/state` (the JSON the `/ui` page reads).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::http::get;
use gpuledger_testkit::workload::{inventory, pod};
use gpuledger_testkit::{Allocators, EtcdCluster};
use hdrhistogram::Histogram;

use crate::common::{cpu_seconds, histogram, q_ms, record, run_dir, title};

/// Flags of `gpuledger-bench scrape`.
#[derive(clap::Args)]
pub struct Args {
    /// Nodes registered, each with `--gpus` GPUs of 80 GiB.
    #[arg(long, default_value_t = 5000)]
    nodes: usize,
    /// GPUs per node.
    #[arg(long, default_value_t = 8)]
    gpus: u32,
    /// Pods of 30 GiB placed per GPU (two fill an 80 GiB GPU; every figure has its full width).
    #[arg(long, default_value_t = 2)]
    pods_per_gpu: usize,
    /// Requests measured per endpoint (after two warm-up requests).
    #[arg(long, default_value_t = 100)]
    scrapes: usize,
    /// Concurrent clients while filling the ledger.
    #[arg(long, default_value_t = 64)]
    clients: usize,
}

fn node(i: usize) -> String {
    format!("node-{i:05}")
}

async fn fill(allocs: &Allocators, a: &Args) -> Result<usize> {
    let mut tasks = Vec::new();
    for w in 0..a.clients {
        let (nodes, gpus, clients) = (a.nodes, a.gpus, a.clients);
        // Registered as an operator would (one certificate, not one per node agent).
        let mut c = allocs.admin(0)?;
        tasks.push(tokio::spawn(async move {
            for i in (w..nodes).step_by(clients) {
                c.register_node(api::RegisterNodeRequest {
                    inventory: Some(inventory(&node(i), gpus, 81_920, "NVIDIA A100-SXM4-80GB")),
                })
                .await
                .with_context(|| format!("registering {}", node(i)))?;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks.drain(..) {
        t.await??;
    }
    let pods = a.nodes * a.gpus as usize * a.pods_per_gpu;
    for w in 0..a.clients {
        let (nodes, clients) = (a.nodes, a.clients);
        let mut c = allocs.extender(0)?;
        tasks.push(tokio::spawn(async move {
            for k in (w..pods).step_by(clients) {
                c.reserve(api::ReserveRequest {
                    request: Some(pod(&format!("scrape-{k}"), 30_000, 30)),
                    node: node(k % nodes),
                    ttl_ms: 3_600_000,
                })
                .await
                .map_err(|s| anyhow::anyhow!("reserve: {}", s.message()))?;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(pods)
}

struct Measured {
    hist: Histogram<u64>,
    bytes: usize,
    lines: usize,
    /// Allocator CPU per request: unlike latency, not inflated by other load on the machine.
    cpu_ms: f64,
}

async fn measure(url: &str, n: usize, pid: u32) -> Result<Measured> {
    let mut hist = histogram();
    let mut cpu = 0.0;
    let mut last = String::new();
    for i in 0..n + 2 {
        if i == 2 {
            cpu = cpu_seconds(pid);
        }
        let t = Instant::now();
        let (code, body) = get(url).await?;
        let took = t.elapsed();
        if code != 200 {
            bail!(
                "GET {url}: HTTP {code}: {}",
                body.chars().take(300).collect::<String>()
            );
        }
        if i >= 2 {
            record(&mut hist, took);
        }
        last = body;
    }
    Ok(Measured {
        hist,
        bytes: last.len(),
        lines: last.lines().filter(|l| !l.starts_with('#')).count(),
        cpu_ms: (cpu_seconds(pid) - cpu) * 1000.0 / n.max(1) as f64,
    })
}

/// Run the benchmark.
pub async fn run(a: Args) -> Result<()> {
    let dir = run_dir("scrape")?;
    title("starting etcd and one allocator");
    let etcd = EtcdCluster::start_in(&dir.path().join("etcd"), 1).await?;
    let allocs = Allocators::start(dir.path(), &etcd, 1, "scrape", &["--http-state-api"])?;
    allocs.wait_leader(Duration::from_secs(30)).await?;

    title(&format!(
        "filling the ledger: {} nodes x {} GPUs, {} pods of 30 GiB",
        a.nodes,
        a.gpus,
        a.nodes * a.gpus as usize * a.pods_per_gpu
    ));
    let t = Instant::now();
    let pods = fill(&allocs, &a).await?;
    let st = allocs.status(0).await.context("allocator status")?;
    println!(
        "{} nodes, {} live allocations (made {pods}) at seq {} in {:.1}s",
        st.nodes,
        st.allocations,
        st.seq,
        t.elapsed().as_secs_f64()
    );

    title(&format!("{} sequential GETs per endpoint", a.scrapes));
    let http = &allocs.http[0];
    let pid = allocs.procs[0].pid().context("allocator exited")?;
    let health = measure(&format!("http://{http}/healthz"), a.scrapes, pid).await?;
    let metrics = measure(&format!("http://{http}/metrics"), a.scrapes, pid).await?;
    let state = measure(&format!("http://{http}/api/v1/state"), a.scrapes, pid).await?;

    println!();
    println!(
        "{:<34} {:>9} {:>9} {:>9} {:>10} {:>12} {:>9}",
        "endpoint", "p50 ms", "p99 ms", "max ms", "cpu ms/req", "bytes", "series"
    );
    for (what, m) in [
        ("/healthz (HTTP round trip)", &health),
        ("/metrics", &metrics),
        ("/api/v1/state (the /ui JSON)", &state),
    ] {
        println!(
            "{:<34} {:>9.2} {:>9.2} {:>9.2} {:>10.2} {:>12} {:>9}",
            what,
            q_ms(&m.hist, 0.5),
            q_ms(&m.hist, 0.99),
            m.hist.max() as f64 / 1000.0,
            m.cpu_ms,
            m.bytes,
            if what == "/metrics" {
                m.lines.to_string()
            } else {
                "-".into()
            }
        );
    }
    println!(
        "budget for 5,000 nodes x 8 GPUs, /metrics p99 <= 100 ms and <= 5 MB, at {} x {}: {}",
        a.nodes,
        a.gpus,
        if q_ms(&metrics.hist, 0.99) <= 100.0 && metrics.bytes <= 5_000_000 {
            "met"
        } else {
            "NOT met"
        }
    );
    println!(
        "scrape_p50_ms={:.2} scrape_p99_ms={:.2} scrape_bytes={}",
        q_ms(&metrics.hist, 0.5),
        q_ms(&metrics.hist, 0.99),
        metrics.bytes
    );
    Ok(())
}
