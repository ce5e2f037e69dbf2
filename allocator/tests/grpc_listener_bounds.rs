//! The bounds of the allocator's gRPC listener that the hostile-load tests do not reach, each
//! on a real allocator process over real TLS: a full listener of peers holding one connection
//! each closes a newcomer at accept, as a peer at its own bound does; silent handshakes take at most the
//! listener's handshake slots but the last tenth, left to a client that holds few; a handshake
//! stalled after its ClientHello is cut at `--tls-handshake-timeout-ms`, or at
//! `--tls-hello-timeout-ms` while more than half of the handshake slots are taken; calls past a
//! connection's streams wait for one to close; a peer that stops answering HTTP/2 pings is
//! closed after `--keepalive-ms` and a half.

use std::time::{Duration, Instant};

use gpuledger_auth::identity::Role;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::attacker::{
    allocator_from, client_hello, count_closed, silent_h2, tcp_from, tls_from, tls_trusting,
};
use gpuledger_testkit::workload::inventory;
use gpuledger_testkit::{Allocators, EtcdCluster};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::hostile_load::limited;

/// One allocator with `flags`, leading.
async fn one(
    dir: &std::path::Path,
    etcd: &EtcdCluster,
    flags: &[&str],
) -> anyhow::Result<Allocators> {
    let allocs = Allocators::start(dir, etcd, 1, "bounds", flags)?;
    allocs.wait_leader(Duration::from_secs(20)).await?;
    Ok(allocs)
}

/// How long the server took to close `s` (end of stream or an error), reading and dropping
/// what it sends; `None` if it is still open after `wait`.
async fn closed_after(
    mut s: impl tokio::io::AsyncRead + Unpin,
    wait: Duration,
) -> Option<Duration> {
    let t = Instant::now();
    let mut buf = [0u8; 4096];
    tokio::time::timeout(wait, async {
        while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
    })
    .await
    .ok()
    .map(|()| t.elapsed())
}

/// Idle TLS connections to replica 0 of `allocs`, one from each address of `sources` in
/// turn: how many are open a moment after (a handshake that failed, the connection closed at
/// accept, counts as closed).
async fn still_open(
    allocs: &Allocators,
    sources: impl IntoIterator<Item = impl AsRef<str>>,
) -> anyhow::Result<usize> {
    let tls = tls_trusting(allocs.ids.pki.ca_file())?;
    let to = allocs.addrs[0].parse()?;
    let mut tcp = Vec::new();
    for source in sources {
        tcp.extend(
            tls_from(&tls, source.as_ref(), to)
                .await
                .ok()
                .map(|s| s.into_inner().0),
        );
    }
    Ok(tcp.len() - count_closed(&mut tcp, Duration::from_millis(200)).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_listener_of_light_peers_closes_a_newcomer_at_accept() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = one(dir.path(), &etcd, &["--max-connections=16"]).await?;
    // Twenty addresses, one idle TLS connection each: the listener holds sixteen at most, and
    // no address holds two more than a newcomer, so no idle connection is evicted for one.
    let open = still_open(&allocs, (2..22).map(|i| format!("127.0.0.{i}"))).await?;
    assert!(
        open <= 16,
        "{open} connections held past --max-connections=16"
    );
    let refused = limited(&allocs, 0, "connections").await?;
    assert!(refused >= 4.0, "{refused} connections closed at accept");
    assert_eq!(limited(&allocs, 0, "connections_evicted").await?, 0.0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_a_peers_bound_are_closed_at_accept() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = one(dir.path(), &etcd, &["--max-connections-per-peer=4"]).await?;
    let open = still_open(&allocs, ["127.0.0.2"; 8]).await?;
    assert_eq!(open, 4, "connections held from one address");
    assert_eq!(limited(&allocs, 0, "connections_per_peer").await?, 4.0);
    // Another address is served meanwhile.
    let viewer = allocs.ids.credentials(&Role::Viewer)?;
    let mut other = allocator_from("127.0.0.3", &allocs.addrs[0], &viewer)?;
    other.status(api::StatusRequest {}).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_handshakes_take_at_most_the_listeners_handshake_slots() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = one(dir.path(), &etcd, &["--max-tls-handshakes=16"]).await?;
    let to = allocs.addrs[0].parse()?;
    // Thirty-two sockets from one address that never send a ClientHello: under the per-peer
    // bound (64), twice the listener's handshake slots.
    let mut silent = Vec::new();
    for _ in 0..32 {
        silent.extend(tcp_from("127.0.0.2", to).await.ok());
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let refused = limited(&allocs, 0, "tls_handshakes").await?;
    assert!(
        refused >= 16.0,
        "{refused} of 32 handshakes closed at accept"
    );
    assert_eq!(limited(&allocs, 0, "tls_handshakes_per_peer").await?, 0.0);
    // The last tenth stays for a client that holds few: it is answered meanwhile.
    let viewer = allocs.ids.credentials(&Role::Viewer)?;
    let mut fresh = allocator_from("127.0.0.30", &allocs.addrs[0], &viewer)?;
    let status =
        tokio::time::timeout(Duration::from_secs(3), fresh.status(api::StatusRequest {})).await;
    assert!(matches!(status, Ok(Ok(_))), "a new client: {status:?}");
    drop(silent);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handshake_stalled_after_its_client_hello_is_cut_sooner_when_busy() -> anyhow::Result<()>
{
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let flags = ["--tls-handshake-timeout-ms=1500", "--max-tls-handshakes=16"];
    let allocs = one(dir.path(), &etcd, &flags).await?;
    let to = allocs.addrs[0].parse()?;
    let hello = client_hello(allocs.ids.pki.ca_file())?;
    // The ClientHello arrives at once (no hello timeout), then the client never finishes.
    let mut s = tcp_from("127.0.0.2", to).await?;
    s.write_all(&hello).await?;
    let took = closed_after(s, Duration::from_secs(5)).await;
    assert!(
        took.is_some_and(|t| t >= Duration::from_millis(1_300)),
        "a stalled handshake closed after {took:?} (--tls-handshake-timeout-ms=1500)"
    );
    assert_eq!(limited(&allocs, 0, "tls_handshake_timeout").await?, 1.0);
    assert_eq!(limited(&allocs, 0, "tls_hello_timeout").await?, 0.0);
    // With more than half of the handshake slots taken (nine silent sockets of sixteen), the
    // same handshake has only the hello timeout (1 s) to finish.
    let mut silent = Vec::new();
    for _ in 0..9 {
        silent.push(tcp_from("127.0.0.3", to).await?);
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut s = tcp_from("127.0.0.2", to).await?;
    s.write_all(&hello).await?;
    let took = closed_after(s, Duration::from_secs(5)).await;
    assert!(
        took.is_some_and(|t| t < Duration::from_millis(1_300)),
        "a stalled handshake while busy closed after {took:?} (--tls-hello-timeout-ms=1000)"
    );
    assert_eq!(limited(&allocs, 0, "tls_handshake_timeout").await?, 2.0);
    drop(silent);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_past_a_connections_streams_wait_for_one_to_close() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = one(dir.path(), &etcd, &["--max-streams-per-connection=4"]).await?;
    allocs
        .node_agent(0, "n1")?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("n1", 1, 16_000, "T4")),
        })
        .await?;
    // One client, one connection: four streams open.
    let viewer = allocs.viewer(0)?;
    let subscribe = || {
        let mut v = viewer.clone();
        async move {
            v.subscribe(api::SubscribeRequest {
                node: "n1".into(),
                from_seq: 0,
            })
            .await
        }
    };
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(subscribe().await?);
    }
    // A fifth waits in the client's queue, not refused...
    let fifth = tokio::spawn(subscribe());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !fifth.is_finished(),
        "a fifth stream on a connection of four: {:?}",
        fifth.await?.map(drop)
    );
    // ...until one of the four closes.
    drop(held.pop());
    let got = tokio::time::timeout(Duration::from_secs(5), fifth).await??;
    assert!(got.is_ok(), "the fifth stream: {:?}", got.map(drop));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stops_answering_pings_is_closed() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = one(dir.path(), &etcd, &["--keepalive-ms=1000"]).await?;
    let s = silent_h2(
        allocs.ids.pki.ca_file(),
        "127.0.0.2",
        allocs.addrs[0].parse()?,
    )
    .await?;
    // A ping after a second of silence, its answer due half a second later.
    let took = closed_after(s, Duration::from_secs(6)).await;
    assert!(
        took.is_some_and(|t| t >= Duration::from_millis(1_000)),
        "a silent HTTP/2 peer closed after {took:?} (--keepalive-ms=1000)"
    );
    Ok(())
}
