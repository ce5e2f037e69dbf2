//! The client-visible operations of a run, as their clients saw them: the scheduler
//! emulator's binds (each one a reserve in the allocator), the kubelet's Allocate calls to a
//! node agent (each one a claim committed in the ledger), and how each pod ended. An operation
//! whose outcome the client cannot know (a timeout, a connection cut after the request was
//! sent) is recorded as `unknown`, never guessed. `gpuledger-chaos run` writes them as JSONL
//! and checks them against the ledger.

use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::json;

/// What the client learned of an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Acknowledged.
    Ok,
    /// Refused: the client knows nothing was granted.
    Fail,
    /// No answer: it may or may not have taken effect.
    Unknown,
}

impl Outcome {
    /// `ok`, `fail` or `unknown`.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Fail => "fail",
            Outcome::Unknown => "unknown",
        }
    }
}

/// One client-visible operation.
#[derive(Debug, Clone)]
pub struct Op {
    /// Milliseconds since the Unix epoch, when the answer (or the give-up) came.
    pub at_ms: u64,
    /// `bind`, `allocate` or `end`.
    pub op: &'static str,
    /// `namespace/name` of the pod.
    pub pod: String,
    /// The pod's UID.
    pub uid: String,
    /// The node.
    pub node: String,
    /// What the client learned.
    pub outcome: Outcome,
    /// The allocation the answer named (Allocate answers carry `GPULEDGER_ALLOCATION_ID`).
    pub allocation: Option<u64>,
    /// The error message, or what the answer said.
    pub detail: String,
}

impl Op {
    /// One JSON line.
    pub fn to_json(&self) -> String {
        json!({
            "at_ms": self.at_ms,
            "op": self.op,
            "pod": self.pod,
            "uid": self.uid,
            "node": self.node,
            "result": self.outcome.as_str(),
            "allocation": self.allocation,
            "detail": self.detail,
        })
        .to_string()
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Which pod on which node an operation was about.
#[derive(Debug, Clone, Copy)]
pub struct PodAt<'a> {
    /// `namespace/name`.
    pub pod: &'a str,
    /// UID.
    pub uid: &'a str,
    /// Node.
    pub node: &'a str,
}

/// A thread-safe record of operations.
#[derive(Default)]
pub struct History {
    ops: Mutex<Vec<Op>>,
}

impl History {
    /// Record `op` about `at`, stamped now.
    pub fn record(
        &self,
        op: &'static str,
        at: PodAt<'_>,
        outcome: Outcome,
        allocation: Option<u64>,
        detail: impl Into<String>,
    ) {
        let o = Op {
            at_ms: now_ms(),
            op,
            pod: at.pod.to_string(),
            uid: at.uid.to_string(),
            node: at.node.to_string(),
            outcome,
            allocation,
            detail: detail.into(),
        };
        self.ops.lock().unwrap_or_else(|p| p.into_inner()).push(o);
    }

    /// A copy of every operation so far.
    pub fn all(&self) -> Vec<Op> {
        self.ops.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}
