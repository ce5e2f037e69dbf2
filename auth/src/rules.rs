//! The authorization table: which role may make which call, and on what condition.
//!
//! Modelled on Kubernetes' node authorizer and NodeRestriction: a node agent may touch only its
//! own node's part of the ledger; the extender may place and reserve only for pods the API
//! server has and that a gpuledger scheduler schedules; operators read, and only admins write.
//! Every decision goes through [`authorize`], so the whole policy is this one table.

use std::fmt;

use crate::identity::{Caller, Role};

/// Every call the allocator serves: the gRPC API's RPCs and the HTTP state read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Call {
    /// `RegisterNode`.
    RegisterNode,
    /// `RemoveNode`.
    RemoveNode,
    /// `SetDeviceHealth`.
    SetDeviceHealth,
    /// `Filter`.
    Filter,
    /// `Score`.
    Score,
    /// `Reserve`.
    Reserve,
    /// `ConfirmBound`.
    ConfirmBound,
    /// `Assign`.
    Assign,
    /// `CorrectIdentity`.
    CorrectIdentity,
    /// `Release`.
    Release,
    /// `ReportViolation`.
    ReportViolation,
    /// `Subscribe`.
    Subscribe,
    /// `Status`.
    Status,
    /// `Dump`.
    Dump,
    /// `ReadLog`.
    ReadLog,
    /// `ReadSnapshots`.
    ReadSnapshots,
    /// `Replicate`.
    Replicate,
    /// The HTTP API's state (`/api/v1/state`, `/ui`): every tenant's pod names.
    HttpState,
    /// `SetBudget`.
    SetBudget,
    /// `SetQuota`.
    SetQuota,
    /// `Preempt`.
    Preempt,
    /// `PrepareClaim`.
    PrepareClaim,
    /// `UnprepareClaim`.
    UnprepareClaim,
    /// `GrantClaim`.
    GrantClaim,
    /// `RefuseClaim`.
    RefuseClaim,
    /// `Adopt`.
    Adopt,
}

impl Call {
    /// Every call, for tests and metrics.
    pub const ALL: [Call; 26] = [
        Call::RegisterNode,
        Call::RemoveNode,
        Call::SetDeviceHealth,
        Call::Filter,
        Call::Score,
        Call::Reserve,
        Call::ConfirmBound,
        Call::Assign,
        Call::CorrectIdentity,
        Call::Release,
        Call::ReportViolation,
        Call::Subscribe,
        Call::Status,
        Call::Dump,
        Call::ReadLog,
        Call::ReadSnapshots,
        Call::Replicate,
        Call::HttpState,
        Call::SetBudget,
        Call::SetQuota,
        Call::Preempt,
        Call::PrepareClaim,
        Call::UnprepareClaim,
        Call::GrantClaim,
        Call::RefuseClaim,
        Call::Adopt,
    ];

    /// Whether the call changes the ledger.
    pub fn writes(self) -> bool {
        matches!(
            self,
            Call::RegisterNode
                | Call::RemoveNode
                | Call::SetDeviceHealth
                | Call::Reserve
                | Call::ConfirmBound
                | Call::Assign
                | Call::CorrectIdentity
                | Call::Release
                | Call::ReportViolation
                | Call::SetBudget
                | Call::SetQuota
                | Call::Preempt
                | Call::PrepareClaim
                | Call::UnprepareClaim
                | Call::GrantClaim
                | Call::RefuseClaim
                | Call::Adopt
        )
    }

    /// The RPC's name as in the proto (and the gRPC path's last segment).
    pub fn name(self) -> &'static str {
        match self {
            Call::RegisterNode => "RegisterNode",
            Call::RemoveNode => "RemoveNode",
            Call::SetDeviceHealth => "SetDeviceHealth",
            Call::Filter => "Filter",
            Call::Score => "Score",
            Call::Reserve => "Reserve",
            Call::ConfirmBound => "ConfirmBound",
            Call::Assign => "Assign",
            Call::CorrectIdentity => "CorrectIdentity",
            Call::Release => "Release",
            Call::ReportViolation => "ReportViolation",
            Call::Subscribe => "Subscribe",
            Call::Status => "Status",
            Call::Dump => "Dump",
            Call::ReadLog => "ReadLog",
            Call::ReadSnapshots => "ReadSnapshots",
            Call::Replicate => "Replicate",
            Call::HttpState => "HttpState",
            Call::SetBudget => "SetBudget",
            Call::SetQuota => "SetQuota",
            Call::Preempt => "Preempt",
            Call::PrepareClaim => "PrepareClaim",
            Call::UnprepareClaim => "UnprepareClaim",
            Call::GrantClaim => "GrantClaim",
            Call::RefuseClaim => "RefuseClaim",
            Call::Adopt => "Adopt",
        }
    }

    /// The call a gRPC path names (`/gpuledger.allocator.v1.Allocator/Reserve`).
    pub fn from_grpc_path(path: &str) -> Option<Call> {
        let method = path.strip_prefix("/gpuledger.allocator.v1.Allocator/")?;
        Call::ALL
            .into_iter()
            .find(|c| *c != Call::HttpState && c.name() == method)
    }
}

/// What must also hold for a rule to allow a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Condition {
    /// Nothing more.
    None,
    /// Every node the call touches (named in it, or holding an allocation it names) is the
    /// caller's own node, and the call touches at least one.
    OwnNode,
    /// Every allocation the call would release is still only a reservation (never bound).
    ReservationsOnly,
    /// The pod exists in the API server, uses one of gpuledger's scheduler names, and is
    /// pending (unbound) or bound to the node the call names.
    AdmissiblePod,
}

/// One row of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    /// Its name, given in denials, logs and metrics.
    pub name: &'static str,
    /// What must also hold.
    pub condition: Condition,
}

const fn rule(name: &'static str, condition: Condition) -> Option<Rule> {
    Some(Rule { name, condition })
}

/// The rule that may allow `role` to make `call` (None: that role may never make it).
pub fn rule_for(role: &Role, call: Call) -> Option<Rule> {
    use Call::*;
    use Condition::*;
    match (role, call) {
        // Everyone authenticated may ask whether the ledger can serve.
        (_, Status) => rule("any-status", None),

        // Peers read the log and state; a follower's forwarded writes are judged as their
        // original caller's, never as the allocator's own.
        (Role::Allocator, Dump | ReadLog | Replicate | Filter | Score) => {
            rule("allocator-peer-read", None)
        }

        (Role::Extender, Filter | Score) => rule("extender-place", None),
        (Role::Extender, Replicate) => rule("extender-replicate", None),
        (Role::Extender, Reserve) => rule("extender-reserve-admissible-pod", AdmissiblePod),
        (Role::Extender, ConfirmBound) => rule("extender-confirm-admissible-pod", AdmissiblePod),
        (Role::Extender, Release) => rule("extender-release-own-reservations", ReservationsOnly),
        // Evicts other pods: only for a pending pod that exists and a gpuledger scheduler
        // schedules; the allocator reads its priority and preemptionPolicy itself.
        (Role::Extender, Preempt) => rule("extender-preempt-admissible-pod", AdmissiblePod),

        (Role::NodeAgent { .. }, RegisterNode) => rule("node-agent-register-own-node", OwnNode),
        (Role::NodeAgent { .. }, SetDeviceHealth) => rule("node-agent-health-own-node", OwnNode),
        (Role::NodeAgent { .. }, Assign) => rule("node-agent-assign-own-node", OwnNode),
        (Role::NodeAgent { .. }, CorrectIdentity) => rule("node-agent-correct-own-node", OwnNode),
        (Role::NodeAgent { .. }, ReportViolation) => rule("node-agent-report-own-node", OwnNode),
        (Role::NodeAgent { .. }, Subscribe) => rule("node-agent-subscribe-own-node", OwnNode),
        // Only grants on its own node, as for Assign.
        (Role::NodeAgent { .. }, PrepareClaim) => rule("node-agent-prepare-own-node", OwnNode),
        (Role::NodeAgent { .. }, UnprepareClaim) => rule("node-agent-unprepare-own-node", OwnNode),

        (
            Role::Viewer | Role::Admin,
            Dump | ReadLog | ReadSnapshots | Subscribe | Filter | Score | HttpState,
        ) => rule("operator-read", None),
        (
            Role::Admin,
            RegisterNode | RemoveNode | SetDeviceHealth | Release | SetBudget | SetQuota
            | GrantClaim | RefuseClaim | Adopt,
        ) => rule("admin-write", None),
        _ => Option::None,
    }
}

/// What the allocator found out about a call that a condition needs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Facts {
    /// Every node the call touches: named in the request, or holding an allocation it names.
    pub nodes: Vec<String>,
    /// The call names an allocation the ledger does not have (so its node is unknown).
    pub unknown_allocation: bool,
    /// Every allocation the call would release is still only reserved.
    pub only_reservations: bool,
    /// The pod the call is for, as the API server has it (None: not looked up).
    pub pod: Option<PodFacts>,
}

/// A pod as the API server has it, for [`Condition::AdmissiblePod`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodFacts {
    /// The API server has no pod with that UID (deleted, recreated, or never existed).
    Missing,
    /// The pod.
    Found {
        /// Whether its `spec.schedulerName` is one of gpuledger's.
        gpuledger_scheduler: bool,
        /// Its `spec.nodeName` (None while pending).
        node: Option<String>,
        /// Whether it has ended (Succeeded or Failed) or is being deleted.
        ended: bool,
    },
    /// Without a Kubernetes API (an install that runs no scheduler extender through the API
    /// server), pods cannot be looked up; the allocator says so at start.
    NoApiServer,
}

/// A refused call: which rule refused it and why, for `PERMISSION_DENIED`, the log and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denied {
    /// The rule that refused (or `no-rule` when the role may never make the call).
    pub rule: &'static str,
    /// What did not hold.
    pub why: String,
}

impl fmt::Display for Denied {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "denied by rule {}: {}", self.rule, self.why)
    }
}

/// Whether `caller` may make `call` given `facts`; Ok names the rule that allowed it.
/// `target_node` is the node the call places on (Reserve, ConfirmBound), if any.
pub fn authorize(
    caller: &Caller,
    call: Call,
    facts: &Facts,
    target_node: Option<&str>,
) -> Result<&'static str, Denied> {
    let Some(r) = rule_for(&caller.role, call) else {
        return Err(Denied {
            rule: "no-rule",
            why: format!(
                "{} {} may not call {}",
                if caller.role.kind().starts_with(['a', 'e', 'i', 'o', 'u']) {
                    "an"
                } else {
                    "a"
                },
                caller.role.kind(),
                call.name()
            ),
        });
    };
    let deny = |why: String| Err(Denied { rule: r.name, why });
    match r.condition {
        Condition::None => Ok(r.name),
        Condition::OwnNode => {
            let own = caller.node().unwrap_or_default();
            if facts.unknown_allocation {
                return deny("it names an allocation the ledger does not have".into());
            }
            if facts.nodes.is_empty() {
                return deny("it names no node".into());
            }
            match facts.nodes.iter().find(|n| n.as_str() != own) {
                Some(other) => deny(format!(
                    "it touches node {other}, not the caller's node {own}"
                )),
                None => Ok(r.name),
            }
        }
        Condition::ReservationsOnly => {
            if facts.unknown_allocation {
                return deny("it names an allocation the ledger does not have".into());
            }
            if facts.only_reservations {
                Ok(r.name)
            } else {
                deny("it would release an allocation that is already bound or assigned".into())
            }
        }
        Condition::AdmissiblePod => match &facts.pod {
            Some(PodFacts::NoApiServer) => Ok(r.name),
            None | Some(PodFacts::Missing) => {
                deny("the API server has no pod with this UID".into())
            }
            Some(PodFacts::Found {
                gpuledger_scheduler,
                node,
                ended,
            }) => {
                if !gpuledger_scheduler {
                    deny("the pod is not scheduled by a gpuledger scheduler".into())
                } else if *ended {
                    deny("the pod has ended or is being deleted".into())
                } else {
                    match (node.as_deref(), target_node) {
                        (None, _) => Ok(r.name),
                        (Some(n), Some(t)) if n == t => Ok(r.name),
                        (Some(n), t) => deny(format!(
                            "the pod is bound to node {n}, not {}",
                            t.unwrap_or("(none)")
                        )),
                    }
                }
            }
        },
    }
}

#[cfg(test)]
mod tests;
