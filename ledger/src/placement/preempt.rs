//! Preemption: which lower-priority pods to evict so that a pod fits on a node.
//!
//! kube-scheduler's own dry run does not see GPU memory or compute (they are ignored by the
//! scheduler), so it cannot tell which pods free a fit; this answers it from the ledger: the
//! fewest pods whose slices, once released, let [`evaluate`] place the request, then the lowest
//! priorities. Evicting a pod whose slices are on other GPUs than the ones the request lands on
//! helps nobody, and such a pod is never in the answer. [`choose_victims`] answers for one node
//! (the scheduler's `preempt` verb); [`choose_nomination`] picks the node as well (the
//! allocator's own preemption, which nominates the pod for the room). On a DRA node the
//! allocations are claim grants: a grant counts as the pod's its claim is reserved for, so the
//! same search chooses the DRA pods whose eviction frees room for a claim.

use std::collections::BTreeSet;

use rustc_hash::FxHashMap;

use super::{ContainerPlacement, PodRequest, evaluate, materialize};
use crate::pb;
use crate::state::{Alloc, Ledger, NodeState, holders, pod_kind};

/// Placement evaluations spent on the exhaustive search before it settles for an irreducible set
/// found greedily: a node with many small pods would otherwise cost C(n, k) evaluations.
const EXACT_BUDGET: usize = 5_000;

/// A pod that may be evicted, with its priority (`spec.priority`, 0 when unset).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evictable {
    /// Pod UID.
    pub pod_uid: String,
    /// The pod's priority.
    pub priority: i32,
}

/// The pods to evict and where the preemptor then goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Victims {
    /// UIDs of the pods to evict, lowest priority first (ties by UID); empty when the pod fits
    /// once the pods already leaving are gone.
    pub pods: Vec<String>,
    /// Where the preemptor's containers land once they are gone.
    pub placement: Vec<ContainerPlacement>,
}

/// What evicting one pod frees on the node.
struct Freed {
    priority: i32,
    /// (GPU index, memory, compute) per share.
    shares: Vec<(usize, u64, u32)>,
    cpu_milli: u64,
    memory_mib: u64,
    kinds: Vec<usize>,
}

impl Freed {
    fn of(node: &NodeState, allocs: &[&Alloc], priority: i32) -> Freed {
        let mut f = Freed {
            priority,
            shares: Vec::new(),
            cpu_milli: 0,
            memory_mib: 0,
            kinds: Vec::new(),
        };
        for a in allocs {
            for s in &a.shares {
                if let Some(i) = node.gpus.iter().position(|g| g.uuid == s.gpu_uuid) {
                    f.shares.push((i, s.mem_mib, s.core_milli));
                }
            }
            f.cpu_milli += a.cpu_milli;
            f.memory_mib += a.memory_mib;
            let core = a.shares.first().map_or(0, |s| s.core_milli);
            f.kinds.push(pod_kind(a.shares.len(), core));
        }
        f
    }

    /// Release (or, with `back`, take again) what this pod holds on `node`.
    fn apply(&self, node: &mut NodeState, back: bool) {
        for &(i, mem, core) in &self.shares {
            let g = &mut node.gpus[i];
            if back {
                g.mem_used += mem;
                g.core_used += core;
                g.holders += 1;
            } else {
                g.mem_used = g.mem_used.saturating_sub(mem);
                g.core_used = g.core_used.saturating_sub(core);
                g.holders = g.holders.saturating_sub(1);
            }
        }
        for &k in &self.kinds {
            let c = &mut node.pod_kinds[k];
            *c = if back { *c + 1 } else { c.saturating_sub(1) };
        }
        if back {
            node.cpu_used += self.cpu_milli;
            node.memory_used += self.memory_mib;
        } else {
            node.cpu_used = node.cpu_used.saturating_sub(self.cpu_milli);
            node.memory_used = node.memory_used.saturating_sub(self.memory_mib);
        }
    }
}

/// The fewest pods of `evictable` to evict from `node` so that `req` fits, then the lowest
/// priorities (the highest victim priority, then their sum, then UIDs); None if evicting all
/// of them does not make it fit.
///
/// `allocs` are the live allocations on `node`; `priority` is the preemptor's: only pods of
/// lower priority, holding an allocation here, are ever chosen. The pods of `leaving` (being
/// evicted or deleted anyway) count as gone and are not part of the answer.
pub fn choose_victims(
    node: &NodeState,
    allocs: &[&Alloc],
    req: &PodRequest,
    priority: i32,
    leaving: &BTreeSet<String>,
    evictable: &[Evictable],
) -> Option<Victims> {
    let mut scratch = NodeState {
        allocs: BTreeSet::new(),
        devices: Default::default(),
        ..node.clone()
    };
    let mut by_pod: FxHashMap<&str, Vec<&Alloc>> = FxHashMap::default();
    for a in allocs {
        by_pod.entry(a.pod.uid.as_str()).or_default().push(a);
    }
    for uid in leaving {
        if let Some(held) = by_pod.remove(uid.as_str()) {
            Freed::of(node, &held, 0).apply(&mut scratch, false);
        }
    }
    let mut cands: Vec<&Evictable> = evictable
        .iter()
        .filter(|e| e.priority < priority && by_pod.contains_key(e.pod_uid.as_str()))
        .collect();
    cands.sort_by(|a, b| (a.priority, &a.pod_uid).cmp(&(b.priority, &b.pod_uid)));
    cands.dedup_by(|a, b| a.pod_uid == b.pod_uid);
    let freed: Vec<Freed> = cands
        .iter()
        .map(|e| Freed::of(node, &by_pod[e.pod_uid.as_str()], e.priority))
        .collect();

    let answer = |scratch: &NodeState, chosen: &[usize]| -> Option<Victims> {
        let c = evaluate(scratch, req).ok()?;
        Some(Victims {
            pods: chosen.iter().map(|&i| cands[i].pod_uid.clone()).collect(),
            placement: materialize(scratch, req, &c),
        })
    };
    if let Some(v) = answer(&scratch, &[]) {
        return Some(v);
    }
    // Hopeless nodes are the common case among the scheduler's candidates: find out at once.
    freed.iter().for_each(|f| f.apply(&mut scratch, false));
    let fits_all = evaluate(&scratch, req).is_ok();
    freed.iter().for_each(|f| f.apply(&mut scratch, true));
    if !fits_all {
        return None;
    }
    let mut budget = EXACT_BUDGET;
    for k in 1..=freed.len() {
        match smallest_of_size(&mut scratch, req, &freed, k, &mut budget) {
            Search::Found(chosen) => {
                chosen
                    .iter()
                    .for_each(|&i| freed[i].apply(&mut scratch, false));
                return answer(&scratch, &chosen);
            }
            Search::None => {}
            Search::OutOfBudget => break,
        }
    }
    let chosen = irreducible(&mut scratch, req, &freed);
    chosen
        .iter()
        .for_each(|&i| freed[i].apply(&mut scratch, false));
    answer(&scratch, &chosen)
}

/// What Kubernetes says about the pods of one candidate node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodePods {
    /// The node.
    pub node: String,
    /// Its pods that may be evicted, with their priorities (the caller leaves out pods a
    /// PodDisruptionBudget protects and pods already terminating).
    pub evictable: Vec<Evictable>,
    /// UIDs of its pods on their way out anyway (terminating, or ended).
    pub leaving: BTreeSet<String>,
}

/// Where to preempt for a pod, and what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The node.
    pub node: String,
    /// The pods to evict, with their priorities, lowest priority first; empty when the pod
    /// fits there once the pods already leaving are gone.
    pub victims: Vec<Evictable>,
    /// Where the pod's containers land once they are gone.
    pub placement: Vec<ContainerPlacement>,
}

impl Plan {
    /// The `Nominated` event of this plan for `req`, ending at `deadline_ms`; `pods` names the
    /// victims (namespace and name by UID; unknown ones keep only their UID).
    pub fn nomination(
        &self,
        req: &PodRequest,
        deadline_ms: i64,
        pods: &dyn Fn(&str) -> Option<pb::PodRef>,
    ) -> pb::Nominated {
        pb::Nominated {
            pod: Some(req.pod.clone()),
            priority: req.priority,
            node: self.node.clone(),
            containers: self
                .placement
                .iter()
                .map(|c| pb::NominatedContainer {
                    container: c.container.clone(),
                    shares: c.shares.clone(),
                })
                .collect(),
            victims: self
                .victims
                .iter()
                .map(|v| pb::Victim {
                    pod: Some(pods(&v.pod_uid).unwrap_or_else(|| pb::PodRef {
                        uid: v.pod_uid.clone(),
                        ..Default::default()
                    })),
                    priority: v.priority,
                })
                .collect(),
            deadline_ms,
            cpu_milli: req.cpu_milli,
            memory_mib: req.memory_mib,
        }
    }
}

/// One candidate node for [`choose_among`], taken out of the state so that the search can run
/// without holding it: the node as the preemptor sees it ([`Ledger::node_for`]), its live
/// allocations, and what Kubernetes says about its pods.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// The node, nominated room of pods that outrank the preemptor counted as taken.
    pub node: NodeState,
    /// Its live allocations, each under the eviction unit that frees it.
    pub allocs: Vec<Alloc>,
    /// Its pods' priorities and who is leaving, pods tied by a shared claim as one unit.
    pub pods: NodePods,
    /// The units of several pods ([`units`]): the unit's name, and the pods evicted for it.
    pub units: FxHashMap<String, Vec<Evictable>>,
}

/// Evicting a pod frees a claim grant only when every pod the claim is reserved for goes, so
/// pods that share a grant, and that may all be moved (evictable or leaving), are evicted
/// together: one unit, of the highest priority among them, named by their UIDs joined by `+`.
/// The allocations of a unit's pods are put under the unit's name; a grant shared with a pod
/// that may not be moved stays under its claim, which no pod is, and is never freed. Returns
/// the allocations so relabelled, the pods with the units in place of their members, and
/// each unit's members that are not leaving anyway.
fn units(
    allocs: Vec<Alloc>,
    pods: &NodePods,
) -> (Vec<Alloc>, NodePods, FxHashMap<String, Vec<Evictable>>) {
    let may_go: BTreeSet<&str> = (pods.leaving.iter().map(String::as_str))
        .chain(pods.evictable.iter().map(|e| e.pod_uid.as_str()))
        .collect();
    let movable = |u: &str| may_go.contains(u);
    // Union-find over the pods of the grants that several movable pods share.
    let mut parent: FxHashMap<&str, &str> = FxHashMap::default();
    fn root<'a>(parent: &FxHashMap<&'a str, &'a str>, mut u: &'a str) -> &'a str {
        while let Some(&p) = parent.get(u).filter(|p| **p != u) {
            u = p;
        }
        u
    }
    for a in &allocs {
        let h = holders(a);
        if h.len() < 2 || !h.iter().all(|u| movable(u)) {
            continue;
        }
        for u in &h {
            parent.entry(u).or_insert(u);
        }
        let first = root(&parent, h[0]);
        for u in &h[1..] {
            let r = root(&parent, u);
            if r != first {
                parent.insert(r, first);
            }
        }
    }
    let mut members: FxHashMap<&str, BTreeSet<&str>> = FxHashMap::default();
    for &u in parent.keys() {
        members.entry(root(&parent, u)).or_default().insert(u);
    }
    let name_of: FxHashMap<&str, String> = members
        .values()
        .flat_map(|m| {
            let name = m.iter().copied().collect::<Vec<_>>().join("+");
            m.iter().map(move |u| (*u, name.clone()))
        })
        .collect();
    let relabel = |a: &Alloc| -> Alloc {
        let mut a = a.clone();
        let h = holders(&a);
        let unit = match h.as_slice() {
            [only] => name_of
                .get(only)
                .cloned()
                .or_else(|| Some((*only).to_string())),
            [first, ..] if h.iter().all(|u| movable(u)) => name_of.get(first).cloned(),
            _ => None,
        };
        if let Some(u) = unit {
            a.pod.uid = u;
        }
        a
    };
    let allocs = allocs.iter().map(relabel).collect();
    let mut out = NodePods {
        node: pods.node.clone(),
        ..Default::default()
    };
    let mut unit_members: FxHashMap<String, Vec<Evictable>> = FxHashMap::default();
    for m in members.values() {
        let name = name_of[m.iter().next().expect("a unit has members")].clone();
        let going: Vec<Evictable> = pods
            .evictable
            .iter()
            .filter(|e| m.contains(e.pod_uid.as_str()) && !pods.leaving.contains(&e.pod_uid))
            .cloned()
            .collect();
        match going.iter().map(|e| e.priority).max() {
            None => {
                out.leaving.insert(name.clone());
            }
            Some(priority) => out.evictable.push(Evictable {
                pod_uid: name.clone(),
                priority,
            }),
        }
        unit_members.insert(name, going);
    }
    out.evictable.extend(
        pods.evictable
            .iter()
            .filter(|e| !name_of.contains_key(e.pod_uid.as_str()))
            .cloned(),
    );
    out.leaving.extend(
        pods.leaving
            .iter()
            .filter(|u| !name_of.contains_key(u.as_str()))
            .cloned(),
    );
    (allocs, out, unit_members)
}

/// The candidates of `pods` as `req` sees them in `ledger` (unknown nodes left out, and nodes
/// where no pod may be evicted and none is leaving: nothing can free room there). On a DRA
/// node the allocations are claim grants, each under the pod, or the [`units`] of pods, whose
/// eviction frees it.
pub fn candidates(ledger: &Ledger, req: &PodRequest, pods: &[NodePods]) -> Vec<Candidate> {
    pods.iter()
        .filter(|p| !p.evictable.is_empty() || !p.leaving.is_empty())
        .filter_map(|p| {
            let node = ledger.node_for(&p.node, req)?.into_owned();
            let allocs = node
                .allocs
                .iter()
                .filter_map(|id| ledger.alloc(*id))
                .cloned()
                .collect();
            let (allocs, pods, units) = units(allocs, p);
            Some(Candidate {
                node,
                allocs,
                pods,
                units,
            })
        })
        .collect()
}

/// The best of `candidates` to preempt on for `req` (at `req.priority`), or None when no
/// eviction makes it fit on any. Nodes are compared as kube-scheduler compares its
/// candidates: the lowest highest victim priority, then the lowest sum of priorities, then the
/// fewest victims; ties go to the first in the caller's order. A node that needs no eviction
/// (its leaving pods free the room) beats every other.
pub fn choose_among(req: &PodRequest, candidates: &[Candidate]) -> Option<Plan> {
    let mut best: Option<((i32, i64, usize), Plan)> = None;
    for c in candidates {
        let allocs: Vec<&Alloc> = c.allocs.iter().collect();
        let p = &c.pods;
        let Some(v) = choose_victims(
            &c.node,
            &allocs,
            req,
            req.priority,
            &p.leaving,
            &p.evictable,
        ) else {
            continue;
        };
        let prio = |uid: &String| {
            p.evictable
                .iter()
                .find(|e| &e.pod_uid == uid)
                .map_or(0, |e| e.priority)
        };
        let mut victims: Vec<Evictable> = v
            .pods
            .iter()
            .flat_map(|u| match c.units.get(u) {
                Some(members) => members.clone(),
                None => vec![Evictable {
                    pod_uid: u.clone(),
                    priority: prio(u),
                }],
            })
            .collect();
        victims.sort_by(|a, b| (a.priority, &a.pod_uid).cmp(&(b.priority, &b.pod_uid)));
        let key = (
            victims.iter().map(|e| e.priority).max().unwrap_or(i32::MIN),
            victims.iter().map(|e| i64::from(e.priority)).sum::<i64>(),
            victims.len(),
        );
        if best.as_ref().is_none_or(|(b, _)| key < *b) {
            best = Some((
                key,
                Plan {
                    node: p.node.clone(),
                    victims,
                    placement: v.placement,
                },
            ));
        }
    }
    best.map(|(_, p)| p)
}

/// [`choose_among`] the candidates of `pods` in `ledger`.
pub fn choose_nomination(ledger: &Ledger, req: &PodRequest, pods: &[NodePods]) -> Option<Plan> {
    choose_among(req, &candidates(ledger, req, pods))
}

enum Search {
    Found(Vec<usize>),
    None,
    OutOfBudget,
}

/// The best `k`-subset of `freed` (by highest priority, then sum of priorities, then indices)
/// that lets `req` fit, trying subsets in lexicographic order of indices.
fn smallest_of_size(
    node: &mut NodeState,
    req: &PodRequest,
    freed: &[Freed],
    k: usize,
    budget: &mut usize,
) -> Search {
    let n = freed.len();
    let mut idx: Vec<usize> = (0..k).collect();
    let mut best: Option<((i32, i64), Vec<usize>)> = None;
    loop {
        // Candidates are sorted by priority, so the last index has the highest.
        let key = (
            freed[idx[k - 1]].priority,
            idx.iter()
                .map(|&i| i64::from(freed[i].priority))
                .sum::<i64>(),
        );
        // Lexicographic order makes an earlier subset with an equal key the better one.
        if best.as_ref().is_none_or(|(b, _)| key < *b) {
            if *budget == 0 {
                return Search::OutOfBudget;
            }
            *budget -= 1;
            idx.iter().for_each(|&i| freed[i].apply(node, false));
            let fits = evaluate(node, req).is_ok();
            idx.iter().for_each(|&i| freed[i].apply(node, true));
            if fits {
                best = Some((key, idx.clone()));
            }
        }
        // Next combination in lexicographic order.
        let Some(pos) = (0..k).rev().find(|&p| idx[p] < n - k + p) else {
            break;
        };
        idx[pos] += 1;
        for p in pos + 1..k {
            idx[p] = idx[p - 1] + 1;
        }
    }
    best.map_or(Search::None, |(_, chosen)| Search::Found(chosen))
}

/// Evict in order of priority until `req` fits, then give back, highest priority first, every
/// pod the fit does not need (kube-scheduler's reprieve): no victim can be spared, though a
/// smaller set may exist. The caller has checked that evicting all of them fits.
fn irreducible(node: &mut NodeState, req: &PodRequest, freed: &[Freed]) -> Vec<usize> {
    let mut chosen = Vec::new();
    for (i, f) in freed.iter().enumerate() {
        f.apply(node, false);
        chosen.push(i);
        if evaluate(node, req).is_ok() {
            break;
        }
    }
    for pos in (0..chosen.len()).rev() {
        let i = chosen[pos];
        freed[i].apply(node, true);
        if evaluate(node, req).is_ok() {
            chosen.remove(pos);
        } else {
            freed[i].apply(node, false);
        }
    }
    chosen.iter().for_each(|&i| freed[i].apply(node, true));
    chosen
}

#[cfg(test)]
mod tests;
