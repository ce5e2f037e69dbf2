//! /healthz, /readyz and /metrics of real allocator replicas: the series exist, move with the
//! ledger, and readiness drops when etcd is gone.

use std::time::{Duration, Instant};

use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::http::get;
use gpuledger_testkit::workload::{inventory, pod};
use gpuledger_testkit::{Allocators, EtcdCluster};

fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name) && !l.starts_with('#'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_readiness_and_metrics() -> anyhow::Result<()> {
    let mut etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = Allocators::start(dir.path(), &etcd, 2, "http", &[])?;
    let leader = allocs.wait_leader(Duration::from_secs(20)).await?;
    let follower = 1 - leader;
    // A replica binds its HTTP port once it reached etcd: the follower may be a moment
    // behind the leader there (seen refused on a loaded machine).
    for h in &allocs.http {
        let deadline = Instant::now() + Duration::from_secs(10);
        let code = loop {
            match get(&format!("http://{h}/healthz")).await {
                Ok((code, _)) => break code,
                Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(e),
            }
        };
        assert_eq!(code, 200);
    }
    // The follower is ready once it knows the leader.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (code, body) = get(&format!("http://{}/readyz", allocs.http[follower])).await?;
        if code == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "follower never ready: {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    allocs
        .node_agent(leader, "n1")?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("n1", 2, 16_000, "T4")),
        })
        .await?;
    allocs
        .extender(leader)?
        .reserve(api::ReserveRequest {
            request: Some(pod("m1", 5_000, 25)),
            node: "n1".into(),
            ttl_ms: 0,
        })
        .await?;
    let (code, text) = get(&format!("http://{}/metrics", allocs.http[leader])).await?;
    assert_eq!(code, 200);
    assert_eq!(
        metric(&text, "gpuledger_allocator_is_leader"),
        Some(1.0),
        "{text}"
    );
    assert!(
        metric(&text, "gpuledger_allocator_ledger_seq").unwrap_or(0.0) >= 3.0,
        "{text}"
    );
    assert!(
        text.contains(r#"gpuledger_allocator_gpu_memory_allocated_mib{node="n1",gpu="0"} 5000"#)
            || text.contains(
                r#"gpuledger_allocator_gpu_memory_allocated_mib{node="n1",gpu="1"} 5000"#
            ),
        "{text}"
    );
    assert!(
        text.contains(r#"gpuledger_allocator_allocations{state="reserved"} 1"#),
        "{text}"
    );
    assert!(
        text.contains("gpuledger_allocator_commit_latency_seconds_count"),
        "{text}"
    );
    assert!(
        text.contains(r#"gpuledger_allocator_events_total{type="reserved"} 1"#),
        "{text}"
    );
    let (_, ftext) = get(&format!("http://{}/metrics", allocs.http[follower])).await?;
    assert_eq!(metric(&ftext, "gpuledger_allocator_is_leader"), Some(0.0));

    etcd.kill(0);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (code, body) = get(&format!("http://{}/readyz", allocs.http[leader])).await?;
        if code == 503 {
            assert!(body.contains("etcd"), "{body}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still ready 10 s after etcd died"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// One leading allocator with `flags` (its state in `dir`), once its plain HTTP port answers:
/// the allocator and that port's address.
async fn plain_port(
    dir: &std::path::Path,
    etcd: &EtcdCluster,
    flags: &[&str],
) -> anyhow::Result<(Allocators, std::net::SocketAddr)> {
    let allocs = Allocators::start(dir, etcd, 1, "http", flags)?;
    allocs.wait_leader(Duration::from_secs(20)).await?;
    let addr: std::net::SocketAddr = allocs.http[0].parse()?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while get(&format!("http://{addr}/healthz")).await.is_err() {
        anyhow::ensure!(Instant::now() < deadline, "the HTTP port never answered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok((allocs, addr))
}

/// Regression (hostile load II): the plain HTTP port accepted every connection, and 20,000
/// idle ones used up the leader's file descriptors until `/healthz` timed out. Now it holds
/// `--http-max-connections` (per peer too), closes what sends no request within
/// `--http-header-read-timeout-ms`, and the kubelet's probe still gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_cannot_take_the_plain_port() -> anyhow::Result<()> {
    use gpuledger_testkit::attacker::{ensure_closed_within, idle_flood_past};
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let flags = [
        "--http-max-connections=64",
        "--http-max-connections-per-peer=8",
        "--http-header-read-timeout-ms=1500",
    ];
    let (_allocs, addr) = plain_port(dir.path(), &etcd, &flags).await?;
    // Twelve addresses, 12 connections each: 144, over both the per-peer and the total bound.
    let mut flood = idle_flood_past(addr, 64).await?;
    let t = Instant::now();
    let (code, _) = get(&format!("http://{addr}/healthz")).await?;
    assert_eq!(code, 200, "the liveness probe during the flood");
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    // What sends no request is closed once the header read timeout passes.
    ensure_closed_within(&mut flood, Duration::from_millis(1600)).await?;
    let (_, text) = get(&format!("http://{addr}/metrics")).await?;
    for limit in ["http_connections_per_peer", "http_connections_evicted"] {
        let line = format!("gpuledger_allocator_limited_total{{limit=\"{limit}\"}}");
        assert!(
            metric(&text, &line).unwrap_or(0.0) >= 1.0,
            "{limit} not counted: {text}"
        );
    }
    Ok(())
}

/// A plain port full of peers holding one connection each closes a newcomer at accept: no
/// peer holds two more than it, so no idle connection is evicted for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_plain_port_of_light_peers_closes_a_newcomer_at_accept() -> anyhow::Result<()> {
    use gpuledger_testkit::attacker::{count_closed, idle_flood};
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let flags = [
        "--http-max-connections=8",
        "--http-header-read-timeout-ms=5000",
    ];
    let (_allocs, addr) = plain_port(dir.path(), &etcd, &flags).await?;
    // Twelve addresses, one idle connection each, on a port of eight.
    let mut flood = idle_flood(2..14, 1, addr).await;
    let closed = count_closed(&mut flood, Duration::from_millis(200)).await;
    assert!(closed >= 4, "{closed} of 12 closed on a port of 8");
    drop(flood);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (_, text) = get(&format!("http://{addr}/metrics")).await?;
    let series = |limit: &str| {
        let line = format!("gpuledger_allocator_limited_total{{limit=\"{limit}\"}}");
        metric(&text, &line).unwrap_or(0.0)
    };
    assert!(series("http_connections") >= 4.0, "{text}");
    assert_eq!(series("http_connections_evicted"), 0.0);
    Ok(())
}

/// No handler of the plain port reads a body: a request with one, however large or slow, is
/// answered at once and its connection closed, so a body never holds a connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_on_the_plain_port_is_never_waited_for() -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let flags = ["--http-header-read-timeout-ms=5000"];
    let (_allocs, addr) = plain_port(dir.path(), &etcd, &flags).await?;
    // 100 KiB sent whole, and 2 bytes of a promised 1 MB.
    for (length, sent) in [(100 << 10, 100 << 10), (1 << 20, 2)] {
        for method in ["GET", "POST"] {
            let mut s = tokio::net::TcpStream::connect(addr).await?;
            let head = format!(
                "{method} /healthz HTTP/1.1\r\nhost: x\r\ncontent-length: {length}\r\n\r\n"
            );
            s.write_all(head.as_bytes()).await?;
            // The server may close before the whole body is written.
            let _ = s.write_all(&vec![b'a'; sent]).await;
            let mut answer = Vec::new();
            let t = Instant::now();
            let read =
                tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut answer)).await;
            let text = String::from_utf8_lossy(&answer);
            assert!(
                read.is_ok() && text.starts_with("HTTP/1.1 "),
                "{method} with {sent} of {length} bytes: closed {:?}, after {:?}: {text:?}",
                read.is_ok(),
                t.elapsed()
            );
        }
    }
    Ok(())
}
