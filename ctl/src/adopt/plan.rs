//! The adoption plan, pure: every running pod another scheduler placed, read as that peer
//! recorded it, resolved against the ledger's inventory and decided by the ledger's own
//! `Adopt` on a copy of its state, in order. So the plan says exactly what `--apply` will
//! commit, and a GPU the peer over-committed shows as the pods that do not fit, naming the ones
//! already on it.

use gpuledger_ledger::{Command, CommandError, Ledger, Reply, pb};
use gpuledger_request::adopt::{DeviceRef, Peer, PeerGrant, PeerMemory, recorded};
use k8s_openapi::api::core::v1::Pod;

/// One pod of the plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// The node it runs on ("" when the pod is not bound).
    pub node: String,
    /// The pod.
    pub pod: pb::PodRef,
    /// Who placed it.
    pub peer: Option<Peer>,
    /// Each GPU container's shares as resolved (empty when refused before resolving).
    pub containers: Vec<pb::NominatedContainer>,
    /// What becomes of it.
    pub outcome: PlanOutcome,
}

/// What becomes of a pod (the outcome, without the containers the entry lists).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanOutcome {
    /// Adopted on `--apply`.
    Adopt,
    /// Already in the ledger, with these allocations.
    Held(Vec<u64>),
    /// Cannot be adopted, and why.
    Refused(String),
}

/// Whether the pod still runs or may (not finished, not being deleted).
fn live(p: &Pod) -> bool {
    p.metadata.deletion_timestamp.is_none()
        && !matches!(
            p.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Succeeded" | "Failed")
        )
}

fn pod_ref(p: &Pod) -> pb::PodRef {
    pb::PodRef {
        uid: p.metadata.uid.clone().unwrap_or_default(),
        namespace: p
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into()),
        name: p.metadata.name.clone().unwrap_or_default(),
    }
}

/// The shares of `g` on the registered GPUs of its node, or why they cannot be named.
fn resolve(l: &Ledger, g: &PeerGrant) -> Result<Vec<pb::NominatedContainer>, String> {
    let node = l.node(&g.node).ok_or_else(|| {
        format!(
            "node {} is not registered in the ledger: install gpuledger's node agent there first",
            g.node
        )
    })?;
    g.containers
        .iter()
        .map(|c| {
            let shares = c
                .shares
                .iter()
                .map(|s| {
                    let gpu = match &s.device {
                        DeviceRef::Uuid(u) => node.gpu(u).ok_or_else(|| match l.gpu_owner(u) {
                            Some(other) => {
                                format!("GPU {u} is registered on node {other}, not {}", g.node)
                            }
                            None => format!("no node registers GPU {u}"),
                        })?,
                        DeviceRef::Index(i) => {
                            node.gpus.iter().find(|x| x.index == *i).ok_or_else(|| {
                                format!("node {} registers no GPU with index {i}", g.node)
                            })?
                        }
                    };
                    let mem_mib = match s.memory {
                        PeerMemory::Mib(m) => m,
                        PeerMemory::Whole => gpu.memory_mib,
                        PeerMemory::Fraction { units, per_gpu } => u64::try_from(
                            u128::from(units) * u128::from(gpu.memory_mib)
                                / u128::from(per_gpu.max(1)),
                        )
                        .unwrap_or(u64::MAX),
                    };
                    Ok(pb::GpuShare {
                        gpu_uuid: gpu.uuid.clone(),
                        mem_mib,
                        core_milli: s.core_milli,
                    })
                })
                .collect::<Result<Vec<_>, String>>()?;
            Ok(pb::NominatedContainer {
                container: c.name.clone(),
                shares,
            })
        })
        .collect()
}

/// The pods already on the GPUs `shares` name, for a refusal's reason.
fn holders(l: &Ledger, node: &str, shares: &[pb::NominatedContainer]) -> String {
    let Some(n) = l.node(node) else {
        return String::new();
    };
    let mut out: Vec<String> = Vec::new();
    for s in shares.iter().flat_map(|c| &c.shares) {
        let mut on: Vec<String> = n
            .allocs
            .iter()
            .filter_map(|id| l.alloc(*id))
            .filter(|a| a.shares.iter().any(|x| x.gpu_uuid == s.gpu_uuid))
            .map(|a| format!("{}/{}", a.pod.namespace, a.pod.name))
            .collect();
        on.dedup();
        if !on.is_empty() {
            out.push(format!("{} holds {}", s.gpu_uuid, on.join(", ")));
        }
    }
    if out.is_empty() {
        String::new()
    } else {
        format!("; {}", out.join("; "))
    }
}

/// The plan for `pods` against the ledger `l` (which it advances as `--apply` would, so that
/// pods that share a GPU are decided together), ordered by node, then by when each pod was
/// created (the peer's first placement keeps its room), then by name.
pub fn plan(l: &mut Ledger, pods: &[Pod]) -> Vec<Entry> {
    let mut pods: Vec<&Pod> = pods.iter().filter(|p| live(p)).collect();
    pods.sort_by_key(|p| {
        (
            p.spec
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .unwrap_or_default(),
            p.metadata.creation_timestamp.as_ref().map(|t| t.0),
            p.metadata.namespace.clone(),
            p.metadata.name.clone(),
        )
    });
    let mut out = Vec::new();
    for p in pods {
        let Some(rec) = recorded(p) else { continue };
        let pod = pod_ref(p);
        let node = p
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        let entry = |peer, containers, outcome| Entry {
            node: node.clone(),
            pod: pod.clone(),
            peer,
            containers,
            outcome,
        };
        let g = match rec {
            Ok(g) => g,
            Err(why) => {
                out.push(entry(None, Vec::new(), PlanOutcome::Refused(why)));
                continue;
            }
        };
        if pod.uid.is_empty() {
            out.push(entry(
                Some(g.peer),
                Vec::new(),
                PlanOutcome::Refused("the pod has no uid".into()),
            ));
            continue;
        }
        let containers = match resolve(l, &g) {
            Ok(c) => c,
            Err(why) => {
                out.push(entry(Some(g.peer), Vec::new(), PlanOutcome::Refused(why)));
                continue;
            }
        };
        let cmd = Command::Adopt {
            pod: pod.clone(),
            node: g.node.clone(),
            containers: containers.clone(),
            source: g.peer.as_str().into(),
        };
        let (epoch, now) = (l.epoch(), l.time_ms());
        let outcome = match l.execute(cmd, epoch, now) {
            Ok((_, Reply::Reserved { created: true, .. })) => PlanOutcome::Adopt,
            Ok((_, Reply::Reserved { allocations, .. })) => {
                PlanOutcome::Held(allocations.iter().map(|a| a.id).collect())
            }
            Ok((_, other)) => PlanOutcome::Refused(format!("unexpected answer {other:?}")),
            Err(CommandError::NoCapacity(why)) => {
                PlanOutcome::Refused(format!("{why}{}", holders(l, &g.node, &containers)))
            }
            Err(e) => PlanOutcome::Refused(e.to_string()),
        };
        out.push(entry(Some(g.peer), containers, outcome));
    }
    out
}

#[cfg(test)]
mod tests;
