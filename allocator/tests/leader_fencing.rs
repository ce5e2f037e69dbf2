//! A leader paused past its lease (SIGSTOP) and then resumed writes nothing after a new leader
//! took over, and steps down. The fence itself is also checked directly against etcd.

use std::time::{Duration, Instant};

use gpuledger_allocator::log::{Commit, EtcdLog};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::workload::{inventory, pod, reserve_retry};
use gpuledger_testkit::{Allocators, EtcdCluster};
use nix::sys::signal::Signal;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_leader_writes_nothing_after_takeover_and_steps_down() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = Allocators::start(dir.path(), &etcd, 2, "fence", &[])?;
    let old = allocs.wait_leader(Duration::from_secs(20)).await?;
    let old_epoch = allocs.status(old).await.expect("leader").epoch;
    allocs
        .node_agent(old, "n1")?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("n1", 4, 80_000, "A100")),
        })
        .await?;

    allocs.procs[old].signal(Signal::SIGSTOP)?;
    // A request reaches the paused leader's socket; it will only see it after SIGCONT.
    let mut c = allocs.extender(old)?;
    let stale = tokio::spawn(async move {
        let r = c
            .reserve(api::ReserveRequest {
                request: Some(pod("while-paused", 1_000, 0)),
                node: "n1".into(),
                ttl_ms: 0,
            })
            .await;
        anyhow::Ok(r)
    });
    let new = allocs
        .wait_leader_except(Duration::from_secs(15), Some(old))
        .await?;
    let new_epoch = allocs.status(new).await.expect("new leader").epoch;
    assert!(
        new_epoch > old_epoch,
        "epochs increase: {old_epoch} -> {new_epoch}"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    for i in 0..20 {
        let req = api::ReserveRequest {
            request: Some(pod(&format!("after-{i}"), 1_000, 0)),
            node: "n1".into(),
            ttl_ms: 0,
        };
        reserve_retry(&allocs, new, req, deadline).await?;
    }
    allocs.procs[old].signal(Signal::SIGCONT)?;
    // Whatever the resumed process answers, it must not be a grant from the old epoch.
    if let Ok(Ok(Ok(Ok(r)))) = tokio::time::timeout(Duration::from_secs(15), stale).await {
        let r = r.into_inner();
        assert!(
            r.epoch >= new_epoch,
            "a grant acked by the deposed leader's epoch {}",
            r.epoch
        );
    }
    // It steps down.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match allocs.status(old).await {
            Some(s) if s.role == "follower" => break,
            _ if Instant::now() > deadline => panic!("the resumed old leader did not step down"),
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    // More writes through the new leader, then read the log: after the new epoch's first batch,
    // no batch carries the old epoch, and seqs are gapless.
    for i in 0..5 {
        let req = api::ReserveRequest {
            request: Some(pod(&format!("late-{i}"), 1_000, 0)),
            node: "n1".into(),
            ttl_ms: 0,
        };
        reserve_retry(&allocs, new, req, Instant::now() + Duration::from_secs(10)).await?;
    }
    let client = etcd.client().await?;
    let log = EtcdLog::new(&client, "fence", Duration::from_secs(5));
    let (batches, _) = log.read(1, 0).await?;
    let mut seen_new = false;
    let mut expect = 1;
    for b in &batches {
        for e in &b.events {
            assert_eq!(e.seq, expect, "gapless seq");
            expect += 1;
        }
        if b.epoch >= new_epoch {
            seen_new = true;
        } else {
            assert!(
                !seen_new,
                "batch at seq {} written by old epoch {} after the takeover",
                b.first_seq, b.epoch
            );
        }
    }
    assert!(seen_new);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_with_a_lost_leader_key_is_fenced() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let client = etcd.client().await?;
    let log = EtcdLog::new(&client, "fence2", Duration::from_secs(5));
    let session =
        gpuledger_allocator::election::Session::start(&client, Duration::from_secs(2)).await?;
    let key = gpuledger_allocator::election::campaign(
        &client,
        &log.election_name(),
        "me",
        session.lease_id,
    )
    .await?;
    let batch = |seq: u64| pb::EventBatch {
        version: 1,
        first_seq: seq,
        epoch: key.rev() as u64,
        events: vec![pb::Event {
            seq,
            epoch: key.rev() as u64,
            time_ms: 0,
            body: Some(pb::event::Body::QuotaSet(pb::QuotaSet {
                namespace: "a".into(),
                mem_mib: seq,
                core_milli: 0,
            })),
            ..Default::default()
        }],
        ..Default::default()
    };
    let Commit::Done { head_rev } = log.commit(key.key(), key.rev(), 0, &batch(1)).await? else {
        panic!("the first fenced commit should succeed");
    };
    // A stale head revision is refused…
    assert!(matches!(
        log.commit(key.key(), key.rev(), 0, &batch(2)).await?,
        Commit::Fenced
    ));
    // …and so is any write once the leader key is gone (lease revoked = deposed).
    session.revoke(&client).await;
    assert!(matches!(
        log.commit(key.key(), key.rev(), head_rev, &batch(2))
            .await?,
        Commit::Fenced
    ));
    assert_eq!(log.head().await?.seq, 1);
    Ok(())
}
