//! The prepare decision, pure: which ledger grants serve a ResourceClaim's current allocation
//! on this node, or why none may. A result is served only by a live grant of the same claim
//! UID, request, pool, device (so GPU) and share id: a claim whose `status.allocation` was
//! written behind the ledger's back, or changed after the grant, gets no device.

use gpuledger_proto::ledger::v1 as pb;

use crate::view::View;

pub use gpuledger_request::dra::{ClaimResult, DRIVER};

/// What prepare does with a claim, given the view.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Every result has its grant (in result order).
    Granted(Vec<(ClaimResult, pb::Allocation)>),
    /// Some result has no grant yet (the allocator may still be certifying it): why.
    NotYet(String),
    /// Refused for good: why.
    Refused(String),
}

/// Decide for claim `uid`'s `results` (our driver's only) on node `node`.
pub fn decide(uid: &str, results: &[ClaimResult], node: &str, view: &View) -> Decision {
    if results.is_empty() {
        return Decision::Refused(format!("it has no allocation result for driver {DRIVER}"));
    }
    let mut out = Vec::with_capacity(results.len());
    for r in results {
        if r.admin_access {
            return Decision::Refused(format!(
                "request {} asks for adminAccess to device {}, which gpuledger does not grant",
                r.request, r.device
            ));
        }
        if r.pool != node {
            return Decision::Refused(format!(
                "request {} is allocated from pool {}, not from this node {node}",
                r.request, r.pool
            ));
        }
        let grant = view.grants_of_claim(uid).into_iter().find(|a| {
            a.node == node
                && a.claim.as_ref().is_some_and(|c| {
                    c.request == r.request
                        && c.share_id == r.share_id
                        && c.pool == r.pool
                        && c.device == r.device
                })
        });
        match grant {
            Some(a) => out.push((r.clone(), a.clone())),
            None => {
                if let Some(f) = view.refusal_of(uid, &r.request, &r.pool, &r.device, &r.share_id) {
                    return Decision::Refused(format!(
                        "request {} was refused by the ledger: {}",
                        r.request, f.reason
                    ));
                }
                let other = view.grants_of_claim(uid).into_iter().find_map(|a| {
                    let c = a.claim.as_ref()?;
                    (c.request == r.request).then(|| (c.device.clone(), c.share_id.clone()))
                });
                return Decision::NotYet(match other {
                    Some((device, share)) => format!(
                        "request {} is allocated device {} share {:?}, but the ledger granted device {device} share {share:?}",
                        r.request, r.device, r.share_id
                    ),
                    None => format!(
                        "the ledger holds no grant of request {} (device {}, share {:?}) as of seq {}",
                        r.request, r.device, r.share_id, view.seq
                    ),
                });
            }
        }
    }
    Decision::Granted(out)
}

#[cfg(test)]
mod tests;
