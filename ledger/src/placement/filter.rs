//! Filter: whether a pod fits on a node now, later or never, and why not.

use super::{ContainerRequest, Free, PodRequest, evaluate};
use crate::state::{GpuState, Ledger, NodeState};

/// Whether a pod fits on a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fit {
    /// It fits now.
    Fits,
    /// Not now: enough capacity could free up (the reason says what is short).
    Wait(String),
    /// Never on this node as it is: no amount of waiting helps.
    Never(String),
}

/// Whether the pod fits on the node now, later, or never.
pub fn fit_node(node: &NodeState, req: &PodRequest) -> Fit {
    // Fast yes for the common one-container, one-slice pod: what `evaluate` would accept,
    // without building a placement (Filter runs this for thousands of nodes per pod).
    if let [c] = req.containers.as_slice()
        && node.mode == crate::pb::NodeMode::DevicePlugin
        && !req.dra
        && c.slices == 1
        && node_has_room(node, req)
    {
        let fits = node.gpus.iter().any(|g| {
            let (mem, core) = c.slice_on(g);
            g.healthy
                && mem <= g.memory_mib
                && mem <= g.mem_free()
                && core <= g.core_free()
                && req.selector.accepts(g)
        });
        if fits {
            return Fit::Fits;
        }
    }
    match evaluate(node, req) {
        Ok(_) => Fit::Fits,
        Err(f) => f,
    }
}

/// Why a node that gpuledger does not know can never host a pod.
pub const NOT_REGISTERED: &str =
    "node is not registered with gpuledger (no node agent running there?)";

/// Why a DRA node never hosts a pod that asks through the device plugin: its GPUs are granted
/// to ResourceClaims only.
pub const DRA_NODE: &str =
    "node serves its GPUs through DRA (ResourceClaims), not the device plugin";

/// Why a device-plugin node never hosts a pod that asks through DRA: no ResourceSlice of
/// gpuledger's driver is published there.
pub const DEVICE_PLUGIN_NODE: &str =
    "node serves its GPUs through the device plugin, not DRA (ResourceClaims)";

/// Filter's answer for a list of nodes: where the pod fits, and why not elsewhere.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Filtered {
    /// Nodes where the pod fits now, in the order asked.
    pub fits: Vec<String>,
    /// Node and why the pod does not fit there now.
    pub wait: Vec<(String, String)>,
    /// Node and why the pod can never fit there (unregistered nodes included).
    pub never: Vec<(String, String)>,
    /// How many of the nodes are not registered (they are in `never`).
    pub unregistered: usize,
}

/// Filter `names` for the request against the state: the one procedure behind the allocator's
/// Filter and the extender's answer from its replica, so both give the same reasons.
pub fn filter_nodes<S: AsRef<str> + Into<String>>(
    ledger: &Ledger,
    names: impl IntoIterator<Item = S>,
    req: &PodRequest,
) -> Filtered {
    let mut out = Filtered::default();
    // A pod that holds GPUs already (a reservation whose bind did not finish: the extender
    // died, or the Binding failed and the release did not reach a leader) is bound only
    // there: a Reserve elsewhere is refused, and one there answers what it holds. Its other
    // nodes are unresolvable until that reservation is bound or expires (--reserve-ttl).
    if !req.dra
        && let Some(held) = ledger.node_of_pod(&req.pod.uid)
    {
        let why = format!(
            "pod already holds GPUs on node {held} (reserved by a bind that did not finish): it is bound there, or elsewhere once that reservation expires"
        );
        for n in names {
            if n.as_ref() == held {
                out.fits.push(n.into());
            } else {
                out.never.push((n.into(), why.clone()));
            }
        }
        return out;
    }
    for n in names {
        // Room nominated for pods that outrank this one counts as taken.
        let seen = ledger.node_for(n.as_ref(), req);
        match seen.as_deref().map(|ns| fit_node(ns, req)) {
            None => {
                out.unregistered += 1;
                out.never.push((n.into(), NOT_REGISTERED.to_string()));
            }
            Some(Fit::Fits) => out.fits.push(n.into()),
            Some(Fit::Wait(why)) => {
                let kept = match seen {
                    Some(std::borrow::Cow::Owned(_)) => ledger.room_kept(n.as_ref(), req),
                    _ => String::new(),
                };
                out.wait.push((n.into(), why + &kept));
            }
            Some(Fit::Never(why)) => out.never.push((n.into(), why)),
        }
    }
    out
}

/// Why the pod can never fit on this node (whatever is released), if so.
pub(super) fn never_fits(node: &NodeState, req: &PodRequest) -> Option<String> {
    match (node.mode, req.dra) {
        (crate::pb::NodeMode::DevicePlugin, false) | (crate::pb::NodeMode::Dra, true) => {}
        (_, false) => return Some(DRA_NODE.to_string()),
        (_, true) => return Some(DEVICE_PLUGIN_NODE.to_string()),
    }
    if node.cpu_milli > 0 && req.cpu_milli > node.cpu_milli {
        return Some(format!(
            "pod requests {}m CPU, node has {}m",
            req.cpu_milli, node.cpu_milli
        ));
    }
    if node.memory_mib > 0 && req.memory_mib > node.memory_mib {
        return Some(format!(
            "pod requests {} MiB host memory, node has {} MiB",
            req.memory_mib, node.memory_mib
        ));
    }
    for c in &req.containers {
        let c = c.normalized();
        let able = node
            .gpus
            .iter()
            .filter(|g| req.selector.accepts(g) && c.mem_on(g) <= g.memory_mib)
            .count();
        if able < c.slices as usize {
            let accepted: Vec<&GpuState> = node
                .gpus
                .iter()
                .filter(|g| req.selector.accepts(g))
                .collect();
            if accepted.is_empty() {
                return Some(if node.gpus.is_empty() {
                    "node has no GPU".to_string()
                } else {
                    "no GPU on the node matches the pod's gpu-type/gpu-uuid selectors".to_string()
                });
            }
            let largest = accepted.iter().map(|g| g.memory_mib).max().unwrap_or(0);
            return Some(if accepted.len() < c.slices as usize {
                format!(
                    "container {} needs {} GPUs, node has {} matching",
                    c.name,
                    c.slices,
                    accepted.len()
                )
            } else {
                format!(
                    "container {} needs {} MiB per GPU, largest GPU has {} MiB",
                    c.name, c.mem_mib, largest
                )
            });
        }
    }
    None
}

pub(super) fn shortage(
    node: &NodeState,
    req: &PodRequest,
    c: &ContainerRequest,
    free: &[Free],
) -> String {
    let healthy = node
        .gpus
        .iter()
        .filter(|g| g.healthy && req.selector.accepts(g))
        .count();
    if healthy < c.slices as usize {
        return format!(
            "container {} needs {} healthy GPUs, node has {healthy}",
            c.name, c.slices
        );
    }
    let best_mem = node
        .gpus
        .iter()
        .zip(free)
        .filter(|(g, _)| g.healthy && req.selector.accepts(g))
        .map(|(_, f)| f.mem)
        .max()
        .unwrap_or(0);
    let best_core = node
        .gpus
        .iter()
        .zip(free)
        .filter(|(g, _)| g.healthy && req.selector.accepts(g))
        .map(|(_, f)| f.core)
        .max()
        .unwrap_or(0);
    let mem = node.gpus.first().map_or(c.mem_mib, |g| c.mem_on(g));
    format!(
        "container {} needs {} GPU(s) with {} MiB and {}% compute free; most free: {} MiB, {}%",
        c.name,
        c.slices,
        mem,
        c.core_milli / 10,
        best_mem,
        best_core / 10
    )
}

/// The node's CPU and host memory take the pod (the node-level checks of `evaluate`).
pub(super) fn node_has_room(node: &NodeState, req: &PodRequest) -> bool {
    (node.cpu_milli == 0 || node.cpu_used.saturating_add(req.cpu_milli) <= node.cpu_milli)
        && (node.memory_mib == 0
            || node.memory_used.saturating_add(req.memory_mib) <= node.memory_mib)
}
