//! The log is hash-chained from seq 1 through the archive and etcd: `gpuledger verify` passes
//! on an untouched log and names the first batch that breaks the chain when one byte of an
//! archived batch, of a batch in etcd or of a stored snapshot's state is flipped, or a batch
//! is deleted; a replica loading such a log (or a snapshot whose chain hash was changed)
//! refuses to fold it.

use std::time::Duration;

use gpuledger_allocator::archive::Archive;
use gpuledger_allocator::log::EtcdLog;
use gpuledger_allocator::shared::Shared;
use gpuledger_allocator::tail;
use gpuledger_auth::identity::Role;
use gpuledger_ledger::Ledger;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::pki::credential_flags;
use gpuledger_testkit::workload::{churn, inventory};
use gpuledger_testkit::{Allocators, EtcdCluster, eventually};
use prost::Message;

use crate::kit;
use kit::ctl;

/// `bytes` with one bit flipped inside its events, where the result still decodes to a batch
/// of the same seqs and link (a flip that does not decode is refused before any chain check).
fn flip_one_byte(bytes: &[u8]) -> Vec<u8> {
    let b = pb::EventBatch::decode(bytes).expect("a stored batch decodes");
    for i in (bytes.len() / 3..bytes.len()).rev() {
        let mut t = bytes.to_vec();
        t[i] ^= 0x01;
        if let Ok(d) = pb::EventBatch::decode(t.as_slice())
            && d.first_seq == b.first_seq
            && d.prev_hash == b.prev_hash
            && d.events.len() == b.events.len()
            && d != b
        {
            return t;
        }
    }
    panic!("no byte of the batch flips into another valid batch");
}

/// `bytes` of a stored snapshot with one bit flipped in its state: it still decodes and loads,
/// at the same seq and chain hash, into a different state.
fn flip_snapshot_byte(bytes: &[u8]) -> Vec<u8> {
    let s = pb::Snapshot::decode(bytes).expect("a stored snapshot decodes");
    let l = Ledger::from_snapshot(&s).expect("a stored snapshot loads");
    for i in (bytes.len() / 2..bytes.len()).rev() {
        let mut t = bytes.to_vec();
        t[i] ^= 0x01;
        if let Ok(d) = pb::Snapshot::decode(t.as_slice())
            && d.seq == s.seq
            && d.chain_hash == s.chain_hash
            && Ledger::from_snapshot(&d).is_ok_and(|m| !m.same_state(&l))
        {
            return t;
        }
    }
    panic!("no byte of the snapshot flips into another valid state");
}

/// Why replica state `shared` stopped folding.
fn broken(shared: &Shared) -> String {
    shared
        .health
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .broken
        .clone()
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_byte_or_a_deleted_batch_breaks_the_chain_and_is_named() -> anyhow::Result<()> {
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
    let mut allocs = Allocators::start(dir.path(), &etcd, 2, "chain", &flags)?;
    let first = allocs.wait_leader(Duration::from_secs(20)).await?;
    allocs
        .node_agent(first, "n1")?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("n1", 8, 80_000, "A100")),
        })
        .await?;
    churn(&allocs, first, "n1", 0, 30).await?;
    // A failover: the new leader continues the chain from the head's hash.
    allocs.procs[first].kill();
    let leader = allocs
        .wait_leader_except(Duration::from_secs(20), Some(first))
        .await?;
    churn(&allocs, leader, "n1", 30, 30).await?;
    let client = etcd.client().await?;
    let log = EtcdLog::new(&client, "chain", Duration::from_secs(5));
    let archive = Archive::open(&archive_dir)?;
    eventually(
        "part of the log is archived",
        Duration::from_secs(20),
        || async { Ok(archive.segments()?.len() >= 2) },
    )
    .await?;
    // A few more batches after the newest snapshot, then the trimming settles.
    churn(&allocs, leader, "n1", 60, 4).await?;
    let head = allocs.status(leader).await.expect("leader").seq;
    allocs.wait_seq(head, Duration::from_secs(20)).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let target = format!("--allocator={}", allocs.addrs[leader]);
    let who = credential_flags(&allocs.ids.credentials(&Role::Viewer)?);
    let mut kv = client.kv_client();

    let (ok, out) = ctl(&who, &["verify", &target]);
    assert!(ok, "verify of an untouched log failed:\n{out}");
    assert!(out.contains("every batch links"), "{out}");
    assert!(
        out.contains("stored snapshot(s)") && !out.contains(" and 0 stored snapshot"),
        "verify checks the stored snapshots:\n{out}"
    );

    // One byte of a stored snapshot's state (its chain hash untouched).
    let snap_seq = *log.snapshot_seqs().await?.last().expect("a snapshot");
    let part = format!("/gpuledger/chain/snapdata/{snap_seq:020}/0000");
    let original_snap = kv
        .get(part.clone(), None)
        .await?
        .kvs()
        .first()
        .expect("the snapshot's first part")
        .value()
        .to_vec();
    kv.put(part.clone(), flip_snapshot_byte(&original_snap), None)
        .await?;
    let (ok, out) = ctl(&who, &["verify", &target]);
    assert!(
        !ok,
        "verify passed with a flipped byte in a snapshot:\n{out}"
    );
    assert!(
        out.contains(&format!(
            "DIFFERENCE snapshot at seq {snap_seq} (etcd {part})"
        )),
        "names the snapshot:\n{out}"
    );
    kv.put(part, original_snap, None).await?;
    let (ok, out) = ctl(&who, &["verify", &target]);
    assert!(ok, "verify of the restored snapshot failed:\n{out}");

    // One byte of a batch in etcd (not the newest: the batch after it carries its hash).
    let in_etcd = log.read_stored(head.saturating_sub(5), 0).await?;
    assert!(in_etcd.len() >= 3, "etcd keeps a tail of batches");
    let (victim, original) = &in_etcd[in_etcd.len() - 2];
    let next_seq = in_etcd[in_etcd.len() - 1].0.first_seq;
    let key = log.log_key(victim.first_seq);
    kv.put(key.clone(), flip_one_byte(original), None).await?;
    let (ok, out) = ctl(&who, &["verify", &target]);
    assert!(!ok, "verify passed with a flipped byte in etcd:\n{out}");
    assert!(
        out.contains(&format!("broken link at seq {next_seq}")),
        "{out}"
    );
    assert!(
        out.contains(&format!("etcd {key}")),
        "names the key:\n{out}"
    );
    // Never "every batch links" beside a broken link.
    assert!(
        !out.contains("every batch links") && out.contains("hash chain: BROKEN"),
        "the summary contradicts the difference:\n{out}"
    );
    // A replica loading this log stops at the broken link.
    let probe = Shared::new("probe".into(), "127.0.0.1:1".into());
    let loaded = tail::load(&probe, &log, false, Some(&archive)).await;
    assert!(loaded.is_err(), "a replica folded a broken chain");
    assert_eq!(
        probe.seq(),
        next_seq - 1,
        "folded up to the break, no further"
    );
    assert!(
        broken(&probe).contains(&format!("hash chain breaks at seq {next_seq}")),
        "{}",
        broken(&probe)
    );
    kv.put(key.clone(), original.clone(), None).await?;

    // One byte of an archived batch.
    let seg = archive.segments()?[0].clone();
    let file = std::fs::read(&seg.path)?;
    let mut records = Vec::new();
    let mut buf = file.as_slice();
    while !buf.is_empty() {
        let len = prost::encoding::decode_varint(&mut buf)? as usize;
        records.push(buf[..len].to_vec());
        buf = &buf[len..];
    }
    assert!(
        records.len() >= 2,
        "the first segment holds several batches"
    );
    let mut tampered = Vec::new();
    for (i, r) in records.iter().enumerate() {
        let r = if i == 0 { flip_one_byte(r) } else { r.clone() };
        prost::encoding::encode_varint(r.len() as u64, &mut tampered);
        tampered.extend_from_slice(&r);
    }
    std::fs::write(&seg.path, &tampered)?;
    let second = pb::EventBatch::decode(records[1].as_slice())?.first_seq;
    let (ok, out) = ctl(&who, &["verify", &target]);
    assert!(
        !ok,
        "verify passed with a flipped byte in the archive:\n{out}"
    );
    assert!(
        out.contains(&format!("broken link at seq {second}")),
        "{out}"
    );
    assert!(
        out.contains(&seg.path.display().to_string()),
        "names the segment:\n{out}"
    );
    let probe = Shared::new("probe".into(), "127.0.0.1:1".into());
    assert!(
        tail::load(&probe, &log, false, Some(&archive))
            .await
            .is_err()
    );
    assert!(
        broken(&probe).contains(&format!("hash chain breaks at seq {second}")),
        "{}",
        broken(&probe)
    );
    std::fs::write(&seg.path, &file)?;

    // A snapshot whose chain hash was changed: the next link no longer fits it.
    let snap = log.latest_snapshot(0).await?.expect("a snapshot");
    assert_eq!(snap.chain_hash.len(), 32, "snapshots record the chain hash");
    let mut bad = snap.clone();
    bad.chain_hash[0] ^= 0x01;
    let part = format!("/gpuledger/chain/snapdata/{:020}/0000", snap.seq);
    kv.put(part.clone(), bad.encode_to_vec(), None).await?;
    // A batch after it, if the snapshot is at the head.
    churn(&allocs, leader, "n1", 64, 1).await?;
    let head = allocs.status(leader).await.expect("leader").seq;
    assert_eq!(
        log.latest_snapshot(0).await?.map(|s| s.seq),
        Some(snap.seq),
        "no newer snapshot was written meanwhile"
    );
    let (ok, out) = ctl(&who, &["verify", &target]);
    assert!(
        !ok,
        "verify passed with a changed snapshot chain hash:\n{out}"
    );
    assert!(
        out.contains(&format!(
            "snapshot at seq {} (etcd {part}): records chain hash",
            snap.seq
        )),
        "{out}"
    );
    let probe = Shared::new("probe".into(), "127.0.0.1:1".into());
    assert!(
        tail::load(&probe, &log, true, Some(&archive))
            .await
            .is_err()
    );
    assert!(
        broken(&probe).contains(&format!("hash chain breaks at seq {}", snap.seq + 1)),
        "{}",
        broken(&probe)
    );
    kv.put(part, snap.encode_to_vec(), None).await?;
    let probe = Shared::new("probe".into(), "127.0.0.1:1".into());
    tail::load(&probe, &log, true, Some(&archive)).await?;
    assert_eq!(probe.seq(), head, "the restored log loads whole");

    // A deleted batch is a gap, named by its seqs.
    kv.delete(key, None).await?;
    let (ok, out) = ctl(&who, &["verify", &target]);
    assert!(!ok, "verify passed with a deleted batch:\n{out}");
    assert!(
        !out.contains("every batch links"),
        "the summary contradicts the difference:\n{out}"
    );
    assert!(
        out.contains(&format!(
            "seqs {}..{} are missing",
            victim.first_seq,
            next_seq - 1
        )),
        "{out}"
    );
    Ok(())
}
