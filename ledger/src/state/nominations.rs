//! Nominations: the room a preemption frees, kept for the pod that preempted.
//!
//! A nomination does not count against capacity: its victims hold their slices until they are
//! released. It changes what placement offers instead: a pod of priority at most the nominee's
//! (other than the nominee) sees the nominated shares as taken ([`Ledger::node_for`]), so the
//! room the evictions free goes to the nominee, as kube-scheduler's nominated pods do for the
//! resources it knows. While the victims are still terminating both count (the sums may run
//! past capacity in that copy of the node): nothing of priority at most the nominee's lands
//! there before the nominee, and no second preemption takes the same room.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};

use super::{Ledger, NodeState};
use crate::pb;
use crate::placement::PodRequest;

/// Live nominations by pod UID, with an index by node.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Nominations {
    by_pod: BTreeMap<String, pb::Nominated>,
    by_node: BTreeMap<String, BTreeSet<String>>,
}

// prost derives no `Eq` for messages with message fields; `Nominated` holds no float, so its
// equality is total.
impl Eq for Nominations {}

impl Nominations {
    /// The live nomination of pod `uid`.
    pub fn get(&self, uid: &str) -> Option<&pb::Nominated> {
        self.by_pod.get(uid)
    }

    /// Every live nomination, by pod UID.
    pub fn iter(&self) -> impl Iterator<Item = &pb::Nominated> {
        self.by_pod.values()
    }

    /// The live nominations on `node`, by pod UID.
    pub fn on_node<'a>(&'a self, node: &str) -> impl Iterator<Item = &'a pb::Nominated> + 'a {
        self.by_node
            .get(node)
            .into_iter()
            .flatten()
            .filter_map(|uid| self.by_pod.get(uid))
    }

    /// Number of live nominations.
    pub fn len(&self) -> usize {
        self.by_pod.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.by_pod.is_empty()
    }

    fn insert(&mut self, n: pb::Nominated, uid: String) {
        self.by_node
            .entry(n.node.clone())
            .or_default()
            .insert(uid.clone());
        self.by_pod.insert(uid, n);
    }

    fn remove(&mut self, uid: &str) -> Option<pb::Nominated> {
        let n = self.by_pod.remove(uid)?;
        if let Some(s) = self.by_node.get_mut(&n.node) {
            s.remove(uid);
            if s.is_empty() {
                self.by_node.remove(&n.node);
            }
        }
        Some(n)
    }

    /// `node` as a pod `uid` of `priority` must see it: the nominations of other pods of
    /// priority at least `priority` taken (borrowed when none applies).
    pub fn seen_by<'a>(&self, node: &'a NodeState, uid: &str, priority: i32) -> Cow<'a, NodeState> {
        let mut binding = self
            .on_node(&node.name)
            .filter(|n| n.priority >= priority && nominee(n) != uid)
            .peekable();
        if binding.peek().is_none() {
            return Cow::Borrowed(node);
        }
        let mut n = node.clone();
        for nom in binding {
            take_nominated(&mut n, nom);
        }
        Cow::Owned(n)
    }

    /// The nominations that keep room on `node` from a pod `uid` of `priority`.
    pub fn keeping_from<'a>(
        &'a self,
        node: &str,
        uid: &'a str,
        priority: i32,
    ) -> impl Iterator<Item = &'a pb::Nominated> + 'a {
        self.on_node(node)
            .filter(move |n| n.priority >= priority && nominee(n) != uid)
    }
}

/// The UID of a nomination's pod.
pub fn nominee(n: &pb::Nominated) -> &str {
    n.pod.as_ref().map_or("", |p| p.uid.as_str())
}

/// Count `nom`'s shares and node-level requests as used on `node`. While the victims still
/// hold what the nominee will take, the sums run past capacity: the free room reads 0, and
/// evicting one more pod frees nothing of the nominee's.
pub(crate) fn take_nominated(node: &mut NodeState, nom: &pb::Nominated) {
    for s in nom.containers.iter().flat_map(|c| &c.shares) {
        if let Some(g) = node.gpu_mut(&s.gpu_uuid) {
            g.mem_used = g.mem_used.saturating_add(s.mem_mib);
            g.core_used = g.core_used.saturating_add(s.core_milli);
            g.holders = g.holders.saturating_add(1);
        }
    }
    node.cpu_used = node.cpu_used.saturating_add(nom.cpu_milli);
    node.memory_used = node.memory_used.saturating_add(nom.memory_mib);
}

impl Ledger {
    /// Live nominations.
    pub fn nominations(&self) -> &Nominations {
        &self.nominations
    }

    /// The node `name` as placement must see it for `req`: the room nominated there for other
    /// pods of `req.priority` or higher counts as taken.
    pub fn node_for(&self, name: &str, req: &PodRequest) -> Option<Cow<'_, NodeState>> {
        let n = self.nodes.get(name)?;
        Some(self.nominations.seen_by(n, &req.pod.uid, req.priority))
    }

    /// Fold a `Nominated` event.
    pub(super) fn nominate(&mut self, n: &pb::Nominated) -> Result<(), String> {
        let pod = n.pod.as_ref().ok_or("Nominated without pod")?;
        if pod.uid.is_empty() {
            return Err("Nominated with an empty pod uid".into());
        }
        if self.nominations.get(&pod.uid).is_some() {
            return Err(format!("pod {} is already nominated", pod.uid));
        }
        if self.by_pod.contains_key(&pod.uid) {
            return Err(format!(
                "pod {} holds allocations and cannot be nominated",
                pod.uid
            ));
        }
        check_shape(self, n)?;
        if let Some(v) = n.victims.iter().find(|v| v.priority >= n.priority) {
            return Err(format!(
                "victim {:?} has priority {}, not below the nominee's {}",
                v.pod.as_ref().map(|p| &p.uid),
                v.priority,
                n.priority
            ));
        }
        self.nominations.insert(n.clone(), pod.uid.clone());
        Ok(())
    }

    /// Fold a `NominationEnded` event.
    pub(super) fn end_nomination(&mut self, e: &pb::NominationEnded) -> Result<(), String> {
        let uid = e.pod.as_ref().map_or("", |p| p.uid.as_str());
        let n = self
            .nominations
            .get(uid)
            .ok_or_else(|| format!("NominationEnded of pod {uid:?}, which has none"))?;
        if !e.node.is_empty() && n.node != e.node {
            return Err(format!(
                "NominationEnded names node {} but pod {uid} is nominated on {}",
                e.node, n.node
            ));
        }
        self.nominations.remove(uid);
        Ok(())
    }

    /// Why `inv` cannot replace its node's inventory while nominations name GPUs it lacks.
    pub(super) fn nominations_keep_gpus(&self, inv: &pb::NodeInventory) -> Result<(), String> {
        for n in self.nominations.on_node(&inv.node) {
            for s in n.containers.iter().flat_map(|c| &c.shares) {
                if !inv.gpus.iter().any(|g| g.uuid == s.gpu_uuid) {
                    return Err(format!(
                        "node {}: GPU {} is nominated for pod {} and cannot leave the inventory",
                        inv.node,
                        s.gpu_uuid,
                        nominee(n)
                    ));
                }
            }
        }
        Ok(())
    }

    /// The nominations of the state as a whole: indexed both ways, on registered nodes and
    /// GPUs, none for a pod that holds allocations.
    pub(super) fn check_nominations(&self) -> Result<(), String> {
        let indexed: usize = self.nominations.by_node.values().map(BTreeSet::len).sum();
        if indexed != self.nominations.by_pod.len() {
            return Err("nomination index and nominations differ in size".into());
        }
        for (uid, n) in &self.nominations.by_pod {
            if nominee(n) != uid
                || !self
                    .nominations
                    .by_node
                    .get(&n.node)
                    .is_some_and(|s| s.contains(uid))
            {
                return Err(format!("nomination of pod {uid} is indexed wrongly"));
            }
            if self.by_pod.contains_key(uid) {
                return Err(format!("pod {uid} holds both allocations and a nomination"));
            }
            check_shape(self, n)?;
        }
        Ok(())
    }
}

/// A nomination's node is registered, its containers are distinct and each takes at least one
/// share, on distinct GPUs of that node.
fn check_shape(l: &Ledger, n: &pb::Nominated) -> Result<(), String> {
    let node = l
        .nodes
        .get(&n.node)
        .ok_or_else(|| format!("nomination on unknown node {}", n.node))?;
    if n.containers.is_empty() {
        return Err(format!("nomination of pod {} has no container", nominee(n)));
    }
    let mut names = BTreeSet::new();
    for c in &n.containers {
        if !names.insert(c.container.as_str()) {
            return Err(format!(
                "nomination lists container {:?} twice",
                c.container
            ));
        }
        if c.shares.is_empty() {
            return Err(format!(
                "nominated container {:?} has no GPU share",
                c.container
            ));
        }
        let mut gpus = BTreeSet::new();
        for s in &c.shares {
            if node.gpu(&s.gpu_uuid).is_none() {
                return Err(format!(
                    "nomination on GPU {} not on node {}",
                    s.gpu_uuid, n.node
                ));
            }
            if !gpus.insert(s.gpu_uuid.as_str()) {
                return Err(format!("nomination takes GPU {} twice", s.gpu_uuid));
            }
        }
    }
    Ok(())
}
