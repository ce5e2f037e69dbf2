//! Memory-limit enforcement: NVML's per-process memory, each process mapped to its allocation,
//! over the limit (longer than --grace) → SIGKILL or report, and `LimitViolated` either way.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuledger_ops::events::{Kind, PodEvent};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use tracing::field::{self, Empty};
use tracing::{Instrument, info, info_span, warn};

use crate::agent::Agent;
use crate::config::OnViolation;
use crate::nvml::GpuProcess;
use crate::view::View;

/// Who a GPU process belongs to, from /proc.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcOwner {
    /// Pod UID from the kubepods cgroup path.
    pub pod_uid: Option<String>,
    /// `GPULEDGER_ALLOCATION_ID` from the process environment.
    pub allocation_id: Option<u64>,
}

/// A finding of one enforcement pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    /// An allocation's processes on a GPU use more than its share.
    Over {
        /// The allocation.
        allocation_id: u64,
        /// The GPU.
        gpu: String,
        /// Its processes on that GPU, largest user first.
        pids: Vec<u32>,
        /// Their total use.
        used_mib: u64,
        /// The share's limit.
        limit_mib: u64,
    },
    /// A GPU process that belongs to no allocation on this node.
    Rogue {
        /// The GPU.
        gpu: String,
        /// The process.
        pid: u32,
        /// Its use.
        used_mib: u64,
    },
}

/// The pod UID in a `/proc/<pid>/cgroup` text, if the process is in a kubepods cgroup
/// (cgroupfs `…/kubepods/burstable/pod<uid>/…` or systemd `…kubepods-burstable-pod<uid_with_underscores>.slice…`).
pub fn pod_uid_from_cgroup(text: &str) -> Option<String> {
    for line in text.lines() {
        let path = line.splitn(3, ':').nth(2).unwrap_or(line);
        if !path.contains("kubepods") {
            continue;
        }
        for part in path.split('/') {
            let part = part.strip_suffix(".slice").unwrap_or(part);
            if let Some(i) = part.rfind("pod") {
                let uid = part[i + 3..].replace('_', "-");
                if uid.len() == 36 && uid.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
                    return Some(uid);
                }
            }
        }
    }
    None
}

/// `GPULEDGER_ALLOCATION_ID` in a `/proc/<pid>/environ` blob.
pub fn allocation_from_environ(env: &[u8]) -> Option<u64> {
    env.split(|b| *b == 0)
        .find_map(|kv| kv.strip_prefix(b"GPULEDGER_ALLOCATION_ID="))
        .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
}

/// Which allocation a process on `gpu` belongs to: by pod UID (a single allocation of that pod
/// on the GPU), else by the allocation id in its environment.
pub fn owning_allocation(view: &View, gpu: &str, owner: &ProcOwner) -> Option<u64> {
    let on_gpu = |a: &&pb::Allocation| a.shares.iter().any(|s| s.gpu_uuid == gpu);
    if let Some(uid) = &owner.pod_uid {
        let mine: Vec<&pb::Allocation> = view
            .allocs
            .values()
            .filter(|a| a.pod.as_ref().is_some_and(|p| &p.uid == uid))
            .filter(on_gpu)
            .collect();
        if mine.len() == 1 {
            return Some(mine[0].id);
        }
        if let Some(id) = owner.allocation_id
            && mine.iter().any(|a| a.id == id)
        {
            return Some(id);
        }
    }
    let id = owner.allocation_id?;
    view.allocs.get(&id).filter(on_gpu).map(|a| a.id)
}

/// Judge one sample: which allocations are over their share, which processes are rogue.
pub fn judge(view: &View, procs: &[(GpuProcess, ProcOwner)]) -> Vec<Finding> {
    let mut groups: BTreeMap<(u64, String), Vec<&GpuProcess>> = BTreeMap::new();
    let mut out = Vec::new();
    for (p, owner) in procs {
        match owning_allocation(view, &p.gpu, owner) {
            Some(id) => groups.entry((id, p.gpu.clone())).or_default().push(p),
            None => out.push(Finding::Rogue {
                gpu: p.gpu.clone(),
                pid: p.pid,
                used_mib: p.used_mib,
            }),
        }
    }
    for ((id, gpu), mut ps) in groups {
        let limit = view.allocs[&id]
            .shares
            .iter()
            .find(|s| s.gpu_uuid == gpu)
            .map_or(0, |s| s.mem_mib);
        let used: u64 = ps.iter().map(|p| p.used_mib).sum();
        if used > limit {
            ps.sort_by_key(|p| std::cmp::Reverse(p.used_mib));
            out.push(Finding::Over {
                allocation_id: id,
                gpu,
                pids: ps.iter().map(|p| p.pid).collect(),
                used_mib: used,
                limit_mib: limit,
            });
        }
    }
    out
}

fn read_owner(pid: u32) -> ProcOwner {
    ProcOwner {
        pod_uid: std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
            .ok()
            .and_then(|t| pod_uid_from_cgroup(&t)),
        allocation_id: std::fs::read(format!("/proc/{pid}/environ"))
            .ok()
            .and_then(|e| allocation_from_environ(&e)),
    }
}

/// Whether the process exists and is not a zombie (a killed child not yet reaped).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

/// Enforcement state across passes: when each violation started, what was already reported.
#[derive(Default)]
pub struct Enforcer {
    over_since: HashMap<(u64, String), Instant>,
    reported: HashSet<(u64, String, u32)>,
    killed: HashSet<u32>,
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
        let procs: Vec<(GpuProcess, ProcOwner)> = procs
            .into_iter()
            .filter(|p| alive(p.pid) && !self.killed.contains(&p.pid))
            .map(|p| {
                let o = read_owner(p.pid);
                (p, o)
            })
            .collect();
        record_memory_used(agent, procs.iter().map(|(p, _)| p));
        if !agent.synced() {
            return;
        }
        let findings = agent.with_view(|v| judge(v, &procs));
        let now = Instant::now();
        let mut still_over = HashSet::new();
        for f in findings {
            let span = match &f {
                Finding::Over {
                    allocation_id, gpu, ..
                } => {
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
            self.act(agent, f, now, &mut still_over)
                .instrument(span)
                .await;
        }
        self.over_since.retain(|k, _| still_over.contains(k));
        let live: HashSet<u32> = procs.iter().map(|(p, _)| p.pid).collect();
        self.reported.retain(|(_, _, pid)| live.contains(pid));
        self.killed.retain(|pid| alive(*pid));
    }

    /// Act on one finding: past the grace period, kill or report, tell the pod and the ledger.
    async fn act(
        &mut self,
        agent: &Agent,
        f: Finding,
        now: Instant,
        still_over: &mut HashSet<(u64, String)>,
    ) {
        match f {
            Finding::Over {
                allocation_id,
                gpu,
                pids,
                used_mib,
                limit_mib,
            } => {
                let key = (allocation_id, gpu.clone());
                still_over.insert(key.clone());
                let since = *self.over_since.entry(key).or_insert(now);
                if now.duration_since(since) < agent.cfg.grace {
                    return;
                }
                let top = pids[0];
                if !self.reported.insert((allocation_id, gpu.clone(), top)) {
                    return;
                }
                let action = agent.cfg.on_violation;
                warn!(
                    ?pids,
                    used_mib,
                    limit_mib,
                    action = action.as_str(),
                    "memory limit exceeded"
                );
                if action == OnViolation::Kill {
                    for pid in &pids {
                        if let Ok(pid_i) = i32::try_from(*pid) {
                            match nix::sys::signal::kill(
                                nix::unistd::Pid::from_raw(pid_i),
                                nix::sys::signal::Signal::SIGKILL,
                            ) {
                                Ok(()) => {
                                    self.killed.insert(*pid);
                                }
                                Err(e) => warn!(pid, "SIGKILL failed: {e}"),
                            }
                        }
                    }
                }
                agent
                    .metrics
                    .violations
                    .get_or_create(&vec![("action", action.as_str().to_string())])
                    .inc();
                tell_pod(
                    agent,
                    allocation_id,
                    &gpu,
                    &pids,
                    used_mib,
                    limit_mib,
                    action,
                );
                report(
                    agent,
                    pb::LimitViolated {
                        allocation_id,
                        node: agent.cfg.node_name.clone(),
                        gpu_uuid: gpu,
                        pid: top,
                        used_mib,
                        limit_mib,
                        action: action.as_str().into(),
                    },
                )
                .await;
            }
            Finding::Rogue { gpu, pid, used_mib } => {
                if !self.reported.insert((0, gpu.clone(), pid)) {
                    return;
                }
                warn!(used_mib, "GPU process on no allocation (rogue)");
                agent
                    .metrics
                    .violations
                    .get_or_create(&vec![("action", "rogue".to_string())])
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
                        action: "rogue".into(),
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

/// A Warning Event on the pod whose container went over its limit, saying what happened.
fn tell_pod(
    agent: &Agent,
    allocation_id: u64,
    gpu: &str,
    pids: &[u32],
    used_mib: u64,
    limit_mib: u64,
    action: OnViolation,
) {
    let Some((pod, container)) = agent.with_view(|v| {
        v.allocs
            .get(&allocation_id)
            .and_then(|a| Some((a.pod.clone()?, a.container.clone())))
    }) else {
        return;
    };
    let what = match action {
        OnViolation::Kill => format!("its GPU processes {pids:?} were killed"),
        OnViolation::Report => "reported only (--on-violation=report)".to_string(),
    };
    agent.event(PodEvent {
        namespace: pod.namespace,
        name: pod.name,
        uid: pod.uid,
        kind: Kind::Warning,
        reason: "GpuLimitExceeded",
        message: format!(
            "container {container} used {used_mib} MiB on {gpu}, over its limit of {limit_mib} MiB (allocation {allocation_id}): {what}"
        ),
    });
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
