//! The invariants of the state as a whole, re-derived from scratch.

use std::collections::HashMap;

use super::{Containers, Ledger, POD_KINDS, pod_kind};
use crate::CORE_MILLI_PER_GPU;

impl Ledger {
    /// Recompute every usage counter from the live allocations and check every invariant of
    /// the state as a whole (the per-event checks, re-done from scratch). Used by tests and by
    /// `gpuledger verify`.
    pub fn check(&self) -> Result<(), String> {
        let mut mem: HashMap<&str, u64> = HashMap::new();
        let mut core: HashMap<&str, u32> = HashMap::new();
        let mut holders: HashMap<&str, u32> = HashMap::new();
        let mut cpu: HashMap<&str, u64> = HashMap::new();
        let mut hmem: HashMap<&str, u64> = HashMap::new();
        for a in self.allocs.values() {
            let n = self
                .nodes
                .get(&a.node)
                .ok_or_else(|| format!("allocation {} on unknown node {}", a.id, a.node))?;
            if !n.allocs.contains(&a.id) {
                return Err(format!("node {} does not list allocation {}", a.node, a.id));
            }
            if self
                .by_pod
                .get(&a.pod.uid)
                .and_then(|c| c.get(&a.container))
                != Some(&a.id)
            {
                return Err(format!(
                    "allocation {} missing from the container index",
                    a.id
                ));
            }
            for s in &a.shares {
                if n.gpu(&s.gpu_uuid).is_none() {
                    return Err(format!("allocation {} on unknown GPU {}", a.id, s.gpu_uuid));
                }
                *mem.entry(&s.gpu_uuid).or_default() += s.mem_mib;
                *core.entry(&s.gpu_uuid).or_default() += s.core_milli;
                *holders.entry(&s.gpu_uuid).or_default() += 1;
            }
            *cpu.entry(&a.node).or_default() += a.cpu_milli;
            *hmem.entry(&a.node).or_default() += a.memory_mib;
        }
        if self.by_pod.values().map(Containers::len).sum::<usize>() != self.allocs.len() {
            return Err("container index and allocations differ in size".into());
        }
        for n in self.nodes.values() {
            let listed = n
                .allocs
                .iter()
                .filter(|id| self.allocs.contains_key(id))
                .count();
            if listed != n.allocs.len() {
                return Err(format!("node {} lists released allocations", n.name));
            }
            let held: usize = n
                .allocs
                .iter()
                .filter_map(|id| self.allocs.get(id))
                .map(|a| a.device_ids.len())
                .sum();
            if held != n.devices.len()
                || n.devices.iter().any(|(d, id)| {
                    !self
                        .allocs
                        .get(id)
                        .is_some_and(|a| a.device_ids.contains(d))
                })
            {
                return Err(format!("node {} device index is off", n.name));
            }
            let mut kinds = [0u32; POD_KINDS];
            for a in n.allocs.iter().filter_map(|id| self.allocs.get(id)) {
                let core = a.shares.first().map_or(0, |s| s.core_milli);
                kinds[pod_kind(a.shares.len(), core)] += 1;
            }
            if kinds != n.pod_kinds {
                return Err(format!("node {} pod kind counts are off", n.name));
            }
            if cpu.get(n.name.as_str()).copied().unwrap_or(0) != n.cpu_used
                || hmem.get(n.name.as_str()).copied().unwrap_or(0) != n.memory_used
            {
                return Err(format!("node {} CPU/memory counters are off", n.name));
            }
            for g in &n.gpus {
                let (m, c, h) = (
                    mem.get(g.uuid.as_str()).copied().unwrap_or(0),
                    core.get(g.uuid.as_str()).copied().unwrap_or(0),
                    holders.get(g.uuid.as_str()).copied().unwrap_or(0),
                );
                if (m, c, h) != (g.mem_used, g.core_used, g.holders) {
                    return Err(format!("GPU {} counters are off", g.uuid));
                }
                if m > g.memory_mib {
                    return Err(format!(
                        "GPU {} memory over capacity: {m} > {}",
                        g.uuid, g.memory_mib
                    ));
                }
                if c > CORE_MILLI_PER_GPU {
                    return Err(format!("GPU {} compute over capacity: {c}", g.uuid));
                }
                if self.gpu_owner.get(&g.uuid) != Some(&n.name) {
                    return Err(format!("GPU {} missing from the owner index", g.uuid));
                }
            }
        }
        self.check_modes()?;
        self.check_nominations()
    }
}
