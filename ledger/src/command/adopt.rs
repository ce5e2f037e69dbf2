//! Deciding an adoption: a running pod that another scheduler (HAMi, gpushare, gpu-manager)
//! placed becomes the ledger's grant on exactly the GPUs it runs on, or is refused with the
//! reason, never squeezed in: a GPU the peer over-committed refuses the pod that does not fit.

use std::collections::BTreeMap;

use super::{CommandError, Reply};
use crate::CORE_MILLI_PER_GPU;
use crate::pb;
use crate::pb::event::Body;
use crate::state::Ledger;

/// How an adopted allocation's policy begins (`adopted-from=<peer>`).
pub const ADOPTED_FROM: &str = "adopted-from=";

/// The policy recorded on an adopted allocation: who placed it.
pub fn adopted_policy(source: &str) -> String {
    format!("{ADOPTED_FROM}{source}")
}

/// Whether an allocation of this policy was adopted: its pod runs on devices another device
/// plugin handed out, so no kubelet Allocate of gpuledger's will ever claim it.
pub fn is_adopted(policy: &str) -> bool {
    policy.starts_with(ADOPTED_FROM)
}

impl Ledger {
    /// Decide an `Adopt` of `pod`'s `containers` on `node`, placed by `source`.
    pub(super) fn decide_adopt(
        &self,
        pod: pb::PodRef,
        node: String,
        containers: Vec<pb::NominatedContainer>,
        source: &str,
    ) -> Result<(Vec<Body>, Reply), CommandError> {
        if pod.uid.is_empty() || pod.name.is_empty() || pod.namespace.is_empty() {
            return Err(CommandError::Invalid(
                "an adopted pod needs its uid, namespace and name".into(),
            ));
        }
        if source.is_empty() {
            return Err(CommandError::Invalid(
                "an adoption names the scheduler that placed the pod".into(),
            ));
        }
        // Idempotent by pod UID: a pod the ledger already holds (adopted before, or placed by
        // gpuledger itself) is answered with what it holds, never granted twice.
        if let Some(repeat) = self.repeat_of(&pod, &node) {
            return repeat;
        }
        let n = self
            .node(&node)
            .ok_or_else(|| CommandError::NotFound(format!("node {node} is not registered")))?;
        if n.mode != pb::NodeMode::DevicePlugin {
            return Err(CommandError::Unsatisfiable(format!(
                "node {node} serves GPUs through DRA: pods there hold ResourceClaims, not \
                 device-plugin grants"
            )));
        }
        let containers: Vec<pb::NominatedContainer> = containers
            .into_iter()
            .filter(|c| !c.shares.is_empty())
            .collect();
        if containers.is_empty() {
            return Err(CommandError::Invalid(format!(
                "pod {}/{} holds no GPU share to adopt",
                pod.namespace, pod.name
            )));
        }
        // The pod's whole hold per GPU, checked at once: two containers of one pod on one GPU
        // must fit together.
        let mut wanted: BTreeMap<&str, (u64, u32)> = BTreeMap::new();
        for c in &containers {
            let mut seen = std::collections::BTreeSet::new();
            for s in &c.shares {
                if !seen.insert(s.gpu_uuid.as_str()) {
                    return Err(CommandError::Invalid(format!(
                        "container {} names GPU {} twice",
                        c.container, s.gpu_uuid
                    )));
                }
                if s.core_milli > CORE_MILLI_PER_GPU {
                    return Err(CommandError::Invalid(format!(
                        "container {} asks {} thousandths of GPU {}; at most {CORE_MILLI_PER_GPU}",
                        c.container, s.core_milli, s.gpu_uuid
                    )));
                }
                let w = wanted.entry(s.gpu_uuid.as_str()).or_default();
                w.0 = w.0.saturating_add(s.mem_mib);
                w.1 = w.1.saturating_add(s.core_milli);
            }
        }
        for (uuid, (mem, core)) in &wanted {
            let g = n.gpu(uuid).ok_or_else(|| {
                CommandError::NotFound(format!("GPU {uuid} is not registered on node {node}"))
            })?;
            if !g.healthy {
                return Err(CommandError::Conflict(format!(
                    "GPU {uuid} on node {node} is unhealthy: the ledger grants nothing on it"
                )));
            }
            if g.mem_used.saturating_add(*mem) > g.memory_mib
                || g.core_used.saturating_add(*core) > CORE_MILLI_PER_GPU
            {
                return Err(CommandError::NoCapacity(format!(
                    "GPU {uuid} on node {node} holds {} of {} MiB and {} of {CORE_MILLI_PER_GPU} \
                     compute; the pod's {mem} MiB and {core} do not fit (over-committed by \
                     {source}?)",
                    g.mem_used, g.memory_mib, g.core_used
                )));
            }
        }
        let mut bodies: Vec<Body> = self
            .end_nomination_body(&pod.uid, format!("adopted on node {node}"))
            .into_iter()
            .collect();
        let first = self.seq() + 1 + bodies.len() as u64;
        let policy = adopted_policy(source);
        let ids: Vec<u64> = (0..containers.len() as u64).map(|i| first + i).collect();
        bodies.extend(containers.into_iter().zip(&ids).map(|(c, id)| {
            Body::Reserved(pb::Reserved {
                allocation_id: *id,
                pod: Some(pod.clone()),
                container: c.container,
                node: node.clone(),
                shares: c.shares,
                // Bound in the same batch: it never waits for a binding, so never expires.
                deadline_ms: 0,
                cpu_milli: 0,
                memory_mib: 0,
                policy: policy.clone(),
            })
        }));
        bodies.extend(ids.iter().map(|id| {
            Body::Bound(pb::Bound {
                allocation_id: *id,
                reason: policy.clone(),
                node: node.clone(),
            })
        }));
        Ok((
            bodies,
            Reply::Reserved {
                allocations: Vec::new(),
                created: true,
            },
        ))
    }
}

#[cfg(test)]
mod tests;
