//! Deciding a reservation: a repeat answers with the pod's allocations, a new one is placed on
//! the node it names (on the shares nominated for it, if any) within its namespace's quota.

use super::{CommandError, Reply};
use crate::pb;
use crate::pb::event::Body;
use crate::placement::{self, Fit, PodRequest};
use crate::state::Ledger;

impl Ledger {
    /// Decide a `Reserve` of `request` on `node`, its reservation lasting until `deadline_ms`.
    pub(super) fn decide_reserve(
        &self,
        request: PodRequest,
        node: String,
        deadline_ms: i64,
    ) -> Result<(Vec<Body>, Reply), CommandError> {
        request.validate().map_err(CommandError::Invalid)?;
        if let Some(repeat) = self.repeat_of(&request.pod, &node) {
            return repeat;
        }
        let n = self
            .node_for(&node, &request)
            .ok_or_else(|| CommandError::NotFound(format!("node {node} is not registered")))?;
        if n.mode != pb::NodeMode::DevicePlugin {
            return Err(CommandError::Unsatisfiable(format!(
                "node {node} serves GPUs through DRA: pods get them with a ResourceClaim"
            )));
        }
        let placed = match self.nominated_placement(&n, &request) {
            Some(p) => p,
            None => placement::place_on_node(&n, &request).map_err(|f| match f {
                Fit::Never(r) => CommandError::Unsatisfiable(format!("node {node}: {r}")),
                Fit::Wait(r) => CommandError::NoCapacity(format!(
                    "node {node}: {r}{}",
                    self.room_kept(&node, &request)
                )),
                Fit::Fits => CommandError::NoCapacity(format!("node {node}")),
            })?,
        };
        self.check_quota(&request.pod.namespace, &placed)?;
        // The pod's own nomination, wherever it was, ends with its reservation.
        let mut bodies: Vec<Body> = self
            .end_nomination_body(&request.pod.uid, format!("reserved on node {node}"))
            .into_iter()
            .collect();
        let first = self.seq() + 1 + bodies.len() as u64;
        bodies.extend(placed.into_iter().enumerate().map(|(i, p)| {
            Body::Reserved(pb::Reserved {
                allocation_id: first + i as u64,
                pod: Some(request.pod.clone()),
                container: p.container,
                node: node.clone(),
                shares: p.shares,
                deadline_ms,
                // The pod's node-level requests are counted once, on its first container.
                cpu_milli: if i == 0 { request.cpu_milli } else { 0 },
                memory_mib: if i == 0 { request.memory_mib } else { 0 },
                policy: request.policy.to_string(),
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

    /// The answer to a grant asked again for a pod that holds allocations already: what it
    /// holds, written nothing, or a conflict when it holds them on another node than `node`.
    /// None when the pod holds nothing.
    pub(super) fn repeat_of(
        &self,
        pod: &pb::PodRef,
        node: &str,
    ) -> Option<Result<(Vec<Body>, Reply), CommandError>> {
        let existing = self.allocs_of_pod(&pod.uid);
        if existing.is_empty() {
            return None;
        }
        if let Some(a) = existing.iter().find(|a| a.node != node) {
            return Some(Err(CommandError::Conflict(format!(
                "pod {}/{} already holds allocation {} on node {}",
                pod.namespace, pod.name, a.id, a.node
            ))));
        }
        let mut allocations: Vec<pb::Allocation> = existing.iter().map(|a| a.to_pb()).collect();
        allocations.sort_by_key(|a| a.id);
        Some(Ok((
            Vec::new(),
            Reply::Reserved {
                allocations,
                created: false,
            },
        )))
    }

    /// Refuse a grant that would take a namespace over its quota. The leader decides every
    /// grant in log order against the folded state, so two racing pods cannot both slip in.
    fn check_quota(
        &self,
        ns: &str,
        placed: &[placement::ContainerPlacement],
    ) -> Result<(), CommandError> {
        self.check_quota_of(ns, placed.iter().flat_map(|p| &p.shares))
    }

    /// Refuse `shares` when they would take namespace `ns` over its quota.
    pub(super) fn check_quota_of<'a>(
        &self,
        ns: &str,
        shares: impl Iterator<Item = &'a pb::GpuShare> + Clone,
    ) -> Result<(), CommandError> {
        let Some(q) = self.quotas().get(ns) else {
            return Ok(());
        };
        let (held_m, held_c) = self.budgets().held(ns);
        let m = shares
            .clone()
            .fold(0u64, |t, s| t.saturating_add(s.mem_mib));
        let c = shares.fold(0u64, |t, s| t.saturating_add(u64::from(s.core_milli)));
        if q.mem_mib > 0 && held_m.saturating_add(m) > q.mem_mib {
            return Err(CommandError::NoCapacity(format!(
                "namespace {ns} is over its GPU memory quota: holds {held_m} MiB, asks {m} MiB, \
                 quota {} MiB",
                q.mem_mib
            )));
        }
        if q.core_milli > 0 && held_c.saturating_add(c) > q.core_milli {
            return Err(CommandError::NoCapacity(format!(
                "namespace {ns} is over its GPU compute quota: holds {held_c}, asks {c}, quota {} \
                 (thousandths of a GPU)",
                q.core_milli
            )));
        }
        Ok(())
    }
}
