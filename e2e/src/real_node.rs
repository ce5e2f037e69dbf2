//! One real GPU node: Debian's containerd and runc, a real kubelet (1.20.2) and a
//! `gpuledger-node-agent` on the fake NVML library, all as processes of this run.
//!
//! Some paths are the host's and not the run directory's, because kubelet 1.20 fixes them
//! whatever `--root-dir` says: `/var/lib/kubelet/device-plugins/` (where the agent registers)
//! and `/var/log/pods/`, `/var/log/containers/` (container logs); what this node adds there is
//! removed when it stops.
//! Only one real node can run on a machine at a time. The kubelet sets three kernel tunables at
//! start (`vm.overcommit_memory`, `kernel.panic`, `kernel.panic_on_oops`); they are put back
//! when the node stops.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpuledger_testkit::kubelet::node::{FakeNvml, fake_nvml_lib};
use gpuledger_testkit::{Proc, bin_path, free_port};
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;

use crate::bins::KubeBins;
use crate::gpuledger::NODE_AGENT_SA;
use crate::pki::{Identity, Pki};

/// The device-plugin directory kubelet 1.20 uses whatever its `--root-dir`.
pub const DEVICE_PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins";

/// Which kubelet binary runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KubeletBuild {
    /// With the device-plugin dial patch (upstream PR #112597, in every kubelet from 1.26).
    Patched,
    /// Stock 1.20.2: its ListAndWatch dial sends the socket path as `:authority`.
    Unpatched,
}

impl KubeletBuild {
    fn program(self) -> &'static str {
        match self {
            KubeletBuild::Patched => "kubelet",
            KubeletBuild::Unpatched => "kubelet-unpatched",
        }
    }
}

const SYSCTLS: [&str; 3] = [
    "/proc/sys/vm/overcommit_memory",
    "/proc/sys/kernel/panic",
    "/proc/sys/kernel/panic_on_oops",
];

/// The node's processes. Dropping it stops them, removes the containers and restores the
/// kernel tunables.
pub struct RealNode {
    /// The node's name.
    pub name: String,
    /// The fake NVML state (GPUs, processes, Xids).
    pub nvml: FakeNvml,
    /// `127.0.0.1:<port>` of the agent's /healthz, /readyz, /metrics.
    pub agent_http: String,
    /// The PodResources socket of this kubelet.
    pub pod_resources_socket: PathBuf,
    /// containerd's socket.
    pub containerd_sock: PathBuf,
    /// The kubelet.
    pub kubelet: Proc,
    /// The node agent.
    pub agent: Proc,
    containerd: Proc,
    sysctls: Vec<(&'static str, String)>,
    kubelet_args: Vec<String>,
    bins: KubeBins,
    dir: PathBuf,
    /// What the kubelet's fixed log directories held before this node started.
    logs_before: Vec<PathBuf>,
}

impl RealNode {
    /// Start containerd, the node agent and the kubelet for node `name` under `dir`; wait until
    /// the Node object is Ready. `gpus` fake GPUs of `gpu_mem_mib`.
    #[allow(clippy::too_many_arguments)]
    pub async fn start(
        dir: &Path,
        bins: &KubeBins,
        pki: &Pki,
        server: &str,
        client: &kube::Client,
        allocators: &[String],
        name: &str,
        kubelet: KubeletBuild,
        (gpus, gpu_mem_mib): (u32, u64),
    ) -> Result<RealNode> {
        if !nix::unistd::Uid::effective().is_root() {
            bail!("the real node needs root (containerd, runc and the kubelet)");
        }
        let dir = dir.join(format!("node-{name}"));
        std::fs::create_dir_all(&dir)?;
        let logs_before = host_logs();
        let sysctls = SYSCTLS
            .iter()
            .map(|p| Ok((*p, std::fs::read_to_string(p)?.trim().to_string())))
            .collect::<Result<Vec<_>>>()?;

        let containerd_sock = dir.join("containerd/containerd.sock");
        let config = containerd_config(&dir)?;
        let containerd = Proc::spawn(
            &dir,
            "containerd",
            Path::new("containerd"),
            vec![format!("--config={}", config.display())],
            vec![],
        )?;
        wait_for(&containerd_sock, Duration::from_secs(30))
            .await
            .context("containerd did not start")?;
        crate::images::prepare(&dir, &containerd_sock)?;

        // A kubelet of an earlier run may have left its registration socket and checkpoint here.
        clean_device_plugin_dir()?;
        let nvml = FakeNvml::new(&dir, name, gpus, gpu_mem_mib)?;
        let root = dir.join("kubelet");
        let pod_resources_socket = root.join("pod-resources/kubelet.sock");
        let agent_http = format!("127.0.0.1:{}", free_port()?);
        let agent_kc = pki.kubeconfig(server, &Identity::ServiceAccount(NODE_AGENT_SA.into()))?;
        let agent = Proc::spawn(
            &dir,
            "node-agent",
            &bin_path("gpuledger-node-agent")?,
            vec![
                format!("--node-name={name}"),
                format!("--allocator={}", allocators.join(",")),
                format!("--nvml-lib={}", fake_nvml_lib()?.display()),
                format!("--kubelet-dir={DEVICE_PLUGIN_DIR}"),
                format!("--pod-resources-socket={}", pod_resources_socket.display()),
                format!("--health-listen={agent_http}"),
                format!("--kubeconfig={}", agent_kc.display()),
                // Debian's containerd 1.6 has no CDI and the fake GPUs no CDI spec: the
                // NVIDIA runtime's variable is how this node names a container's GPUs.
                "--device-list-strategy=envvar".into(),
            ],
            vec![
                ("FAKE_NVML_CONFIG".into(), nvml.path().display().to_string()),
                ("GPULEDGER_LOG".into(), "info".into()),
            ],
        )?;

        let kc = pki.kubeconfig(server, &Identity::Node(name.to_string()))?;
        let args = vec![
            format!("--kubeconfig={}", kc.display()),
            format!("--root-dir={}", root.display()),
            format!("--cert-dir={}", root.join("pki").display()),
            "--container-runtime=remote".into(),
            format!(
                "--container-runtime-endpoint=unix://{}",
                containerd_sock.display()
            ),
            "--cgroups-per-qos=false".into(),
            "--enforce-node-allocatable=".into(),
            "--cgroup-driver=cgroupfs".into(),
            "--fail-swap-on=false".into(),
            format!("--hostname-override={name}"),
            "--address=127.0.0.1".into(),
            format!("--port={}", free_port()?),
            "--healthz-port=0".into(),
            "--read-only-port=0".into(),
            format!("--pod-infra-container-image={}", crate::images::PAUSE_IMAGE),
            // The machine's disk is shared: never garbage-collect the imported images, never
            // evict a test pod for disk the other tenants use.
            "--image-gc-high-threshold=100".into(),
            "--image-gc-low-threshold=99".into(),
            "--eviction-hard=memory.available<1Mi,nodefs.available<1Mi,imagefs.available<1Mi"
                .into(),
            format!(
                "--volume-plugin-dir={}",
                root.join("volume-plugins").display()
            ),
            "--v=2".into(),
        ];
        let kubelet = Proc::spawn(
            &dir,
            "kubelet",
            &bins.path(kubelet.program()),
            args.clone(),
            vec![],
        )?;
        let node = RealNode {
            name: name.to_string(),
            nvml,
            agent_http,
            pod_resources_socket,
            containerd_sock,
            kubelet,
            agent,
            containerd,
            sysctls,
            kubelet_args: args,
            bins: bins.clone(),
            dir,
            logs_before,
        };
        node.wait_ready(client, Duration::from_secs(90)).await?;
        Ok(node)
    }

    /// Wait until the Node object says Ready.
    pub async fn wait_ready(&self, client: &kube::Client, timeout: Duration) -> Result<()> {
        let nodes: Api<Node> = Api::all(client.clone());
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(n) = nodes.get(&self.name).await
                && node_ready(&n)
            {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        bail!(
            "node {} not Ready within {timeout:?}\n--- kubelet:\n{}\n--- containerd:\n{}",
            self.name,
            self.kubelet.log_tail(25),
            self.containerd.log_tail(10)
        )
    }

    /// The agent's /readyz: (status, body).
    pub async fn agent_readyz(&self) -> Result<(u16, String)> {
        gpuledger_testkit::http::get(&format!("http://{}/readyz", self.agent_http)).await
    }

    /// Stop the kubelet (SIGTERM) and start it again with the same flags, as an upgrade or a
    /// crash would: it deletes the plugin sockets and makes a new registration socket.
    pub fn restart_kubelet(&mut self) -> Result<()> {
        self.kubelet.terminate(Duration::from_secs(10));
        self.kubelet.start()
    }

    /// Stop the kubelet and start the `build` one with the same flags (an upgrade).
    pub fn replace_kubelet(&mut self, build: KubeletBuild) -> Result<()> {
        self.kubelet.terminate(Duration::from_secs(10));
        self.kubelet = Proc::spawn(
            &self.dir,
            "kubelet",
            &self.bins.path(build.program()),
            self.kubelet_args.clone(),
            vec![],
        )?;
        Ok(())
    }
}

/// The pod on this node's host network (this node makes no pod network; see
/// `containerd_config`).
pub fn host_network(mut pod: serde_json::Value) -> serde_json::Value {
    pod["spec"]["hostNetwork"] = serde_json::Value::Bool(true);
    pod
}

/// What a container printed, from the file the kubelet writes and `kubectl logs` serves
/// (`/var/log/pods/<ns>_<pod>_<uid>/<container>/0.log`, CRI format: time, stream, tag, text).
pub fn container_log(ns: &str, pod: &str, uid: &str, container: &str) -> Result<String> {
    let p = PathBuf::from(format!("/var/log/pods/{ns}_{pod}_{uid}/{container}/0.log"));
    let text = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
    Ok(text
        .lines()
        .filter_map(|l| l.splitn(4, ' ').nth(3))
        .map(|l| format!("{l}\n"))
        .collect())
}

/// Whether the node's Ready condition is True.
pub fn node_ready(n: &Node) -> bool {
    n.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The node's allocatable `gpuledger.io/gpu` (0 when absent).
pub fn allocatable_gpu(n: &Node) -> i64 {
    n.status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .and_then(|a| a.get("gpuledger.io/gpu"))
        .and_then(|q| q.0.parse().ok())
        .unwrap_or(0)
}

impl Drop for RealNode {
    fn drop(&mut self) {
        self.kubelet.terminate(Duration::from_secs(5));
        self.agent.terminate(Duration::from_secs(5));
        // The kubelet is gone: stop the pods' containers so no shim outlives the run.
        let sock = self.containerd_sock.display().to_string();
        let ctr = |args: &[&str]| {
            std::process::Command::new("ctr")
                .arg(format!("--address={sock}"))
                .args(["-n", "k8s.io"])
                .args(args)
                .output()
        };
        if let Ok(o) = ctr(&["tasks", "ls", "-q"]) {
            for id in String::from_utf8_lossy(&o.stdout).lines() {
                let _ = ctr(&["tasks", "kill", "-s", "SIGKILL", id]);
            }
            std::thread::sleep(Duration::from_millis(500));
            for id in String::from_utf8_lossy(&o.stdout).lines() {
                let _ = ctr(&["tasks", "delete", "-f", id]);
            }
        }
        self.containerd.terminate(Duration::from_secs(5));
        // The kubelet bind-mounts its root directory and containerd mounts a shm per sandbox;
        // neither unmounts them on exit, and the run directory could not be removed.
        unmount_under(&self.dir);
        // The pods' logs under /var/log are this run's: remove them with it.
        for p in host_logs() {
            if !self.logs_before.contains(&p) {
                let _ = std::fs::remove_dir_all(&p).or_else(|_| std::fs::remove_file(&p));
            }
        }
        for (p, v) in &self.sysctls {
            let _ = std::fs::write(p, v);
        }
        let _ = clean_device_plugin_dir();
    }
}

/// The entries of the kubelet's fixed log directories, `/var/log/pods` and `/var/log/containers`.
fn host_logs() -> Vec<PathBuf> {
    ["/var/log/pods", "/var/log/containers"]
        .iter()
        .filter_map(|d| std::fs::read_dir(d).ok())
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect()
}

/// Detach every mount at or below `dir`, deepest first.
fn unmount_under(dir: &Path) {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    // The fifth field is the mount point (spaces escaped as \040).
    let mut points: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(p.replace("\\040", " ")))
        .filter(|p| p.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    for p in points {
        let _ = nix::mount::umount2(&p, nix::mount::MntFlags::MNT_DETACH);
    }
}

fn clean_device_plugin_dir() -> Result<()> {
    let dir = Path::new(DEVICE_PLUGIN_DIR);
    if !dir.is_dir() {
        return Ok(());
    }
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        if !e.file_type()?.is_dir() {
            let _ = std::fs::remove_file(e.path());
        }
    }
    Ok(())
}

async fn wait_for(p: &Path, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if p.exists() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("{} did not appear within {timeout:?}", p.display())
}

/// containerd's configuration: everything under `dir`, the local pause image, runc, and a
/// loopback-only CNI network: enough for the runtime (and so the node) to be network-ready,
/// while the tests' pods use the host's network and no interface is made on the machine.
fn containerd_config(dir: &Path) -> Result<PathBuf> {
    let base = dir.join("containerd");
    let netd = dir.join("cni");
    std::fs::create_dir_all(&base)?;
    std::fs::create_dir_all(&netd)?;
    std::fs::write(
        netd.join("10-e2e.conflist"),
        r#"{"cniVersion": "0.4.0", "name": "e2e-loopback", "plugins": [{"type": "loopback"}]}"#,
    )?;
    let toml = format!(
        r#"version = 2
root = "{b}/root"
state = "{b}/state"
[grpc]
  address = "{b}/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  # The kubelet asks for negative OOM scores that this machine does not let root set
  # (no CAP_SYS_RESOURCE): clamp them to containerd's own instead of failing the sandbox.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{netd}"
"#,
        b = base.display(),
        pause = crate::images::PAUSE_IMAGE,
        netd = netd.display(),
    );
    let p = base.join("config.toml");
    std::fs::write(&p, toml)?;
    Ok(p)
}
