//! Integrating allocations over a window, one ledger event at a time: pure, no IO, no clock.

use std::collections::{BTreeMap, HashMap};

use anyhow::{Result, bail};
use gpuledger_ledger::pb::event::Body;
use gpuledger_ledger::{Alloc, Ledger, pb};

use super::By;
use super::report::{Acc, Report};

/// Who holds an allocation's shares now, and how much.
#[derive(Debug, Clone)]
struct Holder {
    pod: pb::PodRef,
    node: String,
    mem_mib: u64,
    core_milli: u64,
    /// Start of the current holding (effective ms).
    since_ms: i64,
    /// Groups this allocation was already counted in (normally one).
    counted: Vec<Vec<String>>,
}

impl Holder {
    fn of(a: &Alloc, at_ms: i64) -> Holder {
        Holder {
            pod: a.pod.clone(),
            node: a.node.clone(),
            mem_mib: a.shares.iter().map(|s| s.mem_mib).sum(),
            core_milli: a.shares.iter().map(|s| u64::from(s.core_milli)).sum(),
            since_ms: at_ms,
            counted: Vec::new(),
        }
    }

    /// The group this holding counts in.
    fn key(&self, by: By) -> Vec<String> {
        match by {
            By::Namespace => vec![self.pod.namespace.clone()],
            By::Pod => vec![self.pod.namespace.clone(), self.pod.name.clone()],
            By::Node => vec![self.node.clone()],
        }
    }
}

/// What reading the log tells the caller.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// Keep reading.
    More,
    /// The event is at or after the window's end: nothing later can count.
    Done,
}

/// Integrates the ledger's allocations over a window, one event at a time. Pure: no IO, no clock.
pub struct Meter {
    by: By,
    since_ms: Option<i64>,
    until_ms: i64,
    ledger: Ledger,
    holders: HashMap<u64, Holder>,
    groups: BTreeMap<Vec<String>, Acc>,
    first_ms: Option<i64>,
    last_ms: Option<i64>,
}

impl Meter {
    /// A meter over `[since, until)`; `since` None = the first event's time.
    pub fn new(by: By, since_ms: Option<i64>, until_ms: i64) -> Meter {
        Meter {
            by,
            since_ms,
            until_ms,
            ledger: Ledger::new(),
            holders: HashMap::new(),
            groups: BTreeMap::new(),
            first_ms: None,
            last_ms: None,
        }
    }

    /// Fold one event (in log order, from seq 1).
    pub fn apply(&mut self, e: &pb::Event) -> Result<Step> {
        let t = self.last_ms.map_or(e.time_ms, |l| l.max(e.time_ms));
        if self.first_ms.is_none() {
            if e.seq != 1 {
                bail!(
                    "the log starts at seq {}, not 1: the events before it are not readable, \
                     and allocations reserved there would be missing",
                    e.seq
                );
            }
            self.first_ms = Some(t);
            self.since_ms.get_or_insert(t);
        }
        if t >= self.until_ms {
            return Ok(Step::Done);
        }
        self.last_ms = Some(t);
        self.ledger.apply(e).map_err(|err| {
            anyhow::anyhow!("the log does not replay (run gpuledger verify): {err}")
        })?;
        match &e.body {
            // A claim grant is metered as a reservation is, under its claim's namespace.
            Some(Body::Reserved(pb::Reserved { allocation_id, .. }))
            | Some(Body::ClaimGranted(pb::ClaimGranted { allocation_id, .. })) => {
                let a = self
                    .ledger
                    .alloc(*allocation_id)
                    .expect("a grant the ledger accepted is live");
                self.holders.insert(*allocation_id, Holder::of(a, t));
            }
            Some(Body::Released(r)) => {
                if let Some(h) = self.holders.remove(&r.allocation_id) {
                    self.close(h, t);
                }
            }
            Some(Body::IdentityCorrected(c)) => {
                for id in [c.from_allocation_id, c.to_allocation_id] {
                    let Some(old) = self.holders.remove(&id) else {
                        continue;
                    };
                    let counted = old.counted.clone();
                    self.close(old, t);
                    let a = self
                        .ledger
                        .alloc(id)
                        .expect("a corrected allocation the ledger accepted is live");
                    let mut h = Holder::of(a, t);
                    h.counted = counted;
                    self.holders.insert(id, h);
                }
            }
            _ => {}
        }
        Ok(Step::More)
    }

    /// Close the holding `h` at `end_ms`, adding its part inside the window to its group.
    fn close(&mut self, mut h: Holder, end_ms: i64) {
        let since = self.since_ms.unwrap_or(i64::MIN);
        let lo = h.since_ms.max(since);
        let hi = end_ms.min(self.until_ms);
        if hi <= lo {
            return;
        }
        let ms = (hi - lo) as u128;
        let key = h.key(self.by);
        let acc = self.groups.entry(key.clone()).or_default();
        acc.mib_ms += u128::from(h.mem_mib) * ms;
        acc.core_milli_ms += u128::from(h.core_milli) * ms;
        if !h.counted.contains(&key) {
            acc.allocations += 1;
            h.counted.push(key);
        }
    }

    /// Close every holding still open at the window's end; the rows by group key.
    pub fn finish(mut self) -> Report {
        let mut open: Vec<(u64, Holder)> = self.holders.drain().collect();
        open.sort_by_key(|(id, _)| *id);
        for (_, h) in open {
            self.close(h, self.until_ms);
        }
        let mut total = Acc::default();
        for a in self.groups.values() {
            total.add(a);
        }
        Report {
            by: self.by,
            since_ms: self.since_ms.unwrap_or(self.until_ms),
            until_ms: self.until_ms,
            seq: self.ledger.seq(),
            first_ms: self.first_ms,
            rows: self.groups,
            total,
        }
    }
}
