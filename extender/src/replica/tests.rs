use gpuledger_ledger::chain::{GENESIS, hash_stored};
use gpuledger_ledger::{Command, pb};
use gpuledger_testkit::workload::inventory;
use prost::Message;

use super::*;
use api::replicate_response::Body;

/// A chained log of batches of `sizes`, each registering one node per event as the leader
/// writes it.
fn log(sizes: &[u64]) -> Vec<pb::EventBatch> {
    let (mut leader, mut prev) = (Ledger::new(), GENESIS);
    let mut out = Vec::new();
    for &n in sizes {
        let mut events = Vec::new();
        for _ in 0..n {
            let node = format!("n{}", leader.seq() + 1);
            let cmd = Command::RegisterNode(inventory(&node, 1, 16_384, "A10"));
            let (evs, _) = leader.execute(cmd, 1, 1).expect("a valid registration");
            events.extend(evs);
        }
        let b = pb::EventBatch {
            version: 1,
            first_seq: events[0].seq,
            epoch: 1,
            events,
            prev_hash: prev.to_vec(),
            stored: None,
        };
        prev = hash_stored(&b.encode_to_vec());
        out.push(b);
    }
    out
}

fn msg(body: Body) -> api::ReplicateResponse {
    api::ReplicateResponse {
        epoch: 1,
        body: Some(body),
    }
}

/// A replica that has loaded the empty ledger's snapshot, and its fold's state.
async fn synced() -> (Arc<Replica>, Option<Follower>, u64) {
    let r = Replica::new(Duration::from_secs(60));
    let (mut follower, mut max_epoch) = (None, 0);
    r.fold(
        msg(Body::Snapshot(Ledger::new().to_snapshot())),
        &mut follower,
        &mut max_epoch,
    )
    .await
    .expect("the snapshot loads");
    (r, follower, max_epoch)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filter_holding_its_view_does_not_delay_the_fold() {
    let (r, mut follower, mut max_epoch) = synced().await;
    let publisher = r.clone();
    tokio::spawn(async move { publisher.views.maintain(Duration::ZERO).await });
    let batches = log(&[2, 2, 2, 2]);
    r.fold(
        msg(Body::Batch(batches[0].clone())),
        &mut follower,
        &mut max_epoch,
    )
    .await
    .expect("folds");
    r.note_write(2);
    // A filter that holds its view until it is told to let go.
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let reader = r.clone();
    let filter = tokio::spawn(async move {
        reader
            .read("filter", move |l, _| {
                let _ = started_tx.send(());
                let _ = release_rx.recv();
                Some(l.seq())
            })
            .await
    });
    started_rx.await.expect("the filter runs");
    for b in &batches[1..] {
        let fold = r.fold(msg(Body::Batch(b.clone())), &mut follower, &mut max_epoch);
        tokio::time::timeout(Duration::from_secs(5), fold)
            .await
            .expect("the fold does not wait for the filter")
            .expect("folds");
    }
    assert_eq!(follower.as_ref().map(Follower::seq), Some(8));
    release_tx.send(()).expect("the filter waits");
    assert_eq!(
        filter.await.expect("joins"),
        Some(2),
        "a view never changes"
    );
    r.note_write(8);
    assert_eq!(r.read("filter", |l, _| Some(l.seq())).await, Some(8));
}

#[tokio::test]
async fn a_batch_that_breaks_the_chain_is_refused_and_the_replica_answers_nothing() {
    let (r, mut follower, mut max_epoch) = synced().await;
    let mut batches = log(&[2, 2]);
    r.fold(
        msg(Body::Batch(batches[0].clone())),
        &mut follower,
        &mut max_epoch,
    )
    .await
    .expect("folds");
    r.note_write(2);
    assert_eq!(r.read("filter", |l, _| Some(l.seq())).await, Some(2));
    batches[1].prev_hash = vec![7; 32];
    let end = r
        .fold(
            msg(Body::Batch(batches[1].clone())),
            &mut follower,
            &mut max_epoch,
        )
        .await;
    assert!(matches!(end, Err(StreamEnd::ChainBroken(_))), "{end:?}");
    r.drop_state(&mut follower);
    assert_eq!(r.read("filter", |l, _| Some(l.seq())).await, None);
    assert_eq!(r.seq(), 0);
}
