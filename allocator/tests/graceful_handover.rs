//! SIGTERM on the leader resigns at once: a follower leads well before the lease TTL.

use std::time::{Duration, Instant};

use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::workload::{inventory, pod, reserve_retry};
use gpuledger_testkit::{Allocators, EtcdCluster};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_hands_over_in_well_under_the_lease_ttl() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    // A long lease makes the difference between resigning and expiring obvious.
    let mut allocs = Allocators::start(
        dir.path(),
        &etcd.endpoints_flag(),
        2,
        "term",
        &["--lease-ttl=10"],
    )?;
    let leader = allocs.wait_leader(Duration::from_secs(20)).await?;
    allocs
        .client(leader)?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("n1", 1, 16_000, "T4")),
        })
        .await?;
    let t = Instant::now();
    allocs.procs[leader].terminate(Duration::from_secs(5));
    let new = allocs
        .wait_leader_except(Duration::from_secs(20), Some(leader))
        .await?;
    let req = api::ReserveRequest {
        request: Some(pod("after-term", 1_000, 0)),
        node: "n1".into(),
        ttl_ms: 0,
    };
    reserve_retry(
        &allocs.addrs,
        new,
        req,
        Instant::now() + Duration::from_secs(10),
    )
    .await?;
    let took = t.elapsed();
    assert!(
        took < Duration::from_secs(3),
        "hand-over took {took:?} with a 10 s lease"
    );
    Ok(())
}
