//! Range reads of the log in etcd from any seq: the batch holding the seq comes first, then
//! every later batch in order, whether the seq starts a batch, lies inside a small one, or deep
//! inside one of thousands of events (the search for its batch widens step by step).

use std::time::Duration;

use gpuledger_allocator::log::{Commit, EtcdLog};
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::EtcdCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_from_any_seq_starts_at_the_batch_holding_it() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let client = etcd.client().await?;
    let log = EtcdLog::new(&client, "reads", Duration::from_secs(5));
    let session =
        gpuledger_allocator::election::Session::start(&client, Duration::from_secs(5)).await?;
    let key = gpuledger_allocator::election::campaign(
        &client,
        &log.election_name(),
        "me",
        session.lease_id,
    )
    .await?;
    let epoch = key.rev() as u64;
    // Batch sizes that put boundaries inside every width the search tries (1, 64, 4,096,
    // 262,144 seqs below the one read), and a batch longer than the window a bounded read
    // walks the log in (8,192 seqs), with one after it.
    let sizes = [1u64, 5, 100, 3, 70, 1, 5_000, 2, 300, 20_000, 1];
    let mut bounds = Vec::new(); // (first, last) of each batch
    let (mut seq, mut head_rev) = (1u64, 0i64);
    for n in sizes {
        let batch = pb::EventBatch {
            version: 1,
            first_seq: seq,
            epoch,
            events: (seq..seq + n)
                .map(|s| pb::Event {
                    seq: s,
                    epoch,
                    time_ms: 0,
                    body: Some(pb::event::Body::QuotaSet(pb::QuotaSet {
                        namespace: "a".into(),
                        mem_mib: s,
                        core_milli: 0,
                    })),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        let Commit::Done { head_rev: r } =
            log.commit(key.key(), key.rev(), head_rev, &batch).await?
        else {
            anyhow::bail!("commit of the batch at seq {seq} was fenced");
        };
        head_rev = r;
        bounds.push((seq, seq + n - 1));
        seq += n;
    }
    let last = seq - 1;
    // Every boundary, its neighbours, and points deep inside the big batches.
    let mut froms: Vec<u64> = bounds
        .iter()
        .flat_map(|&(a, b)| [a, a + 1, b.saturating_sub(1), b])
        .chain([bounds[6].0 + 64, bounds[6].0 + 4_096, bounds[6].1 - 65, 1])
        .filter(|&s| (1..=last).contains(&s))
        .collect();
    froms.sort_unstable();
    froms.dedup();
    for from in froms {
        let holding = bounds
            .iter()
            .position(|&(a, b)| a <= from && from <= b)
            .expect("every seq is in a batch");
        let (batches, _) = log.read(from, 0).await?;
        let got: Vec<(u64, u64)> = batches
            .iter()
            .map(|b| (b.first_seq, b.events.last().map_or(b.first_seq, |e| e.seq)))
            .collect();
        assert_eq!(
            got,
            bounds[holding..],
            "a read from seq {from} starts at its batch and reads every later one"
        );
        // Bounded: up to the batch holding `to`.
        let to = (from + 3).min(last);
        let (batches, _) = log.read(from, to).await?;
        let upto = bounds
            .iter()
            .position(|&(a, b)| a <= to && to <= b)
            .expect("to");
        assert_eq!(
            batches.iter().map(|b| b.first_seq).collect::<Vec<_>>(),
            bounds[holding..=upto]
                .iter()
                .map(|b| b.0)
                .collect::<Vec<_>>(),
            "a read of seqs {from}..={to}"
        );
    }
    // Past the head: nothing.
    assert!(log.read(last + 1, 0).await?.0.is_empty());
    Ok(())
}
