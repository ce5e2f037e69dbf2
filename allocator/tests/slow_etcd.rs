//! A slow etcd, not a full or dead one: the only member stops answering (SIGSTOP) for a moment
//! shorter than the lease, then for longer, while a client keeps reserving. What happens: no
//! allocator exits, every reservation either succeeds or gets a retryable error (never a grant
//! lost or given twice), readiness says why while etcd is away, and writes resume by themselves
//! within a few seconds of etcd answering again, with every replica folding the same ledger.

use std::time::{Duration, Instant};

use gpuledger_client::is_retryable as retryable;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::workload::{inventory, pod};
use gpuledger_testkit::{Allocators, EtcdCluster};
use nix::sys::signal::Signal;

use crate::support::wait_until;

/// Reserve pods `prefix-<i>` through replica `via` for `for_`, one after another; how many
/// were granted and how many refused with a retryable error (anything else fails the test).
async fn reserve_for(
    allocs: &Allocators,
    via: usize,
    prefix: &str,
    for_: Duration,
) -> anyhow::Result<(u32, u32)> {
    let mut c = allocs.extender(via)?;
    let (mut ok, mut retry) = (0, 0);
    let t0 = Instant::now();
    let mut i = 0;
    while t0.elapsed() < for_ {
        let mut req = tonic::Request::new(api::ReserveRequest {
            request: Some(pod(&format!("{prefix}-{i}"), 100, 0)),
            node: "n1".into(),
            ttl_ms: 600_000,
        });
        req.set_timeout(Duration::from_secs(3));
        match c.reserve(req).await {
            Ok(_) => ok += 1,
            Err(s) if retryable(&s) => retry += 1,
            Err(s) => anyhow::bail!("reservation {prefix}-{i}: not retryable: {s:?}"),
        }
        i += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok((ok, retry))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_etcd_delays_writes_and_the_ledger_recovers_by_itself() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let mut allocs = Allocators::start(dir.path(), &etcd, 2, "slow", &[])?;
    let leader = allocs.wait_leader(Duration::from_secs(20)).await?;
    allocs
        .node_agent(leader, "n1")?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("n1", 8, 80_000, "A100")),
        })
        .await?;
    let member = etcd.member(0).expect("one member");

    for (pause, what) in [
        (Duration::from_millis(800), "shorter than the lease"),
        (Duration::from_millis(3500), "longer than the lease"),
    ] {
        let client = reserve_for(&allocs, leader, what, pause + Duration::from_secs(2));
        let stall = async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            member.signal(Signal::SIGSTOP)?;
            tokio::time::sleep(pause).await;
            member.signal(Signal::SIGCONT)?;
            anyhow::Ok(())
        };
        let ((granted, retried), ()) = tokio::try_join!(client, stall)?;
        println!("etcd paused {pause:?} ({what}): {granted} granted, {retried} told to retry");
        // Writes resume by themselves.
        let resumed = wait_until(
            &format!("a reservation after etcd was paused {what}"),
            Duration::from_secs(15),
            || async {
                let mut c = allocs.extender(0)?;
                let r = c
                    .reserve(api::ReserveRequest {
                        request: Some(pod(&format!("after-{what}"), 100, 0)),
                        node: "n1".into(),
                        ttl_ms: 600_000,
                    })
                    .await;
                Ok(r.is_ok())
            },
        )
        .await?;
        println!("  writes resumed {resumed:?} after etcd answered again");
        for (i, p) in allocs.procs.iter_mut().enumerate() {
            assert!(p.exited().is_none(), "allocator {i} exited");
        }
    }

    // Every replica folds the same ledger, and it holds its invariants.
    allocs.wait_caught_up(Duration::from_secs(10)).await?;
    let (a, b) = (allocs.ledger(0).await?, allocs.ledger(1).await?);
    a.check().map_err(anyhow::Error::msg)?;
    assert!(
        a.same_state(&b),
        "the replicas disagree after etcd was slow"
    );
    // Each granted pod holds exactly one allocation (idempotent retries, nothing granted twice).
    let mut uids: Vec<&str> = a.allocs().values().map(|x| x.pod.uid.as_str()).collect();
    let n = uids.len();
    uids.sort_unstable();
    uids.dedup();
    assert_eq!(uids.len(), n, "a pod holds two allocations");
    Ok(())
}
