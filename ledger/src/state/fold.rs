//! Folding one event into the state, with every per-event invariant checked first.

use std::collections::BTreeSet;

use rustc_hash::FxHashMap;

use super::{
    Alloc, AllocState, ApplyError, Containers, GpuState, Ledger, NodeState, POD_KINDS, pod_kind,
};
use crate::CORE_MILLI_PER_GPU;
use crate::pb;
use crate::pb::event::Body;

impl Ledger {
    /// Fold a batch of events in order. Stops at the first bad event; the events before it stay
    /// applied (the caller treats the state as broken and reports the error).
    pub fn apply_all<'a>(
        &mut self,
        events: impl IntoIterator<Item = &'a pb::Event>,
    ) -> Result<(), ApplyError> {
        for e in events {
            self.apply(e)?;
        }
        Ok(())
    }

    /// Fold one event, checking every invariant first: a rejected event changes nothing.
    pub fn apply(&mut self, ev: &pb::Event) -> Result<(), ApplyError> {
        if ev.seq != self.seq + 1 {
            return Err(ApplyError::SeqGap {
                expected: self.seq + 1,
                got: ev.seq,
            });
        }
        if ev.epoch < self.epoch {
            return Err(ApplyError::EpochBackwards {
                seq: ev.seq,
                current: self.epoch,
                got: ev.epoch,
            });
        }
        let body = ev.body.as_ref().ok_or(ApplyError::EmptyEvent(ev.seq))?;
        let bad = |what: String| ApplyError::Invariant { seq: ev.seq, what };
        let before = self.holdings_before(body);
        match body {
            Body::NodeRegistered(r) => {
                let inv = r
                    .inventory
                    .as_ref()
                    .ok_or_else(|| bad("NodeRegistered without inventory".into()))?;
                self.nominations_keep_gpus(inv).map_err(bad)?;
                self.register(inv).map_err(bad)?;
            }
            Body::NodeRemoved(r) => {
                let node = self
                    .nodes
                    .get(&r.node)
                    .ok_or_else(|| bad(format!("NodeRemoved of unknown node {}", r.node)))?;
                if !node.allocs.is_empty() {
                    return Err(bad(format!(
                        "NodeRemoved of {} with {} live allocations",
                        r.node,
                        node.allocs.len()
                    )));
                }
                if self.nominations.on_node(&r.node).next().is_some() {
                    return Err(bad(format!(
                        "NodeRemoved of {} with live nominations",
                        r.node
                    )));
                }
                if let Some(n) = self.nodes.remove(&r.node) {
                    for g in &n.gpus {
                        self.gpu_owner.remove(&g.uuid);
                    }
                }
            }
            Body::DeviceHealthChanged(h) => {
                let gpu = self
                    .nodes
                    .get_mut(&h.node)
                    .and_then(|n| n.gpu_mut(&h.gpu_uuid))
                    .ok_or_else(|| {
                        bad(format!(
                            "health change for unknown GPU {} on {}",
                            h.gpu_uuid, h.node
                        ))
                    })?;
                gpu.healthy = h.healthy;
            }
            Body::Reserved(r) => {
                self.require_mode(&r.node, pb::NodeMode::DevicePlugin, "Reserved")
                    .map_err(bad)?;
                self.reserve(ev, r).map_err(bad)?;
            }
            Body::ClaimGranted(g) => self.grant_claim(ev, g).map_err(bad)?,
            // Audit only: a refusal holds nothing.
            Body::ClaimRefused(_) => {}
            Body::ClaimPrepared(p) => self.prepare_claims(p).map_err(bad)?,
            Body::ClaimUnprepared(u) => self.unprepare_claims(u).map_err(bad)?,
            Body::ClaimConsumersChanged(c) => self.set_claim_consumers(c).map_err(bad)?,
            Body::Bound(b) => {
                let a = self.allocs.get_mut(&b.allocation_id).ok_or_else(|| {
                    bad(format!("Bound of unknown allocation {}", b.allocation_id))
                })?;
                if !b.node.is_empty() && a.node != b.node {
                    return Err(bad(format!(
                        "Bound names node {} but allocation {} is on {}",
                        b.node, a.id, a.node
                    )));
                }
                if a.state != AllocState::Reserved || a.claim.is_some() {
                    return Err(bad(format!(
                        "Bound of allocation {} in state {} (claim grants are bound at grant)",
                        a.id,
                        a.state.as_str()
                    )));
                }
                a.state = AllocState::Bound;
            }
            Body::Assigned(x) => self.assign(x).map_err(bad)?,
            Body::IdentityCorrected(c) => self.correct(c).map_err(bad)?,
            Body::Released(r) => {
                if let Some(a) = self.allocs.get(&r.allocation_id)
                    && !r.node.is_empty()
                    && a.node != r.node
                {
                    return Err(bad(format!(
                        "Released names node {} but allocation {} is on {}",
                        r.node, a.id, a.node
                    )));
                }
                self.release(r.allocation_id).map_err(bad)?;
            }
            Body::LimitViolated(_) => self.violations += 1,
            Body::LeaderElected(_) => {
                if ev.epoch <= self.epoch && self.seq > 0 {
                    return Err(bad(format!(
                        "LeaderElected with epoch {} not above {}",
                        ev.epoch, self.epoch
                    )));
                }
            }
            Body::QuotaSet(_) | Body::BudgetRemoved(_) => {}
            Body::BudgetSet(b) => {
                if let Some(why) = super::validate_budget(b) {
                    return Err(bad(format!("BudgetSet of {:?}: {why}", b.namespace)));
                }
            }
            // Both modes: a DRA node's nominations keep room from claims (preemption for
            // DRA pods).
            Body::Nominated(n) => self.nominate(n).map_err(bad)?,
            Body::NominationEnded(e) => self.end_nomination(e).map_err(bad)?,
        }
        self.account(body, before, ev.time_ms);
        self.seq = ev.seq;
        self.epoch = ev.epoch;
        self.time_ms = ev.time_ms;
        Ok(())
    }

    pub(super) fn register(&mut self, inv: &pb::NodeInventory) -> Result<(), String> {
        if inv.node.is_empty() {
            return Err("NodeRegistered with an empty node name".into());
        }
        let mut seen = BTreeSet::new();
        for g in &inv.gpus {
            if g.uuid.is_empty() || !seen.insert(g.uuid.as_str()) {
                return Err(format!(
                    "node {}: empty or duplicate GPU uuid {:?}",
                    inv.node, g.uuid
                ));
            }
            if let Some(other) = self.gpu_owner.get(&g.uuid).filter(|o| **o != inv.node) {
                return Err(format!(
                    "GPU {} is already registered on node {other}",
                    g.uuid
                ));
            }
        }
        let mode = super::types::node_mode(inv.mode)
            .ok_or_else(|| format!("node {}: unknown mode {}", inv.node, inv.mode))?;
        let old = self.nodes.get(&inv.node);
        if let Some(o) = old.filter(|o| o.mode != mode && !o.allocs.is_empty()) {
            return Err(format!(
                "node {}: mode changes from {} to {} while it holds {} allocations",
                inv.node,
                o.mode.as_str_name(),
                mode.as_str_name(),
                o.allocs.len()
            ));
        }
        let mut gpus: Vec<GpuState> = inv
            .gpus
            .iter()
            .map(|g| {
                let prev = old.and_then(|o| o.gpu(&g.uuid));
                GpuState {
                    uuid: g.uuid.clone(),
                    index: g.index,
                    model: g.model.clone(),
                    memory_mib: g.memory_mib,
                    healthy: g.healthy,
                    compute_capability: g.compute_capability.clone(),
                    mem_used: prev.map_or(0, |p| p.mem_used),
                    core_used: prev.map_or(0, |p| p.core_used),
                    holders: prev.map_or(0, |p| p.holders),
                }
            })
            .collect();
        gpus.sort_by_key(|g| g.index);
        if let Some(old) = old {
            for g in old.gpus.iter().filter(|g| g.holders > 0) {
                match gpus.iter().find(|n| n.uuid == g.uuid) {
                    None => {
                        return Err(format!(
                            "node {}: GPU {} has live allocations and cannot leave the inventory",
                            inv.node, g.uuid
                        ));
                    }
                    Some(n) if n.memory_mib < n.mem_used => {
                        return Err(format!(
                            "node {}: GPU {} would have {} MiB but {} MiB are allocated",
                            inv.node, g.uuid, n.memory_mib, n.mem_used
                        ));
                    }
                    Some(_) => {}
                }
            }
        }
        if let Some(old) = old {
            for g in &old.gpus {
                self.gpu_owner.remove(&g.uuid);
            }
        }
        for g in &gpus {
            self.gpu_owner.insert(g.uuid.clone(), inv.node.clone());
        }
        let old = self.nodes.get(&inv.node);
        let (cpu_used, memory_used, allocs, devices, pod_kinds) = old.map_or(
            (0, 0, BTreeSet::new(), FxHashMap::default(), [0; POD_KINDS]),
            |o| {
                (
                    o.cpu_used,
                    o.memory_used,
                    o.allocs.clone(),
                    o.devices.clone(),
                    o.pod_kinds,
                )
            },
        );
        self.nodes.insert(
            inv.node.clone(),
            NodeState {
                name: inv.node.clone(),
                gpus,
                cpu_milli: inv.cpu_milli,
                memory_mib: inv.memory_mib,
                cpu_used,
                memory_used,
                allocs,
                devices,
                pod_kinds,
                mode,
                isolation: inv.isolation.clone(),
                dra_cores: inv.dra_cores.clone(),
            },
        );
        Ok(())
    }

    pub(super) fn reserve(&mut self, ev: &pb::Event, r: &pb::Reserved) -> Result<(), String> {
        if r.allocation_id != ev.seq {
            return Err(format!(
                "Reserved allocation id {} is not its seq {}",
                r.allocation_id, ev.seq
            ));
        }
        let pod = r.pod.as_ref().ok_or("Reserved without pod")?;
        if pod.uid.is_empty() {
            return Err("Reserved with an empty pod uid".into());
        }
        if self.nominations.get(&pod.uid).is_some() {
            return Err(format!(
                "pod {} reserves while nominated: its nomination must end first",
                pod.uid
            ));
        }
        if let Some(other) = self.by_pod.get(&pod.uid).and_then(|c| c.get(&r.container)) {
            return Err(format!(
                "pod {} container {} already holds allocation {other}",
                pod.uid, r.container
            ));
        }
        if r.shares.is_empty() {
            return Err(format!("Reserved {} has no GPU share", r.allocation_id));
        }
        let node = self
            .nodes
            .get_mut(&r.node)
            .ok_or_else(|| format!("Reserved on unknown node {}", r.node))?;
        let mut idx: Vec<usize> = Vec::with_capacity(r.shares.len());
        for s in &r.shares {
            let i = node
                .gpus
                .iter()
                .position(|g| g.uuid == s.gpu_uuid)
                .ok_or_else(|| format!("Reserved on GPU {} not on node {}", s.gpu_uuid, r.node))?;
            if idx.contains(&i) {
                return Err(format!("Reserved takes GPU {} twice", s.gpu_uuid));
            }
            idx.push(i);
            let g = &node.gpus[i];
            if !g.healthy {
                return Err(format!("Reserved on unhealthy GPU {}", s.gpu_uuid));
            }
            if g.mem_used.saturating_add(s.mem_mib) > g.memory_mib {
                return Err(format!(
                    "GPU {} memory over capacity: {} + {} > {} MiB",
                    g.uuid, g.mem_used, s.mem_mib, g.memory_mib
                ));
            }
            if g.core_used.saturating_add(s.core_milli) > CORE_MILLI_PER_GPU {
                return Err(format!(
                    "GPU {} compute over capacity: {} + {} > {CORE_MILLI_PER_GPU}",
                    g.uuid, g.core_used, s.core_milli
                ));
            }
        }
        if node.cpu_milli > 0 && node.cpu_used.saturating_add(r.cpu_milli) > node.cpu_milli {
            return Err(format!("node {} CPU over capacity", r.node));
        }
        if node.memory_mib > 0 && node.memory_used.saturating_add(r.memory_mib) > node.memory_mib {
            return Err(format!("node {} host memory over capacity", r.node));
        }
        for (s, i) in r.shares.iter().zip(idx) {
            let g = &mut node.gpus[i];
            g.mem_used += s.mem_mib;
            g.core_used += s.core_milli;
            g.holders += 1;
        }
        // Unconstrained nodes (0) take any request: the sums saturate rather than wrap.
        node.cpu_used = node.cpu_used.saturating_add(r.cpu_milli);
        node.memory_used = node.memory_used.saturating_add(r.memory_mib);
        node.add_pod_kind(pod_kind(r.shares.len(), r.shares[0].core_milli));
        node.allocs.insert(r.allocation_id);
        self.index_insert(&pod.uid, &r.container, r.allocation_id);
        self.allocs.insert(
            r.allocation_id,
            Alloc {
                id: r.allocation_id,
                pod: pod.clone(),
                container: r.container.clone(),
                node: r.node.clone(),
                shares: r.shares.clone(),
                state: AllocState::Reserved,
                reserved_ms: ev.time_ms,
                deadline_ms: r.deadline_ms,
                device_ids: Vec::new(),
                cpu_milli: r.cpu_milli,
                memory_mib: r.memory_mib,
                epoch: ev.epoch,
                policy: r.policy.clone(),
                claim: None,
            },
        );
        Ok(())
    }

    fn assign(&mut self, x: &pb::Assigned) -> Result<(), String> {
        let a = self
            .allocs
            .get(&x.allocation_id)
            .ok_or_else(|| format!("Assigned of unknown allocation {}", x.allocation_id))?;
        if !x.node.is_empty() && a.node != x.node {
            return Err(format!(
                "Assigned names node {} but allocation {} is on {}",
                x.node, a.id, a.node
            ));
        }
        if a.state == AllocState::Assigned {
            return Err(format!("allocation {} is already assigned", a.id));
        }
        if a.claim.is_some() {
            return Err(format!(
                "Assigned of claim grant {} (claims are prepared)",
                a.id
            ));
        }
        if x.device_ids.is_empty() {
            return Err(format!("Assigned {} without device ids", a.id));
        }
        let node = self
            .nodes
            .get_mut(&a.node)
            .ok_or("allocation on unknown node")?;
        for d in &x.device_ids {
            if let Some(o) = node.devices.get(d).filter(|o| **o != a.id) {
                return Err(format!("device {d} is already held by allocation {o}"));
            }
        }
        for d in &x.device_ids {
            node.devices.insert(d.clone(), x.allocation_id);
        }
        let a = self
            .allocs
            .get_mut(&x.allocation_id)
            .expect("checked above");
        a.state = AllocState::Assigned;
        a.device_ids = x.device_ids.clone();
        Ok(())
    }

    fn correct(&mut self, c: &pb::IdentityCorrected) -> Result<(), String> {
        let (a, b) = (c.from_allocation_id, c.to_allocation_id);
        if a == b {
            return Err(format!("IdentityCorrected of allocation {a} with itself"));
        }
        let (Some(x), Some(y)) = (self.allocs.get(&a), self.allocs.get(&b)) else {
            return Err(format!(
                "IdentityCorrected between unknown allocations {a} and {b}"
            ));
        };
        if x.node != y.node {
            return Err(format!(
                "IdentityCorrected across nodes {} and {}",
                x.node, y.node
            ));
        }
        if x.claim.is_some() || y.claim.is_some() {
            return Err(format!(
                "IdentityCorrected between {a} and {b}: claim grants name their claim, not a guess"
            ));
        }
        // What belongs to the pod moves with it: who it is, its reservation clock and its
        // host CPU/memory request. What belongs to the devices stays: GPUs, shares, device IDs
        // and a claim. The pod that lost `a` was never admitted (its reservation was claimed
        // for another pod's devices), so `b` becomes its reservation again unless `b` is
        // itself claimed; whether that pod is bound the pod watcher confirms at the deadline.
        let xp = (
            x.pod.clone(),
            x.container.clone(),
            x.reserved_ms,
            x.deadline_ms,
        );
        let yp = (
            y.pod.clone(),
            y.container.clone(),
            y.reserved_ms,
            y.deadline_ms,
        );
        let (xr, yr) = ((x.cpu_milli, x.memory_mib), (y.cpu_milli, y.memory_mib));
        self.index_remove(&xp.0.uid, &xp.1);
        self.index_remove(&yp.0.uid, &yp.1);
        self.index_insert(&xp.0.uid, &xp.1, b);
        self.index_insert(&yp.0.uid, &yp.1, a);
        let x = self.allocs.get_mut(&a).expect("checked above");
        (x.pod, x.container, x.reserved_ms, x.deadline_ms) = yp;
        (x.cpu_milli, x.memory_mib) = yr;
        let y = self.allocs.get_mut(&b).expect("checked above");
        (y.pod, y.container, y.reserved_ms, y.deadline_ms) = xp;
        (y.cpu_milli, y.memory_mib) = xr;
        if y.state == AllocState::Bound {
            y.state = AllocState::Reserved;
        }
        Ok(())
    }

    fn index_insert(&mut self, uid: &str, container: &str, id: u64) {
        match self.by_pod.get_mut(uid) {
            Some(c) => c.insert(container, id),
            None => {
                let mut c = Containers::default();
                c.insert(container, id);
                self.by_pod.insert(uid.to_owned(), c);
            }
        }
    }

    fn index_remove(&mut self, uid: &str, container: &str) {
        if let Some(c) = self.by_pod.get_mut(uid) {
            c.remove(container);
            if c.is_empty() {
                self.by_pod.remove(uid);
            }
        }
    }

    fn release(&mut self, id: u64) -> Result<(), String> {
        let a = self
            .allocs
            .remove(&id)
            .ok_or_else(|| format!("Released of unknown allocation {id}"))?;
        self.index_remove(&a.pod.uid, &a.container);
        let node = self
            .nodes
            .get_mut(&a.node)
            .expect("an allocation's node stays registered while it lives");
        for s in &a.shares {
            let g = node
                .gpu_mut(&s.gpu_uuid)
                .expect("an allocated GPU stays in the inventory while it is held");
            g.mem_used -= s.mem_mib;
            g.core_used -= s.core_milli;
            g.holders -= 1;
        }
        node.cpu_used = node.cpu_used.saturating_sub(a.cpu_milli);
        node.memory_used = node.memory_used.saturating_sub(a.memory_mib);
        node.remove_pod_kind(pod_kind(
            a.shares.len(),
            a.shares.first().map_or(0, |s| s.core_milli),
        ));
        node.allocs.remove(&id);
        for d in &a.device_ids {
            node.devices.remove(d);
        }
        Ok(())
    }
}
