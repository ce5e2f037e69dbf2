//! `gpuledger verify`: replay the whole log, check every invariant and the hash chain from
//! seq 1 through the archive and etcd, and compare the state with each live replica's.

use std::collections::BTreeMap;

use anyhow::{Result, bail};
use gpuledger_ledger::chain::{Chain, ChainError, Hash, short_hex};
use gpuledger_ledger::{Ledger, pb};
use gpuledger_proto::allocator::v1 as api;
use prost::Message;

use crate::client::{Client, Target, connect, connect_one, dump_of, read_batches};

/// Largest snapshot `verify` assembles (its meta key says how large it is before any byte).
const MAX_SNAPSHOT_BYTES: u64 = 2 * 1024 * 1024 * 1024;

/// The hash chain as `verify` walks it.
#[derive(Default)]
pub struct ChainCheck {
    chain: Chain,
    /// Where the batch before the next one lives.
    prev_at: String,
    /// The first break, said in full (later ones follow from it and are not reported).
    pub broken: Option<String>,
    /// Hashes at the seqs a replica's dump is at.
    at: BTreeMap<u64, Hash>,
}

impl ChainCheck {
    /// A check that also records the chain's hash at each of `seqs`.
    pub fn new(seqs: impl IntoIterator<Item = u64>) -> Self {
        ChainCheck {
            at: seqs.into_iter().map(|s| (s, [0; 32])).collect(),
            ..Default::default()
        }
    }

    /// Link the next batch as ReadLog gave it (stamped with its stored hash and location).
    pub fn batch(&mut self, b: &pb::EventBatch) {
        if self.broken.is_some() {
            return;
        }
        let Some(stored) = &b.stored else {
            self.broken = Some(format!(
                "the batch at seq {} comes without its stored hash: the allocator is older than this gpuledger; the chain is not checked",
                b.first_seq
            ));
            return;
        };
        let Ok(hash) = Hash::try_from(stored.hash.as_slice()) else {
            self.broken = Some(format!(
                "the batch at seq {} has no valid stored hash",
                b.first_seq
            ));
            return;
        };
        if let Err(e) = self.chain.link(b, hash) {
            let at = &stored.location;
            self.broken = Some(match &e {
                ChainError::Gap { .. } => format!(
                    "{e}: the batch before ({}) is followed by {at}",
                    self.prev_at
                ),
                ChainError::Broken { .. } => format!(
                    "{e}: the batch before it ({}) or this batch ({at}) was changed",
                    self.prev_at
                ),
                _ => format!("{e} ({at})"),
            });
            return;
        }
        self.prev_at = stored.location.clone();
        let last = self.chain.next_seq() - 1;
        if let Some(h) = self.at.get_mut(&last) {
            *h = hash;
        }
    }

    /// Check a replica's chain hash at its seq (empty: it does not know it) against the log.
    pub fn replica(&self, name: &str, seq: u64, hash: &[u8]) -> Option<String> {
        let ours = self.at.get(&seq).filter(|h| **h != [0; 32])?;
        (!hash.is_empty() && hash != ours).then(|| {
            format!(
                "{name}: folded a batch ending at seq {seq} that hashed to {}, but the log's hashes to {}: the newest batch was changed after it was read",
                short_hex(hash),
                short_hex(ours)
            )
        })
    }

    /// Check a stored snapshot's `chain_hash` against the chain's hash at its seq.
    pub fn snapshot(&self, name: &str, seq: u64, hash: &[u8]) -> Option<String> {
        if self.broken.is_some() || seq == 0 {
            return None;
        }
        let ours = self.at.get(&seq).filter(|h| **h != [0; 32]);
        match ours {
            _ if hash.is_empty() => (seq > self.unchained_until()).then(|| {
                format!("{name}: records no chain hash although the log is chained at its seq")
            }),
            None if seq < self.chain.next_seq() => Some(format!(
                "{name}: no batch of the log ends at its seq"
            )),
            None => None,
            Some(ours) => (hash != ours).then(|| {
                format!(
                    "{name}: records chain hash {} but the log's batch ending at seq {seq} hashes to {}: the snapshot was changed",
                    short_hex(hash),
                    short_hex(ours)
                )
            }),
        }
    }

    /// The last seq of the batches written before the log was chained (0: none).
    pub fn unchained_until(&self) -> u64 {
        self.chain.unchained_until()
    }
}

/// Arguments of `gpuledger verify`.
#[derive(clap::Args, Debug)]
pub struct VerifyArgs {
    /// Allocator replicas to compare, comma-separated; every one must match the replayed log.
    #[command(flatten)]
    target: Target,
}

/// Differences between a replayed state and a replica's dump (empty = equal).
pub fn diff(replayed: &Ledger, live: &Ledger) -> Vec<String> {
    let mut d = Vec::new();
    if replayed.seq() != live.seq() || replayed.epoch() != live.epoch() {
        d.push(format!(
            "seq/epoch: replayed {}/{}, live {}/{}",
            replayed.seq(),
            replayed.epoch(),
            live.seq(),
            live.epoch()
        ));
    }
    for (name, n) in replayed.nodes() {
        match live.node(name) {
            None => d.push(format!("node {name}: in the log, not in the live state")),
            Some(m) if m != n => d.push(format!("node {name}: differs")),
            _ => {}
        }
    }
    for name in live.nodes().keys() {
        if replayed.node(name).is_none() {
            d.push(format!("node {name}: live, not in the log"));
        }
    }
    let mut ids: Vec<u64> = replayed
        .allocs()
        .keys()
        .chain(live.allocs().keys())
        .copied()
        .collect();
    ids.sort_unstable();
    ids.dedup();
    for id in ids {
        match (replayed.alloc(id), live.alloc(id)) {
            (Some(a), Some(b)) if a != b => d.push(format!(
                "allocation {id}: log says {}/{} on {} {:?} ({}), live says {}/{} on {} {:?} ({})",
                a.pod.namespace,
                a.pod.name,
                a.node,
                a.shares
                    .iter()
                    .map(|s| (&s.gpu_uuid, s.mem_mib))
                    .collect::<Vec<_>>(),
                a.state.as_str(),
                b.pod.namespace,
                b.pod.name,
                b.node,
                b.shares
                    .iter()
                    .map(|s| (&s.gpu_uuid, s.mem_mib))
                    .collect::<Vec<_>>(),
                b.state.as_str()
            )),
            (Some(_), None) => d.push(format!("allocation {id}: in the log, not live")),
            (None, Some(_)) => d.push(format!("allocation {id}: live, not in the log")),
            _ => {}
        }
    }
    if d.is_empty() && !replayed.same_state(live) {
        d.push("states differ in their indexes".into());
    }
    d
}

/// One stored snapshot as `ReadSnapshots` streamed it: its parts joined.
struct StoredSnapshot {
    seq: u64,
    /// Where it lives, for messages: `snapshot at seq N (etcd <first part's key>)`.
    name: String,
    bytes: Vec<u8>,
    /// Parts and length its meta key records, and the parts that came.
    parts: u32,
    total_bytes: u64,
    got_parts: u32,
}

impl StoredSnapshot {
    /// The snapshot decoded and checked against its meta key and its seq.
    fn decode(&self) -> Result<pb::Snapshot, String> {
        if self.got_parts != self.parts || self.bytes.len() as u64 != self.total_bytes {
            return Err(format!(
                "{}: its meta key records {} part(s) of {} bytes in all, etcd holds {} part(s) of {} bytes",
                self.name,
                self.parts,
                self.total_bytes,
                self.got_parts,
                self.bytes.len()
            ));
        }
        let snap = pb::Snapshot::decode(self.bytes.as_slice())
            .map_err(|e| format!("{}: does not decode: {e}", self.name))?;
        if snap.seq != self.seq {
            return Err(format!(
                "{}: holds the state at seq {}, not at its key's seq",
                self.name, snap.seq
            ));
        }
        Ok(snap)
    }
}

/// Every stored snapshot, through `ReadSnapshots`.
async fn stored_snapshots(c: &mut Client) -> Result<Vec<StoredSnapshot>> {
    let mut stream = c
        .read_snapshots(api::ReadSnapshotsRequest {})
        .await
        .map_err(|s| anyhow::anyhow!("reading the snapshots: {}", s.message()))?
        .into_inner();
    let mut out: Vec<StoredSnapshot> = Vec::new();
    while let Some(p) = stream
        .message()
        .await
        .map_err(|s| anyhow::anyhow!("reading the snapshots: {}", s.message()))?
    {
        if out.last().is_none_or(|s| s.seq != p.seq) {
            if p.total_bytes > MAX_SNAPSHOT_BYTES {
                bail!(
                    "the snapshot at seq {} ({}) says it is {} bytes, more than verify reads ({MAX_SNAPSHOT_BYTES})",
                    p.seq,
                    p.key,
                    p.total_bytes
                );
            }
            out.push(StoredSnapshot {
                seq: p.seq,
                name: format!("snapshot at seq {} (etcd {})", p.seq, p.key),
                bytes: Vec::new(),
                parts: p.parts,
                total_bytes: p.total_bytes,
                got_parts: 0,
            });
        }
        let s = out.last_mut().expect("pushed above");
        if (s.bytes.len() + p.data.len()) as u64 > MAX_SNAPSHOT_BYTES {
            bail!("{}: its parts run past {MAX_SNAPSHOT_BYTES} bytes", s.name);
        }
        s.bytes.extend_from_slice(&p.data);
        s.got_parts += 1;
    }
    Ok(out)
}

/// `gpuledger verify`.
pub async fn verify(a: VerifyArgs) -> Result<()> {
    // Dumps first: the log can only be longer than any dump.
    let mut dumps: Vec<(String, Ledger)> = Vec::new();
    let mut dump_hashes: Vec<(String, u64, Vec<u8>)> = Vec::new();
    let mut problems: Vec<String> = Vec::new();
    let creds = a.target.credentials().await?;
    for addr in &a.target.addrs().await? {
        match connect_one(addr, &creds).await {
            Ok(mut c) => match dump_of(&mut c).await {
                Ok((replica, snap)) => match Ledger::from_snapshot(&snap) {
                    Ok(l) => {
                        let name = format!("{replica} ({addr})");
                        dump_hashes.push((name.clone(), snap.seq, snap.chain_hash));
                        dumps.push((name, l));
                    }
                    Err(e) => problems.push(format!("{addr}: its state does not load: {e}")),
                },
                Err(e) => problems.push(format!("{addr}: {e:#}")),
            },
            Err(e) => problems.push(format!("{addr}: {e:#}")),
        }
    }
    if dumps.is_empty() {
        bail!("no replica to compare with: {}", problems.join("; "));
    }
    let replicas = dumps.len();
    // Each stored snapshot is compared like a replica: its state and its chain hash.
    let mut snap_hashes: Vec<(String, u64, Vec<u8>)> = Vec::new();
    let stored = match connect(&a.target).await {
        Ok(mut c) => stored_snapshots(&mut c).await,
        Err(e) => Err(e),
    };
    match stored {
        Ok(stored) => {
            for s in &stored {
                match s.decode().and_then(|snap| {
                    let l = Ledger::from_snapshot(&snap)
                        .map_err(|e| format!("{}: its state does not load: {e}", s.name))?;
                    Ok((snap.chain_hash, l))
                }) {
                    Ok((hash, l)) => {
                        snap_hashes.push((s.name.clone(), s.seq, hash));
                        dumps.push((s.name.clone(), l));
                    }
                    Err(p) => problems.push(p),
                }
            }
        }
        Err(e) => problems.push(format!("snapshots: {e:#}")),
    }
    dumps.sort_by_key(|(_, l)| l.seq());
    let mut l = Ledger::new();
    let mut next = 0;
    let mut events = 0u64;
    let compare =
        |l: &Ledger, dumps: &[(String, Ledger)], next: &mut usize, problems: &mut Vec<String>| {
            while *next < dumps.len() && dumps[*next].1.seq() == l.seq() {
                let (name, live) = &dumps[*next];
                for d in diff(l, live) {
                    problems.push(format!("{name}: {d}"));
                }
                *next += 1;
            }
        };
    compare(&l, &dumps, &mut next, &mut problems);
    let mut chain = ChainCheck::new(dump_hashes.iter().chain(&snap_hashes).map(|(_, s, _)| *s));
    let read = read_batches(&a.target, 0, |b| {
        chain.batch(b);
        for e in &b.events {
            if let Err(err) = l.apply(e) {
                problems.push(format!("log: {err}"));
                return Ok(false);
            }
            events += 1;
            compare(&l, &dumps, &mut next, &mut problems);
        }
        Ok(true)
    })
    .await;
    if let Err(e) = read {
        problems.push(format!("log: {e:#}"));
    }
    if let Some(b) = &chain.broken {
        problems.push(format!("chain: {b}"));
    }
    for (name, seq, hash) in &dump_hashes {
        if let Some(p) = chain.replica(name, *seq, hash) {
            problems.push(format!("chain: {p}"));
        }
    }
    for (name, seq, hash) in &snap_hashes {
        if let Some(p) = chain.snapshot(name, *seq, hash) {
            problems.push(format!("chain: {p}"));
        }
    }
    if let Err(e) = l.check() {
        problems.push(format!("replayed state: {e}"));
    }
    for (name, live) in &dumps[next..] {
        problems.push(format!(
            "{name}: at seq {}, but the log replays only to seq {}",
            live.seq(),
            l.seq()
        ));
    }
    println!(
        "replayed {events} events to seq {} (epoch {}): {} nodes, {} allocations; compared {replicas} replica(s) and {} stored snapshot(s)",
        l.seq(),
        l.epoch(),
        l.nodes().len(),
        l.allocs().len(),
        snap_hashes.len()
    );
    let chain_problems = problems.iter().filter(|p| p.starts_with("chain: ")).count();
    let log_read = !problems.iter().any(|p| p.starts_with("log: "));
    match chain.unchained_until() {
        // Never "every batch links" beside a difference that says otherwise.
        _ if chain.broken.is_some() => {
            println!("hash chain: BROKEN (see the chain DIFFERENCE below)")
        }
        _ if chain_problems > 0 => println!(
            "hash chain: the log links, but {chain_problems} replica or snapshot hash(es) differ from it (see DIFFERENCE below)"
        ),
        _ if !log_read => {
            println!("hash chain: not checked to the end: the log could not be read to its head")
        }
        0 => println!("hash chain: every batch links to the one before it"),
        n => println!(
            "hash chain: unchained before seq {} (batches written before the log was hash-chained; not a sign of tampering, and not covered by the chain); linked from there on",
            n + 1
        ),
    }
    if problems.is_empty() {
        println!(
            "verify: OK — every invariant holds, the hash chain is unbroken and every replica and stored snapshot equals the replayed log"
        );
        Ok(())
    } else {
        for p in &problems {
            println!("DIFFERENCE {p}");
        }
        bail!("verify failed: {} difference(s)", problems.len())
    }
}
