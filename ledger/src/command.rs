//! Commands: what clients ask the leader to do. [`Ledger::execute`] decides a command against
//! the state, applies the resulting events and returns them with the reply. Commands are
//! idempotent: asking again for what the ledger already says writes nothing and answers the same.

pub mod bounds;

use crate::pb;
use crate::pb::event::Body;
use crate::placement::PodRequest;
use crate::state::{Alloc, AllocState, ApplyError, Ledger};

mod adopt;
mod claim;

pub use adopt::{ADOPTED_FROM, is_adopted};
mod nominate;
mod reserve;

/// A request to change the ledger.
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    /// Add or replace a node's inventory.
    RegisterNode(pb::NodeInventory),
    /// Remove a node, releasing its allocations first.
    RemoveNode {
        /// Node name.
        node: String,
        /// Why (for the audit trail).
        reason: String,
    },
    /// Mark a GPU healthy or unhealthy.
    SetDeviceHealth(pb::DeviceHealthChanged),
    /// Reserve GPUs on `node` for every container of the pod.
    Reserve {
        /// The pod's request.
        request: PodRequest,
        /// The node the scheduler chose.
        node: String,
        /// When the reservation expires if the pod is not bound.
        deadline_ms: i64,
    },
    /// The pod is bound to `node`.
    ConfirmBound {
        /// Pod UID.
        pod_uid: String,
        /// Node it was bound to.
        node: String,
        /// Why (e.g. "extender" or "reconcile").
        reason: String,
    },
    /// A node agent claims a reservation for these device IDs.
    Assign {
        /// The calling agent's node.
        node: String,
        /// The allocation claimed.
        allocation_id: u64,
        /// The kubelet's device IDs.
        device_ids: Vec<String>,
    },
    /// Swap the pod identities of two allocations of one node (the kubelet gave the devices of
    /// one to the other's container).
    CorrectIdentity {
        /// The calling agent's node.
        node: String,
        /// The allocation that was claimed for the wrong pod.
        from_allocation_id: u64,
        /// The allocation of the pod that really got the devices.
        to_allocation_id: u64,
        /// The devices concerned.
        device_ids: Vec<String>,
    },
    /// Release allocations: one by id, or a pod's (all containers or one).
    Release {
        /// Pod UID (ignored when `allocation_id` is set).
        pod_uid: String,
        /// Container, empty = all of the pod's.
        container: String,
        /// A single allocation; 0 = by pod.
        allocation_id: u64,
        /// Why.
        reason: String,
    },
    /// A process over its limit, or on no allocation.
    ReportViolation(pb::LimitViolated),
    /// A new leader took over (the first event of every epoch).
    LeaderElected(pb::LeaderElected),
    /// Set or clear (both caps 0) a namespace's quota on GPU memory and compute held at once.
    SetQuota(pb::QuotaSet),
    /// Set or replace a namespace's budget ("" = the cluster default).
    SetBudget(pb::BudgetSet),
    /// Remove a namespace's budget (it falls back to the cluster default, if any).
    RemoveBudget(pb::BudgetRemoved),
    /// Keep the room a preemption frees for the pod that preempted: refused unless its shares
    /// fit on the node once the victims (and the pods of `leaving`) are gone, with the room
    /// nominated for pods of its priority or higher still taken. An identical nomination of
    /// the same pod (same node and shares) is a repeat.
    Nominate {
        /// The nomination, as `Nominated` records it.
        nomination: pb::Nominated,
        /// UIDs of pods whose allocations are on their way out anyway (terminating), counted
        /// as gone when checking the room; not recorded.
        leaving: Vec<String>,
    },
    /// Grant one result of a ResourceClaim (its share of one GPU of a DRA node), checked as
    /// `Reserve` is: node mode, health, capacity and the claim namespace's quota. The
    /// `allocation_id` is ignored (the grant's seq becomes it). A repeat of a live grant of the
    /// same claim, request and share answers with that grant.
    GrantClaim(pb::ClaimGranted),
    /// Record that a claim's result was refused, and why (refused while the result is granted).
    RefuseClaim(pb::ClaimRefused),
    /// A node agent prepared claim grants of its node (NodePrepareResources).
    PrepareClaim {
        /// The calling agent's node.
        node: String,
        /// The grants prepared (one claim's results).
        allocation_ids: Vec<u64>,
        /// The CDI device ids handed to the kubelet.
        cdi_device_ids: Vec<String>,
    },
    /// A node agent unprepared claim grants of its node (NodeUnprepareResources); grants
    /// already released or never prepared are skipped.
    UnprepareClaim {
        /// The calling agent's node.
        node: String,
        /// The grants unprepared.
        allocation_ids: Vec<u64>,
    },
    /// Set the consumers of a claim's live grants to its `status.reservedFor` (nothing when
    /// they already are).
    SetClaimConsumers {
        /// The claim's UID.
        claim_uid: String,
        /// The pods it is reserved for now.
        consumers: Vec<pb::PodRef>,
    },
    /// Take over a running pod that another scheduler placed (`gpuledger adopt`): its
    /// containers are reserved and bound at once on exactly the shares named, checked against
    /// the node's mode, the GPUs' health and capacity (not the namespace's quota: the pod runs
    /// already). A pod that already holds allocations writes nothing.
    Adopt {
        /// The running pod.
        pod: pb::PodRef,
        /// The node it runs on.
        node: String,
        /// Each GPU container's shares, as the other scheduler recorded them.
        containers: Vec<pb::NominatedContainer>,
        /// Who placed it (`hami`, `gpushare`, `gpu-manager`): recorded as the allocations'
        /// policy `adopted-from=<source>`.
        source: String,
    },
    /// End a pod's nomination (nothing when it has none).
    EndNomination {
        /// The nominee's UID.
        pod_uid: String,
        /// Why (expired, pod deleted, …).
        reason: String,
    },
}

/// Why a command was refused. Nothing was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommandError {
    /// The request is malformed or impossible; retrying will not help.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// A node, GPU, pod or allocation the request names is not in the ledger.
    #[error("not found: {0}")]
    NotFound(String),
    /// The request does not fit now; it may later.
    #[error("does not fit: {0}")]
    NoCapacity(String),
    /// The request can never fit where it asks.
    #[error("can never fit: {0}")]
    Unsatisfiable(String),
    /// The request contradicts what the ledger already holds (e.g. reserved on another node).
    #[error("conflict: {0}")]
    Conflict(String),
    /// The decided events broke an invariant: a bug. The state must be rebuilt from the log.
    #[error("internal invariant violation (state must be reloaded): {0}")]
    Bug(ApplyError),
}

/// The answer to a command.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// Whether the command changed anything.
    Done {
        /// False for an idempotent repeat.
        changed: bool,
    },
    /// The allocations of a reservation.
    Reserved {
        /// One per GPU container.
        allocations: Vec<pb::Allocation>,
        /// False when an existing grant was returned.
        created: bool,
    },
    /// The allocation after an assign.
    Assigned(Box<pb::Allocation>),
}

impl Ledger {
    /// Decide `cmd`, apply its events and return them (with seq, epoch and time set) and the
    /// reply. On `Err` the state is unchanged, except for `CommandError::Bug`.
    pub fn execute(
        &mut self,
        cmd: Command,
        epoch: u64,
        now_ms: i64,
    ) -> Result<(Vec<pb::Event>, Reply), CommandError> {
        let (bodies, reply) = self.decide(cmd)?;
        let mut events = Vec::with_capacity(bodies.len());
        let mut reply = reply;
        for body in bodies {
            let ev = pb::Event {
                seq: self.seq() + 1,
                epoch,
                time_ms: now_ms,
                actor: None,
                body: Some(body),
            };
            self.apply(&ev).map_err(CommandError::Bug)?;
            events.push(ev);
        }
        // Reservations answer with the allocations as they are in the state after apply.
        if let Reply::Reserved {
            allocations,
            created: true,
        } = &mut reply
        {
            *allocations = events
                .iter()
                .filter_map(|e| match &e.body {
                    Some(Body::Reserved(pb::Reserved { allocation_id, .. }))
                    | Some(Body::ClaimGranted(pb::ClaimGranted { allocation_id, .. })) => {
                        self.alloc(*allocation_id).map(Alloc::to_pb)
                    }
                    _ => None,
                })
                .collect();
        }
        Ok((events, reply))
    }

    fn decide(&self, cmd: Command) -> Result<(Vec<Body>, Reply), CommandError> {
        bounds::check(&cmd).map_err(CommandError::Invalid)?;
        let unchanged = Ok((Vec::new(), Reply::Done { changed: false }));
        let changed = |b: Vec<Body>| Ok((b, Reply::Done { changed: true }));
        match cmd {
            Command::RegisterNode(mut inv) => {
                if inv.node.is_empty() {
                    return Err(CommandError::Invalid("node name is empty".into()));
                }
                // CPU and host memory come from Kubernetes (node allocatable), GPUs from the
                // node agent: a registration that does not know one (0) keeps the ledger's.
                if let Some(n) = self.node(&inv.node) {
                    if inv.cpu_milli == 0 {
                        inv.cpu_milli = n.cpu_milli;
                    }
                    if inv.memory_mib == 0 {
                        inv.memory_mib = n.memory_mib;
                    }
                }
                if let Some(n) = self.node(&inv.node) {
                    let mut cur = n.inventory();
                    let mut new = inv.clone();
                    cur.gpus.sort_by_key(|g| g.index);
                    new.gpus.sort_by_key(|g| g.index);
                    if cur == new {
                        return unchanged;
                    }
                }
                let Some(mode) = crate::state::node_mode(inv.mode) else {
                    return Err(CommandError::Invalid(format!(
                        "node {}: unknown mode {}",
                        inv.node, inv.mode
                    )));
                };
                if let Some(n) = self.node(&inv.node)
                    && n.mode != mode
                    && !n.allocs.is_empty()
                {
                    return Err(CommandError::Conflict(format!(
                        "node {} holds {} allocations: its mode stays {} until they are released",
                        inv.node,
                        n.allocs.len(),
                        n.mode.as_str_name()
                    )));
                }
                if let Some(existing) = self.node(&inv.node) {
                    for g in existing.gpus.iter().filter(|g| g.holders > 0) {
                        match inv.gpus.iter().find(|n| n.uuid == g.uuid) {
                            None => {
                                return Err(CommandError::Conflict(format!(
                                    "GPU {} has live allocations and cannot leave node {}'s inventory",
                                    g.uuid, inv.node
                                )));
                            }
                            Some(n) if n.memory_mib < g.mem_used => {
                                return Err(CommandError::Conflict(format!(
                                    "GPU {} would have {} MiB but {} MiB are allocated",
                                    g.uuid, n.memory_mib, g.mem_used
                                )));
                            }
                            Some(_) => {}
                        }
                    }
                }
                let mut seen = std::collections::BTreeSet::new();
                for g in &inv.gpus {
                    if g.uuid.is_empty() || !seen.insert(g.uuid.as_str()) {
                        return Err(CommandError::Invalid(format!(
                            "node {}: empty or duplicate GPU uuid {:?}",
                            inv.node, g.uuid
                        )));
                    }
                    if let Some(other) = self.gpu_owner(&g.uuid).filter(|o| *o != inv.node) {
                        return Err(CommandError::Conflict(format!(
                            "GPU {} is already registered on node {other}",
                            g.uuid
                        )));
                    }
                }
                let kept: Vec<&str> = inv.gpus.iter().map(|g| g.uuid.as_str()).collect();
                let mut b = self.nominations_ending_on(
                    &inv.node,
                    Some(&kept),
                    "a nominated GPU left the node's inventory",
                );
                b.push(Body::NodeRegistered(pb::NodeRegistered {
                    inventory: Some(inv),
                }));
                changed(b)
            }
            Command::RemoveNode { node, reason } => {
                let Some(n) = self.node(&node) else {
                    return unchanged;
                };
                let mut b =
                    self.nominations_ending_on(&node, None, &format!("node removed: {reason}"));
                b.extend(n.allocs.iter().map(|id| {
                    Body::Released(pb::Released {
                        allocation_id: *id,
                        reason: format!("node removed: {reason}"),
                        node: node.clone(),
                    })
                }));
                b.push(Body::NodeRemoved(pb::NodeRemoved { node, reason }));
                changed(b)
            }
            Command::SetDeviceHealth(h) => {
                let g = self
                    .node(&h.node)
                    .ok_or_else(|| CommandError::NotFound(format!("node {}", h.node)))?
                    .gpu(&h.gpu_uuid)
                    .ok_or_else(|| {
                        CommandError::NotFound(format!("GPU {} on node {}", h.gpu_uuid, h.node))
                    })?;
                if g.healthy == h.healthy {
                    return unchanged;
                }
                changed(vec![Body::DeviceHealthChanged(h)])
            }
            Command::Reserve {
                request,
                node,
                deadline_ms,
            } => self.decide_reserve(request, node, deadline_ms),
            Command::ConfirmBound {
                pod_uid,
                node,
                reason,
            } => {
                let allocs = self.allocs_of_pod(&pod_uid);
                if allocs.is_empty() {
                    return Err(CommandError::NotFound(format!(
                        "pod {pod_uid} holds no allocation"
                    )));
                }
                if let Some(a) = allocs.iter().find(|a| a.node != node) {
                    return Err(CommandError::Conflict(format!(
                        "pod {pod_uid} is reserved on node {}, not {node}",
                        a.node
                    )));
                }
                let b: Vec<Body> = allocs
                    .iter()
                    .filter(|a| a.state == AllocState::Reserved)
                    .map(|a| {
                        Body::Bound(pb::Bound {
                            allocation_id: a.id,
                            reason: reason.clone(),
                            node: node.clone(),
                        })
                    })
                    .collect();
                if b.is_empty() { unchanged } else { changed(b) }
            }
            Command::Assign {
                node,
                allocation_id,
                device_ids,
            } => {
                let a = self.node_alloc(&node, allocation_id)?;
                if device_ids.is_empty() {
                    return Err(CommandError::Invalid("no device ids".into()));
                }
                if a.state == AllocState::Assigned {
                    if same_set(&a.device_ids, &device_ids) {
                        return Ok((Vec::new(), Reply::Assigned(Box::new(a.to_pb()))));
                    }
                    return Err(CommandError::Conflict(format!(
                        "allocation {allocation_id} is already assigned to devices {:?}",
                        a.device_ids
                    )));
                }
                if let Some(o) = self.node(&node).and_then(|n| {
                    device_ids
                        .iter()
                        .filter_map(|d| n.devices.get(d))
                        .find(|o| **o != allocation_id)
                        .and_then(|o| self.alloc(*o))
                }) {
                    return Err(CommandError::Conflict(format!(
                        "devices {device_ids:?} overlap allocation {} ({}/{})",
                        o.id, o.pod.namespace, o.pod.name
                    )));
                }
                let mut after = a.to_pb();
                after.state = pb::AllocationState::Assigned as i32;
                after.device_ids = device_ids.clone();
                Ok((
                    vec![Body::Assigned(pb::Assigned {
                        allocation_id,
                        device_ids,
                        node,
                    })],
                    Reply::Assigned(Box::new(after)),
                ))
            }
            Command::CorrectIdentity {
                node,
                from_allocation_id,
                to_allocation_id,
                device_ids,
            } => {
                if from_allocation_id == to_allocation_id {
                    return unchanged;
                }
                self.node_alloc(&node, from_allocation_id)?;
                self.node_alloc(&node, to_allocation_id)?;
                changed(vec![Body::IdentityCorrected(pb::IdentityCorrected {
                    from_allocation_id,
                    to_allocation_id,
                    device_ids,
                    node,
                })])
            }
            Command::Release {
                pod_uid,
                container,
                allocation_id,
                reason,
            } => {
                let allocs: Vec<&Alloc> = if allocation_id != 0 {
                    self.alloc(allocation_id).into_iter().collect()
                } else {
                    self.allocs_of_pod(&pod_uid)
                        .into_iter()
                        .filter(|a| container.is_empty() || a.container == container)
                        .collect()
                };
                if allocs.is_empty() {
                    return unchanged;
                }
                changed(
                    allocs
                        .into_iter()
                        .map(|a| {
                            Body::Released(pb::Released {
                                allocation_id: a.id,
                                reason: reason.clone(),
                                node: a.node.clone(),
                            })
                        })
                        .collect(),
                )
            }
            Command::ReportViolation(v) => changed(vec![Body::LimitViolated(v)]),
            Command::LeaderElected(l) => changed(vec![Body::LeaderElected(l)]),
            Command::SetQuota(q) => {
                if !crate::state::is_dns_label(&q.namespace) {
                    return Err(CommandError::Invalid(format!(
                        "quota namespace {:?} is not a DNS label",
                        q.namespace
                    )));
                }
                let cur = self.quotas().get(&q.namespace).copied().unwrap_or_default();
                if (cur.mem_mib, cur.core_milli) == (q.mem_mib, q.core_milli) {
                    return unchanged;
                }
                changed(vec![Body::QuotaSet(q)])
            }
            Command::SetBudget(b) => {
                if let Some(why) = crate::state::validate_budget(&b) {
                    return Err(CommandError::Invalid(why));
                }
                match self.budgets().budgets().get(&b.namespace) {
                    Some(cur) if crate::state::same_budget(cur, &b) => unchanged,
                    _ => changed(vec![Body::BudgetSet(b)]),
                }
            }
            Command::RemoveBudget(b) => {
                if self.budgets().budgets().contains_key(&b.namespace) {
                    changed(vec![Body::BudgetRemoved(b)])
                } else {
                    unchanged
                }
            }
            Command::Nominate {
                nomination,
                leaving,
            } => self.decide_nominate(nomination, &leaving),
            Command::GrantClaim(g) => self.decide_grant_claim(g),
            Command::RefuseClaim(r) => self.decide_refuse_claim(r),
            Command::PrepareClaim {
                node,
                allocation_ids,
                cdi_device_ids,
            } => self.decide_prepare_claim(node, allocation_ids, cdi_device_ids),
            Command::UnprepareClaim {
                node,
                allocation_ids,
            } => self.decide_unprepare_claim(node, allocation_ids),
            Command::SetClaimConsumers {
                claim_uid,
                consumers,
            } => self.decide_set_claim_consumers(&claim_uid, consumers),
            Command::Adopt {
                pod,
                node,
                containers,
                source,
            } => self.decide_adopt(pod, node, containers, &source),
            Command::EndNomination { pod_uid, reason } => {
                match self.end_nomination_body(&pod_uid, reason) {
                    Some(b) => changed(vec![b]),
                    None => unchanged,
                }
            }
        }
    }

    fn node_alloc(&self, node: &str, id: u64) -> Result<&Alloc, CommandError> {
        let a = self
            .alloc(id)
            .ok_or_else(|| CommandError::NotFound(format!("allocation {id}")))?;
        if a.node != node {
            return Err(CommandError::Conflict(format!(
                "allocation {id} is on node {}, not {node}",
                a.node
            )));
        }
        Ok(a)
    }
}

fn same_set(a: &[String], b: &[String]) -> bool {
    let mut x = a.to_vec();
    let mut y = b.to_vec();
    x.sort();
    y.sort();
    x == y
}

#[cfg(test)]
mod tests;
