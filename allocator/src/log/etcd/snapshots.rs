//! Snapshots in etcd: a snapshot is written in parts of at most [`MAX_VALUE_BYTES`] under
//! `snapdata/<seq>/`, then its meta key `snapmeta/<seq>` ("<parts> <bytes>"), which makes it
//! complete; one without meta is ignored.

use etcd_client::{Compare, CompareOp, GetOptions, Txn, TxnOp};
use gpuledger_ledger::pb;
use prost::Message;

use super::{EtcdLog, seq_key};
use crate::log::{LogError, MAX_VALUE_BYTES};

impl EtcdLog {
    /// The meta key of the snapshot at `seq`.
    fn snapshot_meta_key(&self, seq: u64) -> String {
        format!("{}snapmeta/{}", self.prefix, seq_key(seq))
    }

    /// The prefix of the parts of the snapshot at `seq`.
    fn snapshot_data_prefix(&self, seq: u64) -> String {
        format!("{}snapdata/{}/", self.prefix, seq_key(seq))
    }

    /// Write a snapshot in ≤ 1 MiB parts, then its meta key (a snapshot without meta is
    /// incomplete and ignored). Only writes if no snapshot exists at that seq.
    pub async fn write_snapshot(&self, snap: &pb::Snapshot) -> Result<bool, LogError> {
        let meta_key = self.snapshot_meta_key(snap.seq);
        let mut kv = self.kv.clone();
        let existing = self
            .timed(kv.get(meta_key.clone(), Some(GetOptions::new().with_count_only())))
            .await?;
        if existing.count() > 0 {
            return Ok(false);
        }
        let bytes = snap.encode_to_vec();
        let parts: Vec<&[u8]> = bytes.chunks(MAX_VALUE_BYTES).collect();
        for (i, p) in parts.iter().enumerate() {
            let key = format!("{}{i:04}", self.snapshot_data_prefix(snap.seq));
            self.timed(kv.put(key, p.to_vec(), None)).await?;
        }
        let meta = format!("{} {}", parts.len(), bytes.len());
        let txn = Txn::new()
            .when([Compare::version(meta_key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(meta_key, meta, None)]);
        Ok(self.timed(kv.txn(txn)).await?.succeeded())
    }

    /// Seqs of the complete snapshots, ascending.
    pub async fn snapshot_seqs(&self) -> Result<Vec<u64>, LogError> {
        let mut kv = self.kv.clone();
        let prefix = format!("{}snapmeta/", self.prefix);
        let resp = self
            .timed(kv.get(
                prefix.clone(),
                Some(GetOptions::new().with_prefix().with_keys_only()),
            ))
            .await?;
        let mut seqs: Vec<u64> = resp
            .kvs()
            .iter()
            .filter_map(|k| {
                String::from_utf8_lossy(k.key())
                    .strip_prefix(&prefix)
                    .and_then(|s| s.parse().ok())
            })
            .collect();
        seqs.sort_unstable();
        Ok(seqs)
    }

    /// The newest complete snapshot at or below `max_seq` (0 = any).
    pub async fn latest_snapshot(&self, max_seq: u64) -> Result<Option<pb::Snapshot>, LogError> {
        let seqs = self.snapshot_seqs().await?;
        let Some(seq) = seqs
            .into_iter()
            .rev()
            .find(|s| max_seq == 0 || *s <= max_seq)
        else {
            return Ok(None);
        };
        let mut kv = self.kv.clone();
        let key = self.snapshot_data_prefix(seq);
        let resp = self
            .timed(kv.get(key.clone(), Some(GetOptions::new().with_prefix())))
            .await?;
        let mut bytes = Vec::new();
        for p in resp.kvs() {
            bytes.extend_from_slice(p.value());
        }
        let snap = pb::Snapshot::decode(bytes.as_slice()).map_err(|e| LogError::Corrupt {
            key,
            why: e.to_string(),
        })?;
        Ok(Some(snap))
    }

    /// The snapshot at `seq` as stored: its meta key's `(parts, length)` and the key of each
    /// part, for reading the parts one at a time with [`EtcdLog::get_raw`] (None: pruned).
    pub async fn snapshot_layout(
        &self,
        seq: u64,
    ) -> Result<Option<(u32, u64, Vec<String>)>, LogError> {
        let meta_key = self.snapshot_meta_key(seq);
        let mut kv = self.kv.clone();
        let meta = self.timed(kv.get(meta_key.clone(), None)).await?;
        let Some(meta) = meta.kvs().first() else {
            return Ok(None);
        };
        let meta = String::from_utf8_lossy(meta.value()).into_owned();
        let corrupt = || LogError::Corrupt {
            key: meta_key.clone(),
            why: format!("{meta:?} is not \"<parts> <bytes>\""),
        };
        let (parts, len) = meta.split_once(' ').ok_or_else(corrupt)?;
        let (parts, len): (u32, u64) = (
            parts.parse().map_err(|_| corrupt())?,
            len.parse().map_err(|_| corrupt())?,
        );
        let prefix = self.snapshot_data_prefix(seq);
        let keys = self
            .timed(kv.get(
                prefix,
                Some(GetOptions::new().with_prefix().with_keys_only()),
            ))
            .await?
            .kvs()
            .iter()
            .map(|k| String::from_utf8_lossy(k.key()).into_owned())
            .collect();
        Ok(Some((parts, len, keys)))
    }

    /// Delete all but the newest `keep` snapshots.
    pub async fn prune_snapshots(&self, keep: usize) -> Result<(), LogError> {
        let seqs = self.snapshot_seqs().await?;
        let mut kv = self.kv.clone();
        for seq in seqs.iter().take(seqs.len().saturating_sub(keep)) {
            let meta = self.snapshot_meta_key(*seq);
            self.timed(kv.delete(meta, None)).await?;
            let data = self.snapshot_data_prefix(*seq);
            self.timed(kv.delete(data, Some(etcd_client::DeleteOptions::new().with_prefix())))
                .await?;
        }
        Ok(())
    }
}
