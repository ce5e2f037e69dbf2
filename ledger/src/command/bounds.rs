//! Bounds on what a command may carry. Every name and free string that ends up in an event has
//! a length limit, every list a count limit, and every size that arithmetic touches (GPU memory,
//! node CPU and memory, a pod's requests) a ceiling far above any real machine and far below
//! where a sum of them could overflow. A command past a bound is refused with
//! [`CommandError::Invalid`](super::CommandError::Invalid) before anything is decided, so it
//! can neither grow an event without limit nor make the sequencer panic.

use super::Command;
use crate::pb;

/// Longest node, pod or namespace name (a Kubernetes object name: a DNS subdomain).
pub const MAX_NAME_BYTES: usize = 253;
/// Longest GPU UUID, GPU model, device ID, container name or pod UID.
pub const MAX_ID_BYTES: usize = 128;
/// Longest free text: a reason, a replica's name or address.
pub const MAX_TEXT_BYTES: usize = 1024;
/// The actions a `LimitViolated` may name: a node agent's `--on-violation` (kill, report) and
/// `--rogue-policy` (rogue, rogue-kill).
pub const VIOLATION_ACTIONS: [&str; 4] = ["kill", "report", "rogue", "rogue-kill"];
/// Most device IDs in one `Assign` or `CorrectIdentity` (a container's slices).
pub const MAX_DEVICE_IDS: usize = 64;
/// Most containers of one pod that ask for GPUs.
pub const MAX_CONTAINERS: usize = 64;
/// Victims of one nomination, and pods counted as leaving: pods on one node (the kubelet's
/// default is 110 pods a node; a node may be configured for more).
pub const MAX_VICTIMS: usize = 1024;
/// Most slices (distinct GPUs) one container may ask for.
pub const MAX_SLICES: u32 = 64;
/// Most entries in one of a pod's GPU selectors (types, UUIDs and their exclusions).
pub const MAX_SELECTOR_ENTRIES: usize = 64;
/// Most pods one claim grant names as consumers (a claim's `status.reservedFor` holds at most
/// 256).
pub const MAX_CLAIM_CONSUMERS: usize = 256;
/// Most grants one claim prepare or unprepare names (a claim's results).
pub const MAX_CLAIM_GRANTS: usize = 64;
/// Largest node CPU or pod CPU request, in millicores (a billion cores).
pub const MAX_CPU_MILLI: u64 = 1 << 40;
/// Largest node host memory or pod memory request, in MiB (an exbibyte).
pub const MAX_HOST_MEMORY_MIB: u64 = 1 << 40;

/// How large one node's inventory may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InventoryLimits {
    /// Most GPUs on one node.
    pub max_gpus: usize,
    /// Most memory of one GPU, in MiB.
    pub max_gpu_memory_mib: u64,
}

impl InventoryLimits {
    /// What the ledger itself holds every inventory to, whatever the allocator's flags say: a
    /// thousand GPUs of a pebibyte each. Sums over a node and percentages of a GPU stay far
    /// from overflowing below it.
    pub const CEILING: InventoryLimits = InventoryLimits {
        max_gpus: 1024,
        max_gpu_memory_mib: 1 << 30,
    };

    /// These limits, no higher than [`Self::CEILING`].
    pub fn capped(self) -> InventoryLimits {
        InventoryLimits {
            max_gpus: self.max_gpus.min(Self::CEILING.max_gpus),
            max_gpu_memory_mib: self
                .max_gpu_memory_mib
                .min(Self::CEILING.max_gpu_memory_mib),
        }
    }

    /// Why `inv` is refused under these limits, if it is.
    pub fn check(&self, inv: &pb::NodeInventory) -> Result<(), String> {
        name("node name", &inv.node)?;
        if inv.gpus.len() > self.max_gpus {
            return Err(format!(
                "node {} reports {} GPUs; at most {} per node",
                inv.node,
                inv.gpus.len(),
                self.max_gpus
            ));
        }
        if inv.cpu_milli > MAX_CPU_MILLI || inv.memory_mib > MAX_HOST_MEMORY_MIB {
            return Err(format!(
                "node {} reports {}m CPU and {} MiB host memory; at most {MAX_CPU_MILLI}m and \
                 {MAX_HOST_MEMORY_MIB} MiB",
                inv.node, inv.cpu_milli, inv.memory_mib
            ));
        }
        for g in &inv.gpus {
            id("GPU uuid", &g.uuid)?;
            id("GPU model", &g.model)?;
            if g.memory_mib > self.max_gpu_memory_mib {
                return Err(format!(
                    "node {}: GPU {} reports {} MiB of memory; at most {} MiB per GPU",
                    inv.node, g.uuid, g.memory_mib, self.max_gpu_memory_mib
                ));
            }
        }
        Ok(())
    }
}

/// Refuse a name longer than [`MAX_NAME_BYTES`].
pub(crate) fn name(what: &str, s: &str) -> Result<(), String> {
    limit(what, s, MAX_NAME_BYTES)
}

/// Refuse an identifier longer than [`MAX_ID_BYTES`].
pub(crate) fn id(what: &str, s: &str) -> Result<(), String> {
    limit(what, s, MAX_ID_BYTES)
}

/// Refuse a free text longer than [`MAX_TEXT_BYTES`].
pub(crate) fn text(what: &str, s: &str) -> Result<(), String> {
    limit(what, s, MAX_TEXT_BYTES)
}

fn limit(what: &str, s: &str, max: usize) -> Result<(), String> {
    if s.len() > max {
        return Err(format!("{what} is {} bytes; at most {max}", s.len()));
    }
    Ok(())
}

/// Refuse more than [`MAX_DEVICE_IDS`] device IDs, or one that is too long.
pub(crate) fn device_ids(ids: &[String]) -> Result<(), String> {
    if ids.len() > MAX_DEVICE_IDS {
        return Err(format!(
            "{} device ids; at most {MAX_DEVICE_IDS}",
            ids.len()
        ));
    }
    ids.iter().try_for_each(|d| id("device id", d))
}

/// Refuse more than [`MAX_CLAIM_GRANTS`] grants in one prepare or unprepare.
/// A claim's consumers: at most [`MAX_CLAIM_CONSUMERS`] pods, each named within bounds.
fn consumers(pods: &[pb::PodRef]) -> Result<(), String> {
    if pods.len() > MAX_CLAIM_CONSUMERS {
        return Err(format!(
            "{} consumers, at most {MAX_CLAIM_CONSUMERS}",
            pods.len()
        ));
    }
    pods.iter().try_for_each(|p| {
        id("pod uid", &p.uid)?;
        name("pod namespace", &p.namespace)?;
        name("pod name", &p.name)
    })
}

fn grants(ids: &[u64]) -> Result<(), String> {
    if ids.len() > MAX_CLAIM_GRANTS {
        return Err(format!(
            "{} claim grants, at most {MAX_CLAIM_GRANTS}",
            ids.len()
        ));
    }
    Ok(())
}

/// Why a `LimitViolated` report is refused, if it is: an unknown action or an overlong field.
pub fn check_violation(v: &pb::LimitViolated) -> Result<(), String> {
    if v.node.is_empty() {
        return Err("violation without node".into());
    }
    name("node name", &v.node)?;
    id("GPU uuid", &v.gpu_uuid)?;
    if !VIOLATION_ACTIONS.contains(&v.action.as_str()) {
        let shown: String = v.action.chars().take(32).collect();
        return Err(format!(
            "violation action {shown:?} is not one of {}",
            VIOLATION_ACTIONS.join(", ")
        ));
    }
    Ok(())
}

/// Why `cmd` carries more than an event may hold, if it does.
pub(crate) fn check(cmd: &Command) -> Result<(), String> {
    match cmd {
        Command::RegisterNode(inv) => InventoryLimits::CEILING.check(inv),
        Command::RemoveNode { node, reason } => {
            name("node name", node)?;
            text("reason", reason)
        }
        Command::SetDeviceHealth(h) => {
            name("node name", &h.node)?;
            id("GPU uuid", &h.gpu_uuid)?;
            text("reason", &h.reason)
        }
        // The request's own validation bounds its names and sizes.
        Command::Reserve { node, .. } => name("node name", node),
        Command::ConfirmBound {
            pod_uid,
            node,
            reason,
        } => {
            id("pod uid", pod_uid)?;
            name("node name", node)?;
            text("reason", reason)
        }
        Command::Assign {
            node,
            device_ids: d,
            ..
        }
        | Command::CorrectIdentity {
            node,
            device_ids: d,
            ..
        } => {
            name("node name", node)?;
            device_ids(d)
        }
        Command::Release {
            pod_uid,
            container,
            reason,
            ..
        } => {
            id("pod uid", pod_uid)?;
            id("container name", container)?;
            text("reason", reason)
        }
        Command::ReportViolation(v) => check_violation(v),
        Command::LeaderElected(l) => {
            text("replica", &l.replica)?;
            text("address", &l.address)
        }
        Command::SetQuota(_) => Ok(()),
        Command::SetBudget(b) => text("budget source", &b.source),
        Command::RemoveBudget(b) => text("budget source", &b.source),
        Command::Nominate {
            nomination: n,
            leaving,
        } => {
            name("node name", &n.node)?;
            if n.containers.len() > MAX_CONTAINERS {
                return Err(format!(
                    "{} containers nominated, at most {}",
                    n.containers.len(),
                    MAX_CONTAINERS
                ));
            }
            for c in &n.containers {
                id("container name", &c.container)?;
                if c.shares.len() > MAX_SLICES as usize {
                    return Err(format!(
                        "container {} nominated on {} GPUs, at most {}",
                        c.container,
                        c.shares.len(),
                        MAX_SLICES
                    ));
                }
            }
            // A node holds at most MAX_SLICES GPUs' worth of slices per pod; victims and
            // pods leaving are pods on one node.
            for (what, n) in [
                ("victims", n.victims.len()),
                ("pods leaving", leaving.len()),
            ] {
                if n > MAX_VICTIMS {
                    return Err(format!("{n} {what}, at most {}", MAX_VICTIMS));
                }
            }
            leaving.iter().try_for_each(|u| id("pod uid", u))
        }
        Command::EndNomination { pod_uid, reason } => {
            id("pod uid", pod_uid)?;
            text("reason", reason)
        }
        Command::Adopt {
            pod,
            node,
            containers,
            source,
        } => {
            id("pod uid", &pod.uid)?;
            name("pod namespace", &pod.namespace)?;
            name("pod name", &pod.name)?;
            name("node name", node)?;
            id("adoption source", source)?;
            if containers.len() > MAX_CONTAINERS {
                return Err(format!(
                    "{} containers adopted, at most {MAX_CONTAINERS}",
                    containers.len()
                ));
            }
            for c in containers {
                id("container name", &c.container)?;
                if c.shares.len() > MAX_SLICES as usize {
                    return Err(format!(
                        "container {} holds {} GPUs, at most {MAX_SLICES}",
                        c.container,
                        c.shares.len()
                    ));
                }
                c.shares
                    .iter()
                    .try_for_each(|s| id("GPU uuid", &s.gpu_uuid))?;
            }
            Ok(())
        }
        Command::GrantClaim(g) => {
            claim_bounds(
                g.claim.as_ref(),
                &g.request,
                &g.node,
                &[("pool", &g.pool), ("device", &g.device)],
            )?;
            id("share id", &g.share_id)?;
            id("grant source", &g.source)?;
            id("GPU uuid", g.share.as_ref().map_or("", |s| &s.gpu_uuid))?;
            consumers(&g.consumers)
        }
        Command::RefuseClaim(r) => {
            claim_bounds(
                r.claim.as_ref(),
                &r.request,
                &r.node,
                &[("device", &r.device), ("reason", &r.reason)],
            )?;
            id("share id", &r.share_id)?;
            id("GPU uuid", r.share.as_ref().map_or("", |s| &s.gpu_uuid))
        }
        Command::PrepareClaim {
            node,
            allocation_ids,
            cdi_device_ids,
        } => {
            name("node name", node)?;
            grants(allocation_ids)?;
            device_ids(cdi_device_ids)
        }
        Command::UnprepareClaim {
            node,
            allocation_ids,
        } => {
            name("node name", node)?;
            grants(allocation_ids)
        }
        Command::SetClaimConsumers {
            claim_uid,
            consumers: c,
        } => {
            id("claim uid", claim_uid)?;
            consumers(c)
        }
    }
}

/// Why a claim command carries more than an event may hold, if it does.
fn claim_bounds(
    claim: Option<&pb::ClaimRef>,
    request: &str,
    node: &str,
    texts: &[(&str, &str)],
) -> Result<(), String> {
    if let Some(c) = claim {
        id("claim uid", &c.uid)?;
        name("claim namespace", &c.namespace)?;
        name("claim name", &c.name)?;
    }
    name("claim request", request)?;
    name("node name", node)?;
    texts.iter().try_for_each(|(what, s)| text(what, s))
}
