//! Deciding nominations: keeping the room a preemption frees for the pod that preempted,
//! ending them, and a nominee's reservation on the shares it was nominated for.

use std::collections::BTreeMap;

use super::{CommandError, Reply};
use crate::pb;
use crate::pb::event::Body;
use crate::placement::{ContainerPlacement, PodRequest};
use crate::state::{Ledger, NodeState, nominee};

impl Ledger {
    pub(super) fn decide_nominate(
        &self,
        n: pb::Nominated,
        leaving: &[String],
    ) -> Result<(Vec<Body>, Reply), CommandError> {
        let invalid = |m: String| Err(CommandError::Invalid(m));
        let uid = nominee(&n).to_string();
        if uid.is_empty() {
            return invalid("a nomination needs the pod's uid".into());
        }
        if n.containers.is_empty() || n.containers.iter().any(|c| c.shares.is_empty()) {
            return invalid("a nomination needs a GPU share for every container".into());
        }
        if let Some(v) = n.victims.iter().find(|v| v.priority >= n.priority) {
            return invalid(format!(
                "victim {} has priority {}, not below the preemptor's {}",
                v.pod.as_ref().map_or("?", |p| p.name.as_str()),
                v.priority,
                n.priority
            ));
        }
        let node = self
            .node(&n.node)
            .ok_or_else(|| CommandError::NotFound(format!("node {} is not registered", n.node)))?;
        if let Some(cur) = self.nominations().get(&uid) {
            if cur.node == n.node && cur.containers == n.containers {
                return Ok((Vec::new(), Reply::Done { changed: false }));
            }
            return Err(CommandError::Conflict(format!(
                "pod {uid} is already nominated on node {} until {} ms",
                cur.node, cur.deadline_ms
            )));
        }
        if let Some(a) = self.allocs_of_pod(&uid).first() {
            return Err(CommandError::Conflict(format!(
                "pod {uid} already holds allocation {} on node {}",
                a.id, a.node
            )));
        }
        let mut room = without(
            self,
            node,
            n.victims
                .iter()
                .filter_map(|v| v.pod.as_ref())
                .map(|p| p.uid.as_str())
                .chain(leaving.iter().map(String::as_str)),
        );
        for other in self.nominations().keeping_from(&n.node, &uid, n.priority) {
            crate::state::take_nominated(&mut room, other);
        }
        let mut want: BTreeMap<&str, (u64, u32)> = BTreeMap::new();
        for s in n.containers.iter().flat_map(|c| &c.shares) {
            let w = want.entry(s.gpu_uuid.as_str()).or_default();
            w.0 = w.0.saturating_add(s.mem_mib);
            w.1 = w.1.saturating_add(s.core_milli);
        }
        for (uuid, (mem, core)) in want {
            let g = room.gpu(uuid).ok_or_else(|| {
                CommandError::Invalid(format!("GPU {uuid} is not on node {}", n.node))
            })?;
            if !g.healthy {
                return Err(CommandError::NoCapacity(format!("GPU {uuid} is unhealthy")));
            }
            if mem > g.mem_free() || core > g.core_free() {
                return Err(CommandError::NoCapacity(format!(
                    "GPU {uuid} has {} MiB and {} thousandths free once the victims are gone, \
                     the nomination takes {mem} MiB and {core}",
                    g.mem_free(),
                    g.core_free()
                )));
            }
        }
        let short = |limit: u64, used: u64, add: u64| limit > 0 && used.saturating_add(add) > limit;
        if short(room.cpu_milli, room.cpu_used, n.cpu_milli)
            || short(room.memory_mib, room.memory_used, n.memory_mib)
        {
            return Err(CommandError::NoCapacity(format!(
                "node {} lacks the pod's CPU or host memory once the victims are gone",
                n.node
            )));
        }
        Ok((vec![Body::Nominated(n)], Reply::Done { changed: true }))
    }

    /// The event that ends pod `uid`'s nomination, when it has one.
    pub(super) fn end_nomination_body(&self, uid: &str, reason: String) -> Option<Body> {
        let n = self.nominations().get(uid)?;
        Some(Body::NominationEnded(pb::NominationEnded {
            pod: n.pod.clone(),
            node: n.node.clone(),
            reason,
        }))
    }

    /// The events ending the nominations on `node` (all of them, or with `kept` the GPUs that
    /// stay, those that name another GPU).
    pub(super) fn nominations_ending_on(
        &self,
        node: &str,
        kept: Option<&[&str]>,
        reason: &str,
    ) -> Vec<Body> {
        self.nominations()
            .on_node(node)
            .filter(|n| {
                kept.is_none_or(|k| {
                    n.containers
                        .iter()
                        .flat_map(|c| &c.shares)
                        .any(|s| !k.contains(&s.gpu_uuid.as_str()))
                })
            })
            .filter_map(|n| self.end_nomination_body(nominee(n), reason.to_string()))
            .collect()
    }

    /// The shares the pod of `req` was nominated for on `node`, when they fit there now and
    /// name the request's containers: a nominee reserves exactly the room its preemption
    /// freed.
    pub(super) fn nominated_placement(
        &self,
        node: &NodeState,
        req: &PodRequest,
    ) -> Option<Vec<ContainerPlacement>> {
        let n = self.nominations().get(&req.pod.uid)?;
        if n.node != node.name || n.containers.len() != req.containers.len() {
            return None;
        }
        let mut out = Vec::with_capacity(req.containers.len());
        let mut scratch = node.clone();
        for c in &req.containers {
            let nc = n.containers.iter().find(|x| x.container == c.name)?;
            let c = c.normalized();
            if nc.shares.len() != c.slices as usize {
                return None;
            }
            for s in &nc.shares {
                let g = scratch.gpus.iter_mut().find(|g| g.uuid == s.gpu_uuid)?;
                let fits = g.healthy
                    && req.selector.accepts(g)
                    && s.mem_mib == c.mem_on(g)
                    && s.core_milli == c.core_milli
                    && g.mem_free() >= s.mem_mib
                    && g.core_free() >= s.core_milli;
                if !fits {
                    return None;
                }
                g.mem_used += s.mem_mib;
                g.core_used += s.core_milli;
            }
            out.push(ContainerPlacement {
                container: c.name.clone(),
                shares: nc.shares.clone(),
            });
        }
        let short = |limit: u64, used: u64, add: u64| limit > 0 && used.saturating_add(add) > limit;
        if short(node.cpu_milli, node.cpu_used, req.cpu_milli)
            || short(node.memory_mib, node.memory_used, req.memory_mib)
        {
            return None;
        }
        Some(out)
    }

    /// What a refusal on `node` adds when room there is nominated for pods that outrank `req`.
    pub fn room_kept(&self, node: &str, req: &PodRequest) -> String {
        let kept: Vec<String> = self
            .nominations()
            .keeping_from(node, &req.pod.uid, req.priority)
            .filter_map(|n| n.pod.as_ref())
            .map(|p| format!("{}/{}", p.namespace, p.name))
            .collect();
        if kept.is_empty() {
            return String::new();
        }
        format!(
            " (room there is kept for {}, which preempted for it)",
            kept.join(", ")
        )
    }
}

/// `node` with the allocations of the pods `gone` released (their reservations, and the
/// grants of claims reserved for them only).
fn without<'a>(l: &Ledger, node: &NodeState, gone: impl Iterator<Item = &'a str>) -> NodeState {
    let gone: std::collections::BTreeSet<&str> = gone.collect();
    let mut n = node.clone();
    for a in l.freed_on(&node.name, &gone) {
        for s in &a.shares {
            if let Some(g) = n.gpus.iter_mut().find(|g| g.uuid == s.gpu_uuid) {
                g.mem_used = g.mem_used.saturating_sub(s.mem_mib);
                g.core_used = g.core_used.saturating_sub(s.core_milli);
                g.holders = g.holders.saturating_sub(1);
            }
        }
        n.cpu_used = n.cpu_used.saturating_sub(a.cpu_milli);
        n.memory_used = n.memory_used.saturating_sub(a.memory_mib);
    }
    n
}

#[cfg(test)]
mod dra_tests;
#[cfg(test)]
mod tests;
