use gpuledger_ledger::Command;
use gpuledger_testkit::workload::inventory;

use super::*;

/// Batches registering nodes `from..to`, one per node, continuing `ledger`.
fn batches(ledger: &mut Ledger, from: usize, to: usize) -> Vec<pb::EventBatch> {
    (from..to)
        .map(|i| {
            let cmd = Command::RegisterNode(inventory(&format!("n{i}"), 2, 16_000, "T4"));
            let (events, _) = ledger.execute(cmd, 1, 0).expect("a valid registration");
            pb::EventBatch {
                version: 1,
                first_seq: events[0].seq,
                epoch: 1,
                events,
                ..Default::default()
            }
        })
        .collect()
}

fn fold(shared: &Shared, batches: Vec<pb::EventBatch>) {
    for b in batches {
        assert!(shared.apply_committed(b));
    }
}

#[tokio::test]
async fn a_view_holds_every_batch_folded_before_it_was_asked_for() {
    let shared = Shared::new("r".into(), "a".into());
    let mut model = Ledger::new();
    fold(&shared, batches(&mut model, 0, 5));
    let v = shared.view().await;
    assert_eq!(v.seq(), 5);
    assert!(v.same_state(&model));
    fold(&shared, batches(&mut model, 5, 7));
    assert_eq!(v.seq(), 5, "a view never changes");
    let w = shared.view().await;
    assert!(w.same_state(&model), "read-your-writes");
}

#[tokio::test]
async fn the_fold_never_waits_for_readers_and_a_publisher_waits_only_for_old_ones() {
    let shared = Shared::new("r".into(), "a".into());
    let mut model = Ledger::new();
    fold(&shared, batches(&mut model, 0, 2));
    let first = shared.view().await;
    fold(&shared, batches(&mut model, 2, 4));
    let second = shared.view().await;
    // Both copies are held now: folding goes on regardless.
    fold(&shared, batches(&mut model, 4, 6));
    assert_eq!(shared.seq(), 6);
    // A newer view needs the copy `first` still holds: its reader waits, nobody else does.
    let s = shared.clone();
    let third = tokio::spawn(async move { s.view().await.seq() });
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert!(!third.is_finished(), "the spare is still read");
    assert_eq!((first.seq(), second.seq()), (2, 4));
    drop(first);
    assert_eq!(third.await.expect("joins"), 6);
    assert!(shared.view().await.same_state(&model));
    drop(second);
}

#[tokio::test]
async fn a_reset_starts_the_views_over() {
    let shared = Shared::new("r".into(), "a".into());
    let mut model = Ledger::new();
    fold(&shared, batches(&mut model, 0, 3));
    assert_eq!(shared.view().await.seq(), 3);
    let mut other = Ledger::new();
    let _ = batches(&mut other, 10, 12);
    let loaded = Ledger::from_snapshot(&other.to_snapshot()).expect("a snapshot");
    shared.reset(loaded, &[]).await;
    assert!(shared.view().await.same_state(&other));
    fold(&shared, batches(&mut other, 12, 13));
    let v = shared.view().await;
    assert_eq!(v.seq(), 3);
    assert!(v.same_state(&other));
}

#[tokio::test(start_paused = true)]
async fn views_keep_up_when_nobody_reads() {
    let shared = Shared::new("r".into(), "a".into());
    let s = shared.clone();
    tokio::spawn(async move { s.maintain_views().await });
    let mut model = Ledger::new();
    fold(&shared, batches(&mut model, 0, 4));
    assert_eq!(shared.views.latest().seq(), 0, "published lazily");
    tokio::time::sleep(MAINTAIN_VIEWS_EVERY).await;
    assert_eq!(shared.views.latest().seq(), 4);
    assert!(
        shared.views.backlog() <= 4,
        "the backlog holds only what one copy lacks"
    );
    fold(&shared, batches(&mut model, 4, 5));
    tokio::time::sleep(MAINTAIN_VIEWS_EVERY).await;
    assert!(shared.views.latest().same_state(&model));
    assert!(
        shared.views.backlog() <= 1,
        "what both copies hold is dropped"
    );
}
