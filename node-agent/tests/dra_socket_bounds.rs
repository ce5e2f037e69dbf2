//! The bounds of the DRA plugin socket, against the real node agent over its real unix socket
//! (the DRA kubelet emulator dials it as the kubelet does): anything that reaches the socket can
//! hold at most --dra-max-health-streams health streams, have at most
//! --dra-max-claims-in-flight claims prepared at once, and send no request over 4 MiB.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::dra::v1 as dra;
use gpuledger_proto::drahealth::v1 as h1;
use gpuledger_testkit::free_port;

use crate::dra_plugin::DraNode;

/// The gRPC status an emulator call failed with.
fn status_of(e: &anyhow::Error) -> Option<&tonic::Status> {
    e.downcast_ref::<tonic::Status>()
}

/// `gpuledger_node_agent_limited_total{listener="dra",limit}` on the agent's plain port.
async fn dra_bites(port: u16, limit: &str) -> Result<f64> {
    let (code, text) =
        gpuledger_testkit::http::get(&format!("http://127.0.0.1:{port}/metrics")).await?;
    anyhow::ensure!(code == 200, "/metrics answered {code}: {text}");
    let series =
        format!("gpuledger_node_agent_limited_total{{listener=\"dra\",limit=\"{limit}\"}}");
    text.lines()
        .find(|l| l.starts_with(&series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .with_context(|| format!("no {series} in\n{text}"))
}

/// With the default bound (4) a fifth health stream, of any version, is refused with RESOURCE_EXHAUSTED and a
/// message naming the flag; once a client goes, its slot is free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifth_health_stream_is_refused_until_one_ends() -> Result<()> {
    let port = free_port()?;
    let n = DraNode::start_with(|_| {}, &[format!("--health-listen=127.0.0.1:{port}")]).await?;
    n.wait_slice(None).await?;
    let mut open = Vec::new();
    for i in 0..4 {
        let mut s = n
            .dra
            .watch_health()
            .await
            .with_context(|| format!("health stream {i}\n{}", n.log()))?;
        s.message().await?.context("the stream's first answer")?;
        open.push(s);
    }
    assert_eq!(dra_bites(port, "health_streams").await?, 0.0);
    // The bound counts every version together: the fifth, of v1, is refused too.
    let st =
        h1::dra_resource_health_client::DraResourceHealthClient::new(n.dra.plugin_channel().await?)
            .node_watch_resources(
                gpuledger_proto::drahealth::v1alpha1::NodeWatchResourcesRequest {},
            )
            .await
            .err()
            .context("a fifth health stream was served")?;
    assert_eq!(st.code(), tonic::Code::ResourceExhausted, "{st:?}");
    assert!(
        st.message().contains("serves 4 health streams already")
            && st.message().contains("--dra-max-health-streams"),
        "{}",
        st.message()
    );
    assert_eq!(dra_bites(port, "health_streams").await?, 1.0);
    // The streams still open go on being served.
    open[0].message().await?.context("an open stream ended")?;

    // A client goes: its slot is given back and a new stream is served.
    drop(open.pop());
    let t0 = Instant::now();
    let mut s = loop {
        match n.dra.watch_health().await {
            Ok(s) => break s,
            Err(e) if t0.elapsed() < Duration::from_secs(5) => {
                let code = status_of(&e).map(tonic::Status::code);
                anyhow::ensure!(code == Some(tonic::Code::ResourceExhausted), "{e:#}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => bail!(
                "the ended stream's slot was never given back: {e:#}\n{}",
                n.log()
            ),
        }
    };
    eprintln!(
        "a slot was free again {:?} after its client went",
        t0.elapsed()
    );
    s.message()
        .await?
        .context("the new stream's first answer")?;
    Ok(())
}

/// With --dra-max-claims-in-flight=1 a claim that arrives while another waits for its grant is
/// answered at once with an error the kubelet retries, and prepared once the slot is free; a
/// request over 4 MiB is refused whole (OUT_OF_RANGE) and the socket goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_past_the_bound_and_oversized_requests_are_refused() -> Result<()> {
    let port = free_port()?;
    let n = DraNode::start_with(
        |_| {},
        &[
            format!("--health-listen=127.0.0.1:{port}"),
            "--dra-max-claims-in-flight=1".to_string(),
        ],
    )
    .await?;
    n.wait_slice(None).await?;
    let slow = n.add_claim("claim-uid-slow", "slow", 0, "share-s")?;
    let other = n.add_claim("claim-uid-other", "other", 1, "share-o")?;
    // `slow` is never granted: it holds the one slot for --prepare-grant-wait (2 s).
    let (a, b) = tokio::join!(n.dra.prepare(std::slice::from_ref(&slow)), async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let t0 = Instant::now();
        let r = n.dra.prepare(std::slice::from_ref(&other)).await;
        (r, t0.elapsed())
    });
    let a = a?;
    assert!(
        a.claims["claim-uid-slow"]
            .error
            .contains("no gpuledger grant"),
        "{:?}",
        a.claims
    );
    let (b, took) = b;
    let b = &b?.claims["claim-uid-other"];
    assert!(b.devices.is_empty(), "{b:?}");
    assert!(
        b.error.contains("prepares or unprepares 1 claims already")
            && b.error.contains("--dra-max-claims-in-flight"),
        "{}",
        b.error
    );
    assert!(took < Duration::from_secs(1), "refused only after {took:?}");
    assert_eq!(dra_bites(port, "claims_in_flight").await?, 1.0);

    // The slot is free again: granted, the same claim is prepared.
    n.allocs
        .admin(0)?
        .grant_claim(api::GrantClaimRequest {
            grant: Some(n.grant(&other, 1, "share-o")),
        })
        .await?;
    let r = n.dra.prepare(std::slice::from_ref(&other)).await?;
    let b = &r.claims["claim-uid-other"];
    assert!(b.error.is_empty() && !b.devices.is_empty(), "{b:?}");

    // One claim whose name is 5 MiB: refused before any of it is decided.
    let huge = dra::Claim {
        namespace: "team-a".into(),
        uid: "claim-uid-huge".into(),
        name: "x".repeat(5 * 1024 * 1024),
    };
    let e = n
        .dra
        .prepare(&[huge])
        .await
        .err()
        .context("a 5 MiB request was answered")?;
    let st = status_of(&e).with_context(|| format!("not a gRPC status: {e:#}"))?;
    assert_eq!(st.code(), tonic::Code::OutOfRange, "{st:?}");
    let r = n.dra.prepare(std::slice::from_ref(&other)).await?;
    assert!(r.claims["claim-uid-other"].error.is_empty(), "{r:?}");
    Ok(())
}
