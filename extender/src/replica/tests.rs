use gpuledger_ledger::chain::GENESIS;

use super::*;

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
                        node: format!("n{seq}"),
                        gpus: vec![pb::Gpu {
                            uuid: format!("GPU-{seq}"),
                            index: 0,
                            model: "A10".into(),
                            memory_mib: 16_384,
                            healthy: true,
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

fn follow(batches: Vec<pb::EventBatch>) -> (Ledger, Chain, Result<(), StreamEnd>) {
    let (mut l, mut c) = (Ledger::new(), Chain::new());
    let mut end = Ok(());
    for b in batches {
        end = fold_batch(&mut l, &mut c, b);
        if end.is_err() {
            break;
        }
    }
    (l, c, end)
}

#[test]
fn an_untouched_log_folds_and_repeats_are_skipped() {
    let mut batches = log(&[2, 3, 1]);
    batches.insert(2, batches[1].clone());
    let (l, c, end) = follow(batches);
    end.expect("chains");
    assert_eq!(l.seq(), 6);
    assert_eq!(l.nodes().len(), 6);
    assert_eq!(c.next_seq(), 7);
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
    let (l, _, end) = follow(batches);
    let Err(StreamEnd::ChainBroken(why)) = end else {
        panic!("refused as a chain break, got {end:?}");
    };
    assert!(why.contains("seq 3") && why.contains("etcd /log/"), "{why}");
    assert_eq!(l.seq(), 2, "nothing of the changed batch folds");
}

#[test]
fn a_changed_batch_restamped_to_match_breaks_the_next_link() {
    let mut batches = log(&[2, 2, 2]);
    batches[1].events[1].time_ms = 99;
    batches[1].stored = None;
    let (l, _, end) = follow(batches);
    let Err(StreamEnd::ChainBroken(why)) = end else {
        panic!("refused as a chain break, got {end:?}");
    };
    assert!(why.contains("broken link at seq 5"), "{why}");
    assert_eq!(l.seq(), 4);
}

#[test]
fn a_missing_batch_is_a_gap() {
    let mut batches = log(&[2, 2, 2]);
    batches.remove(1);
    let (l, _, end) = follow(batches);
    let Err(StreamEnd::ChainBroken(why)) = end else {
        panic!("refused as a chain break, got {end:?}");
    };
    assert!(why.contains("gap"), "{why}");
    assert_eq!(l.seq(), 2);
}

#[test]
fn a_snapshot_with_the_wrong_chain_hash_refuses_the_next_batch() {
    let batches = log(&[2, 2]);
    let mut l = Ledger::new();
    let mut c = Chain::new();
    fold_batch(&mut l, &mut c, batches[0].clone()).expect("chains");
    let snap = l.to_snapshot();
    let mut resumed = Ledger::from_snapshot(&snap).expect("loads");
    let mut wrong = Chain::resume(resumed.seq(), &[7; 32]);
    let end = fold_batch(&mut resumed, &mut wrong, batches[1].clone());
    assert!(matches!(end, Err(StreamEnd::ChainBroken(_))), "{end:?}");
    let mut right = Chain::resume(resumed.seq(), &c.tip().expect("tip"));
    fold_batch(&mut resumed, &mut right, batches[1].clone()).expect("chains");
    assert_eq!(resumed.seq(), 4);
}
