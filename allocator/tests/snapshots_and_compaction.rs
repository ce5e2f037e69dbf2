//! A new replica starts from the newest snapshot plus the log tail, even after etcd compacted
//! its history; a follower that was paused through a compaction catches up by itself.

use std::time::Duration;

use gpuledger_allocator::log::EtcdLog;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::workload::{churn, inventory};
use gpuledger_testkit::{Allocators, EtcdCluster, eventually};
use nix::sys::signal::Signal;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cold_start_from_snapshot_and_recovery_after_compaction() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = Allocators::start(
        dir.path(),
        &etcd.endpoints_flag(),
        2,
        "snap",
        &["--snapshot-every=25"],
    )?;
    let leader = allocs.wait_leader(Duration::from_secs(20)).await?;
    let follower = 1 - leader;
    allocs
        .client(leader)?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("n1", 8, 80_000, "A100")),
        })
        .await?;
    churn(&allocs, leader, "n1", 0, 60).await?;
    // Pause the follower, write more, compact all history, resume.
    allocs.procs[follower].signal(Signal::SIGSTOP)?;
    churn(&allocs, leader, "n1", 60, 60).await?;
    let client = etcd.client().await?;
    etcd.compact_all().await?;
    allocs.procs[follower].signal(Signal::SIGCONT)?;
    churn(&allocs, follower, "n1", 120, 10).await?;
    let head = allocs.status(leader).await.expect("leader").seq;
    allocs.wait_seq(head, Duration::from_secs(20)).await?;
    assert!(
        allocs
            .ledger(follower)
            .await?
            .same_state(&allocs.ledger(leader).await?)
    );

    let log = EtcdLog::new(&client, "snap", Duration::from_secs(5));
    let snaps = log.snapshot_seqs().await?;
    assert!(!snaps.is_empty(), "snapshots were written");
    // A replica prunes right after it writes: a listing between the two sees one more.
    eventually(
        "old snapshots are pruned",
        Duration::from_secs(5),
        || async { Ok(log.snapshot_seqs().await?.len() <= 2) },
    )
    .await?;
    // A brand-new replica loads the newest snapshot and the tail.
    let dir2 = tempfile::tempdir()?;
    let fresh = Allocators::start(dir2.path(), &etcd.endpoints_flag(), 1, "snap", &[])?;
    fresh.wait_seq(head, Duration::from_secs(20)).await?;
    assert!(
        fresh
            .ledger(0)
            .await?
            .same_state(&allocs.ledger(leader).await?)
    );
    let logtext = std::fs::read_to_string(fresh.procs[0].log_path())?;
    assert!(
        logtext.contains("loaded snapshot"),
        "the new replica did not start from a snapshot:\n{logtext}"
    );
    Ok(())
}
