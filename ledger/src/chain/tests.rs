use prost::Message;

use super::*;

fn batch(first: u64, n: u64, prev: &[u8]) -> pb::EventBatch {
    pb::EventBatch {
        version: 1,
        first_seq: first,
        epoch: 3,
        events: (first..first + n)
            .map(|seq| pb::Event {
                seq,
                epoch: 3,
                ..Default::default()
            })
            .collect(),
        prev_hash: prev.to_vec(),
        stored: None,
    }
}

/// A chained log of `sizes` batches, as stored bytes.
fn log(sizes: &[u64]) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = Vec::new();
    let mut first = 1;
    let mut prev = GENESIS;
    for &n in sizes {
        let bytes = batch(first, n, &prev).encode_to_vec();
        prev = hash_stored(&bytes);
        first += n;
        out.push(bytes);
    }
    out
}

fn walk(stored: &[Vec<u8>]) -> Result<Chain, ChainError> {
    let mut c = Chain::new();
    for b in stored {
        let decoded = pb::EventBatch::decode(b.as_slice()).expect("decodes");
        c.link(&decoded, hash_stored(b))?;
    }
    Ok(c)
}

#[test]
fn an_untouched_log_chains_and_its_tip_is_the_last_hash() {
    let stored = log(&[1, 3, 2]);
    let c = walk(&stored).expect("chains");
    assert_eq!(c.next_seq(), 7);
    assert_eq!(c.tip(), Some(hash_stored(&stored[2])));
    assert_eq!(c.unchained_until(), 0);
    c.check_head(&hash_stored(&stored[2]))
        .expect("head matches");
    assert!(c.check_head(&hash_stored(&stored[1])).is_err());
}

#[test]
fn every_flipped_byte_of_a_batch_breaks_the_next_link() {
    let stored = log(&[2, 2, 2]);
    for i in 0..stored[1].len() {
        let mut t = stored.clone();
        t[1][i] ^= 0x01;
        let Ok(decoded) = pb::EventBatch::decode(t[1].as_slice()) else {
            continue; // a store that does not decode is refused before the chain
        };
        let mut c = Chain::new();
        let first = pb::EventBatch::decode(t[0].as_slice()).expect("decodes");
        c.link(&first, hash_stored(&t[0]))
            .expect("first is untouched");
        let r = c.link(&decoded, hash_stored(&t[1])).and_then(|()| {
            let third = pb::EventBatch::decode(t[2].as_slice()).expect("decodes");
            c.link(&third, hash_stored(&t[2]))
        });
        assert!(r.is_err(), "flipping byte {i} went unnoticed");
    }
}

#[test]
fn a_removed_batch_is_a_gap_named_by_its_seqs() {
    let mut stored = log(&[1, 3, 2]);
    stored.remove(1);
    let err = walk(&stored).expect_err("a gap");
    assert_eq!(
        err,
        ChainError::Gap {
            expected: 2,
            found: 5
        }
    );
    assert!(err.to_string().contains("seqs 2..4 are missing"), "{err}");
}

#[test]
fn a_stripped_link_after_the_chain_began_is_refused() {
    let mut stored = log(&[1, 1, 1]);
    let mut b = pb::EventBatch::decode(stored[2].as_slice()).expect("decodes");
    b.prev_hash.clear();
    stored[2] = b.encode_to_vec();
    assert_eq!(
        walk(&stored).expect_err("unlinked"),
        ChainError::Unlinked(3)
    );
}

#[test]
fn a_log_that_starts_unchained_is_accepted_up_to_its_first_link() {
    let old1 = batch(1, 2, &[]).encode_to_vec();
    let old2 = batch(3, 1, &[]).encode_to_vec();
    let new = batch(4, 1, &hash_stored(&old2)).encode_to_vec();
    let c = walk(&[old1.clone(), old2.clone(), new.clone()]).expect("an upgrade chains");
    assert_eq!(c.unchained_until(), 3);
    // Changing the last unchained batch breaks the first link.
    let mut t = old2.clone();
    let end = t.len() - 1;
    t[end] ^= 0x02;
    assert!(matches!(
        walk(&[old1, t, new]),
        Err(ChainError::Broken { seq: 4, .. })
    ));
}

#[test]
fn a_chain_resumed_from_a_snapshot_checks_the_next_link() {
    let stored = log(&[2, 2]);
    let b = pb::EventBatch::decode(stored[1].as_slice()).expect("decodes");
    let mut good = Chain::resume(2, &hash_stored(&stored[0]));
    good.link(&b, hash_stored(&stored[1])).expect("links");
    let mut bad = Chain::resume(2, &hash_stored(b"another state"));
    assert!(matches!(
        bad.link(&b, hash_stored(&stored[1])),
        Err(ChainError::Broken { seq: 3, .. })
    ));
    // A snapshot from before chaining: the next link is taken as it is.
    let mut unknown = Chain::resume(2, &[]);
    unknown.link(&b, hash_stored(&stored[1])).expect("links");
}
