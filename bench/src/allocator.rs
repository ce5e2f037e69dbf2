//! `gpuledger-bench allocator`: reservation throughput and latency against raw etcd.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp};
use gpuledger_auth::identity::Role;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::allocator::v1::allocator_client::AllocatorClient;
use gpuledger_testkit::allocators;
use gpuledger_testkit::pki::Identities;
use gpuledger_testkit::workload::{inventory, pod};
use gpuledger_testkit::{Allocators, EtcdCluster};
use hdrhistogram::Histogram;
use tokio::sync::Mutex;
use tonic::service::interceptor::InterceptedService;

mod baseline;

use self::baseline::{ab_phase, speaks_tls, ui_phase};
use crate::common::{cpu_seconds, histogram, q_ms, record, rss_mib, run_dir, title};

/// Flags of `gpuledger-bench allocator`.
#[derive(clap::Args)]
pub struct Args {
    /// Concurrent clients (for both gpuledger and raw etcd).
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// Seconds each throughput phase runs.
    #[arg(long, default_value_t = 8)]
    seconds: u64,
    /// Nodes (8 GPUs of 80 GiB each) registered for the throughput phase.
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
    /// Nodes for the memory phase (0 skips it).
    #[arg(long, default_value_t = 5000)]
    rss_nodes: usize,
    /// Live allocations for the memory phase.
    #[arg(long, default_value_t = 100_000)]
    rss_allocs: usize,
    /// The allocator's `--commit-linger-us` (0 = its default: no linger).
    #[arg(long, default_value_t = 0)]
    commit_linger_us: u64,
    /// Nodes (8 GPUs each) for the phase that reserves while a poller reads `/ui`'s state
    /// (0 skips it).
    #[arg(long, default_value_t = 5000)]
    ui_nodes: usize,
    /// Live allocations in the ledger of the /ui phase (the JSON lists them all).
    #[arg(long, default_value_t = 20_000)]
    ui_allocs: usize,
    /// Reservations per second in the /ui phase, sent at a fixed rate whatever the answers
    /// (as pods arrive), so that a stall delays every request that arrives during it.
    #[arg(long, default_value_t = 400)]
    ui_rate: u32,
    /// Seconds each round of the /ui phase reserves.
    #[arg(long, default_value_t = 10)]
    ui_seconds: u64,
    /// Rounds of the /ui phase per allocator, alternating (ABBA) with the baseline.
    #[arg(long, default_value_t = 2)]
    ui_rounds: usize,
    /// An allocator binary built from an earlier commit, measured beside this build in the same
    /// run: in the /ui phase, and in an ABBA throughput phase (when it predates authentication,
    /// no --tls-cert, that phase measures what TLS and authentication cost).
    #[arg(long)]
    baseline_allocator: Option<PathBuf>,
}

async fn raw_etcd(
    etcd: &EtcdCluster,
    tag: &str,
    clients: usize,
    dur: Duration,
) -> Result<(f64, Histogram<u64>)> {
    let mut conns = Vec::new();
    for _ in 0..4 {
        conns.push(etcd.client().await?);
    }
    let hist = Arc::new(Mutex::new(histogram()));
    let deadline = Instant::now() + dur;
    let mut tasks = Vec::new();
    for i in 0..clients {
        let mut c = conns[i % conns.len()].clone();
        let hist = hist.clone();
        let tag = tag.to_string();
        tasks.push(tokio::spawn(async move {
            let key = format!("/bench/raw/{tag}/{i}");
            let mut last = 0;
            let mut n = 0u64;
            let mut local = histogram();
            while Instant::now() < deadline {
                let t = Instant::now();
                let txn = Txn::new()
                    .when([Compare::mod_revision(key.clone(), CompareOp::Equal, last)])
                    .and_then([TxnOp::put(key.clone(), vec![0u8; 200], None)]);
                match c.txn(txn).await {
                    Ok(r) if r.succeeded() => {
                        last = r.header().map_or(0, |h| h.revision());
                        n += 1;
                        record(&mut local, t.elapsed());
                    }
                    Ok(_) => bail!("raw txn compare failed unexpectedly"),
                    Err(e) => bail!("raw txn: {e}"),
                }
            }
            hist.lock().await.add(&local).ok();
            Ok(n)
        }));
    }
    let started = Instant::now();
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    let h = hist.lock().await.clone();
    Ok((total as f64 / started.elapsed().as_secs_f64(), h))
}

/// How the bench reaches one allocator: over TLS with the run's credentials, or in plain text
/// (a `--baseline-allocator` built before the API was authenticated).
#[derive(Clone)]
struct Target {
    addr: String,
    ids: Option<Identities>,
}

impl Target {
    /// Replica `i` of `allocs`, with its run's credentials.
    fn of(allocs: &Allocators, i: usize) -> Self {
        Target {
            addr: allocs.addrs[i].clone(),
            ids: Some(allocs.ids.clone()),
        }
    }

    /// A client calling as `role`.
    fn client(&self, role: &Role) -> Result<allocators::Client> {
        match &self.ids {
            Some(ids) => allocators::connect(&self.addr, &ids.credentials(role)?),
            None => {
                let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", self.addr))?
                    .tcp_nodelay(true)
                    .connect_lazy();
                Ok(AllocatorClient::new(InterceptedService::new(
                    ch,
                    gpuledger_auth::client::Bearer::default(),
                )))
            }
        }
    }
}

/// Register `nodes` nodes named `<prefix>NNNNN`, as an operator (admin) would.
async fn register(t: &Target, nodes: usize, prefix: &str) -> Result<()> {
    let names: Vec<String> = (0..nodes).map(|i| format!("{prefix}{i:05}")).collect();
    let chunks: Vec<Vec<String>> = names
        .chunks(nodes.div_ceil(32).max(1))
        .map(<[String]>::to_vec)
        .collect();
    let mut tasks = Vec::new();
    for chunk in chunks {
        let mut c = t.client(&Role::Admin)?;
        tasks.push(tokio::spawn(async move {
            for n in chunk {
                c.register_node(api::RegisterNodeRequest {
                    inventory: Some(inventory(&n, 8, 81_920, "NVIDIA A100-SXM4-80GB")),
                })
                .await
                .with_context(|| format!("registering {n}"))?;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

/// Batches (etcd transactions) in the bench cluster's log.
async fn log_batches(kv: &mut Client) -> Result<i64> {
    let opts = etcd_client::GetOptions::new()
        .with_prefix()
        .with_count_only();
    Ok(kv.get("/gpuledger/bench/log/", Some(opts)).await?.count())
}

/// Reserve from `clients` tasks until `dur` passes or `limit` reservations are made.
async fn reserve_load(
    t: &Target,
    clients: usize,
    dur: Duration,
    limit: usize,
    nodes: usize,
    prefix: &str,
    tag: &str,
) -> Result<(f64, Histogram<u64>, usize)> {
    let channels: Vec<_> = (0..8)
        .map(|_| t.client(&Role::Extender))
        .collect::<Result<_>>()?;
    let hist = Arc::new(Mutex::new(histogram()));
    let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let deadline = Instant::now() + dur;
    let mut tasks = Vec::new();
    for w in 0..clients {
        let mut c = channels[w % channels.len()].clone();
        let (hist, count) = (hist.clone(), count.clone());
        let (prefix, tag) = (prefix.to_string(), tag.to_string());
        tasks.push(tokio::spawn(async move {
            let mut local = histogram();
            let mut i = 0usize;
            while Instant::now() < deadline {
                let k = count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if k >= limit {
                    break;
                }
                let node = format!("{prefix}{:05}", (k * 7919) % nodes);
                let req = api::ReserveRequest {
                    request: Some(pod(&format!("{tag}-{w}-{i}"), 1000, 1)),
                    node,
                    ttl_ms: 0,
                };
                let t = Instant::now();
                c.reserve(req)
                    .await
                    .map_err(|s| anyhow::anyhow!("reserve: {}", s.message()))?;
                record(&mut local, t.elapsed());
                i += 1;
            }
            hist.lock().await.add(&local).ok();
            anyhow::Ok(i)
        }));
    }
    let started = Instant::now();
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    let h = hist.lock().await.clone();
    Ok((total as f64 / started.elapsed().as_secs_f64(), h, total))
}

/// Reserve `rate` times a second for `dur`, each request sent on schedule whether or not
/// the earlier ones were answered; latency counts from the scheduled time (no coordinated
/// omission). Returns the latencies and how many were made.
async fn reserve_at_rate(
    t: &Target,
    rate: u32,
    dur: Duration,
    nodes: usize,
    tag: &str,
) -> Result<(Histogram<u64>, usize)> {
    let channels: Vec<_> = (0..8)
        .map(|_| t.client(&Role::Extender))
        .collect::<Result<_>>()?;
    let every = Duration::from_secs(1) / rate.max(1);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let first = tokio::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let mut k = 0usize;
    loop {
        let at = tick.tick().await;
        if at - first >= dur {
            break;
        }
        let mut c = channels[k % channels.len()].clone();
        let req = api::ReserveRequest {
            request: Some(pod(&format!("{tag}-{k}"), 1000, 1)),
            node: format!("ui{:05}", (k * 7919) % nodes),
            ttl_ms: 0,
        };
        k += 1;
        tasks.spawn(async move {
            c.reserve(req)
                .await
                .map_err(|s| anyhow::anyhow!("reserve: {}", s.message()))?;
            anyhow::Ok(at.elapsed())
        });
    }
    let mut h = histogram();
    let mut made = 0;
    while let Some(r) = tasks.join_next().await {
        record(&mut h, r??);
        made += 1;
    }
    Ok((h, made))
}

/// Run the benchmark.
pub async fn run(a: Args) -> Result<()> {
    let dir = run_dir("allocator")?;
    title("starting a 3-member etcd");
    let etcd = EtcdCluster::start_in(&dir.path().join("etcd"), 3).await?;
    let dur = Duration::from_secs(a.seconds);

    title(&format!(
        "raw etcd: single-key compare-and-put txns, {} concurrent clients, {}s",
        a.clients, a.seconds
    ));
    // CPU of the etcd members and of this process (the raw clients) per raw transaction: the
    // same-run yardstick for the CPU a reservation costs below.
    let raw_pids: Vec<u32> = (0..etcd.len())
        .filter_map(|i| etcd.member(i).and_then(|p| p.pid()))
        .chain(std::iter::once(std::process::id()))
        .collect();
    let raw_cpu = || raw_pids.iter().map(|p| cpu_seconds(*p)).sum::<f64>();
    let (cpu0, t0) = (raw_cpu(), Instant::now());
    let (raw, raw_h) = raw_etcd(&etcd, "many", a.clients, dur).await?;
    let raw_cpu_per_txn = (raw_cpu() - cpu0) / (raw * t0.elapsed().as_secs_f64()).max(1.0);
    let (raw1, raw1_h) = raw_etcd(&etcd, "one", 1, Duration::from_secs(3)).await?;

    title(&format!(
        "gpuledger: 1 allocator replica, {} nodes x 8 GPUs, commit linger {} µs",
        a.nodes, a.commit_linger_us
    ));
    let linger = format!("--commit-linger-us={}", a.commit_linger_us);
    let allocs = Allocators::start(dir.path(), &etcd, 1, "bench", &[linger.as_str()])?;
    allocs.wait_leader(Duration::from_secs(30)).await?;
    let target = Target::of(&allocs, 0);
    register(&target, a.nodes, "node").await?;
    let pids: Vec<(String, u32)> =
        std::iter::once(("allocator".to_string(), allocs.procs[0].pid()))
            .chain(
                (0..etcd.len()).map(|i| (format!("etcd{i}"), etcd.member(i).and_then(|p| p.pid()))),
            )
            .chain(std::iter::once((
                "bench clients".to_string(),
                Some(std::process::id()),
            )))
            .filter_map(|(n, p)| p.map(|p| (n, p)))
            .collect();
    let mut kv = etcd.client().await?;
    let log_before = (
        log_batches(&mut kv).await?,
        allocs.status(0).await.map_or(0, |s| s.seq),
    );
    let cpu_before: Vec<f64> = pids.iter().map(|(_, p)| cpu_seconds(*p)).collect();
    let (rps, h, made) =
        reserve_load(&target, a.clients, dur, usize::MAX, a.nodes, "node", "load").await?;
    let log_after = (
        log_batches(&mut kv).await?,
        allocs.status(0).await.map_or(0, |s| s.seq),
    );
    let cpu_used: Vec<(String, f64)> = pids
        .iter()
        .zip(cpu_before)
        .map(|((n, p), b)| (n.clone(), cpu_seconds(*p) - b))
        .collect();
    let (rps1, h1, _) = reserve_load(
        &target,
        1,
        Duration::from_secs(3),
        usize::MAX,
        a.nodes,
        "node",
        "single",
    )
    .await?;
    let rss_bench = allocs.procs[0]
        .pid()
        .map(rss_mib)
        .transpose()?
        .unwrap_or(0.0);

    println!();
    println!(
        "{:<46} {:>12} {:>9} {:>9} {:>9}",
        "what", "ops/s", "p50 ms", "p99 ms", "max ms"
    );
    let row = |what: &str, ops: f64, h: &Histogram<u64>| {
        println!(
            "{:<46} {:>12.0} {:>9.2} {:>9.2} {:>9.2}",
            what,
            ops,
            q_ms(h, 0.5),
            q_ms(h, 0.99),
            h.max() as f64 / 1000.0
        );
    };
    row(&format!("raw etcd txn, {} clients", a.clients), raw, &raw_h);
    row("raw etcd txn, 1 client", raw1, &raw1_h);
    row(
        &format!("gpuledger Reserve (gRPC), {} clients", a.clients),
        rps,
        &h,
    );
    row("gpuledger Reserve (gRPC), 1 client", rps1, &h1);
    println!(
        "ratio gpuledger/raw etcd at {} clients: {:.2}x",
        a.clients,
        rps / raw
    );
    println!(
        "CPU spent during the {}-client phase, per reservation:",
        a.clients
    );
    for (n, c) in &cpu_used {
        println!("  {n:<14} {:>7.1} µs", c * 1e6 / made.max(1) as f64);
    }
    let per_reservation = cpu_used.iter().map(|(_, c)| c).sum::<f64>() / made.max(1) as f64;
    println!(
        "  in all         {:>7.1} µs, against {:.1} µs per raw etcd txn (etcd + clients): at equal CPU use the ratio could be at most {:.2}x",
        per_reservation * 1e6,
        raw_cpu_per_txn * 1e6,
        raw_cpu_per_txn / per_reservation.max(1e-9)
    );
    println!("allocator RSS after the throughput phase: {rss_bench:.1} MiB");
    let (batches, events) = (log_after.0 - log_before.0, log_after.1 - log_before.1);
    println!(
        "group commit in the {}-client phase: {events} events in {batches} etcd transactions ({:.1} events per transaction)",
        a.clients,
        events as f64 / batches.max(1) as f64
    );

    let mut rss_line = String::new();
    if a.rss_nodes > 0 {
        title(&format!(
            "memory: fresh ledger with {} nodes x 8 GPUs and {} live allocations",
            a.rss_nodes, a.rss_allocs
        ));
        let big = Allocators::start(dir.path(), &etcd, 1, "rss", &[])?;
        big.wait_leader(Duration::from_secs(30)).await?;
        let baddr = Target::of(&big, 0);
        let t = Instant::now();
        register(&baddr, a.rss_nodes, "big").await?;
        let (_, _, made) = reserve_load(
            &baddr,
            a.clients,
            Duration::from_secs(600),
            a.rss_allocs,
            a.rss_nodes,
            "big",
            "rss",
        )
        .await?;
        let st = big.status(0).await.context("allocator status")?;
        let rss = big.procs[0].pid().map(rss_mib).transpose()?.unwrap_or(0.0);
        println!(
            "{} nodes, {} live allocations (made {made} in {:.1}s), seq {}: allocator RSS {rss:.1} MiB",
            st.nodes,
            st.allocations,
            t.elapsed().as_secs_f64(),
            st.seq
        );
        rss_line = format!(" rss_mib={rss:.0}");
    }
    if let Some(base) = a.baseline_allocator.as_ref() {
        let key = if speaks_tls(base)? {
            "baseline"
        } else {
            "auth"
        };
        let (with, without) = ab_phase(&a, dir.path(), &etcd, base).await?;
        rss_line.push_str(&format!(
            " {key}_ratio={:.2} {key}_p50_delta_ms={:.2}",
            with.0 / without.0.max(1e-9),
            q_ms(&with.1, 0.5) - q_ms(&without.1, 0.5)
        ));
    }
    if a.ui_nodes > 0 {
        let ui = ui_phase(&a, dir.path(), &etcd).await?;
        if let Some(this) = ui.first() {
            rss_line.push_str(&format!(" ui_p99_ms={:.2}", q_ms(&this.hist, 0.99)));
        }
        if let Some(base) = ui.get(1) {
            rss_line.push_str(&format!(
                " ui_baseline_p99_ms={:.2}",
                q_ms(&base.hist, 0.99)
            ));
        }
    }
    println!(
        "reserve_per_s={rps:.0} raw_etcd_txn_per_s={raw:.0} ratio={:.2} p50_ms={:.2} p99_ms={:.2}{rss_line}",
        rps / raw,
        q_ms(&h1, 0.5),
        q_ms(&h1, 0.99)
    );
    Ok(())
}
