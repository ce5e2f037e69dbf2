//! What the claim certification decides, without IO: which results of a ResourceClaim the
//! ledger must grant or refuse, which grants are stale, and the claim's `status.devices` with
//! our condition set. The shell ([`super`]) reads the claim and the ledger, submits what this
//! decides and writes the status.

use std::collections::HashSet;

use gpuledger_ledger::capacity::{GpuCapacities, consumed};
use gpuledger_ledger::state::{dra_device_name, same_pods};
use gpuledger_ledger::{CORE_MILLI_PER_GPU, CommandError, Ledger, pb};
use gpuledger_request::dra::CoresUnit;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimSpec};
use k8s_openapi::serde_json::{self, Value, json};

pub use gpuledger_request::dra::{ClaimResult as Allotted, DRIVER, GRANTED, REASON_GRANT, REFUSED};
/// The annotation the scheduler puts on a claim it made for an extended resource (KEP-5004).
const EXTENDED_RESOURCE_CLAIM: &str = "resource.kubernetes.io/extended-resource-claim";

/// A ResourceClaim as the certification reads it.
#[derive(Debug, Clone)]
pub struct Claim {
    /// uid, namespace and name.
    pub claim: pb::ClaimRef,
    /// The resourceVersion read (the status patch's precondition).
    pub resource_version: String,
    /// `metadata.generation` (the conditions' observedGeneration).
    pub generation: i64,
    /// "claim", or "extended-resource" for a claim the scheduler made (KEP-5004).
    pub source: &'static str,
    /// The requests.
    pub spec: ResourceClaimSpec,
    /// The allocation results of our driver.
    pub results: Vec<Allotted>,
    /// The pods the claim is reserved for.
    pub consumers: Vec<pb::PodRef>,
    /// The highest priority among the consumers (0 until the shell reads their pods): room
    /// nominated for a preempting pod of this priority or higher is not the claim's.
    pub priority: i32,
    /// `status.devices` as stored, every driver's entries untouched.
    pub devices: Vec<Value>,
}

/// A grant or refusal already written for a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mark {
    /// `gpuledger.io/Granted=True`.
    Granted,
    /// `gpuledger.io/Refused=True`.
    Refused,
}

/// What to do about one result. Every step ends in a condition naming the ledger's decision
/// for that exact result: a condition present that names anything else (written by someone
/// else, or before the allocation changed) is rewritten, never trusted.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Submit the grant. Once the ledger commits it (or answers with the same live grant),
    /// write `Granted` naming it; when it refuses, record the refusal and write `Refused`.
    Grant {
        /// The grant.
        grant: pb::ClaimGranted,
    },
    /// The result can never be granted as allocated: record the refusal, then write
    /// `Refused` (with `reason`).
    Refuse {
        /// The refusal, with its readable reason.
        refusal: pb::ClaimRefused,
        /// The condition's reason.
        reason: &'static str,
    },
    /// The ledger holds the grant but the condition present does not name it: write
    /// `Granted` with `message`.
    Name {
        /// The Granted condition's message ([`granted_message`] of the grant).
        message: String,
    },
}

/// A grant to release.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    /// The grant.
    pub allocation_id: u64,
    /// `claim-deallocated`, `claim-deleted`.
    pub reason: &'static str,
    /// The claim, for the log.
    pub what: String,
}

/// What a claim needs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    /// Grants of the claim that no result of it holds any more.
    pub releases: Vec<Release>,
    /// One step per result that needs one.
    pub steps: Vec<(Allotted, Step)>,
    /// The claim's consumers (`reservedFor`), when the grants it keeps name other pods.
    pub consumers: Option<Vec<pb::PodRef>>,
}

impl Plan {
    /// Nothing to do.
    pub fn is_empty(&self) -> bool {
        self.releases.is_empty() && self.steps.is_empty() && self.consumers.is_none()
    }
}

impl Claim {
    /// Read a ResourceClaim (resource.k8s.io/v1) from its JSON; why not, when it is malformed.
    pub fn from_json(v: &Value) -> Result<Claim, String> {
        let rc: ResourceClaim = serde_json::from_value(v.clone())
            .map_err(|e| format!("not a resource.k8s.io/v1 ResourceClaim: {e}"))?;
        let meta = &rc.metadata;
        let claim = pb::ClaimRef {
            uid: meta.uid.clone().unwrap_or_default(),
            namespace: meta.namespace.clone().unwrap_or_default(),
            name: meta.name.clone().unwrap_or_default(),
        };
        if claim.uid.is_empty() || claim.name.is_empty() {
            return Err("a ResourceClaim without uid or name".into());
        }
        let extended = meta
            .annotations
            .as_ref()
            .and_then(|a| a.get(EXTENDED_RESOURCE_CLAIM))
            .is_some_and(|v| v == "true");
        let results = gpuledger_request::dra::claim_results(&rc).unwrap_or_default();
        let consumers = rc
            .status
            .unwrap_or_default()
            .reserved_for
            .unwrap_or_default()
            .into_iter()
            .filter(|c| c.resource == "pods" && c.api_group.as_deref().unwrap_or("").is_empty())
            .map(|c| pb::PodRef {
                uid: c.uid,
                namespace: claim.namespace.clone(),
                name: c.name,
            })
            .collect();
        let devices = v
            .pointer("/status/devices")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        Ok(Claim {
            resource_version: meta.resource_version.clone().unwrap_or_default(),
            generation: meta.generation.unwrap_or(0),
            source: if extended {
                "extended-resource"
            } else {
                "claim"
            },
            spec: rc.spec,
            results,
            consumers,
            priority: 0,
            devices,
            claim,
        })
    }

    /// "ns/name (uid)", for messages.
    pub fn what(&self) -> String {
        format!(
            "ResourceClaim {}/{} ({})",
            self.claim.namespace, self.claim.name, self.claim.uid
        )
    }
}

/// Whether `entry` of `status.devices` is the entry of result `r`.
fn is_entry_of(entry: &Value, r: &Allotted) -> bool {
    let s = |k: &str| entry.get(k).and_then(Value::as_str).unwrap_or("");
    s("driver") == DRIVER
        && s("pool") == r.pool
        && s("device") == r.device
        && s("shareID") == r.share_id
}

/// The condition already written for `r` in `devices`, if any (status True).
pub fn mark_of(devices: &[Value], r: &Allotted) -> Option<Mark> {
    if true_condition(devices, r, REFUSED).is_some() {
        Some(Mark::Refused)
    } else if true_condition(devices, r, GRANTED).is_some() {
        Some(Mark::Granted)
    } else {
        None
    }
}

/// The condition of type `kind` with status True on the entry of `r` in `devices`.
fn true_condition<'a>(devices: &'a [Value], r: &Allotted, kind: &str) -> Option<&'a Value> {
    let entry = devices.iter().find(|e| is_entry_of(e, r))?;
    entry
        .get("conditions")?
        .as_array()?
        .iter()
        .find(|c| c.get("type") == Some(&json!(kind)) && c.get("status") == Some(&json!("True")))
}

/// Whether the entry of `r` says exactly `Granted` with `message`: that condition True, with
/// our reason and that message, and no `Refused`.
fn names_grant(devices: &[Value], r: &Allotted, message: &str) -> bool {
    let Some(c) = true_condition(devices, r, GRANTED) else {
        return false;
    };
    true_condition(devices, r, REFUSED).is_none()
        && c.get("reason") == Some(&json!(REASON_GRANT))
        && c.get("message") == Some(&json!(message))
}

/// The message of a Granted condition: where the grant is in the ledger. A condition is
/// trusted only when its message is this for the ledger's live grant of that result.
/// Grant `id` of the leader of `epoch` on `node`, sharing `shares`.
pub fn granted_message(id: u64, epoch: u64, node: &str, shares: &[pb::GpuShare]) -> String {
    let share = shares.first().cloned().unwrap_or_default();
    format!(
        "granted by the GPU ledger as allocation {id} (seq {id}, epoch {}): {} MiB and {}/1000 \
         of GPU {} on node {}",
        epoch, share.mem_mib, share.core_milli, share.gpu_uuid, node,
    )
}

/// A `metav1.Condition` of `kind` ([`GRANTED`] or [`REFUSED`]), True.
pub fn condition(kind: &str, reason: &str, message: &str, generation: i64, now: &str) -> Value {
    json!({
        "type": kind,
        "status": "True",
        "observedGeneration": generation,
        "lastTransitionTime": now,
        "reason": reason,
        "message": message,
    })
}

/// `devices` with `cond` set on the entry of `r` (created if missing; our conditions there
/// replaced, so that the entry names one decision); every other entry, and every other field
/// and condition, unchanged.
pub fn devices_with(devices: &[Value], r: &Allotted, cond: Value) -> Vec<Value> {
    let mut out = devices.to_vec();
    let i = match out.iter().position(|e| is_entry_of(e, r)) {
        Some(i) => i,
        None => {
            let mut e = json!({"driver": DRIVER, "pool": r.pool, "device": r.device});
            if !r.share_id.is_empty() {
                e["shareID"] = json!(r.share_id);
            }
            out.push(e);
            out.len() - 1
        }
    };
    let entry = &mut out[i];
    let mut conds: Vec<Value> = entry
        .get("conditions")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let ours = |c: &Value| {
        let t = c.get("type");
        t == cond.get("type") || t == Some(&json!(GRANTED)) || t == Some(&json!(REFUSED))
    };
    conds.retain(|c| !ours(c));
    conds.push(cond);
    entry["conditions"] = Value::Array(conds);
    out
}

/// What `claim` needs from the ledger `l`.
pub fn plan_claim(l: &Ledger, c: &Claim) -> Plan {
    let mut plan = Plan::default();
    for a in l.allocs_of_pod(&c.claim.uid) {
        let Some(g) = a.claim.as_deref() else {
            continue;
        };
        let held = c.results.iter().any(|r| {
            r.request == g.request
                && r.share_id == g.share_id
                && r.pool == g.pool
                && r.device == g.device
        });
        if !held {
            plan.releases.push(Release {
                allocation_id: a.id,
                reason: "claim-deallocated",
                what: c.what(),
            });
        } else if !same_pods(&g.consumers, &c.consumers) {
            plan.consumers = Some(c.consumers.clone());
        }
    }
    for r in &c.results {
        let held = l
            .alloc_of_claim(&c.claim.uid, &r.request, &r.share_id)
            .filter(|a| {
                a.claim
                    .as_deref()
                    .is_some_and(|g| g.pool == r.pool && g.device == r.device)
            });
        let step = match held {
            // The ledger's decision is this grant: the condition must name it, whatever is
            // there now (nothing, another allocation's text, a Refused).
            Some(a) => {
                let message = granted_message(a.id, a.epoch, &a.node, &a.shares);
                if names_grant(&c.devices, r, &message) {
                    continue;
                }
                Step::Name { message }
            }
            // No grant: a Refused stands (the scheduler allocates afresh); a Granted the
            // ledger does not hold is no decision of the ledger's, so the result is decided
            // anew and its condition rewritten.
            None if mark_of(&c.devices, r) == Some(Mark::Refused) => continue,
            None => match grant_of(l, c, r) {
                Ok(grant) => Step::Grant { grant },
                Err((reason, why, share)) => Step::Refuse {
                    refusal: refusal_of(c, r, why, share),
                    reason,
                },
            },
        };
        plan.steps.push((r.clone(), step));
    }
    plan
}

/// The consumers of `c` whose nomination ends now that the ledger `l` holds a grant for every
/// result of `c`: a preempting pod is certified, and the room kept for it is its own.
pub fn nominees_certified(l: &Ledger, c: &Claim) -> Vec<String> {
    let all = !c.results.is_empty()
        && c.results.iter().all(|r| {
            l.alloc_of_claim(&c.claim.uid, &r.request, &r.share_id)
                .is_some()
        });
    if !all {
        return Vec::new();
    }
    c.consumers
        .iter()
        .filter(|p| l.nominations().get(&p.uid).is_some())
        .map(|p| p.uid.clone())
        .collect()
}

/// Grants whose claims are gone: those of a claim `uid` that was deleted.
pub fn releases_of_deleted(l: &Ledger, uid: &str, what: &str) -> Vec<Release> {
    l.allocs_of_pod(uid)
        .into_iter()
        .filter(|a| a.claim.is_some())
        .map(|a| Release {
            allocation_id: a.id,
            reason: "claim-deleted",
            what: what.to_owned(),
        })
        .collect()
}

/// The full pass over every claim: the grants whose claim is not among `claims` (deleted,
/// also while no replica watched), and the indexes of the claims that need a step.
pub fn plan_all(l: &Ledger, claims: &[Claim]) -> (Vec<Release>, Vec<usize>) {
    let uids: HashSet<&str> = claims.iter().map(|c| c.claim.uid.as_str()).collect();
    let mut gone: Vec<Release> = l
        .allocs()
        .values()
        .filter(|a| a.claim.is_some() && !uids.contains(a.pod.uid.as_str()))
        .map(|a| Release {
            allocation_id: a.id,
            reason: "claim-deleted",
            what: format!(
                "ResourceClaim {}/{} ({})",
                a.pod.namespace, a.pod.name, a.pod.uid
            ),
        })
        .collect();
    gone.sort_by_key(|r| r.allocation_id);
    let todo = claims
        .iter()
        .enumerate()
        .filter(|(_, c)| !plan_claim(l, c).is_empty())
        .map(|(i, _)| i)
        .collect();
    (gone, todo)
}

/// The reason of a `Refused` condition for a ledger's refusal of a grant; None for an
/// answer that is no refusal of the claim (a conflict, a bug), which is tried again later.
pub fn refusal_reason(e: &CommandError) -> Option<&'static str> {
    match e {
        CommandError::NoCapacity(m) if m.contains("quota") => Some("LedgerQuota"),
        CommandError::NoCapacity(m) if m.contains("preempted for it") => Some("LedgerRoomKept"),
        CommandError::NoCapacity(_) => Some("LedgerNoCapacity"),
        CommandError::Unsatisfiable(_) => Some("LedgerUnsatisfiable"),
        CommandError::NotFound(_) => Some("LedgerUnknownDevice"),
        CommandError::Invalid(_) => Some("LedgerInvalid"),
        CommandError::Conflict(_) | CommandError::Bug(_) => None,
    }
}

/// The refusal of result `r` of `c`, saying `why`, naming the share it asked when known.
pub fn refusal_of(
    c: &Claim,
    r: &Allotted,
    why: String,
    share: Option<pb::GpuShare>,
) -> pb::ClaimRefused {
    pb::ClaimRefused {
        claim: Some(c.claim.clone()),
        request: r.request.clone(),
        node: r.pool.clone(),
        device: r.device.clone(),
        share_id: r.share_id.clone(),
        share,
        reason: why,
    }
}

/// Why a result can never be granted: the condition's reason, the message, and the share it
/// asks when the GPU and the amounts are known.
type Refusal = (&'static str, String, Option<pb::GpuShare>);

/// The grant result `r` of `c` asks for, checked against the ledger's inventory; or why the
/// result can never be granted (condition reason, message).
fn grant_of(l: &Ledger, c: &Claim, r: &Allotted) -> Result<pb::ClaimGranted, Refusal> {
    let at = format!("device {} of pool {}", r.device, r.pool);
    if r.admin_access {
        return Err((
            "LedgerAdminAccess",
            format!(
                "request {}: adminAccess to {at} is not granted by gpuledger (it would share the \
                 GPU without a ledger share)",
                r.request
            ),
            None,
        ));
    }
    let node = l.node(&r.pool).ok_or_else(|| {
        (
            "LedgerUnknownDevice",
            format!(
                "request {}: pool {} is not a node registered in the GPU ledger",
                r.request, r.pool
            ),
            None,
        )
    })?;
    if node.mode != pb::NodeMode::Dra {
        return Err((
            "LedgerNodeMode",
            format!(
                "request {}: node {} serves its GPUs through the device plugin, not DRA \
                 (label gpuledger.io/mode); no claim is granted there",
                r.request, r.pool
            ),
            None,
        ));
    }
    let gpu = node
        .gpus
        .iter()
        .find(|g| dra_device_name(&g.uuid) == r.device)
        .ok_or_else(|| {
            (
                "LedgerUnknownDevice",
                format!(
                    "request {}: node {} has no GPU named {} in the GPU ledger",
                    r.request, r.pool, r.device
                ),
                None,
            )
        })?;
    let cores = CoresUnit::of_record(&node.dra_cores).map_err(|e| {
        (
            "LedgerUnknownDevice",
            format!(
                "request {}: node {} records its cores in an unknown unit: {e}",
                r.request, r.pool
            ),
            None,
        )
    })?;
    let (mem_mib, core_milli) = share_of(&c.spec, r, &gpu.uuid, gpu.memory_mib, cores)?;
    Ok(pb::ClaimGranted {
        allocation_id: 0,
        claim: Some(c.claim.clone()),
        request: r.request.clone(),
        node: r.pool.clone(),
        pool: r.pool.clone(),
        device: r.device.clone(),
        share_id: r.share_id.clone(),
        share: Some(pb::GpuShare {
            gpu_uuid: gpu.uuid.clone(),
            mem_mib,
            core_milli,
        }),
        consumers: c.consumers.clone(),
        source: c.source.into(),
        priority: c.priority,
    })
}

/// The share (MiB, thousandths) result `r` consumes of a GPU of `gpu_mib`, recomputed from
/// the request with the device's capacity policy; refused when the scheduler's
/// `consumedCapacity` says otherwise (an allocation written behind the ledger's back, or one
/// that under-declares its share).
fn share_of(
    spec: &ResourceClaimSpec,
    r: &Allotted,
    gpu_uuid: &str,
    gpu_mib: u64,
    unit: CoresUnit,
) -> Result<(u64, u32), Refusal> {
    let whole = u64::from(CORE_MILLI_PER_GPU);
    let (want_mem, want_cores) = if r.share_id.is_empty() {
        // No shareID: the scheduler allocated the device whole (not shared).
        (gpu_mib, whole)
    } else {
        let (mem, cores) =
            requested(spec, &r.request, unit).map_err(|e| ("LedgerInvalidRequest", e, None))?;
        let caps = GpuCapacities::of_gpu(gpu_mib);
        let policy = |what: &str, e: gpuledger_ledger::capacity::CapacityError| {
            (
                "LedgerCapacityPolicy",
                format!(
                    "request {}: {what} {e} (device {} has {gpu_mib} MiB and cores {})",
                    r.request,
                    r.device,
                    unit.quantity(whole).0
                ),
                None,
            )
        };
        (
            consumed(mem, &caps.memory).map_err(|e| policy("memory", e))?,
            consumed(cores, &caps.cores).map_err(|e| policy("cores", e))?,
        )
    };
    let declared = r.declared(unit);
    let cores = u32::try_from(want_cores).unwrap_or(u32::MAX);
    let fits = match &declared {
        None => r.share_id.is_empty(),
        Some((m, c)) => *m == Some(want_mem) && *c == Some(want_cores),
    };
    if !fits {
        let said = r.consumed.as_ref().map_or("nothing".to_owned(), |m| {
            m.iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(", ")
        });
        return Err((
            "LedgerShareMismatch",
            format!(
                "request {}: the allocation of {} share {:?} declares consumedCapacity {said}, but \
                 the request consumes memory={want_mem}Mi, cores={} of it",
                r.request,
                r.device,
                r.share_id,
                unit.quantity(want_cores).0
            ),
            Some(pb::GpuShare {
                gpu_uuid: gpu_uuid.to_owned(),
                mem_mib: want_mem,
                core_milli: cores,
            }),
        ));
    }
    Ok((want_mem, cores))
}

/// The capacity request `request` ("name" or "name/sub") makes: memory in MiB and cores,
/// each rounded up to a whole unit, None when left out.
fn requested(
    spec: &ResourceClaimSpec,
    request: &str,
    unit: CoresUnit,
) -> Result<(Option<u64>, Option<u64>), String> {
    let (main, sub) = match request.split_once('/') {
        Some((m, s)) => (m, Some(s)),
        None => (request, None),
    };
    let reqs = spec
        .devices
        .as_ref()
        .and_then(|d| d.requests.as_ref())
        .map(Vec::as_slice)
        .unwrap_or_default();
    let missing = || format!("request {request} is not in the claim's spec");
    let r = reqs.iter().find(|r| r.name == main).ok_or_else(missing)?;
    let capacity = match sub {
        None => r.exactly.as_ref().ok_or_else(missing)?.capacity.as_ref(),
        Some(s) => r
            .first_available
            .as_ref()
            .and_then(|subs| subs.iter().find(|x| x.name == s))
            .ok_or_else(missing)?
            .capacity
            .as_ref(),
    };
    let ask = gpuledger_request::dra::capacity_ask(capacity, unit)
        .map_err(|e| format!("request {request}: {e}"))?;
    Ok((ask.memory_mib, ask.cores))
}

#[cfg(test)]
mod tests;
