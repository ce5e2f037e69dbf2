//! etcd's size stays bounded: the leader moves old batches to the archive (`--archive-dir`)
//! and deletes them from etcd. Every replica still reads the whole history, archive and etcd
//! as one; replaying it gives the live state; a follower paused past the trimmed point (and
//! a compaction) reloads from the newest snapshot; a new replica starts as before.

use std::time::Duration;

use gpuledger_allocator::archive::Archive;
use gpuledger_allocator::log::{EtcdLog, LogError};
use gpuledger_allocator::shared::Shared;
use gpuledger_allocator::tail;
use gpuledger_ledger::{Ledger, pb};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::workload::{churn, inventory};
use gpuledger_testkit::{Allocators, EtcdCluster, eventually};
use nix::sys::signal::Signal;

/// Every batch `ReadLog` streams from replica `i` for `from..=to`.
async fn read_log(
    allocs: &Allocators,
    i: usize,
    from: u64,
    to: u64,
) -> Result<Vec<pb::EventBatch>, tonic::Status> {
    let mut s = allocs
        .client(i)
        .map_err(|e| tonic::Status::internal(e.to_string()))?
        .read_log(api::ReadLogRequest {
            from_seq: from,
            to_seq: to,
        })
        .await?
        .into_inner();
    let mut out = Vec::new();
    while let Some(b) = s.message().await? {
        out.push(b);
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_archive_bounds_etcd_and_history_stays_whole() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let archive_dir = dir.path().join("archive");
    let archive_flag = format!("--archive-dir={}", archive_dir.display());
    let flags = [
        "--snapshot-every=20",
        "--log-retain-events=10",
        "--archive-interval-ms=100",
        archive_flag.as_str(),
    ];
    let allocs = Allocators::start(dir.path(), &etcd.endpoints_flag(), 2, "arch", &flags)?;
    let leader = allocs.wait_leader(Duration::from_secs(20)).await?;
    let follower = 1 - leader;
    allocs
        .client(leader)?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("n1", 8, 80_000, "A100")),
        })
        .await?;
    churn(&allocs, leader, "n1", 0, 40).await?;

    // The follower sleeps through archiving and a compaction: its watch cannot replay what
    // it missed, and etcd no longer holds the batches after its seq.
    let paused_at = allocs.status(follower).await.expect("follower").seq;
    allocs.procs[follower].signal(Signal::SIGSTOP)?;
    churn(&allocs, leader, "n1", 40, 120).await?;
    let client = etcd.client().await?;
    let log = EtcdLog::new(&client, "arch", Duration::from_secs(5));
    eventually(
        "etcd's log is trimmed past the paused follower",
        Duration::from_secs(20),
        || async { Ok(log.first_seq().await?.is_some_and(|f| f > paused_at + 1)) },
    )
    .await?;
    etcd.compact_all().await?;
    allocs.procs[follower].signal(Signal::SIGCONT)?;
    churn(&allocs, leader, "n1", 160, 20).await?;
    let head = allocs.status(leader).await.expect("leader").seq;
    allocs.wait_seq(head, Duration::from_secs(20)).await?;
    let live = allocs.ledger(leader).await?;
    assert!(allocs.ledger(follower).await?.same_state(&live));

    // etcd keeps a bounded tail; the archive holds the rest, gapless. The leader goes on
    // trimming meanwhile, so read etcd's first seq before the archive's last (batches leave
    // etcd only after they are archived): no seq may fall between the two.
    let archive = Archive::open(&archive_dir)?;
    let first = log.first_seq().await?.expect("etcd keeps the tail");
    let archived = archive.last_seq()?;
    assert!(
        first <= archived + 1,
        "etcd's log starts at {first}, but the archive ends at {archived}"
    );
    assert!(
        head - archived < head / 2,
        "most of the log left etcd: archived to {archived} of {head}"
    );

    // The whole history, through either replica: gapless from 1, and replaying it from empty
    // gives the live state.
    for i in [leader, follower] {
        let batches = read_log(&allocs, i, 1, 0).await?;
        let seqs: Vec<u64> = batches
            .iter()
            .flat_map(|b| b.events.iter().map(|e| e.seq))
            .collect();
        assert_eq!(seqs, (1..=head).collect::<Vec<_>>(), "replica {i}");
        let mut replayed = Ledger::new();
        for e in batches.iter().flat_map(|b| &b.events) {
            replayed.apply(e).map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        assert!(
            replayed.same_state(&live),
            "replay equals live (replica {i})"
        );
    }
    // A range that straddles archive and etcd.
    let mid = read_log(&allocs, leader, archived - 2, archived + 2).await?;
    let seqs: Vec<u64> = mid
        .iter()
        .flat_map(|b| b.events.iter().map(|e| e.seq))
        .collect();
    assert!(seqs.contains(&(archived - 2)) && seqs.contains(&(archived + 2)));
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");

    // A replica that needs seqs etcd no longer holds never folds across the hole: without
    // the archive it says so; with it, it fills the hole from there.
    let shared = Shared::new("probe".into(), "127.0.0.1:1".into());
    match tail::catch_up(&shared, &log, None).await {
        // etcd's log only moves forward while the leader trims.
        Err(LogError::Archived {
            needed: 1,
            first: f,
        }) => assert!(f >= first, "{f} < {first}"),
        other => panic!("expected LogError::Archived, got {other:?}"),
    }
    assert_eq!(shared.seq(), 0, "nothing folded across the hole");
    tail::catch_up(&shared, &log, Some(&archive)).await?;
    assert!(
        shared.view().await.same_state(&live),
        "archive + etcd = live"
    );
    // A new replica told to ignore snapshots loads the whole history the same way.
    let dir3 = tempfile::tempdir()?;
    let replayer = Allocators::start(
        dir3.path(),
        &etcd.endpoints_flag(),
        1,
        "arch",
        &["--ignore-snapshots", archive_flag.as_str()],
    )?;
    replayer.wait_seq(head, Duration::from_secs(20)).await?;
    assert!(replayer.ledger(0).await?.same_state(&live));

    // A replica without the archive says where the history went instead of skipping it.
    let dir2 = tempfile::tempdir()?;
    let blind = Allocators::start(dir2.path(), &etcd.endpoints_flag(), 1, "arch", &[])?;
    blind.wait_seq(head, Duration::from_secs(20)).await?;
    let err = read_log(&blind, 0, 1, 0)
        .await
        .expect_err("history before etcd's tail needs the archive");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
    assert!(err.message().contains("--archive-dir"), "{err}");
    assert!(
        blind.ledger(0).await?.same_state(&live),
        "it still starts from snapshot + tail"
    );
    Ok(())
}
