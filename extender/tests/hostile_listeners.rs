//! The extender's two HTTPS ports against hostile clients, on the real binary: the scheduler
//! port admits kube-scheduler's certificate only (not a viewer's or a node agent's from the
//! same CA); connections are bounded per address and the last tenth of a listener is kept for
//! addresses that hold few, so a flood from many addresses leaves both ports answering; a body that trickles in is cut (408), and one over the size limit is
//! answered 413, not with a broken connection. A full listener lets a newcomer in by closing
//! an idle connection of the peer holding the most; the plain port of probes and metrics is
//! bounded the same way; a copy of kube-scheduler's certificate used from another address spends
//! its own turns of the scheduling pace, not the scheduler's. Each refusal is counted in
//! `gpuledger_extender_limited_total{listener,limit}`.

use crate::kit;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use gpuledger_auth::identity::Role;
use gpuledger_testkit::kube::{ExtenderClient, KubeStack, StackOptions};
use gpuledger_testkit::{attacker, free_port};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn filter_args() -> serde_json::Value {
    json!({"Pod": {"metadata": {"name": "p", "namespace": "default", "uid": "u"},
                   "spec": {"containers": []}},
           "Nodes": null, "NodeNames": []})
}

fn pod() -> serde_json::Value {
    json!({"metadata": {"name": "p", "namespace": "default"},
           "spec": {"containers": [{"name": "c", "image": "x",
              "resources": {"limits": {"aliyun.com/gpu-mem": "3"}}}]}})
}

/// The port of the stack's extender's scheduler-facing HTTPS server.
fn scheduler_port(stack: &KubeStack) -> anyhow::Result<u16> {
    Ok(stack
        .extender_url
        .trim_end_matches("/gpuledger")
        .rsplit(':')
        .next()
        .unwrap_or_default()
        .parse()?)
}

async fn stack(extra: &[&str]) -> anyhow::Result<(KubeStack, u16)> {
    let hook = free_port()?;
    let mut flags = vec![kit::webhook_flag(hook)];
    flags.extend(extra.iter().map(|s| s.to_string()));
    let stack = KubeStack::start(StackOptions {
        etcd_members: 1,
        allocators: 1,
        allocator_flags: vec![],
        extender_flags: Some(flags),
    })
    .await?;
    gpuledger_testkit::kube::stack::wait_http(hook, Duration::from_secs(20)).await?;
    Ok((stack, hook))
}

/// A TLS connection from `source` to the webhook, trusting the stack's CA.
async fn tls_from(
    stack: &KubeStack,
    source: &str,
    port: u16,
) -> anyhow::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let tls = attacker::tls_trusting(stack.ids.pki.ca_file())?;
    Ok(attacker::tls_from(&tls, source, SocketAddr::from(([127, 0, 0, 1], port))).await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scheduler_port_admits_only_the_schedulers_identity() -> anyhow::Result<()> {
    let (stack, _) = stack(&[]).await?;
    let body = serde_json::to_vec(&filter_args())?;
    let scheduler = ExtenderClient::new(stack.extender_config()?)?;
    assert_eq!(scheduler.post_raw("filter", body.clone()).await?.0, 200);
    // Certificates from the very CA --client-ca names, of other gpuledger identities.
    for role in [Role::Viewer, Role::NodeAgent { node: "n1".into() }] {
        let (cert, key) = stack.ids.pki.client_cert(&role, "eve")?;
        let mut cfg = stack.extender_config()?;
        if let Some(t) = cfg.tls.as_mut() {
            t.cert = cert;
            t.key = key;
        }
        let r = ExtenderClient::new(cfg)?
            .post_raw("filter", body.clone())
            .await;
        assert!(
            r.is_err(),
            "a {} certificate was answered: {r:?}",
            role.kind()
        );
    }
    let refused = kit::metric(
        &stack,
        "gpuledger_extender_limited_total{listener=\"scheduler\",limit=\"tls_client_name\"} ",
    )
    .await?;
    assert!(refused >= 2.0, "refusals counted: {refused}");
    assert_eq!(scheduler.post_raw("filter", body).await?.0, 200);
    Ok(())
}

/// How often the webhook's `limit` refused something.
async fn webhook_limited(stack: &KubeStack, limit: &str) -> anyhow::Result<f64> {
    let line =
        format!("gpuledger_extender_limited_total{{listener=\"webhook\",limit=\"{limit}\"}} ");
    kit::metric(stack, &line).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_slow_clients_leaves_both_ports_answering() -> anyhow::Result<()> {
    let (stack, hook) = stack(&["--request-read-timeout-ms=2000"]).await?;
    let honest = kit::webhook_client(&stack, hook)?;
    let scheduler = ExtenderClient::new(stack.extender_config()?)?;
    // Eight addresses each open more connections than one peer may hold, twice the
    // listener's 1,024 in all: past the per-peer limit they are closed at once, and the last
    // tenth of the listener stays for clients that hold few.
    let mut flood = Vec::new();
    for source in 2..10 {
        for _ in 0..260 {
            let to = SocketAddr::from(([127, 0, 0, 1], hook));
            if let Ok(s) = attacker::tcp_from(&format!("127.0.0.{source}"), to).await {
                flood.push(s);
            }
        }
    }
    let mut closed = 0;
    for s in &mut flood {
        if let Ok(Ok(0)) =
            tokio::time::timeout(Duration::from_millis(5), s.read(&mut [0u8; 1])).await
        {
            closed += 1;
        }
    }
    assert!(
        closed >= 500,
        "only {closed} of 2,080 connections over the limits were closed"
    );
    // Another address sends bodies a byte at a time (as few as a small client holds).
    let mut slow = Vec::new();
    for _ in 0..10 {
        let mut s = tls_from(&stack, "127.0.0.20", hook).await?;
        s.write_all(
            b"POST /mutate HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: 1000000\r\n\r\n{",
        )
        .await?;
        slow.push(s);
    }
    // Meanwhile both ports answer honest calls.
    let t0 = Instant::now();
    let (status, _) = honest.post("/mutate", &kit::review(&pod(), "u")).await?;
    assert_eq!(status, 200, "the API server's review during the flood");
    let (status, _) = scheduler
        .post_raw("filter", serde_json::to_vec(&filter_args())?)
        .await?;
    assert_eq!(status, 200, "kube-scheduler's filter during the flood");
    // The trickling bodies are cut once the read timeout passes: 408.
    for s in &mut slow {
        let _ = s.write_all(b" ").await;
    }
    for mut s in slow {
        let mut answer = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(6), s.read_to_end(&mut answer)).await;
        assert!(
            read.is_ok(),
            "a slow body still held after {:?}",
            t0.elapsed()
        );
        let text = String::from_utf8_lossy(&answer);
        assert!(text.starts_with("HTTP/1.1 408"), "answered {text:?}");
    }
    assert!(webhook_limited(&stack, "connections_per_peer").await? >= 1.0);
    assert!(webhook_limited(&stack, "connections").await? >= 100.0);
    assert!(webhook_limited(&stack, "http_body_time").await? >= 10.0);
    drop(flood);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_50_mb_body_is_answered_413() -> anyhow::Result<()> {
    let (stack, hook) = stack(&[]).await?;
    // A client that writes its whole request before it reads (as many simple clients do).
    let mut s = tls_from(&stack, "127.0.0.1", hook).await?;
    let body = vec![b' '; 50 << 20];
    let head = format!(
        "POST /mutate HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let wrote = async {
        s.write_all(head.as_bytes()).await?;
        s.write_all(&body).await?;
        s.flush().await
    }
    .await;
    // The connection is not torn down under it (a client that sees a broken pipe reports
    // that, not the answer).
    assert!(wrote.is_ok(), "writing the request failed: {wrote:?}");
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut answer)).await;
    let text = String::from_utf8_lossy(&answer);
    assert!(
        text.starts_with("HTTP/1.1 413"),
        "answered {:?} (write: {wrote:?}, read: {read:?})",
        &text[..text.len().min(200)]
    );
    let (status, _) = kit::webhook_client(&stack, hook)?
        .post("/mutate", &kit::review(&pod(), "u"))
        .await?;
    assert_eq!(status, 200, "and the webhook goes on");
    assert!(webhook_limited(&stack, "http_body_bytes").await? >= 1.0);
    Ok(())
}

/// Regression (hostile load II): the plain port of /healthz, /readyz and /metrics had no
/// bound, and idle connections took the process's file descriptors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_cannot_take_the_probe_port() -> anyhow::Result<()> {
    let (stack, _) = stack(&[
        "--http-max-connections=64",
        "--http-max-connections-per-peer=8",
        "--http-header-read-timeout-ms=1500",
    ])
    .await?;
    let addr: SocketAddr = stack
        .extender_http_url
        .trim_start_matches("http://")
        .parse()?;
    let mut flood = attacker::idle_flood_past(addr, 64).await?;
    let (code, _) =
        gpuledger_testkit::http::get(&format!("{}/healthz", stack.extender_http_url)).await?;
    assert_eq!(code, 200, "the liveness probe during the flood");
    attacker::ensure_closed_within(&mut flood, Duration::from_millis(1600)).await?;
    for limit in ["http_connections_per_peer", "http_connections_evicted"] {
        let line =
            format!("gpuledger_extender_limited_total{{listener=\"http\",limit=\"{limit}\"}} ");
        let n = kit::metric(&stack, &line).await?;
        assert!(n >= 1.0, "{limit} counted {n}");
    }
    Ok(())
}

/// Regression (hostile load II): four addresses at the per-peer limit and a few more at one
/// connection each held every connection of the webhook (its last tenth was kept only for
/// addresses holding few, which a dozen addresses each are); the API server's next connection
/// was refused, and with failurePolicy Fail no GPU pod could be created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dozen_addresses_cannot_fill_the_webhook() -> anyhow::Result<()> {
    let (stack, hook) = stack(&[
        "--max-connections=128",
        "--max-connections-per-peer=32",
        "--request-read-timeout-ms=30000",
    ])
    .await?;
    let mut held = Vec::new();
    for source in 2..6 {
        for _ in 0..32 {
            if let Ok(s) = tls_from(&stack, &format!("127.0.0.{source}"), hook).await {
                held.push(s);
            }
        }
    }
    for source in 10..30 {
        if let Ok(s) = tls_from(&stack, &format!("127.0.0.{source}"), hook).await {
            held.push(s);
        }
    }
    let full = webhook_limited(&stack, "connections").await?
        + webhook_limited(&stack, "connections_evicted").await?;
    assert!(
        full >= 1.0,
        "the webhook never filled ({} connections)",
        held.len()
    );
    // The API server, holding nothing, is answered.
    let (status, _) = kit::webhook_client(&stack, hook)?
        .post("/mutate", &kit::review(&pod(), "u"))
        .await?;
    assert_eq!(status, 200, "the API server's review");
    assert!(webhook_limited(&stack, "connections_evicted").await? >= 1.0);
    drop(held);
    Ok(())
}

/// Regression (hostile load II): the scheduling pace was one bucket for every caller, taken
/// before the body was read, so a copy of kube-scheduler's certificate took the real
/// scheduler's turns (its filter p99 went from 4 to 666 ms). The turns are per address now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_of_the_schedulers_certificate_spends_only_its_own_turns() -> anyhow::Result<()> {
    let (stack, _) = stack(&["--scheduling-calls-per-s=5", "--scheduling-call-burst=5"]).await?;
    let port = scheduler_port(&stack)?;
    let (cert, key) = stack.ids.pki.peer("gpuledger-scheduler")?;
    let connector = attacker::tls_as(stack.ids.pki.ca_file(), &cert, &key)?;
    let body = serde_json::to_vec(&filter_args())?;
    let stop = Instant::now() + Duration::from_secs(3);
    let mut attack = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let (connector, body) = (connector.clone(), body.clone());
        attack.spawn(async move {
            let mut refused = 0;
            while Instant::now() < stop {
                let to = SocketAddr::from(([127, 0, 0, 1], port));
                let s = attacker::tls_from(&connector, "127.0.0.2", to).await?;
                if attacker::post_once(s, "/filter", &body).await? == 429 {
                    refused += 1;
                }
            }
            anyhow::Ok(refused)
        });
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let scheduler = ExtenderClient::new(stack.extender_config()?)?;
    for _ in 0..5 {
        let t = Instant::now();
        let (status, _) = scheduler.post_raw("filter", body.clone()).await?;
        assert_eq!(status, 200, "kube-scheduler's filter during the attack");
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "kube-scheduler's filter waited {:?}",
            t.elapsed()
        );
    }
    let mut refused = 0;
    for r in attack.join_all().await {
        refused += r?;
    }
    assert!(
        refused >= 1,
        "the copy was never refused: the pace did not bite"
    );
    let counted = kit::metric(
        &stack,
        "gpuledger_extender_limited_total{listener=\"scheduler\",limit=\"scheduling_calls\"} ",
    )
    .await?;
    assert_eq!(
        counted,
        f64::from(refused),
        "429s counted as scheduling_calls"
    );
    Ok(())
}
