//! Deciding DRA claim commands: a grant is checked as a reservation is (node mode, health,
//! capacity, quota) and keyed by claim uid, request and share id; prepare and unprepare are the
//! node agent's, idempotent like `Assign`.

use super::{CommandError, Reply};
use crate::CORE_MILLI_PER_GPU;
use crate::pb;
use crate::pb::event::Body;
use crate::state::{Alloc, Ledger, claim_key, dra_device_name, is_dns_label, same_pods};

/// The `source` values a grant may carry.
pub const CLAIM_SOURCES: [&str; 2] = ["claim", "extended-resource"];

type Decided = Result<(Vec<Body>, Reply), CommandError>;

impl Ledger {
    pub(super) fn decide_grant_claim(&self, mut g: pb::ClaimGranted) -> Decided {
        let (claim, share) = claim_and_share(g.claim.as_ref(), g.share.as_ref(), &g.request)?;
        if !CLAIM_SOURCES.contains(&g.source.as_str()) {
            return Err(CommandError::Invalid(format!(
                "grant source {:?} is not one of {}",
                g.source,
                CLAIM_SOURCES.join(", ")
            )));
        }
        if share.mem_mib == 0 || share.core_milli > CORE_MILLI_PER_GPU {
            return Err(CommandError::Invalid(format!(
                "claim {}/{} request {}: a share needs 1 MiB or more and at most {} cores \
                 (got {} MiB, {})",
                claim.namespace,
                claim.name,
                g.request,
                CORE_MILLI_PER_GPU,
                share.mem_mib,
                share.core_milli
            )));
        }
        let what = format!(
            "claim {}/{} ({}) request {}",
            claim.namespace, claim.name, claim.uid, g.request
        );
        if let Some(a) = self.alloc_of(&claim.uid, &claim_key(&g.request, &g.share_id)) {
            let c = a.claim.as_deref();
            if a.node == g.node
                && a.shares.as_slice() == std::slice::from_ref(share)
                && c.is_some_and(|c| c.device == g.device && c.pool == g.pool)
            {
                return Ok((
                    Vec::new(),
                    Reply::Reserved {
                        allocations: vec![a.to_pb()],
                        created: false,
                    },
                ));
            }
            return Err(CommandError::Conflict(format!(
                "{what} share {} is already granted as allocation {} on node {} GPU {}",
                g.share_id,
                a.id,
                a.node,
                a.shares.first().map_or("", |s| s.gpu_uuid.as_str())
            )));
        }
        let n = self
            .node(&g.node)
            .ok_or_else(|| CommandError::NotFound(format!("node {} is not registered", g.node)))?;
        if n.mode != pb::NodeMode::Dra {
            return Err(CommandError::Unsatisfiable(format!(
                "{what}: node {} serves GPUs through the device plugin, not DRA",
                g.node
            )));
        }
        if g.pool != g.node || g.device != dra_device_name(&share.gpu_uuid) {
            return Err(CommandError::Invalid(format!(
                "{what}: pool {:?} device {:?} is not GPU {} of node {} (pool {:?} device {:?})",
                g.pool,
                g.device,
                share.gpu_uuid,
                g.node,
                g.node,
                dra_device_name(&share.gpu_uuid)
            )));
        }
        let gpu = n.gpu(&share.gpu_uuid).ok_or_else(|| {
            CommandError::NotFound(format!("GPU {} on node {}", share.gpu_uuid, g.node))
        })?;
        if share.mem_mib > gpu.memory_mib {
            return Err(CommandError::Unsatisfiable(format!(
                "{what}: {} MiB asked, GPU {} has {} MiB",
                share.mem_mib, gpu.uuid, gpu.memory_mib
            )));
        }
        if !gpu.healthy {
            return Err(CommandError::NoCapacity(format!(
                "{what}: GPU {} is unhealthy",
                gpu.uuid
            )));
        }
        if share.mem_mib > gpu.mem_free() || share.core_milli > gpu.core_free() {
            return Err(CommandError::NoCapacity(format!(
                "{what}: GPU {} has {} MiB and {} cores free, the share asks {} MiB and {}",
                gpu.uuid,
                gpu.mem_free(),
                gpu.core_free(),
                share.mem_mib,
                share.core_milli
            )));
        }
        self.check_room_kept(&g, &what, share)?;
        self.check_quota_of(&claim.namespace, std::iter::once(share))?;
        g.allocation_id = self.seq() + 1;
        Ok((
            vec![Body::ClaimGranted(g)],
            Reply::Reserved {
                allocations: Vec::new(),
                created: true,
            },
        ))
    }

    /// Refuse a grant that takes room nominated on its GPU for a preempting pod its consumers
    /// do not outrank (`g.priority`); the nominee's own claim may take its room.
    fn check_room_kept(
        &self,
        g: &pb::ClaimGranted,
        what: &str,
        share: &pb::GpuShare,
    ) -> Result<(), CommandError> {
        let noms = self.nominations();
        let me = g
            .consumers
            .iter()
            .map(|c| c.uid.as_str())
            .find(|u| noms.get(u).is_some_and(|n| n.node == g.node))
            .unwrap_or("");
        let Some(node) = self.node(&g.node) else {
            return Ok(());
        };
        let seen = noms.seen_by(node, me, g.priority);
        let Some(gpu) = seen.gpu(&share.gpu_uuid) else {
            return Ok(());
        };
        if share.mem_mib <= gpu.mem_free() && share.core_milli <= gpu.core_free() {
            return Ok(());
        }
        let kept: Vec<String> = noms
            .keeping_from(&g.node, me, g.priority)
            .filter(|n| {
                n.containers
                    .iter()
                    .flat_map(|c| &c.shares)
                    .any(|s| s.gpu_uuid == share.gpu_uuid)
            })
            .map(|n| {
                let p = n.pod.clone().unwrap_or_default();
                format!("pod {}/{} (priority {})", p.namespace, p.name, n.priority)
            })
            .collect();
        Err(CommandError::NoCapacity(format!(
            "{what}: the room on GPU {} is kept for {}, which preempted for it, until it is \
             certified there; this claim's pods have priority {}, so only {} MiB and {} cores \
             of it are free to them",
            share.gpu_uuid,
            kept.join(", "),
            g.priority,
            gpu.mem_free(),
            gpu.core_free()
        )))
    }

    pub(super) fn decide_refuse_claim(&self, r: pb::ClaimRefused) -> Decided {
        // A result on a device the inventory lacks is refused with no share to name.
        let claim = match r.share.as_ref() {
            Some(share) => claim_and_share(r.claim.as_ref(), Some(share), &r.request)?.0,
            None => claim_ref(r.claim.as_ref(), &r.request)?,
        };
        if r.reason.is_empty() {
            return Err(CommandError::Invalid("a refusal needs a reason".into()));
        }
        if let Some(a) = self.alloc_of(&claim.uid, &claim_key(&r.request, &r.share_id)) {
            return Err(CommandError::Conflict(format!(
                "claim {}/{} request {} share {} is granted as allocation {}: release it first",
                claim.namespace, claim.name, r.request, r.share_id, a.id
            )));
        }
        Ok((vec![Body::ClaimRefused(r)], Reply::Done { changed: true }))
    }

    pub(super) fn decide_prepare_claim(
        &self,
        node: String,
        allocation_ids: Vec<u64>,
        cdi_device_ids: Vec<String>,
    ) -> Decided {
        if allocation_ids.is_empty() || cdi_device_ids.is_empty() {
            return Err(CommandError::Invalid(
                "a prepare names grants and the CDI device ids given for them".into(),
            ));
        }
        let mut todo = Vec::new();
        for (i, id) in allocation_ids.iter().enumerate() {
            if allocation_ids[..i].contains(id) {
                continue;
            }
            let a = self.node_alloc(&node, *id)?;
            let c = a.claim.as_deref().ok_or_else(|| {
                CommandError::Conflict(format!(
                    "allocation {id} is a pod reservation, not a claim grant"
                ))
            })?;
            if !c.prepared {
                todo.push(*id);
            } else if !super::same_set(&c.cdi_device_ids, &cdi_device_ids) {
                return Err(CommandError::Conflict(format!(
                    "claim grant {id} is already prepared with CDI devices {:?}",
                    c.cdi_device_ids
                )));
            }
        }
        if todo.is_empty() {
            return Ok((Vec::new(), Reply::Done { changed: false }));
        }
        Ok((
            vec![Body::ClaimPrepared(pb::ClaimPrepared {
                allocation_ids: todo,
                cdi_device_ids,
                node,
            })],
            Reply::Done { changed: true },
        ))
    }

    pub(super) fn decide_set_claim_consumers(
        &self,
        claim_uid: &str,
        consumers: Vec<pb::PodRef>,
    ) -> Decided {
        let grants: Vec<&Alloc> = self
            .allocs_of_pod(claim_uid)
            .into_iter()
            .filter(|a| a.claim.is_some())
            .collect();
        let Some(first) = grants.first() else {
            return Err(CommandError::NotFound(format!(
                "claim {claim_uid} holds no grant"
            )));
        };
        let stale: Vec<u64> = grants
            .iter()
            .filter(|a| {
                a.claim
                    .as_ref()
                    .is_some_and(|c| !same_pods(&c.consumers, &consumers))
            })
            .map(|a| a.id)
            .collect();
        if stale.is_empty() {
            return Ok((Vec::new(), Reply::Done { changed: false }));
        }
        Ok((
            vec![Body::ClaimConsumersChanged(pb::ClaimConsumersChanged {
                allocation_ids: stale,
                consumers,
                node: first.node.clone(),
            })],
            Reply::Done { changed: true },
        ))
    }

    pub(super) fn decide_unprepare_claim(&self, node: String, allocation_ids: Vec<u64>) -> Decided {
        let mut todo = Vec::new();
        for (i, id) in allocation_ids.iter().enumerate() {
            // Released already (the claim is gone): nothing left to undo.
            let Some(a) = self.alloc(*id) else { continue };
            if allocation_ids[..i].contains(id) {
                continue;
            }
            let a = self.node_alloc(&node, a.id)?;
            let c = a.claim.as_deref().ok_or_else(|| {
                CommandError::Conflict(format!(
                    "allocation {id} is a pod reservation, not a claim grant"
                ))
            })?;
            if c.prepared {
                todo.push(*id);
            }
        }
        if todo.is_empty() {
            return Ok((Vec::new(), Reply::Done { changed: false }));
        }
        Ok((
            vec![Body::ClaimUnprepared(pb::ClaimUnprepared {
                allocation_ids: todo,
                node,
            })],
            Reply::Done { changed: true },
        ))
    }
}

/// The claim and share a grant or refusal must name, with a request.
fn claim_and_share<'a>(
    claim: Option<&'a pb::ClaimRef>,
    share: Option<&'a pb::GpuShare>,
    request: &str,
) -> Result<(&'a pb::ClaimRef, &'a pb::GpuShare), CommandError> {
    let claim = claim_ref(claim, request)?;
    let share = share.ok_or_else(|| CommandError::Invalid("no GPU share".into()))?;
    if share.gpu_uuid.is_empty() {
        return Err(CommandError::Invalid("share without GPU uuid".into()));
    }
    Ok((claim, share))
}

/// The claim a grant or refusal must name, with a request.
fn claim_ref<'a>(
    claim: Option<&'a pb::ClaimRef>,
    request: &str,
) -> Result<&'a pb::ClaimRef, CommandError> {
    let claim = claim.ok_or_else(|| CommandError::Invalid("no claim".into()))?;
    if claim.uid.is_empty() || claim.name.is_empty() || !is_dns_label(&claim.namespace) {
        return Err(CommandError::Invalid(format!(
            "claim {:?}/{:?} ({:?}) needs a uid, a name and a namespace that is a DNS label",
            claim.namespace, claim.name, claim.uid
        )));
    }
    if request.is_empty() {
        return Err(CommandError::Invalid("no claim request".into()));
    }
    Ok(claim)
}

#[cfg(test)]
mod tests;
