//! What the reconcile of the ledger against Kubernetes decides, as pure functions: the ledger's
//! allocations and nodes, what the watch caches (or the API server) show, and the time in;
//! the fixes out. The watcher gathers the inputs and applies the fixes. Reservations expire
//! on this replica's monotonic clock ([`Expiry`]), never on the wall clock of the leader that
//! wrote their deadline.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

pub use crate::expiry::Expiry;

use gpuledger_ledger::state::AllocState;
use gpuledger_ledger::{Alloc, Ledger};
use k8s_openapi::api::core::v1::{Node, Pod};

/// One allocation as the reconcile sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// The allocation's id.
    pub id: u64,
    /// The pod's namespace.
    pub ns: String,
    /// The pod's name.
    pub name: String,
    /// The node the allocation is on.
    pub node: String,
    /// Only reserved (not yet bound).
    pub reserved: bool,
    /// When a reservation expires.
    pub deadline_ms: i64,
    /// When it was reserved.
    pub reserved_ms: i64,
}

/// What the reconcile needs of a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodFacts {
    /// The pod's UID.
    pub uid: String,
    /// `succeeded` or `failed` once the pod has finished.
    pub finished: Option<String>,
    /// The node it is bound to.
    pub node: Option<String>,
}

impl PodFacts {
    /// The facts of `pod` (None without a UID).
    pub fn of(pod: &Pod) -> Option<PodFacts> {
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        Some(PodFacts {
            uid: pod.metadata.uid.clone()?,
            finished: matches!(phase, Some("Succeeded" | "Failed"))
                .then(|| phase.unwrap_or_default().to_ascii_lowercase()),
            node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
        })
    }
}

/// A write (or a look) the reconcile asks of the watcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fix {
    /// Release every allocation of the pod.
    Release {
        /// The pod's UID.
        uid: String,
        /// Why, as the event records it.
        reason: String,
    },
    /// Confirm that the pod is bound to the node it is reserved on.
    Confirm {
        /// The pod's UID.
        uid: String,
        /// The node.
        node: String,
        /// Why, as the event records it.
        reason: &'static str,
    },
    /// Not in the cache, and not young: read the pod from the API server, then
    /// [`after_read`].
    Read {
        /// The pod's UID.
        uid: String,
        /// Its allocations.
        held: Vec<Held>,
        /// Whether a reservation of it is past its deadline.
        expired: bool,
    },
    /// A reservation past its deadline and its pod not bound there in the cache: read the pod
    /// from the API server (the cache may be behind), then [`after_expiry_read`].
    CheckExpired {
        /// The pod's UID.
        uid: String,
        /// Its first allocation.
        held: Held,
    },
    /// Release the pod's allocations as expired and, when the ledger takes it, tell the pod
    /// why its GPUs went.
    ReleaseExpired {
        /// The pod's UID.
        uid: String,
        /// Its first allocation.
        held: Held,
    },
    /// Remove a node Kubernetes no longer has.
    RemoveNode {
        /// The node.
        node: String,
        /// Why, as the event records it.
        reason: &'static str,
    },
    /// Set a node's CPU (millicores) and memory (MiB) in the ledger to its allocatable.
    SyncCapacity {
        /// The node.
        node: String,
        /// Allocatable CPU in millicores.
        cpu_milli: u64,
        /// Allocatable memory in MiB.
        memory_mib: u64,
    },
}

impl Held {
    fn of(a: &Alloc) -> Held {
        Held {
            id: a.id,
            ns: a.pod.namespace.clone(),
            name: a.pod.name.clone(),
            node: a.node.clone(),
            reserved: a.state == AllocState::Reserved,
            deadline_ms: a.deadline_ms,
            reserved_ms: a.reserved_ms,
        }
    }
}

/// The ledger's pod allocations by pod UID, as the reconcile sees them. Claim grants are held
/// under their ResourceClaim, not a pod: no pod of that UID ever exists, so the pod reconcile
/// would release them as deleted.
pub fn held_by_pod(l: &Ledger) -> BTreeMap<String, Vec<Held>> {
    let mut m: BTreeMap<String, Vec<Held>> = BTreeMap::new();
    for a in l.allocs().values().filter(|a| a.claim.is_none()) {
        m.entry(a.pod.uid.clone()).or_default().push(Held::of(a));
    }
    m
}

/// The allocations of one pod.
pub fn held_of(l: &Ledger, uid: &str) -> Vec<Held> {
    l.allocs_of_pod(uid).into_iter().map(Held::of).collect()
}

/// What a pod as the watch (or a read) shows asks of its allocations `held`: a finished pod's
/// are released, a pod bound to the node it is reserved on is confirmed.
pub fn on_pod(pod: &PodFacts, held: &[Held]) -> Option<Fix> {
    if let Some(phase) = &pod.finished {
        return Some(Fix::Release {
            uid: pod.uid.clone(),
            reason: format!("pod {phase}"),
        });
    }
    let node = pod.node.as_deref()?;
    held.iter()
        .any(|a| a.reserved && a.node == node)
        .then(|| Fix::Confirm {
            uid: pod.uid.clone(),
            node: node.to_string(),
            reason: "reconcile: the pod is bound to this node",
        })
}

/// Compare every pod's allocations with the pod cache at `now` (this replica's monotonic
/// clock): `cached` finds a pod by namespace and name (the caller checks the UID); `deleted`
/// says whether this replica's watch saw the pod of a UID deleted (a pod missing from the
/// cache is read from the API server unless its grants are [young](Expiry::young) here, in
/// case the watch has not delivered it yet; one the watch saw go is not waited for); `expiry`
/// remembers when this replica first saw each reservation, and forgets those no longer held.
pub fn plan_pods(
    held: &BTreeMap<String, Vec<Held>>,
    cached: impl Fn(&str, &str) -> Option<PodFacts>,
    deleted: impl Fn(&str) -> bool,
    expiry: &mut Expiry,
    now: tokio::time::Instant,
) -> Vec<Fix> {
    let ids: HashSet<u64> = held.values().flatten().map(|x| x.id).collect();
    expiry.retain(|id| ids.contains(&id));
    let mut fixes = Vec::new();
    for (uid, list) in held {
        let Some(a) = list.first() else { continue };
        let expired = list
            .iter()
            .any(|x| x.reserved && expiry.expired(x.id, x.reserved_ms, x.deadline_ms, now));
        match cached(&a.ns, &a.name).filter(|p| &p.uid == uid) {
            Some(p) => {
                if p.finished.is_some() || p.node.as_deref() == Some(a.node.as_str()) {
                    fixes.extend(on_pod(&p, list));
                } else if expired {
                    fixes.push(Fix::CheckExpired {
                        uid: uid.clone(),
                        held: a.clone(),
                    });
                }
            }
            // This replica's watch saw the pod deleted (while another replica led, maybe):
            // gone, however young its grants are here.
            None if deleted(uid) => fixes.push(Fix::Release {
                uid: uid.clone(),
                reason: "pod deleted".into(),
            }),
            None => {
                let young = list.iter().all(|x| expiry.young(x.id, now));
                if young && !expired {
                    continue;
                }
                fixes.push(Fix::Read {
                    uid: uid.clone(),
                    held: list.clone(),
                    expired,
                });
            }
        }
    }
    fixes
}

/// After [`Fix::Read`]: the pod as the API server has it (None: gone), and the allocations
/// `held` of `uid` (another pod of that name counts as gone).
pub fn after_read(uid: &str, held: &[Held], expired: bool, read: Option<&PodFacts>) -> Vec<Fix> {
    let Some(first) = held.first() else {
        return Vec::new();
    };
    let Some(p) = read.filter(|p| p.uid == uid) else {
        return vec![Fix::Release {
            uid: uid.to_string(),
            reason: "pod deleted".into(),
        }];
    };
    let mut fixes: Vec<Fix> = on_pod(p, held).into_iter().collect();
    if expired && p.node.as_deref() != Some(first.node.as_str()) {
        fixes.push(Fix::CheckExpired {
            uid: uid.to_string(),
            held: first.clone(),
        });
    }
    fixes
}

/// After [`Fix::CheckExpired`]: bound after all (the extender died after the Binding) →
/// confirm; otherwise release it as expired, telling the pod when it still exists.
pub fn after_expiry_read(uid: &str, held: &Held, read: Option<&PodFacts>) -> Fix {
    match read.filter(|p| p.uid == uid) {
        Some(p) if p.node.as_deref() == Some(held.node.as_str()) => Fix::Confirm {
            uid: uid.to_string(),
            node: held.node.clone(),
            reason: "reconcile: reservation deadline passed; the pod is bound",
        },
        Some(_) => Fix::ReleaseExpired {
            uid: uid.to_string(),
            held: held.clone(),
        },
        None => Fix::Release {
            uid: uid.to_string(),
            reason: "expired".into(),
        },
    }
}

/// Since when each ledger node has been missing from Kubernetes.
#[derive(Debug, Default)]
pub struct Missing(HashMap<String, Instant>);

/// Compare the ledger's nodes (name, CPU millicores and memory MiB) with Kubernetes' at `now`:
/// `kube` says whether a node exists there and its allocatable. A node missing for `grace` is
/// removed; one whose allocatable differs from the ledger's is synced.
pub fn plan_nodes(
    ledger_nodes: &[(String, (u64, u64))],
    kube: impl Fn(&str) -> Option<Option<(u64, u64)>>,
    missing: &mut Missing,
    now: Instant,
    grace: Duration,
) -> Vec<Fix> {
    let known: HashSet<&str> = ledger_nodes.iter().map(|(n, _)| n.as_str()).collect();
    missing.0.retain(|n, _| known.contains(n.as_str()));
    let mut removals = Vec::new();
    let mut syncs = Vec::new();
    for (n, capacity) in ledger_nodes {
        if let Some(allocatable) = kube(n) {
            missing.0.remove(n);
            if let Some((cpu_milli, memory_mib)) = allocatable.filter(|a| a != capacity) {
                syncs.push(Fix::SyncCapacity {
                    node: n.clone(),
                    cpu_milli,
                    memory_mib,
                });
            }
            continue;
        }
        let since = *missing.0.entry(n.clone()).or_insert(now);
        if now.saturating_duration_since(since) >= grace {
            removals.push(Fix::RemoveNode {
                node: n.clone(),
                reason: "node is not in Kubernetes",
            });
            missing.0.remove(n);
        }
    }
    removals.extend(syncs);
    removals
}

/// A node's allocatable CPU (millicores) and memory (MiB), when Kubernetes reports both.
pub fn allocatable(n: &Node) -> Option<(u64, u64)> {
    let a = n.status.as_ref()?.allocatable.as_ref()?;
    let q = |k: &str| gpuledger_ops::quantity::parse(&a.get(k)?.0).ok();
    let cpu = q("cpu")?;
    let mem = q("memory")?;
    (cpu > 0.0 && mem > 0.0).then(|| {
        (
            (cpu * 1000.0).round() as u64,
            (mem / (1024.0 * 1024.0)).floor() as u64,
        )
    })
}

#[cfg(test)]
mod tests;
