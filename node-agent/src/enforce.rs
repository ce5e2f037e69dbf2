//! Memory-limit enforcement: NVML's per-process memory, each process charged to an allocation
//! by the pod its cgroup names (never by what the process claims about itself), over the limit
//! for longer than --grace → SIGKILL through the pidfd taken when it was sampled, or report;
//! `LimitViolated` either way.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuledger_ops::events::{Kind, PodEvent};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use tracing::field::{self, Empty};
use tracing::{Instrument, error, info, info_span, warn};

use crate::agent::Agent;
use crate::cgroup::PodCgroup;
use crate::config::{OnViolation, RoguePolicy};
use crate::isolation::Isolation;
use crate::nvml::GpuProcess;
use crate::procs::{Killed, ProcKey, ProcOwner, SampleError, Sampled, sample};
use crate::view::View;

/// How a GPU process is charged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attribution {
    /// Its cgroup names the pod of this allocation.
    Pod(u64),
    /// Its cgroup names no pod and its environment claims this allocation: charged to it, but
    /// an unverifiable claim can only ever hurt the claimer (see [`judge`]).
    Claim(u64),
    /// It belongs to no allocation on its GPU.
    Rogue(RogueReason),
}

/// Why a GPU process belongs to no allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RogueReason {
    /// Its cgroup names a pod that has no allocation on the GPU, whatever its environment says.
    OtherPod(String),
    /// Its cgroup names no pod, and it claims no allocation on the GPU.
    NoPod,
    /// Its cgroups name several pods.
    Conflict,
}

impl std::fmt::Display for RogueReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RogueReason::OtherPod(uid) => write!(f, "pod {uid} has no allocation on this GPU"),
            RogueReason::NoPod => f.write_str("in no pod and claiming no allocation on this GPU"),
            RogueReason::Conflict => f.write_str("its cgroups name different pods"),
        }
    }
}

/// An allocation whose processes on a GPU use more than its share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverLimit {
    /// The allocation.
    pub allocation_id: u64,
    /// The GPU.
    pub gpu: String,
    /// The processes acted on, largest user first.
    pub pids: Vec<u32>,
    /// What all processes charged to the allocation use.
    pub used_mib: u64,
    /// The share's limit.
    pub limit_mib: u64,
    /// Only processes that merely claim the allocation (no pod in their cgroup) took it over
    /// the limit: they are the ones acted on, the pod's own processes are not.
    pub claimers_only: bool,
}

/// A finding of one enforcement pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    /// An allocation over its share.
    Over(OverLimit),
    /// A GPU process that belongs to no allocation on this node.
    Rogue {
        /// The GPU.
        gpu: String,
        /// The process.
        pid: u32,
        /// Its use.
        used_mib: u64,
        /// Why it belongs to none.
        reason: RogueReason,
    },
}

/// Whether allocation `a` is held for pod `uid`: a reservation of that pod, or a claim grant
/// the claim of which is reserved for it (`reservedFor`, the grant's consumers).
pub fn serves_pod(a: &pb::Allocation, uid: &str) -> bool {
    match &a.claim {
        Some(c) => c.consumers.iter().any(|p| p.uid == uid),
        None => a.pod.as_ref().is_some_and(|p| p.uid == uid),
    }
}

/// Which allocation a process on `gpu` is charged to. A process whose cgroup names a pod is
/// charged only to that pod's allocations on the GPU (its environment may pick among them and
/// nothing more); the environment alone counts only for a process in no pod at all.
pub fn attribute(view: &View, gpu: &str, owner: &ProcOwner) -> Attribution {
    let on_gpu = |a: &pb::Allocation| a.shares.iter().any(|s| s.gpu_uuid == gpu);
    match &owner.pod {
        PodCgroup::Pod(uid) => {
            let mine: Vec<u64> = view
                .allocs
                .values()
                .filter(|a| serves_pod(a, uid) && on_gpu(a))
                .map(|a| a.id)
                .collect();
            match owner
                .claimed_allocations
                .iter()
                .find(|id| mine.contains(id))
            {
                Some(id) => Attribution::Pod(*id),
                // Several containers of the pod on one GPU and no (valid) claim: the oldest.
                None => mine.first().map_or_else(
                    || Attribution::Rogue(RogueReason::OtherPod(uid.clone())),
                    |id| Attribution::Pod(*id),
                ),
            }
        }
        PodCgroup::Conflict(_) => Attribution::Rogue(RogueReason::Conflict),
        PodCgroup::NoPod => owner
            .claimed_allocations
            .iter()
            .copied()
            .find(|id| view.allocs.get(id).is_some_and(on_gpu))
            .map_or(Attribution::Rogue(RogueReason::NoPod), Attribution::Claim),
    }
}

/// Judge one sample: which allocations are over their share, which processes are rogue.
/// Each process may use `allowance_mib` beyond the share (its CUDA context). An allocation is
/// over when its pod's own processes are; when only processes that claim it without being in
/// its pod take it over, only those claimers are named.
pub fn judge(view: &View, procs: &[(GpuProcess, ProcOwner)], allowance_mib: u64) -> Vec<Finding> {
    #[derive(Default)]
    struct Group<'a> {
        pod: Vec<&'a GpuProcess>,
        claimers: Vec<&'a GpuProcess>,
    }
    let mut groups: BTreeMap<(u64, String), Group<'_>> = BTreeMap::new();
    let mut out = Vec::new();
    for (p, owner) in procs {
        match attribute(view, &p.gpu, owner) {
            Attribution::Pod(id) => groups.entry((id, p.gpu.clone())).or_default().pod.push(p),
            Attribution::Claim(id) => groups
                .entry((id, p.gpu.clone()))
                .or_default()
                .claimers
                .push(p),
            Attribution::Rogue(reason) => out.push(Finding::Rogue {
                gpu: p.gpu.clone(),
                pid: p.pid,
                used_mib: p.used_mib,
                reason,
            }),
        }
    }
    let sum = |ps: &[&GpuProcess]| ps.iter().map(|p| p.used_mib).sum::<u64>();
    for ((id, gpu), g) in groups {
        let limit = view.allocs[&id]
            .shares
            .iter()
            .find(|s| s.gpu_uuid == gpu)
            .map_or(0, |s| s.mem_mib);
        let allowed = |n: usize| limit.saturating_add(allowance_mib.saturating_mul(n as u64));
        let used = sum(&g.pod) + sum(&g.claimers);
        let (mut acted_on, claimers_only) =
            if !g.pod.is_empty() && sum(&g.pod) > allowed(g.pod.len()) {
                ([g.pod, g.claimers].concat(), false)
            } else if !g.claimers.is_empty() && used > allowed(g.pod.len() + g.claimers.len()) {
                (g.claimers, true)
            } else {
                continue;
            };
        acted_on.sort_by_key(|p| std::cmp::Reverse(p.used_mib));
        out.push(Finding::Over(OverLimit {
            allocation_id: id,
            gpu,
            pids: acted_on.iter().map(|p| p.pid).collect(),
            used_mib: used,
            limit_mib: limit,
            claimers_only,
        }));
    }
    out
}

/// Enforcement state across passes: when each violation started, what was already reported,
/// what was killed (and may still be on NVML's list while it dies).
#[derive(Default)]
pub struct Enforcer {
    over_since: HashMap<(u64, String), Instant>,
    reported: HashSet<(u64, String, ProcKey)>,
    killed: HashSet<ProcKey>,
    /// Pids whose sampling failed for a reason worth saying once.
    unsampled: HashSet<u32>,
}

impl Enforcer {
    /// One pass.
    pub async fn tick(&mut self, agent: &Agent) {
        let nvml = agent.nvml.clone();
        let procs = match tokio::task::spawn_blocking(move || nvml.processes()).await {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => {
                warn!("enforcement skipped: {e}");
                return;
            }
            Err(_) => return,
        };
        if agent.enforcement_refused.is_some() {
            // NVML's pids name nothing this agent can see: measure, never attribute.
            record_memory_used(agent, procs.iter());
            return;
        }
        let mut pinned: HashMap<u32, Sampled> = HashMap::new();
        let mut sampled: Vec<(GpuProcess, ProcOwner)> = Vec::with_capacity(procs.len());
        for p in procs {
            let s = match pinned.entry(p.pid) {
                Entry::Occupied(e) => e.into_mut(),
                Entry::Vacant(v) => match sample(p.pid) {
                    Ok(s) => v.insert(s),
                    Err(SampleError::Gone(_) | SampleError::Reused(_)) => continue,
                    Err(e) => {
                        if self.unsampled.insert(p.pid) {
                            warn!(pid = p.pid, "GPU process not enforced: {e}");
                        }
                        continue;
                    }
                },
            };
            if !self.killed.contains(&s.key) {
                let owner = s.owner.clone();
                sampled.push((p, owner));
            }
        }
        record_memory_used(agent, sampled.iter().map(|(p, _)| p));
        if !agent.synced() {
            return;
        }
        if let Some(h) = &agent.env.hami_core {
            let live: HashSet<u64> = agent.with_view(|v| v.allocs.keys().copied().collect());
            for e in h.sweep(&live) {
                warn!("removing a released allocation's HAMi-core cache directory: {e}");
            }
        }
        let allowance = agent.cfg.context_allowance_mib;
        let findings = agent.with_view(|v| judge(v, &sampled, allowance));
        let now = Instant::now();
        let mut still_over = HashSet::new();
        for f in findings {
            let span = match &f {
                Finding::Over(OverLimit {
                    allocation_id, gpu, ..
                }) => {
                    let span = info_span!("violation", allocation = allocation_id, %gpu,
                        pod_uid = Empty, pod = Empty);
                    if let Some(p) = agent.with_view(|v| v.allocs.get(allocation_id)?.pod.clone()) {
                        span.record("pod_uid", p.uid.as_str());
                        span.record(
                            "pod",
                            field::display(format_args!("{}/{}", p.namespace, p.name)),
                        );
                    }
                    span
                }
                Finding::Rogue { gpu, pid, .. } => info_span!("rogue", %gpu, pid),
            };
            self.act(agent, f, now, &mut still_over, &pinned)
                .instrument(span)
                .await;
        }
        self.over_since.retain(|k, _| still_over.contains(k));
        let live: HashSet<ProcKey> = pinned.values().map(|s| s.key).collect();
        self.reported.retain(|(_, _, k)| live.contains(k));
        self.killed.retain(|k| live.contains(k));
        self.unsampled.retain(|pid| !pinned.contains_key(pid));
    }

    /// SIGKILL the sampled processes `pids` through their pidfds.
    fn kill(&mut self, pinned: &HashMap<u32, Sampled>, pids: &[u32]) {
        for pid in pids {
            let Some(s) = pinned.get(pid) else { continue };
            match s.kill() {
                Ok(Killed::Now) => {
                    self.killed.insert(s.key);
                }
                Ok(Killed::AlreadyGone) => {
                    info!(
                        pid,
                        "the sampled process exited before the kill: nothing signalled"
                    );
                }
                Err(e) => warn!(pid, "SIGKILL through the pidfd failed: {e}"),
            }
        }
    }

    /// Act on one finding: past the grace period, kill or report, tell the pod and the ledger.
    async fn act(
        &mut self,
        agent: &Agent,
        f: Finding,
        now: Instant,
        still_over: &mut HashSet<(u64, String)>,
        pinned: &HashMap<u32, Sampled>,
    ) {
        match f {
            Finding::Over(o) => {
                let key = (o.allocation_id, o.gpu.clone());
                still_over.insert(key.clone());
                let since = *self.over_since.entry(key).or_insert(now);
                if now.duration_since(since) < agent.cfg.grace {
                    return;
                }
                let top = o.pids[0];
                let Some(top_key) = pinned.get(&top).map(|s| s.key) else {
                    return;
                };
                if !self
                    .reported
                    .insert((o.allocation_id, o.gpu.clone(), top_key))
                {
                    return;
                }
                let action = agent.cfg.on_violation;
                warn!(
                    pids = ?o.pids,
                    used_mib = o.used_mib,
                    limit_mib = o.limit_mib,
                    allowance_mib = agent.cfg.context_allowance_mib,
                    claimers_only = o.claimers_only,
                    action = action.as_str(),
                    "memory limit exceeded"
                );
                if action == OnViolation::Kill {
                    self.kill(pinned, &o.pids);
                }
                agent
                    .metrics
                    .violations
                    .get_or_create(&vec![("action", action.as_str().to_string())])
                    .inc();
                tell_pod(agent, &o, action);
                report(
                    agent,
                    pb::LimitViolated {
                        allocation_id: o.allocation_id,
                        node: agent.cfg.node_name.clone(),
                        gpu_uuid: o.gpu,
                        pid: top,
                        used_mib: o.used_mib,
                        limit_mib: o.limit_mib,
                        action: action.as_str().into(),
                    },
                )
                .await;
            }
            Finding::Rogue {
                gpu,
                pid,
                used_mib,
                reason,
            } => {
                let Some(key) = pinned.get(&pid).map(|s| s.key) else {
                    return;
                };
                if !self.reported.insert((0, gpu.clone(), key)) {
                    return;
                }
                let policy = agent.cfg.rogue_policy;
                warn!(used_mib, %reason, action = policy.as_str(), "GPU process on no allocation (rogue)");
                if policy == RoguePolicy::Kill {
                    self.kill(pinned, &[pid]);
                }
                agent
                    .metrics
                    .violations
                    .get_or_create(&vec![("action", policy.as_str().to_string())])
                    .inc();
                report(
                    agent,
                    pb::LimitViolated {
                        allocation_id: 0,
                        node: agent.cfg.node_name.clone(),
                        gpu_uuid: gpu,
                        pid,
                        used_mib,
                        limit_mib: 0,
                        action: policy.as_str().into(),
                    },
                )
                .await;
            }
        }
    }
}

/// NVML's memory use per GPU by live processes (every GPU of the node, 0 where nothing runs)
/// into the metrics.
fn record_memory_used<'a>(agent: &Agent, procs: impl Iterator<Item = &'a GpuProcess>) {
    const MIB: i64 = 1 << 20;
    let mut used: HashMap<String, u64> = agent
        .gpus
        .borrow()
        .iter()
        .map(|g| (g.info.uuid.clone(), 0))
        .collect();
    for p in procs {
        *used.entry(p.gpu.clone()).or_default() += p.used_mib;
    }
    for (gpu, mib) in used {
        agent
            .metrics
            .memory_used
            .get_or_create(&vec![("gpu", gpu)])
            .set(i64::try_from(mib).unwrap_or(i64::MAX / MIB) * MIB);
    }
}

/// A Warning Event on the pod whose allocation went over its limit, saying what happened.
fn tell_pod(agent: &Agent, o: &OverLimit, action: OnViolation) {
    let Some((pod, container)) = agent.with_view(|v| {
        v.allocs
            .get(&o.allocation_id)
            .and_then(|a| Some((a.pod.clone()?, a.container.clone())))
    }) else {
        return;
    };
    let done = match action {
        OnViolation::Kill => "killed",
        OnViolation::Report => "reported only (--on-violation=report)",
    };
    let message = format!(
        "{} {}",
        over_message(o, &container, done),
        escaped(agent.cfg.isolation)
    );
    agent.event(PodEvent {
        namespace: pod.namespace,
        name: pod.name,
        uid: pod.uid,
        kind: Kind::Warning,
        reason: "GpuLimitExceeded",
        message,
    });
}

/// Which layer the over-limit use got past, for the Event: the node's first isolation layer,
/// or none but the NVML sampling that caught it.
pub fn escaped(isolation: Isolation) -> String {
    match isolation {
        Isolation::Nvml => {
            "This node's isolation is nvml: NVML sampling is its only layer, and it caught this."
                .into()
        }
        other => format!(
            "It escaped this node's first isolation layer, {}, and the NVML backstop caught it.",
            other.as_str()
        ),
    }
}

fn over_message(o: &OverLimit, container: &str, done: &str) -> String {
    let (id, gpu, pids, used, limit) = (o.allocation_id, &o.gpu, &o.pids, o.used_mib, o.limit_mib);
    if o.claimers_only {
        format!(
            "processes {pids:?} in no pod claim allocation {id} of container {container} in their environment and took its use of {gpu} to {used} MiB, over its limit of {limit} MiB: they were {done}; the container's own processes were left alone."
        )
    } else {
        format!(
            "container {container} used {used} MiB on {gpu}, over its limit of {limit} MiB (allocation {id}): its GPU processes {pids:?} were {done}."
        )
    }
}

async fn report(agent: &Agent, v: pb::LimitViolated) {
    let r = agent
        .pool
        .call("ReportViolation", Duration::from_secs(10), |mut c| {
            let v = v.clone();
            async move {
                c.report_violation(api::ReportViolationRequest { violation: Some(v) })
                    .await
            }
        })
        .await;
    match r {
        Ok(w) => info!(
            seq = w.seq,
            allocation = v.allocation_id,
            pid = v.pid,
            "LimitViolated recorded"
        ),
        Err(e) => warn!(
            allocation = v.allocation_id,
            "reporting a violation failed: {e}"
        ),
    }
}

/// Enforce every --enforce-interval, forever.
pub async fn run(agent: Arc<Agent>) {
    if let Some(why) = &agent.enforcement_refused {
        error!("ENFORCEMENT REFUSED, memory limits are not enforced on this node: {why}");
    }
    let mut e = Enforcer::default();
    let mut t = tokio::time::interval(agent.cfg.enforce_interval.max(Duration::from_millis(50)));
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        t.tick().await;
        e.tick(&agent).await;
    }
}

#[cfg(test)]
mod tests;
