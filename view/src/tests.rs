use super::*;

/// A state that records the changes replayed into it.
#[derive(Debug, Clone, Default, PartialEq)]
struct Log(Vec<u64>);

impl Replay for Log {
    type Change = u64;
    fn replay(&mut self, change: &u64) {
        self.0.push(*change);
    }
}

/// The fold's side: its own state and the views that follow it.
struct Fold {
    own: Log,
    views: Views<Log>,
}

impl Fold {
    fn new() -> Self {
        Fold {
            own: Log::default(),
            views: Views::new(&Log::default()),
        }
    }

    fn commit(&mut self, from: u64, to: u64) {
        for c in from..to {
            self.own.replay(&c);
            self.views.committed(Arc::new(c));
        }
    }
}

#[tokio::test]
async fn a_view_holds_every_change_committed_before_it_was_asked_for() {
    let mut f = Fold::new();
    f.commit(0, 5);
    let v = f.views.current().await;
    assert_eq!(*v, f.own);
    f.commit(5, 7);
    assert_eq!(v.0.len(), 5, "a view never changes");
    assert_eq!(*f.views.current().await, f.own, "read-your-writes");
}

#[tokio::test]
async fn the_fold_never_waits_for_readers_and_a_publisher_waits_only_for_old_ones() {
    let mut f = Fold::new();
    f.commit(0, 2);
    let first = f.views.current().await;
    f.commit(2, 4);
    let second = f.views.current().await;
    // Both copies are held now: committing goes on regardless.
    f.commit(4, 6);
    let f = Arc::new(f);
    // A newer view needs the copy `first` still holds: its reader waits, nobody else does.
    let g = f.clone();
    let third = tokio::spawn(async move { g.views.current().await.0.len() });
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert!(!third.is_finished(), "the spare is still read");
    assert_eq!(
        f.views.latest().0.len(),
        4,
        "the published view is still there"
    );
    assert_eq!((first.0.len(), second.0.len()), (2, 4));
    drop(first);
    assert_eq!(third.await.expect("joins"), 6);
    assert_eq!(*f.views.current().await, f.own);
    drop(second);
}

#[tokio::test]
async fn a_view_that_will_do_is_taken_as_it_is() {
    let mut f = Fold::new();
    f.commit(0, 3);
    let old = f.views.current().await;
    f.commit(3, 5);
    let v = f.views.at_least(|l| l.0.len() >= 3).await;
    assert_eq!(v.0.len(), 3, "nothing was published for it");
    drop(v);
    let v = f.views.at_least(|l| l.0.len() >= 5).await;
    assert_eq!(*v, f.own);
    drop(old);
}

#[tokio::test]
async fn a_reset_starts_the_views_over() {
    let mut f = Fold::new();
    f.commit(0, 3);
    assert_eq!(f.views.current().await.0.len(), 3);
    f.own = Log(vec![10, 11]);
    f.views.reset(&f.own).await;
    assert_eq!(*f.views.current().await, f.own);
    f.commit(12, 13);
    assert_eq!(*f.views.current().await, f.own);
    f.commit(13, 15);
    assert_eq!(*f.views.current().await, f.own, "both copies follow");
    assert_eq!(*f.views.current().await, Log(vec![10, 11, 12, 13, 14]));
}

#[tokio::test(start_paused = true)]
async fn views_keep_up_every_period_when_nobody_reads() {
    let views = Arc::new(Views::new(&Log::default()));
    let v = views.clone();
    let every = Duration::from_millis(100);
    tokio::spawn(async move { v.maintain(every).await });
    for c in 0..4 {
        views.committed(Arc::new(c));
    }
    assert!(views.latest().0.is_empty(), "published lazily");
    tokio::time::sleep(every).await;
    assert_eq!(views.latest().0.len(), 4);
    assert!(
        views.backlog() <= 4,
        "the backlog holds only what one copy lacks"
    );
    views.committed(Arc::new(4));
    tokio::time::sleep(every + every / 2).await;
    assert_eq!(views.latest().0, [0, 1, 2, 3, 4]);
    assert!(views.backlog() <= 1, "what both copies hold is dropped");
}

#[tokio::test]
async fn views_are_published_as_soon_as_a_change_is_committed() {
    let views = Arc::new(Views::new(&Log::default()));
    let v = views.clone();
    tokio::spawn(async move { v.maintain(Duration::ZERO).await });
    for c in 0..3 {
        views.committed(Arc::new(c));
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            views.latest().0.len() as u64,
            c + 1,
            "published without a reader"
        );
    }
}

#[test]
fn a_ledger_copy_stops_where_the_fold_stopped() {
    let ev = |seq: u64, epoch: u64| pb::Event {
        seq,
        epoch,
        time_ms: 1,
        actor: None,
        body: Some(pb::event::Body::QuotaSet(pb::QuotaSet {
            namespace: format!("ns{seq}"),
            mem_mib: 1024,
            core_milli: 0,
        })),
    };
    let batch = |events: Vec<pb::Event>| pb::EventBatch {
        first_seq: events[0].seq,
        events,
        ..Default::default()
    };
    let mut l = Ledger::new();
    l.replay(&batch(vec![ev(1, 2), ev(2, 2)]));
    // Epoch 1 after epoch 2: refused, and so is what follows it in the batch.
    l.replay(&batch(vec![ev(3, 2), ev(4, 1), ev(5, 2)]));
    assert_eq!(l.seq(), 3);
    // A repeat changes nothing.
    l.replay(&batch(vec![ev(3, 2)]));
    assert_eq!(l.seq(), 3);
}
