//! What the kubelet loops did with every pod: when each was seen, started and ended, which
//! GPUs it got, and how it ended.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use crate::history::History;

/// How a pod run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunOutcome {
    /// Being admitted or running.
    Running,
    /// The container exited 0.
    Succeeded,
    /// Admission failed, or the container failed or was killed: why.
    Failed(String),
    /// The pod was deleted while it ran.
    Deleted,
}

/// What the kubelet loop did with one pod.
#[derive(Debug, Clone)]
pub struct PodRun {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Node.
    pub node: String,
    /// `(GPU UUID, memory limit MiB, GPU memory MiB)` per GPU the container got.
    pub shares: Vec<(String, u64, u64)>,
    /// `GPULEDGER_ALLOCATION_ID` the agent returned.
    pub allocation_id: Option<u64>,
    /// When the kubelet saw the pod.
    pub seen: Instant,
    /// When its container started.
    pub started: Option<Instant>,
    /// When it ended.
    pub ended: Option<Instant>,
    /// How.
    pub outcome: RunOutcome,
}

/// Every pod run of the cluster, by pod UID.
#[derive(Default)]
pub struct Runs {
    runs: Mutex<HashMap<String, PodRun>>,
    /// Every Allocate call the kubelets made, and how every pod ended.
    pub history: History,
}

impl Runs {
    /// A copy of every run.
    pub fn all(&self) -> Vec<PodRun> {
        self.lock().values().cloned().collect()
    }

    /// Runs whose container is running now.
    pub fn running(&self) -> Vec<PodRun> {
        self.lock()
            .values()
            .filter(|r| r.outcome == RunOutcome::Running && r.started.is_some())
            .cloned()
            .collect()
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, PodRun>> {
        self.runs.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn update(&self, uid: &str, f: impl FnOnce(&mut PodRun)) {
        if let Some(r) = self.lock().get_mut(uid) {
            f(r);
        }
    }
}
