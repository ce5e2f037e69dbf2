use prost::Message;

use super::*;
use crate::chain::GENESIS;

/// Batch `first..first+n` registering one node per event, linked to `prev`.
fn batch(first: u64, n: u64, prev: &[u8]) -> pb::EventBatch {
    pb::EventBatch {
        version: 1,
        first_seq: first,
        epoch: 1,
        events: (first..first + n)
            .map(|seq| pb::Event {
                seq,
                epoch: 1,
                time_ms: 1,
                actor: None,
                body: Some(pb::event::Body::NodeRegistered(pb::NodeRegistered {
                    inventory: Some(pb::NodeInventory {
                        mode: Default::default(),
                        isolation: String::new(),
                        dra_cores: String::new(),
                        node: format!("n{seq}"),
                        gpus: vec![pb::Gpu {
                            uuid: format!("GPU-{seq}"),
                            index: 0,
                            model: "A10".into(),
                            memory_mib: 16_384,
                            healthy: true,
                            compute_capability: String::new(),
                        }],
                        cpu_milli: 0,
                        memory_mib: 0,
                    }),
                })),
            })
            .collect(),
        prev_hash: prev.to_vec(),
        stored: None,
    }
}

/// A chained log of batches of `sizes`, each stamped as an allocator replica stamps what it
/// read from etcd.
fn log(sizes: &[u64]) -> Vec<pb::EventBatch> {
    let mut out = Vec::new();
    let (mut first, mut prev) = (1, GENESIS);
    for &n in sizes {
        let mut b = batch(first, n, &prev);
        prev = hash_stored(&b.encode_to_vec());
        b.stored = Some(pb::StoredAt {
            hash: prev.to_vec(),
            location: format!("etcd /log/{first:020}"),
        });
        first += n;
        out.push(b);
    }
    out
}

/// Follow `batches` as a replica handed them by another, until the first error.
fn receive(batches: Vec<pb::EventBatch>) -> (Follower, Result<(), FollowError>) {
    let mut f = Follower::new();
    for mut b in batches {
        if let Err(e) = f.follow_received(&mut b) {
            return (f, Err(e));
        }
    }
    (f, Ok(()))
}

#[test]
fn an_untouched_log_folds_and_repeats_are_skipped() {
    let mut batches = log(&[2, 3, 1]);
    batches.insert(2, batches[1].clone());
    let mut f = Follower::new();
    let mut repeats = 0;
    for mut b in batches {
        if f.follow_received(&mut b).expect("chains") == Followed::Repeat {
            repeats += 1;
        }
    }
    assert_eq!(repeats, 1);
    assert_eq!(f.seq(), 6);
    assert_eq!(f.ledger().nodes().len(), 6);
    assert_eq!(f.chain().next_seq(), 7);
}

#[test]
fn a_batch_changed_after_it_was_hashed_is_refused_and_not_folded() {
    let mut batches = log(&[2, 2, 2]);
    // The allocator handing it on changed a GPU's memory but kept the stored stamp.
    if let Some(pb::event::Body::NodeRegistered(r)) = &mut batches[1].events[0].body
        && let Some(inv) = &mut r.inventory
    {
        inv.gpus[0].memory_mib = 81_920;
    }
    let (f, end) = receive(batches);
    let e = end.expect_err("refused");
    assert!(matches!(e, FollowError::Altered { .. }), "{e:?}");
    assert!(e.breaks_chain() && !e.is_retryable());
    let why = e.to_string();
    assert!(why.contains("seq 3") && why.contains("etcd /log/"), "{why}");
    assert_eq!(f.seq(), 2, "nothing of the changed batch folds");
}

#[test]
fn a_changed_batch_restamped_to_match_breaks_the_next_link() {
    let mut batches = log(&[2, 2, 2]);
    batches[1].events[1].time_ms = 99;
    batches[1].stored = None;
    let (f, end) = receive(batches);
    let e = end.expect_err("refused");
    assert!(e.breaks_chain(), "{e:?}");
    assert!(e.to_string().contains("broken link at seq 5"), "{e}");
    assert_eq!(f.seq(), 4);
}

#[test]
fn a_missing_batch_is_a_gap() {
    let mut batches = log(&[2, 2, 2]);
    batches.remove(1);
    let (f, end) = receive(batches);
    let e = end.expect_err("refused");
    assert!(e.breaks_chain() && e.to_string().contains("gap"), "{e}");
    assert_eq!(f.seq(), 2);
}

#[test]
fn a_snapshot_with_the_wrong_chain_hash_refuses_the_next_batch() {
    let batches = log(&[2, 2]);
    let mut f = Follower::new();
    f.follow_received(&mut batches[0].clone()).expect("chains");
    let mut snap = f.ledger().to_snapshot();
    snap.chain_hash = vec![7; 32];
    let mut wrong = Follower::from_snapshot(&snap).expect("loads");
    let e = wrong
        .follow_received(&mut batches[1].clone())
        .expect_err("refused");
    assert!(e.breaks_chain(), "{e:?}");
    snap.chain_hash = f.chain().tip().expect("tip").to_vec();
    let mut right = Follower::from_snapshot(&snap).expect("loads");
    right
        .follow_received(&mut batches[1].clone())
        .expect("chains");
    assert_eq!(right.seq(), 4);
}

#[test]
fn a_batch_that_straddles_the_seq_is_retryable_and_folds_nothing() {
    let batches = log(&[2, 2]);
    let mut f = Follower::new();
    f.follow_received(&mut batches[0].clone()).expect("chains");
    // Seqs 2..3: one folded already, one not.
    let mut straddling = batch(2, 2, &GENESIS);
    let e = f.follow_received(&mut straddling).expect_err("refused");
    assert_eq!(
        e,
        FollowError::Straddles {
            first: 2,
            last: 3,
            seq: 2
        }
    );
    assert!(e.is_retryable() && !e.breaks_chain());
    assert_eq!(f.seq(), 2);
    assert_eq!(f.chain().next_seq(), 3, "the chain did not move either");
}

#[test]
fn an_event_that_breaks_an_invariant_stops_the_fold_there() {
    let mut batches = log(&[2, 2]);
    // The same GPU registered on a second node: linked (the stamp is the bytes' hash), but the
    // fold refuses it.
    if let Some(pb::event::Body::NodeRegistered(r)) = &mut batches[1].events[1].body
        && let Some(inv) = &mut r.inventory
    {
        inv.gpus[0].uuid = "GPU-1".into();
    }
    let b = &mut batches[1];
    b.stored = None;
    let hash = hash_stored(&b.encode_to_vec());
    b.stored = Some(pb::StoredAt {
        hash: hash.to_vec(),
        location: "etcd /log/3".into(),
    });
    let (f, end) = receive(batches);
    let e = end.expect_err("refused");
    assert!(
        matches!(e, FollowError::Invariant { seq: 4, .. }),
        "refused at the event: {e:?}"
    );
    assert!(!e.is_retryable() && !e.breaks_chain());
    assert_eq!(f.seq(), 3, "the events before it folded");
}

#[test]
fn a_replica_reading_the_log_itself_links_with_the_stamp_it_made() {
    let mut batches = log(&[2, 2]);
    // Stamped with another hash than its bytes': a replica that read the bytes links with
    // its own stamp (the next link then fails), and one handed the batch refuses it at once.
    let mut stamp = batches[0].stored.clone().expect("stamped");
    stamp.hash = vec![9; 32];
    batches[0].stored = Some(stamp);
    let mut read = Follower::new();
    assert_eq!(
        read.follow_read(&batches[0]),
        Ok(Followed::Folded { hash: [9; 32] })
    );
    let e = read.follow_read(&batches[1]).expect_err("refused");
    assert!(e.to_string().contains("broken link at seq 3"), "{e}");
    let (_, end) = receive(batches);
    assert!(matches!(end, Err(FollowError::Altered { seq: 1, .. })));
}
