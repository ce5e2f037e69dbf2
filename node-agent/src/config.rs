//! Command-line flags (also read from `GPULEDGER_*` environment variables).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};

/// gpuledger-node-agent: makes the GPU ledger real on one node.
///
/// Discovers the node's GPUs through NVML and registers them with the allocator; serves the
/// kubelet device plugin for `gpuledger.io/gpu` (each GPU advertised as --slots-per-gpu replica
/// IDs); claims the pod's reservation in the ledger when the kubelet calls Allocate and verifies
/// the pod through the kubelet PodResources API before the container starts; follows the
/// node's ledger events; enforces memory limits from NVML process accounting; marks GPUs with
/// critical Xid errors unhealthy. It never touches etcd: it speaks gRPC to any allocator
/// replica. SIGTERM stops the agent and leaves running containers untouched.
#[derive(Parser, Debug, Clone)]
#[command(name = "gpuledger-node-agent", version, about, long_about)]
pub struct Config {
    /// This node's Kubernetes name (the ledger's node key).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,

    /// Allocator gRPC addresses (host:port), comma-separated; any replica works (followers
    /// forward writes to the leader). The agent fails over between them.
    #[arg(
        long,
        env = "GPULEDGER_ALLOCATOR",
        value_delimiter = ',',
        default_value = "127.0.0.1:7420"
    )]
    pub allocator: Vec<String>,

    /// How this agent proves to the allocator which node it runs on: the projected
    /// ServiceAccount token of its pod (the kubelet binds it to the pod, and so to the node),
    /// or a client certificate naming `spiffe://gpuledger/node-agent/<node>`.
    #[command(flatten)]
    pub credentials: gpuledger_auth::CredentialArgs,

    /// Path of the NVML library to load (default: the system's libnvidia-ml.so.1). Tests pass
    /// the fake library built in this workspace.
    #[arg(long, env = "GPULEDGER_NVML_LIB")]
    pub nvml_lib: Option<PathBuf>,

    /// The kubelet's device-plugin directory: holds kubelet.sock, and this agent's socket.
    #[arg(
        long,
        env = "GPULEDGER_KUBELET_DIR",
        default_value = "/var/lib/kubelet/device-plugins"
    )]
    pub kubelet_dir: PathBuf,

    /// File name of this agent's device-plugin socket inside --kubelet-dir.
    #[arg(
        long,
        env = "GPULEDGER_PLUGIN_SOCKET",
        default_value = "gpuledger.sock"
    )]
    pub plugin_socket: String,

    /// The kubelet PodResources socket (used to confirm which pod got which devices).
    #[arg(
        long,
        env = "GPULEDGER_POD_RESOURCES_SOCKET",
        default_value = "/var/lib/kubelet/pod-resources/kubelet.sock"
    )]
    pub pod_resources_socket: PathBuf,

    /// Replica device IDs advertised per GPU (`<GPU-UUID>::<k>`): how many containers can share
    /// one GPU at most.
    #[arg(long, env = "GPULEDGER_SLOTS_PER_GPU", default_value_t = 64)]
    pub slots_per_gpu: u32,

    /// How often memory use is checked against the limits ("1s", "500ms", "2m"; a bare number
    /// is seconds).
    #[arg(long, env = "GPULEDGER_ENFORCE_INTERVAL", default_value = "1s", value_parser = parse_duration)]
    pub enforce_interval: Duration,

    /// How long a container may stay over its memory limit before --on-violation applies
    /// (absorbs short spikes; 0 = act at the first check over the limit).
    #[arg(long, env = "GPULEDGER_GRACE", default_value = "0s", value_parser = parse_duration)]
    pub grace: Duration,

    /// What to do with the processes of a container over its memory limit: `kill` (SIGKILL)
    /// or `report` (only the LimitViolated event). Both write LimitViolated to the ledger.
    #[arg(long, env = "GPULEDGER_ON_VIOLATION", value_enum, default_value_t = OnViolation::Kill)]
    pub on_violation: OnViolation,

    /// The node runs the CUDA MPS daemon: also return the MPS limit variables and mount its
    /// pipe directory into containers.
    #[arg(long, env = "GPULEDGER_MPS")]
    pub mps: bool,

    /// MPS pipe directory mounted into containers with --mps.
    #[arg(
        long,
        env = "GPULEDGER_MPS_PIPE_DIR",
        default_value = "/tmp/nvidia-mps"
    )]
    pub mps_pipe_dir: PathBuf,

    /// How long Allocate waits for the ledger to show a matching reservation.
    #[arg(long, env = "GPULEDGER_ALLOCATE_WAIT", default_value = "10s", value_parser = parse_duration)]
    pub allocate_wait: Duration,

    /// How often the GPU inventory is re-read and, when it changed, registered again.
    #[arg(long, env = "GPULEDGER_REDISCOVER_INTERVAL", default_value = "30s", value_parser = parse_duration)]
    pub rediscover_interval: Duration,

    /// Address for HTTP `/healthz`, `/readyz` and `/metrics` (e.g. 0.0.0.0:7422); off when unset.
    #[arg(long, env = "GPULEDGER_HEALTH_LISTEN")]
    pub health_listen: Option<std::net::SocketAddr>,

    /// kubeconfig for creating pod Events (limit exceeded, identity corrected). Default: the
    /// in-cluster service account when running in a pod; without either, no Events.
    #[arg(long, env = "GPULEDGER_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Log format: "human" or "json" (filter with GPULEDGER_LOG, e.g. "debug").
    #[arg(long, env = "GPULEDGER_LOG_FORMAT", default_value = "human", value_parser = ["human", "json"])]
    pub log_format: String,
}

/// What enforcement does to a container over its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OnViolation {
    /// SIGKILL its GPU processes and report.
    Kill,
    /// Only report.
    Report,
}

impl OnViolation {
    /// The `action` string of the LimitViolated event.
    pub fn as_str(self) -> &'static str {
        match self {
            OnViolation::Kill => "kill",
            OnViolation::Report => "report",
        }
    }
}

/// Parse "1s", "500ms", "2m", "1h" or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| !c.is_ascii_digit() && c != '.') {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (try 1s, 500ms, 2m)"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (ms, s, m, h)")),
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("{s:?} is not a duration"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units_and_bare_seconds() {
        assert_eq!(parse_duration("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("3"), Ok(Duration::from_secs(3)));
        assert!(parse_duration("3 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }
}
