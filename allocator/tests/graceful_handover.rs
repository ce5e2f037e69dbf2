//! A leader that goes away hands over well before the lease TTL: on SIGTERM it resigns; when
//! SIGKILLed and restarted at once, the restarted process revokes its dead self's lease.

use std::time::{Duration, Instant};

use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::workload::{inventory, pod, reserve_retry};
use gpuledger_testkit::{Allocators, EtcdCluster, Proc};

/// Two replicas on a 10 s lease (a long lease makes the difference between handing over and
/// expiring obvious); `stop` is done to the leader. Returns how long until a Reserve went
/// through the new leader, the replicas, and the old leader's index.
async fn hand_over(
    cluster: &str,
    stop: impl FnOnce(&mut Proc) -> anyhow::Result<()>,
) -> anyhow::Result<(Duration, Allocators, usize, EtcdCluster, tempfile::TempDir)> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let mut allocs = Allocators::start(dir.path(), &etcd, 2, cluster, &["--lease-ttl=10"])?;
    let leader = allocs.wait_leader(Duration::from_secs(20)).await?;
    allocs
        .node_agent(leader, "n1")?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("n1", 1, 16_000, "T4")),
        })
        .await?;
    let t = Instant::now();
    stop(&mut allocs.procs[leader])?;
    let new = allocs
        .wait_leader_except(Duration::from_secs(20), Some(leader))
        .await?;
    let req = api::ReserveRequest {
        request: Some(pod("after", 1_000, 0)),
        node: "n1".into(),
        ttl_ms: 0,
    };
    reserve_retry(&allocs, new, req, Instant::now() + Duration::from_secs(10)).await?;
    Ok((t.elapsed(), allocs, leader, etcd, dir))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_hands_over_in_well_under_the_lease_ttl() -> anyhow::Result<()> {
    let (took, ..) = hand_over("term", |p| {
        p.terminate(Duration::from_secs(5));
        Ok(())
    })
    .await?;
    assert!(
        took < Duration::from_secs(3),
        "hand-over took {took:?} with a 10 s lease"
    );
    Ok(())
}

/// A SIGKILLed leader that comes back at once (a container restart keeps the pod's address):
/// without the revocation nobody leads for the whole 10 s TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_leader_restarted_at_once_hands_over_in_well_under_the_lease_ttl()
-> anyhow::Result<()> {
    let (took, allocs, leader, _etcd, _dir) = hand_over("crash", |p| {
        p.kill();
        p.start()
    })
    .await?;
    assert!(
        took < Duration::from_secs(5),
        "hand-over after a crash and restart took {took:?} with a 10 s lease"
    );
    // Its log says so (read until it is there).
    let said = |p: &Proc| {
        p.log_tail(200).contains(
            "revoked the election lease of an earlier process of this replica (it crashed): it led",
        )
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while !said(&allocs.procs[leader]) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        said(&allocs.procs[leader]),
        "the restarted replica does not say it revoked its dead self's lease:\n{}",
        allocs.procs[leader].log_tail(50)
    );
    Ok(())
}
