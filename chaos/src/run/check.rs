//! The history check: the ledger log replayed from etcd and the archive, every
//! acknowledged operation looked up in it, every replica and node agent compared with it,
//! and every pod accounted for.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::cluster::{LocalCluster, pod_phase};
use gpuledger_testkit::history::{Op, Outcome};
use prost::Message;
use serde_json::Value;

use super::RunArgs;

/// What the check found.
pub(super) struct Verdict {
    /// Every client-visible operation, in time order.
    pub(super) ops: Vec<Op>,
    /// Where they were written, one JSON line each.
    pub(super) history: PathBuf,
    /// The log, replayed.
    pub(super) replay: Replay,
    /// What is wrong.
    pub(super) violations: Vec<String>,
    /// Acknowledged grants missing from the ledger.
    pub(super) lost: usize,
    /// Pods holding or answered two allocations.
    pub(super) double: usize,
    /// Whether every replica equals the replayed log.
    pub(super) replay_equal: bool,
    /// Pods that succeeded.
    pub(super) succeeded: usize,
    /// Pods that failed, by the first part of their message.
    pub(super) failed: BTreeMap<String, usize>,
}

/// Write the history, replay the log and check everything against it.
pub(super) async fn verdict(c: &mut LocalCluster, a: &RunArgs) -> Result<Verdict> {
    // The history, in time order.
    let mut ops: Vec<Op> = c.scheduler.stats.history.all();
    ops.extend(c.runs.history.all());
    ops.sort_by_key(|o| o.at_ms);
    let hist_path = c.dir.join("history.jsonl");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&hist_path)?);
    for o in &ops {
        writeln!(f, "{}", o.to_json())?;
    }
    f.flush()?;

    let mut r = replay_log(c).await?;
    let mut violations = std::mem::take(&mut r.violations);
    let g = check_grants(&ops, &r);
    violations.extend(g.violations);
    let lost = g.lost;
    let double = r.double + g.double;
    // Every replica equals the replayed log.
    let mut replay_equal = true;
    for i in 0..c.allocs.addrs.len() {
        let d = c
            .allocs
            .viewer(i)?
            .dump(api::DumpRequest {})
            .await
            .with_context(|| format!("Dump of alloc{i}"))?
            .into_inner();
        let live = gpuledger_ledger::Ledger::from_snapshot(&d.snapshot.unwrap_or_default())
            .map_err(anyhow::Error::msg)?;
        if !live.same_state(&r.ledger) {
            replay_equal = false;
            violations.push(format!(
                "replica alloc{i} (seq {}) differs from the replayed log (seq {})",
                live.seq(),
                r.ledger.seq()
            ));
        }
    }
    // Every node agent's view equals the ledger.
    for v in c.check_agent_views(Duration::from_secs(20)).await {
        if !v.agree {
            violations.push(format!(
                "node agent of {} differs from the ledger: {}",
                v.node, v.detail
            ));
        }
    }
    // Pods and allocations match; every pod finished.
    let pods = c.api.store.objects("v1", "pods");
    let mut by_uid: HashMap<String, (&Value, &str)> = HashMap::new();
    // The workload's pods: not the node agents' own (their tokens are bound to them).
    let workload = pods.iter().filter(|p| {
        p.pointer("/metadata/namespace").and_then(Value::as_str)
            != Some(gpuledger_testkit::pki::NAMESPACE)
    });
    for p in workload {
        if let Some(uid) = p.pointer("/metadata/uid").and_then(Value::as_str) {
            by_uid.insert(uid.to_string(), (p, pod_phase(p)));
        }
    }
    let mut failed: BTreeMap<String, usize> = BTreeMap::new();
    let mut succeeded = 0;
    for (p, ph) in by_uid.values() {
        let name = p.pointer("/metadata/name").and_then(Value::as_str);
        match *ph {
            "Succeeded" => succeeded += 1,
            "Failed" => {
                let why = p
                    .pointer("/status/message")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .split(':')
                    .next()
                    .unwrap_or("")
                    .to_string();
                *failed.entry(why).or_default() += 1;
            }
            "Running" => {
                if !r.ledger.allocs().values().any(|x| {
                    Some(x.pod.uid.as_str()) == p.pointer("/metadata/uid").and_then(Value::as_str)
                }) {
                    violations.push(format!(
                        "pod {} is running without an allocation",
                        name.unwrap_or("?")
                    ));
                }
                violations.push(format!(
                    "pod {} still running {}s after the workload began",
                    name.unwrap_or("?"),
                    a.timeout
                ));
            }
            other => violations.push(format!(
                "pod {} never finished (phase {other})",
                name.unwrap_or("?")
            )),
        }
    }
    for x in r.ledger.allocs().values() {
        let live = by_uid
            .get(&x.pod.uid)
            .is_some_and(|(_, ph)| !matches!(*ph, "Succeeded" | "Failed"));
        if !live {
            violations.push(format!(
                "allocation {} of pod {}/{} on {} has no running pod",
                x.id, x.pod.namespace, x.pod.name, x.node
            ));
        }
    }
    Ok(Verdict {
        ops,
        history: hist_path,
        replay: r,
        violations,
        lost,
        double,
        replay_equal,
        succeeded,
        failed,
    })
}

/// What the ledger log says, read from etcd and replayed.
pub struct Replay {
    pub(super) ledger: gpuledger_ledger::Ledger,
    /// Allocation id -> every pod UID that owned it (identity corrections move them).
    owners: HashMap<u64, BTreeSet<String>>,
    /// Allocation ids claimed by a node agent (Assigned).
    assigned: BTreeSet<u64>,
    /// Pod UID -> nodes it was reserved on.
    reserved_on: HashMap<String, BTreeSet<String>>,
    violations: Vec<String>,
    double: usize,
    /// The hash chain over the batches replayed.
    chain: gpuledger_ledger::chain::Chain,
}

/// The whole log: etcd's tail, then the archive (read second: whatever was trimmed from etcd
/// before the first read is in the archive by then, because batches leave etcd only after
/// they are archived).
async fn replay_log(c: &mut LocalCluster) -> Result<Replay> {
    let client = c.etcd().client().await?;
    let mut kv = client
        .kv_client()
        .max_decoding_message_size(512 * 1024 * 1024);
    let resp = kv
        .get(
            "/gpuledger/local/log/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .context("reading the ledger log from etcd")?;
    let mut tail = Vec::with_capacity(resp.kvs().len());
    for kvp in resp.kvs() {
        let mut b = pb::EventBatch::decode(kvp.value()).context("decoding a log batch")?;
        b.stored = Some(pb::StoredAt {
            hash: gpuledger_ledger::chain::hash_stored(kvp.value()).to_vec(),
            location: format!("etcd {}", String::from_utf8_lossy(kvp.key())),
        });
        tail.push(b);
    }
    let archive = gpuledger_archive::Archive::open(&c.dir.join("archive"))?;
    let mut batches = Vec::new();
    archive
        .read(1, 0, |b| {
            batches.push(b);
            true
        })
        .context("reading the log archive")?;
    let archived = batches.last().map_or(0, gpuledger_archive::last_seq);
    batches.extend(
        tail.into_iter()
            .filter(|b| gpuledger_archive::last_seq(b) > archived),
    );
    let mut r = Replay::from_batches(batches);
    // Every batch of a run is written by this version: all of them carry their link.
    if r.chain.unchained_until() > 0 {
        r.violations.push(format!(
            "chain: the log is unchained up to seq {}",
            r.chain.unchained_until()
        ));
    }
    Ok(r)
}

impl Replay {
    /// Replay `batches` (in key order) from an empty ledger, noting every invariant broken on
    /// the way: an apply error (capacity, seq gap, unknown allocation…), an epoch lower than
    /// the batch before, a pod container holding two allocations at once.
    pub fn from_batches(batches: impl IntoIterator<Item = pb::EventBatch>) -> Replay {
        let mut r = Replay {
            ledger: gpuledger_ledger::Ledger::new(),
            owners: HashMap::new(),
            assigned: BTreeSet::new(),
            reserved_on: HashMap::new(),
            violations: Vec::new(),
            double: 0,
            chain: gpuledger_ledger::chain::Chain::new(),
        };
        let mut last_epoch = 0;
        for b in batches {
            if b.epoch < last_epoch {
                r.violations.push(format!(
                    "epoch went down at seq {}: {} after {last_epoch}",
                    b.first_seq, b.epoch
                ));
            }
            last_epoch = b.epoch;
            let hash = gpuledger_ledger::chain::batch_hash(&b);
            if let Err(e) = r.chain.link(&b, hash) {
                let at = b.stored.as_ref().map_or("", |s| s.location.as_str());
                r.violations.push(format!("chain: {e} ({at})"));
                // Go on from this batch: one break, one violation.
                r.chain =
                    gpuledger_ledger::chain::Chain::resume(gpuledger_archive::last_seq(&b), &hash);
            }
            for e in &b.events {
                r.apply(e);
            }
        }
        if let Err(e) = r.ledger.check() {
            r.violations.push(format!("replayed state: {e}"));
        }
        r
    }

    fn apply(&mut self, e: &pb::Event) {
        if let Err(err) = self.ledger.apply(e) {
            self.violations.push(format!("replay: {err}"));
            return;
        }
        let touched: Vec<u64> = match &e.body {
            Some(pb::event::Body::Reserved(x)) => {
                if let Some(p) = &x.pod {
                    self.reserved_on
                        .entry(p.uid.clone())
                        .or_default()
                        .insert(x.node.clone());
                }
                vec![x.allocation_id]
            }
            Some(pb::event::Body::Assigned(x)) => {
                self.assigned.insert(x.allocation_id);
                Vec::new()
            }
            Some(pb::event::Body::IdentityCorrected(x)) => {
                vec![x.from_allocation_id, x.to_allocation_id]
            }
            _ => Vec::new(),
        };
        for id in touched {
            let Some(al) = self.ledger.allocs().get(&id) else {
                continue;
            };
            let uid = al.pod.uid.clone();
            self.owners.entry(id).or_default().insert(uid.clone());
            let mut per_container: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
            for x in self.ledger.allocs_of_pod(&uid) {
                per_container.entry(&x.container).or_default().push(x.id);
            }
            for (container, ids) in per_container {
                if ids.len() > 1 {
                    self.double += 1;
                    self.violations.push(format!(
                        "double grant in the ledger at seq {}: pod {uid} container {container} holds allocations {ids:?}",
                        e.seq
                    ));
                }
            }
        }
    }
}

/// What the acknowledged operations say against the ledger.
#[derive(Debug, Default)]
pub struct GrantCheck {
    /// What is wrong.
    pub violations: Vec<String>,
    /// Acknowledged grants missing from the ledger.
    pub lost: usize,
    /// Pods answered two different allocations.
    pub double: usize,
}

/// Every acknowledged bind has its reservation on that node in the ledger; every acknowledged
/// Allocate names an allocation the ledger gave that pod and shows claimed; no pod was
/// answered two different allocations.
pub fn check_grants(ops: &[Op], r: &Replay) -> GrantCheck {
    let mut g = GrantCheck::default();
    let mut acked: BTreeMap<&str, BTreeSet<u64>> = BTreeMap::new();
    for o in ops.iter().filter(|o| o.outcome == Outcome::Ok) {
        match o.op {
            "bind" => {
                let there = r
                    .reserved_on
                    .get(&o.uid)
                    .is_some_and(|n| n.contains(&o.node));
                if !there {
                    g.lost += 1;
                    g.violations.push(format!(
                        "lost grant: bind of {} to {} was acknowledged, no reservation there in the ledger",
                        o.pod, o.node
                    ));
                }
            }
            "allocate" => {
                let Some(id) = o.allocation else {
                    g.violations.push(format!(
                        "Allocate for {} on {} answered without GPULEDGER_ALLOCATION_ID",
                        o.pod, o.node
                    ));
                    continue;
                };
                acked.entry(&o.uid).or_default().insert(id);
                let owned = r.owners.get(&id).is_some_and(|u| u.contains(&o.uid));
                if !owned || !r.assigned.contains(&id) {
                    g.lost += 1;
                    g.violations.push(format!(
                        "lost grant: Allocate for {} on {} answered allocation {id}, which the ledger {}",
                        o.pod,
                        o.node,
                        if owned {
                            "never shows claimed (Assigned)"
                        } else {
                            "never gave to that pod"
                        }
                    ));
                }
            }
            _ => {}
        }
    }
    for (uid, ids) in &acked {
        if ids.len() > 1 {
            g.double += 1;
            g.violations.push(format!(
                "double grant: pod {uid} was answered allocations {ids:?}"
            ));
        }
    }
    g
}

#[cfg(test)]
mod tests;
