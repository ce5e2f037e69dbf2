//! Folding DRA claim grants: a grant is an allocation of one share of one GPU of a DRA node,
//! held under its claim as a reservation is under its pod, and checked the same way.

use super::{AllocState, ClaimGrant, Ledger, claim_key};
use crate::pb;

/// The ResourceSlice device name of a GPU: `gpu-` and its UUID in lower case without `GPU-`
/// (a DNS label, stable across reboots and reindexing).
pub fn dra_device_name(gpu_uuid: &str) -> String {
    let bare = gpu_uuid.strip_prefix("GPU-").unwrap_or(gpu_uuid);
    format!("gpu-{}", bare.to_ascii_lowercase())
}

/// Whether two consumer lists name the same pods (by UID, in any order).
pub fn same_pods(a: &[pb::PodRef], b: &[pb::PodRef]) -> bool {
    fn uids(p: &[pb::PodRef]) -> std::collections::BTreeSet<&str> {
        p.iter().map(|c| c.uid.as_str()).collect()
    }
    uids(a) == uids(b)
}

/// The pod whose eviction frees allocation `a`: a reservation's pod, or the one pod a claim
/// grant is reserved for. A grant shared by several pods, or reserved for none, is freed by no
/// single eviction (None).
pub fn holder(a: &super::Alloc) -> Option<&str> {
    match holders(a).as_slice() {
        [only] => Some(only),
        _ => None,
    }
}

/// The pods whose evictions together free allocation `a`: a reservation's pod, or every pod a
/// claim grant is reserved for (none for a grant reserved for none: no eviction frees it).
pub fn holders(a: &super::Alloc) -> Vec<&str> {
    match a.claim.as_deref() {
        None => vec![a.pod.uid.as_str()],
        Some(g) => g.consumers.iter().map(|c| c.uid.as_str()).collect(),
    }
}

impl Ledger {
    /// The live allocations on `node` that evicting every pod of `gone` frees ([`holders`]):
    /// their reservations, and the grants of claims reserved for them only.
    pub fn freed_on(
        &self,
        node: &str,
        gone: &std::collections::BTreeSet<&str>,
    ) -> Vec<&super::Alloc> {
        self.live_on(node)
            .filter(|a| {
                let h = holders(a);
                !h.is_empty() && h.iter().all(|u| gone.contains(u))
            })
            .collect()
    }

    /// Whether pod `uid` holds a reservation on `node` or is among the pods a grant there is
    /// reserved for: whether its eviction may free anything there.
    pub fn holds_on(&self, node: &str, uid: &str) -> bool {
        self.live_on(node).any(|a| holders(a).contains(&uid))
    }

    fn live_on(&self, node: &str) -> impl Iterator<Item = &super::Alloc> {
        self.nodes
            .get(node)
            .into_iter()
            .flat_map(|n| n.allocs.iter())
            .filter_map(|id| self.allocs.get(id))
    }

    /// The live grant of a claim's result (request and share), if any.
    pub fn alloc_of_claim(
        &self,
        claim_uid: &str,
        request: &str,
        share_id: &str,
    ) -> Option<&super::Alloc> {
        self.alloc_of(claim_uid, &claim_key(request, share_id))
            .filter(|a| a.claim.is_some())
    }

    /// Refuse `what` on a node that is not registered or not in `mode`.
    pub(super) fn require_mode(
        &self,
        node: &str,
        mode: pb::NodeMode,
        what: &str,
    ) -> Result<(), String> {
        match self.nodes.get(node) {
            Some(n) if n.mode != mode => Err(format!(
                "{what} on node {node}, which is in mode {}",
                n.mode.as_str_name()
            )),
            // An unknown node is the caller's check to report.
            _ => Ok(()),
        }
    }

    pub(super) fn grant_claim(
        &mut self,
        ev: &pb::Event,
        g: &pb::ClaimGranted,
    ) -> Result<(), String> {
        let claim = g.claim.as_ref().ok_or("ClaimGranted without claim")?;
        if claim.uid.is_empty() || g.request.is_empty() {
            return Err("ClaimGranted with an empty claim uid or request".into());
        }
        let share = g.share.as_ref().ok_or("ClaimGranted without share")?;
        if !self.nodes.contains_key(&g.node) {
            return Err(format!("ClaimGranted on unknown node {}", g.node));
        }
        self.require_mode(&g.node, pb::NodeMode::Dra, "ClaimGranted")?;
        if g.pool != g.node || g.device != dra_device_name(&share.gpu_uuid) {
            return Err(format!(
                "ClaimGranted names pool {} device {} for GPU {} on node {}",
                g.pool, g.device, share.gpu_uuid, g.node
            ));
        }
        let r = pb::Reserved {
            allocation_id: g.allocation_id,
            pod: Some(pb::PodRef {
                uid: claim.uid.clone(),
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
            }),
            container: claim_key(&g.request, &g.share_id),
            node: g.node.clone(),
            shares: vec![share.clone()],
            deadline_ms: 0,
            cpu_milli: 0,
            memory_mib: 0,
            policy: String::new(),
        };
        self.reserve(ev, &r)?;
        let a = self
            .allocs
            .get_mut(&g.allocation_id)
            .expect("just reserved");
        // A grant is final when made: the scheduler has allocated the claim already.
        a.state = AllocState::Bound;
        a.claim = Some(Box::new(ClaimGrant::granted(g)));
        Ok(())
    }

    /// Check that each id is a claim grant on `node` whose prepared flag is `!to`.
    fn claim_grants_to_flip(&self, ids: &[u64], node: &str, to: bool) -> Result<(), String> {
        if ids.is_empty() {
            return Err("claim prepare or unprepare without allocation ids".into());
        }
        for (i, id) in ids.iter().enumerate() {
            if ids[..i].contains(id) {
                return Err(format!("allocation {id} named twice"));
            }
            let a = self
                .allocs
                .get(id)
                .ok_or_else(|| format!("claim prepare or unprepare of unknown allocation {id}"))?;
            let c = a.claim.as_ref().ok_or_else(|| {
                format!("allocation {id} is a pod reservation, not a claim grant")
            })?;
            if !node.is_empty() && a.node != node {
                return Err(format!("allocation {id} is on node {}, not {node}", a.node));
            }
            if c.prepared == to {
                return Err(format!(
                    "claim grant {id} is already {}",
                    if to { "prepared" } else { "unprepared" }
                ));
            }
        }
        Ok(())
    }

    pub(super) fn prepare_claims(&mut self, p: &pb::ClaimPrepared) -> Result<(), String> {
        self.claim_grants_to_flip(&p.allocation_ids, &p.node, true)?;
        for id in &p.allocation_ids {
            let c = self.claim_mut(*id);
            c.prepared = true;
            c.cdi_device_ids = p.cdi_device_ids.clone();
        }
        Ok(())
    }

    pub(super) fn unprepare_claims(&mut self, u: &pb::ClaimUnprepared) -> Result<(), String> {
        self.claim_grants_to_flip(&u.allocation_ids, &u.node, false)?;
        for id in &u.allocation_ids {
            let c = self.claim_mut(*id);
            c.prepared = false;
            c.cdi_device_ids.clear();
        }
        Ok(())
    }

    pub(super) fn set_claim_consumers(
        &mut self,
        c: &pb::ClaimConsumersChanged,
    ) -> Result<(), String> {
        if c.allocation_ids.is_empty() {
            return Err("ClaimConsumersChanged without allocation ids".into());
        }
        for id in &c.allocation_ids {
            let a = self
                .allocs
                .get(id)
                .ok_or_else(|| format!("ClaimConsumersChanged of unknown allocation {id}"))?;
            if a.claim.is_none() || a.node != c.node {
                return Err(format!(
                    "ClaimConsumersChanged names allocation {id}, not a claim grant on node {}",
                    c.node
                ));
            }
        }
        for id in &c.allocation_ids {
            self.claim_mut(*id).consumers = c.consumers.clone();
        }
        Ok(())
    }

    fn claim_mut(&mut self, id: u64) -> &mut ClaimGrant {
        self.allocs
            .get_mut(&id)
            .and_then(|a| a.claim.as_deref_mut())
            .expect("checked to be a claim grant")
    }

    /// Every allocation is of the kind its node's mode serves, and a claim grant holds exactly
    /// one share: no GPU is exposed through both the device plugin and DRA.
    pub(super) fn check_modes(&self) -> Result<(), String> {
        for a in self.allocs.values() {
            let Some(n) = self.nodes.get(&a.node) else {
                continue;
            };
            let want = if a.claim.is_some() {
                pb::NodeMode::Dra
            } else {
                pb::NodeMode::DevicePlugin
            };
            if n.mode != want {
                return Err(format!(
                    "allocation {} ({}) on node {} in mode {}",
                    a.id,
                    if a.claim.is_some() {
                        "claim grant"
                    } else {
                        "pod reservation"
                    },
                    a.node,
                    n.mode.as_str_name()
                ));
            }
            if a.claim.is_some() && a.shares.len() != 1 {
                return Err(format!(
                    "claim grant {} holds {} shares",
                    a.id,
                    a.shares.len()
                ));
            }
        }
        Ok(())
    }
}
