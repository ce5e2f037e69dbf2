//! The ledger's nodes: found by hash (filter and prioritize look up thousands of names per
//! pod), listed in name order (snapshots, tables and placement ties stay deterministic).

use std::collections::BTreeSet;

use rustc_hash::FxHashMap;

use super::NodeState;

/// Nodes by name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Nodes {
    by_name: FxHashMap<String, NodeState>,
    order: BTreeSet<String>,
}

impl Nodes {
    /// One node.
    pub fn get(&self, name: &str) -> Option<&NodeState> {
        self.by_name.get(name)
    }
    pub(super) fn get_mut(&mut self, name: &str) -> Option<&mut NodeState> {
        self.by_name.get_mut(name)
    }
    /// Whether the node is known.
    pub fn contains_key(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }
    pub(super) fn insert(&mut self, name: String, node: NodeState) -> Option<NodeState> {
        if !self.by_name.contains_key(&name) {
            self.order.insert(name.clone());
        }
        self.by_name.insert(name, node)
    }
    pub(super) fn remove(&mut self, name: &str) -> Option<NodeState> {
        self.order.remove(name);
        self.by_name.remove(name)
    }
    /// How many nodes.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }
    /// No nodes.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
    /// (name, node) in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &NodeState)> + '_ {
        self.order
            .iter()
            .filter_map(|n| Some((n, self.by_name.get(n)?)))
    }
    /// Names in order.
    pub fn keys(&self) -> impl Iterator<Item = &String> + '_ {
        self.order.iter()
    }
    /// Nodes in name order.
    pub fn values(&self) -> impl Iterator<Item = &NodeState> + '_ {
        self.iter().map(|(_, n)| n)
    }
}

impl<'a> IntoIterator for &'a Nodes {
    type Item = (&'a String, &'a NodeState);
    type IntoIter = Box<dyn Iterator<Item = Self::Item> + 'a>;
    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str) -> NodeState {
        NodeState {
            mode: Default::default(),
            isolation: String::new(),
            dra_cores: String::new(),
            name: name.into(),
            gpus: Vec::new(),
            cpu_milli: 0,
            memory_mib: 0,
            cpu_used: 0,
            memory_used: 0,
            allocs: Default::default(),
            devices: Default::default(),
            pod_kinds: Default::default(),
        }
    }

    #[test]
    fn name_order_survives_insert_replace_remove() {
        let mut n = Nodes::default();
        for x in ["b", "c", "a"] {
            assert!(n.insert(x.into(), node(x)).is_none());
        }
        assert!(n.insert("b".into(), node("b")).is_some());
        assert_eq!(n.keys().collect::<Vec<_>>(), ["a", "b", "c"]);
        assert!(n.remove("b").is_some());
        assert!(n.remove("b").is_none());
        assert_eq!(
            n.values().map(|v| v.name.as_str()).collect::<Vec<_>>(),
            ["a", "c"]
        );
        assert_eq!(
            (n.len(), n.get("c").is_some(), n.contains_key("b")),
            (2, true, false)
        );
    }
}
