//! Command-line flags (also read from `GPULEDGER_*` environment variables).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};

use crate::isolation::{HamiCore, Isolation, Wanted};

/// gpuledger-node-agent: makes the GPU ledger real on one node.
///
/// Discovers the node's GPUs through NVML and registers them with the allocator; serves the
/// kubelet device plugin for `gpuledger.io/gpu` (each GPU advertised as --slots-per-gpu replica
/// IDs); claims the pod's reservation in the ledger when the kubelet calls Allocate and verifies
/// the pod through the kubelet PodResources API before the container starts; follows the
/// node's ledger events; enforces memory limits from NVML process accounting; marks GPUs with
/// critical Xid errors unhealthy. With --mode=dra it is a kubelet DRA plugin instead of a
/// device plugin: it publishes the node's ResourceSlice and prepares a ResourceClaim only when
/// the ledger grants its allocation. It never touches etcd: it speaks gRPC to any allocator
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

    /// What to do with the processes of a container over its memory limit: `kill` (SIGKILL,
    /// through the pidfd opened when each process was sampled, so a reused pid is never hit)
    /// or `report` (only the LimitViolated event). Both write LimitViolated to the ledger.
    #[arg(long, env = "GPULEDGER_ON_VIOLATION", value_enum, default_value_t = OnViolation::Kill)]
    pub on_violation: OnViolation,

    /// What to do with GPU processes that belong to no allocation: a pod whose cgroup names
    /// no allocation on that GPU, or a process outside any pod. `report` (LimitViolated
    /// "rogue") or `kill` (SIGKILL, recorded as "rogue-kill"). The default is `report` because
    /// such processes include the node's own GPU software (the MPS server, DCGM diagnostics,
    /// jobs the node's administrators run), which a kill would break; choose `kill` only on
    /// nodes where nothing but gpuledger pods may use the GPUs.
    #[arg(long, env = "GPULEDGER_ROGUE_POLICY", value_enum, default_value_t = RoguePolicy::Report)]
    pub rogue_policy: RoguePolicy,

    /// GPU memory in MiB that each process may use beyond its container's share before
    /// enforcement counts it. NVML charges a process's CUDA context to the process: on an
    /// H100 80GB HBM3 (driver 580) a process that allocated 4096 MiB showed 4614 MiB, so
    /// without this a container given 4096 MiB that fills them would be killed. The default
    /// is that measured 518 MiB rounded up; 0 counts the context against the share (users
    /// must then request it).
    #[arg(long, env = "GPULEDGER_CONTEXT_ALLOWANCE_MIB", default_value_t = 520)]
    pub context_allowance_mib: u64,

    /// How Allocate tells the container runtime which GPUs a container gets, like NVIDIA's
    /// device plugin; a comma list, several may be combined. `cdi-cri`: CDI device names
    /// (`<--cdi-kind>=<GPU-UUID>`) in the kubelet's CDI field (Kubernetes 1.28+, containerd
    /// 1.7+ or CRI-O with CDI on); `cdi-annotations`: the same names in `cdi.k8s.io/`
    /// annotations (runtimes that read CDI annotations, the NVIDIA runtime in CDI mode);
    /// `envvar`: NVIDIA_VISIBLE_DEVICES (the NVIDIA runtime's legacy mode). The default is what
    /// the NVIDIA GPU Operator configures for its own device plugin since CDI became its
    /// default (v25.10): on nodes that refuse NVIDIA_VISIBLE_DEVICES from unprivileged
    /// containers the variable grants nothing, and a node that cannot resolve a CDI name
    /// fails the container instead of starting it without its GPU. Use `envvar` on nodes whose
    /// runtime has no CDI. The limit variables are exported whatever the strategy.
    #[arg(
        long,
        env = "GPULEDGER_DEVICE_LIST_STRATEGY",
        value_enum,
        value_delimiter = ',',
        default_value = "cdi-annotations,cdi-cri"
    )]
    pub device_list_strategy: Vec<DeviceListStrategy>,

    /// The CDI kind (`<vendor>/<class>`) of the GPUs' CDI devices: the kind of the node's CDI
    /// spec that names each GPU by its UUID (`nvidia-ctk cdi generate
    /// --device-name-strategy=uuid` writes `nvidia.com/gpu`; NVIDIA's device plugin in CDI
    /// mode writes `k8s.device-plugin.nvidia.com/gpu`).
    #[arg(long, env = "GPULEDGER_CDI_KIND", default_value = "nvidia.com/gpu", value_parser = parse_cdi_kind)]
    pub cdi_kind: String,

    /// The first isolation layer in front of each container's share; NVML sampling with a kill
    /// (--on-violation) stands behind every one. `nvml`: that sampling only (a process can
    /// exceed its share until the next sample); `hami-core`: HAMi-core's `libvgpu.so` (from
    /// --hami-core-lib) preloaded into every container through `/etc/ld.so.preload`, which
    /// fails CUDA allocations beyond the share inside the process; `mps`: one MPS control
    /// daemon per GPU run by the agent (--mps-control, --mps-dir), the GPU in EXCLUSIVE_PROCESS
    /// compute mode, each daemon's pinned-memory limit and active-thread percentage set
    /// server-side to the largest share on its GPU, and each container given only its GPU's
    /// pipe directory; `dmem`: each pod cgroup's `dmem.max` under --cgroup-root (cgroup v2,
    /// driver r615+, MIG off) set to the pod's shares and read back. A mode the node cannot
    /// serve stops the agent at start with what is missing; it never runs a weaker one
    /// instead.
    #[arg(long, env = "GPULEDGER_ISOLATION", value_enum, default_value_t = Isolation::Nvml)]
    pub isolation: Isolation,

    /// HAMi-core's library on the host (--isolation=hami-core); mounted read-only into each
    /// container at /usr/local/vgpu/libvgpu.so.
    #[arg(
        long,
        env = "GPULEDGER_HAMI_CORE_LIB",
        default_value = "/usr/local/vgpu/libvgpu.so"
    )]
    pub hami_core_lib: PathBuf,

    /// A host directory the agent owns for HAMi-core (--isolation=hami-core): the preload
    /// file mounted as each container's /etc/ld.so.preload, HAMi-core's lock directory, and
    /// one shared-cache directory per allocation.
    #[arg(
        long,
        env = "GPULEDGER_HAMI_CORE_DIR",
        default_value = "/var/lib/gpuledger/hami-core"
    )]
    pub hami_core_dir: PathBuf,

    /// The cgroup v2 mount (--isolation=dmem): its `dmem.capacity` names each GPU's region,
    /// and the pod cgroups under its `kubepods` get their `dmem.max`.
    #[arg(long, env = "GPULEDGER_CGROUP_ROOT", default_value = "/sys/fs/cgroup")]
    pub cgroup_root: PathBuf,

    /// `nvidia-cuda-mps-control` (--isolation=mps); `nvidia-cuda-mps-server` must be in the
    /// same directory. A node without them refuses --isolation=mps at start.
    #[arg(
        long,
        env = "GPULEDGER_MPS_CONTROL",
        default_value = "/usr/bin/nvidia-cuda-mps-control"
    )]
    pub mps_control: PathBuf,

    /// A host directory the agent owns for its MPS daemons (--isolation=mps): per GPU
    /// `<UUID>/pipe` (mounted into that GPU's containers at --mps-pipe-dir) and `<UUID>/log`.
    #[arg(
        long,
        env = "GPULEDGER_MPS_DIR",
        default_value = "/var/lib/gpuledger/mps"
    )]
    pub mps_dir: PathBuf,

    /// The node runs the CUDA MPS daemon itself (not the agent, unlike --isolation=mps): also
    /// return the MPS limit variables and mount its pipe directory into containers.
    #[arg(long, env = "GPULEDGER_MPS")]
    pub mps: bool,

    /// MPS pipe directory mounted into containers with --mps, and where a container sees its
    /// GPU's pipe directory with --isolation=mps.
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

    /// How often each GPU is asked whether it is still there: one NVML answers
    /// `GPU_IS_LOST` for (fallen off the bus) is marked unhealthy, and healthy again once it
    /// answers.
    #[arg(long, env = "GPULEDGER_HEALTH_PROBE_INTERVAL", default_value = "1s", value_parser = parse_duration)]
    pub health_probe_interval: Duration,

    /// Address for HTTP `/healthz`, `/readyz` and `/metrics` (e.g. 0.0.0.0:7422); off when unset.
    #[arg(long, env = "GPULEDGER_HEALTH_LISTEN")]
    pub health_listen: Option<std::net::SocketAddr>,

    /// The bounds of --health-listen's port.
    #[command(flatten)]
    pub http: gpuledger_auth::PlainHttpArgs,

    /// kubeconfig for creating pod Events (limit exceeded, identity corrected). Default: the
    /// in-cluster service account when running in a pod; without either, no Events.
    #[arg(long, env = "GPULEDGER_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// How this node's GPUs reach containers: `device-plugin` (the kubelet device plugin for
    /// `gpuledger.io/gpu`, reservations made through the scheduler extender) or `dra` (a
    /// kubelet DRA plugin for driver `gpu.gpuledger.io`: a ResourceSlice per node, claims
    /// prepared only when the ledger grants them). The mode is registered in the ledger, which
    /// grants only the node's kind; a node never serves both.
    #[arg(long, env = "GPULEDGER_MODE", value_enum, default_value_t = Mode::DevicePlugin)]
    pub mode: Mode,

    /// The kubelet's plugin registry (`<kubelet --root-dir>/plugins_registry`), where the DRA
    /// registration socket `gpu.gpuledger.io-reg.sock` is served (--mode=dra).
    #[arg(
        long,
        env = "GPULEDGER_DRA_REGISTRY_DIR",
        default_value = "/var/lib/kubelet/plugins_registry"
    )]
    pub dra_registry_dir: PathBuf,

    /// The kubelet's plugins directory (`<kubelet --root-dir>/plugins`): the DRA service is
    /// served on `gpu.gpuledger.io/dra.sock` inside it (--mode=dra).
    #[arg(
        long,
        env = "GPULEDGER_DRA_PLUGIN_DIR",
        default_value = "/var/lib/kubelet/plugins"
    )]
    pub dra_plugin_dir: PathBuf,

    /// Where prepared claims' CDI specs are written (`gpuledger.io-claim_<claim UID>.json`), one
    /// of the container runtime's CDI spec directories (--mode=dra).
    #[arg(long, env = "GPULEDGER_CDI_SPEC_DIR", default_value = "/var/run/cdi")]
    pub cdi_spec_dir: PathBuf,

    /// How long NodePrepareResources waits for the ledger to show the claim's grant (or its
    /// refusal) before it fails; inside the kubelet's 45 s per call (--mode=dra).
    #[arg(long, env = "GPULEDGER_PREPARE_GRANT_WAIT", default_value = "20s", value_parser = parse_duration)]
    pub prepare_grant_wait: Duration,

    /// The effect of the device taint an unhealthy GPU gets in the node's ResourceSlice
    /// (--mode=dra): `no-schedule` keeps new claims off it and leaves running pods be;
    /// `no-execute` also has Kubernetes evict the pods using it (each gets an Event saying so).
    #[arg(
        long,
        env = "GPULEDGER_DRA_UNHEALTHY_TAINT",
        value_enum,
        default_value = "no-schedule"
    )]
    pub dra_unhealthy_taint: TaintEffect,

    /// How many kubelet health streams (`NodeWatchResources`) the DRA socket serves at once
    /// (--mode=dra): the kubelet holds one, two for a moment while it restarts; past it a new
    /// stream is refused with RESOURCE_EXHAUSTED until one ends (0 = no bound).
    #[arg(long, env = "GPULEDGER_DRA_MAX_HEALTH_STREAMS", default_value_t = 4)]
    pub dra_max_health_streams: usize,

    /// How many claims the DRA socket prepares or unprepares at once, across every call
    /// (--mode=dra): each may wait --prepare-grant-wait and reads the API server. Past it a
    /// claim is answered with an error the kubelet retries (0 = no bound).
    #[arg(
        long,
        env = "GPULEDGER_DRA_MAX_CLAIMS_IN_FLIGHT",
        default_value_t = 256
    )]
    pub dra_max_claims_in_flight: usize,

    /// Log format: "human" or "json" (filter with GPULEDGER_LOG, e.g. "debug").
    #[arg(long, env = "GPULEDGER_LOG_FORMAT", default_value = "human", value_parser = ["human", "json"])]
    pub log_format: String,
}

impl Config {
    /// What --isolation asks of the node.
    pub fn isolation_wanted(&self) -> Wanted {
        Wanted {
            isolation: self.isolation,
            hami_core: HamiCore {
                lib: self.hami_core_lib.clone(),
                dir: self.hami_core_dir.clone(),
            },
            cgroup_root: self.cgroup_root.clone(),
            mps_control: self.mps_control.clone(),
        }
    }
}

/// How a node's GPUs reach containers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// The kubelet device plugin.
    DevicePlugin,
    /// A kubelet DRA plugin (Dynamic Resource Allocation).
    Dra,
}

/// The effect of a device taint (`resource.k8s.io/v1` `DeviceTaint.effect`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TaintEffect {
    /// No new allocation of the device; allocated ones stay.
    NoSchedule,
    /// Also evict the pods whose claims hold the device.
    NoExecute,
}

impl TaintEffect {
    /// The API's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            TaintEffect::NoSchedule => "NoSchedule",
            TaintEffect::NoExecute => "NoExecute",
        }
    }
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

/// What enforcement does to a GPU process that belongs to no allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RoguePolicy {
    /// Only report.
    Report,
    /// SIGKILL it and report.
    Kill,
}

impl RoguePolicy {
    /// The `action` string of the LimitViolated event.
    pub fn as_str(self) -> &'static str {
        match self {
            RoguePolicy::Report => "rogue",
            RoguePolicy::Kill => "rogue-kill",
        }
    }
}

/// One way of telling the container runtime which GPUs a container gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
pub enum DeviceListStrategy {
    /// `NVIDIA_VISIBLE_DEVICES=<UUIDs>` in the environment.
    Envvar,
    /// CDI device names in a `cdi.k8s.io/` annotation.
    CdiAnnotations,
    /// CDI device names in the CRI's CDI field.
    CdiCri,
}

/// Check a CDI kind, `<vendor>/<class>`, against the CDI specification's syntax.
pub fn parse_cdi_kind(s: &str) -> Result<String, String> {
    let bad = |why: &str| Err(format!("{s:?} is not a CDI kind <vendor>/<class>: {why}"));
    let Some((vendor, class)) = s.split_once('/') else {
        return bad("no '/'");
    };
    let ok = |name: &str, extra: &[char]| {
        let b = name.as_bytes();
        !b.is_empty()
            && b[0].is_ascii_alphabetic()
            && b[b.len() - 1].is_ascii_alphanumeric()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || extra.contains(&c))
    };
    if !ok(vendor, &['.']) {
        return bad(
            "the vendor starts with a letter, ends with a letter or digit, and has only letters, digits, '_', '-', '.'",
        );
    }
    if !ok(class, &[]) {
        return bad(
            "the class starts with a letter, ends with a letter or digit, and has only letters, digits, '_', '-'",
        );
    }
    Ok(s.to_string())
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

/// GPU `uuid`'s MPS pipe directory under `--mps-dir`: the one thing its containers get (the
/// daemons' layout, which the containers' mounts follow).
pub fn mps_pipe_dir(mps_dir: &std::path::Path, uuid: &str) -> std::path::PathBuf {
    mps_dir.join(uuid).join("pipe")
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

    #[test]
    fn cdi_kinds_follow_the_cdi_syntax() {
        assert_eq!(
            parse_cdi_kind("nvidia.com/gpu").as_deref(),
            Ok("nvidia.com/gpu")
        );
        assert!(parse_cdi_kind("k8s.device-plugin.nvidia.com/gpu").is_ok());
        for bad in [
            "nvidia.com",
            "/gpu",
            "nvidia.com/",
            "nvidia.com/g.pu",
            "1vendor/gpu",
            "v/gpu-",
            "v/a/b",
        ] {
            assert!(parse_cdi_kind(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn device_list_strategies_default_to_cdi_and_combine() {
        let cfg = Config::try_parse_from(["agent", "--node-name=n"]).expect("defaults parse");
        assert_eq!(
            cfg.device_list_strategy,
            [
                DeviceListStrategy::CdiAnnotations,
                DeviceListStrategy::CdiCri
            ]
        );
        assert_eq!(cfg.rogue_policy, RoguePolicy::Report);
        assert_eq!(cfg.mode, Mode::DevicePlugin);
        assert_eq!(cfg.isolation, Isolation::Nvml);
        let hami = Config::try_parse_from(["agent", "--node-name=n", "--isolation=hami-core"])
            .expect("hami-core");
        assert_eq!(hami.isolation, Isolation::HamiCore);
        assert!(Config::try_parse_from(["agent", "--node-name=n", "--isolation=none"]).is_err());
        assert_eq!(cfg.prepare_grant_wait, Duration::from_secs(20));
        assert_eq!(cfg.dra_unhealthy_taint, TaintEffect::NoSchedule);
        let dra = Config::try_parse_from(["agent", "--node-name=n", "--mode=dra"]).expect("dra");
        assert_eq!(dra.mode, Mode::Dra);
        assert!(Config::try_parse_from(["agent", "--node-name=n", "--mode=both"]).is_err());
        let cfg = Config::try_parse_from([
            "agent",
            "--node-name=n",
            "--device-list-strategy=envvar,cdi-cri",
        ])
        .expect("a comma list parses");
        assert_eq!(
            cfg.device_list_strategy,
            [DeviceListStrategy::Envvar, DeviceListStrategy::CdiCri]
        );
        // Repeated, as the manifests give it (one value per flag).
        let cfg = Config::try_parse_from([
            "agent",
            "--node-name=n",
            "--device-list-strategy=cdi-cri",
            "--device-list-strategy=envvar",
        ])
        .expect("a repeated flag parses");
        assert_eq!(
            cfg.device_list_strategy,
            [DeviceListStrategy::CdiCri, DeviceListStrategy::Envvar]
        );
        assert!(
            Config::try_parse_from([
                "agent",
                "--node-name=n",
                "--device-list-strategy=volume-mounts"
            ])
            .is_err()
        );
        assert!(Config::try_parse_from(["agent", "--node-name=n", "--cdi-kind=nvidia"]).is_err());
    }
}
