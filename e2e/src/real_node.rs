//! One real GPU node: containerd 2 (with CDI) and runc, a stock kubelet and a
//! `gpuledger-node-agent` on the fake NVML library, all as processes of this run.
//!
//! The kubelet keeps everything under its `--root-dir` and the run directory (its pod logs
//! through `podLogsDir`) but for one fixed path: the device-plugin registration socket,
//! `/var/lib/kubelet/device-plugins/kubelet.sock` whatever `--root-dir` says (upstream's
//! `pluginapi.KubeletSocket`), where the agent registers as in a cluster; what this node adds
//! there is removed when it stops. Only one real node can run on a machine at a time. The
//! kubelet sets three kernel tunables at start (`vm.overcommit_memory`, `kernel.panic`,
//! `kernel.panic_on_oops`); they are put back when the node stops.
//!
//! The fake GPUs reach containers as CDI devices: the agent answers `Allocate` with
//! `nvidia.com/gpu=<UUID>` (its shipped `--device-list-strategy`), and the CDI spec of this
//! node, written where `nvidia-ctk cdi generate` would put NVIDIA's, gives each GPU a device
//! node and an environment variable that containerd adds to the container.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpuledger_testkit::kubelet::node::{FakeNvml, fake_nvml_lib};
use gpuledger_testkit::{Proc, bin_path, free_port};
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use serde_json::json;

use crate::bins::KubeBins;
use crate::gpuledger::NODE_AGENT_SA;
use crate::pki::{Identity, Pki};

/// The device-plugin directory of every kubelet, whatever its `--root-dir`.
pub const DEVICE_PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins";

/// The CDI kind of the fake GPUs (the agent's default `--cdi-kind`, NVIDIA's).
pub const CDI_KIND: &str = "nvidia.com/gpu";

/// The variable the node's CDI spec sets in a container for each GPU it is given.
pub const CDI_ENV: &str = "E2E_CDI_GPU";

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
    /// Where the kubelet keeps the containers' logs (`podLogsDir`).
    pub pod_logs: PathBuf,
    /// The kubelet.
    pub kubelet: Proc,
    /// The node agent.
    pub agent: Proc,
    containerd: Proc,
    sysctls: Vec<(&'static str, String)>,
    bins: KubeBins,
    dir: PathBuf,
    /// The agent's `--kubelet-dir`, when it is not the kubelet's device-plugin directory.
    misplaced: Option<PathBuf>,
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
        allocators: &gpuledger_testkit::Allocators,
        name: &str,
        (gpus, gpu_mem_mib): (u32, u64),
        misplaced: bool,
        dra: bool,
        allocate_wait: Option<Duration>,
        agent_flags: &[String],
    ) -> Result<RealNode> {
        if !nix::unistd::Uid::effective().is_root() {
            bail!("the real node needs root (containerd, runc and the kubelet)");
        }
        let dir = dir.join(format!("node-{name}"));
        std::fs::create_dir_all(&dir)?;
        let sysctls = SYSCTLS
            .iter()
            .map(|p| Ok((*p, std::fs::read_to_string(p)?.trim().to_string())))
            .collect::<Result<Vec<_>>>()?;

        let nvml = FakeNvml::new(&dir, name, gpus, gpu_mem_mib)?;
        let containerd_sock = dir.join("containerd/containerd.sock");
        let config = containerd_config(&dir, &nvml)?;
        let containerd = Proc::spawn(
            &dir,
            "containerd",
            &bins.path("containerd"),
            vec![format!("--config={}", config.display())],
            // Its runc shim is the one built beside it; runc is the machine's.
            vec![("PATH".into(), path_with(bins.dir()))],
        )?;
        wait_for(&containerd_sock, Duration::from_secs(30))
            .await
            .with_context(|| format!("containerd did not start:\n{}", containerd.log_tail(20)))?;
        crate::images::prepare(&dir, &bins.path("ctr"), &containerd_sock)?;

        // A kubelet of an earlier run may have left its registration socket and checkpoint here.
        clean_device_plugin_dir()?;
        let root = dir.join("kubelet");
        for d in ["plugins_registry", "plugins"] {
            std::fs::create_dir_all(root.join(d))?;
        }
        let pod_resources_socket = root.join("pod-resources/kubelet.sock");
        let agent_http = format!("127.0.0.1:{}", free_port()?);
        let agent_kc = pki.kubeconfig(server, &Identity::ServiceAccount(NODE_AGENT_SA.into()))?;
        // A DaemonSet whose hostPath is not the kubelet's device-plugin directory: the agent
        // reaches the kubelet's registration socket (here through a link), but the kubelet
        // looks for the agent's socket in its own directory and cannot dial it.
        let misplaced = if misplaced {
            let d = dir.join("device-plugins-elsewhere");
            std::fs::create_dir_all(&d)?;
            std::os::unix::fs::symlink(
                Path::new(DEVICE_PLUGIN_DIR).join("kubelet.sock"),
                d.join("kubelet.sock"),
            )?;
            Some(d)
        } else {
            None
        };
        let kubelet_dir = misplaced
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEVICE_PLUGIN_DIR));
        let agent = Proc::spawn(
            &dir,
            "node-agent",
            &bin_path("gpuledger-node-agent")?,
            vec![
                format!("--node-name={name}"),
                format!("--allocator={}", allocators.addrs.join(",")),
                format!("--nvml-lib={}", fake_nvml_lib()?.display()),
                format!("--kubelet-dir={}", kubelet_dir.display()),
                format!("--pod-resources-socket={}", pod_resources_socket.display()),
                format!("--health-listen={agent_http}"),
                format!("--kubeconfig={}", agent_kc.display()),
                // As the shipped DaemonSet names the GPUs: CDI devices, in the CRI field and
                // in annotations.
                "--device-list-strategy=cdi-annotations".into(),
                "--device-list-strategy=cdi-cri".into(),
            ]
            .into_iter()
            // A kubelet DRA plugin: its sockets under the kubelet's --root-dir, the claims'
            // CDI specs where containerd reads the node's.
            .chain(
                dra.then(|| {
                    [
                        "--mode=dra".to_string(),
                        format!(
                            "--dra-registry-dir={}",
                            root.join("plugins_registry").display()
                        ),
                        format!("--dra-plugin-dir={}", root.join("plugins").display()),
                        format!("--cdi-spec-dir={}", dir.join("cdi").display()),
                    ]
                })
                .into_iter()
                .flatten(),
            )
            .chain(agent_flags.iter().cloned())
            .chain(
                allocators
                    .ids
                    .flags(&gpuledger_auth::identity::Role::NodeAgent {
                        node: name.to_string(),
                    })?,
            )
            .collect(),
            [
                ("FAKE_NVML_CONFIG".into(), nvml.path().display().to_string()),
                // GPULEDGER_AGENT_LOG overrides the level (e.g. `info,h2=debug`).
                (
                    "GPULEDGER_LOG".into(),
                    std::env::var("GPULEDGER_AGENT_LOG").unwrap_or_else(|_| "info".into()),
                ),
            ]
            .into_iter()
            .chain(allocate_wait.map(|w| {
                (
                    "GPULEDGER_ALLOCATE_WAIT".to_string(),
                    format!("{}s", w.as_secs().max(1)),
                )
            }))
            .collect(),
        )?;

        let kc = pki.kubeconfig(server, &Identity::Node(name.to_string()))?;
        let pod_logs = dir.join("pod-logs");
        let kubelet_config = kubelet_config(&dir, &root, &pod_logs, &containerd_sock)?;
        let mut args = vec![
            format!("--config={}", kubelet_config.display()),
            format!("--kubeconfig={}", kc.display()),
            format!("--root-dir={}", root.display()),
            format!("--cert-dir={}", root.join("pki").display()),
            format!("--hostname-override={name}"),
            "--v=2".into(),
        ];
        args.extend(bins.feature_gate_flags()?);
        let kubelet = Proc::spawn(&dir, "kubelet", &bins.path("kubelet"), args, vec![])?;
        let node = RealNode {
            name: name.to_string(),
            nvml,
            agent_http,
            pod_resources_socket,
            containerd_sock,
            pod_logs,
            kubelet,
            agent,
            containerd,
            sysctls,
            bins: bins.clone(),
            dir,
            misplaced,
        };
        node.wait_ready(client, Duration::from_secs(90)).await?;
        Ok(node)
    }

    /// Import an image archive ([`crate::images::build_with`]) into this node's containerd.
    pub fn import_image(&self, archive: &Path) -> Result<()> {
        crate::images::import(&self.bins.path("ctr"), &self.containerd_sock, archive)
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

    /// Wait until the node advertises `slots` of `gpuledger.io/gpu` and the agent is ready.
    pub async fn wait_advertised(
        &self,
        client: &kube::Client,
        slots: i64,
        timeout: Duration,
    ) -> Result<()> {
        let nodes: Api<Node> = Api::all(client.clone());
        gpuledger_testkit::eventually(
            &format!(
                "node {} advertises {slots} GPU slots and its agent is ready",
                self.name
            ),
            timeout,
            || async {
                let n = nodes.get(&self.name).await?;
                Ok(allocatable_gpu(&n) == slots && self.agent_readyz().await?.0 == 200)
            },
        )
        .await
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

    /// What a container printed: the file the kubelet keeps under `podLogsDir`
    /// (`<ns>_<pod>_<uid>/<container>/0.log`, CRI format: time, stream, tag, text), as
    /// `kubectl logs` serves it.
    pub fn container_log(&self, ns: &str, pod: &str, uid: &str, container: &str) -> Result<String> {
        cri_log_text(
            &self
                .pod_logs
                .join(format!("{ns}_{pod}_{uid}/{container}/0.log")),
        )
    }

    /// What each attempt of a container printed, by attempt number (the kubelet's `N.log`
    /// beside `0.log`, one per container it created for that name): an attempt the runtime
    /// created but never started has no file or an empty one.
    pub fn container_attempts(
        &self,
        ns: &str,
        pod: &str,
        uid: &str,
        container: &str,
    ) -> Result<Vec<(u32, String)>> {
        let dir = self.pod_logs.join(format!("{ns}_{pod}_{uid}/{container}"));
        let mut out = Vec::new();
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
        };
        for entry in entries {
            let name = entry?.file_name().to_string_lossy().into_owned();
            let Some(n) = name
                .strip_suffix(".log")
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            out.push((n, cri_log_text(&dir.join(&name))?));
        }
        out.sort_by_key(|(n, _)| *n);
        Ok(out)
    }

    /// A client of this kubelet's own HTTPS server (`/metrics`, `/pods`, …) as the admin of
    /// `admin_kubeconfig`: its bearer token, which the kubelet has the API server review
    /// (webhook authentication and authorization), over TLS verified against the self-signed
    /// serving certificate the kubelet wrote into its `--cert-dir` for the node's name. The
    /// port is the one the Node object reports. (The API server's node proxy cannot stand in:
    /// it has no kubelet client certificate here, and the Node's address is not loopback.)
    pub async fn kubelet_client(
        &self,
        client: &kube::Client,
        admin_kubeconfig: &Path,
    ) -> Result<kube::Client> {
        let node = Api::<Node>::all(client.clone()).get(&self.name).await?;
        let port = node
            .status
            .and_then(|s| s.daemon_endpoints)
            .and_then(|d| d.kubelet_endpoint)
            .map(|e| e.port)
            .filter(|p| *p > 0)
            .context("the Node reports no kubelet port")?;
        let kc = kube::config::Kubeconfig::read_from(admin_kubeconfig)?;
        let mut cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
        cfg.cluster_url = format!("https://127.0.0.1:{port}").parse()?;
        cfg.root_cert_file = Some(self.dir.join("kubelet/pki/kubelet.crt"));
        cfg.tls_server_name = Some(self.name.clone());
        Ok(kube::Client::try_from(cfg)?)
    }

    /// The kubelet's `/metrics` text, through a [`RealNode::kubelet_client`].
    pub async fn kubelet_metrics(kubelet: &kube::Client) -> Result<String> {
        let req = http::Request::get("/metrics").body(Vec::new())?;
        kubelet
            .request_text(req)
            .await
            .context("reading the kubelet's /metrics")
    }

    /// Make a misplaced agent's socket reachable where the kubelet dials it (a link in the
    /// kubelet's device-plugin directory), as an operator fixing the DaemonSet's hostPath
    /// would; the agent's next registration succeeds.
    pub fn expose_plugin_socket(&self) -> Result<()> {
        let from = self
            .misplaced
            .as_ref()
            .context("the agent's socket is in the kubelet's directory already")?;
        let name = "gpuledger.sock";
        std::os::unix::fs::symlink(from.join(name), Path::new(DEVICE_PLUGIN_DIR).join(name))
            .context("linking the agent's socket into the kubelet's device-plugin directory")
    }

    /// The CDI device of the fake GPU `uuid`: (the container's device node, its index).
    pub fn cdi_device_node(&self, uuid: &str) -> Option<String> {
        self.nvml
            .gpus
            .iter()
            .position(|g| g.uuid == uuid)
            .map(|i| format!("/dev/nvidia{i}"))
    }
}

/// The pod on this node's host network (this node makes no pod network; see
/// `containerd_config`).
pub fn host_network(mut pod: serde_json::Value) -> serde_json::Value {
    pod["spec"]["hostNetwork"] = serde_json::Value::Bool(true);
    pod
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
        let ctr_bin = self.bins.path("ctr");
        let ctr = |args: &[&str]| {
            std::process::Command::new(&ctr_bin)
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
        // A sandbox's shim exits when containerd tells it to, which a containerd that is gone
        // never does: end what is left of this node's shims (their tasks are gone already).
        kill_shims_of(&sock);
        // The kubelet bind-mounts its root directory and containerd mounts a shm per sandbox;
        // neither unmounts them on exit, and the run directory could not be removed.
        unmount_under(&self.dir);
        for (p, v) in &self.sysctls {
            let _ = std::fs::write(p, v);
        }
        let _ = clean_device_plugin_dir();
    }
}

/// SIGKILL every `containerd-shim` process serving containerd at socket `sock`.
fn kill_shims_of(sock: &str) {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return;
    };
    for p in procs.flatten() {
        let Ok(pid) = p.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(p.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let shim = args
            .first()
            .is_some_and(|a| a.ends_with(b"containerd-shim-runc-v2"));
        let ours = args
            .windows(2)
            .any(|w| w[0] == b"-address" && w[1] == sock.as_bytes());
        if shim && ours {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
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

/// `PATH` with `dir` first.
fn path_with(dir: &Path) -> String {
    format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

/// The kubelet's configuration file: the machine's cgroup v1 (which kubelets from 1.35 refuse
/// unless told), cgroupfs without QoS cgroups, this run's containerd and directories, the
/// kubelet's API on loopback with webhook authentication and authorization as clusters run
/// it, and nothing evicted or garbage-collected for the disk the machine's other tenants use.
/// The text of a kubelet container log (CRI format: time, stream, tag, text per line).
fn cri_log_text(p: &Path) -> Result<String> {
    let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
    Ok(text
        .lines()
        .filter_map(|l| l.splitn(4, ' ').nth(3))
        .map(|l| format!("{l}\n"))
        .collect())
}

fn kubelet_config(dir: &Path, root: &Path, pod_logs: &Path, containerd: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(pod_logs)?;
    let config = json!({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": false,
        "cgroupDriver": "cgroupfs",
        "cgroupsPerQOS": false,
        "enforceNodeAllocatable": [],
        "failSwapOn": false,
        "containerRuntimeEndpoint": format!("unix://{}", containerd.display()),
        "address": "127.0.0.1",
        "port": free_port()?,
        "healthzPort": 0,
        "readOnlyPort": 0,
        "podLogsDir": pod_logs,
        "volumePluginDir": root.join("volume-plugins"),
        "authentication": {"anonymous": {"enabled": false}, "webhook": {"enabled": true}},
        "authorization": {"mode": "Webhook"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1Mi", "imagefs.available": "1Mi"},
    });
    let p = dir.join("kubelet-config.json");
    std::fs::write(&p, serde_json::to_string_pretty(&config)?)?;
    Ok(p)
}

/// The CDI spec of the node's fake GPUs, as `nvidia-ctk cdi generate` writes NVIDIA's: one
/// device per GPU, named by its UUID, with a device node and a variable that say which GPU a
/// container got. (The fake GPU's node is `/dev/null`'s, which every container may open.)
fn cdi_spec(nvml: &FakeNvml) -> serde_json::Value {
    let devices: Vec<serde_json::Value> = nvml
        .gpus
        .iter()
        .enumerate()
        .map(|(i, g)| {
            json!({
                "name": g.uuid,
                "containerEdits": {
                    "env": [format!("{CDI_ENV}={}", g.uuid)],
                    "deviceNodes": [{"path": format!("/dev/nvidia{i}"), "hostPath": "/dev/null"}],
                },
            })
        })
        .collect();
    json!({"cdiVersion": "0.6.0", "kind": CDI_KIND, "devices": devices})
}

/// containerd's configuration (version 3, containerd 2): everything under `dir`, the local
/// pause image, runc, CDI from this node's spec directory, no NRI socket, and a loopback-only
/// CNI network: enough for the runtime (and so the node) to be network-ready, while the
/// tests' pods use the host's network and no interface is made on the machine.
fn containerd_config(dir: &Path, nvml: &FakeNvml) -> Result<PathBuf> {
    let base = dir.join("containerd");
    let netd = dir.join("cni");
    let cdi = dir.join("cdi");
    for d in [&base, &netd, &cdi] {
        std::fs::create_dir_all(d)?;
    }
    std::fs::write(
        netd.join("10-e2e.conflist"),
        r#"{"cniVersion": "0.4.0", "name": "e2e-loopback", "plugins": [{"type": "loopback"}]}"#,
    )?;
    std::fs::write(
        cdi.join("nvidia.json"),
        serde_json::to_string_pretty(&cdi_spec(nvml))?,
    )?;
    let toml = format!(
        r#"version = 3
root = "{b}/root"
state = "{b}/state"
[grpc]
  address = "{b}/containerd.sock"
[ttrpc]
  address = "{b}/containerd.sock.ttrpc"
[plugins.'io.containerd.internal.v1.opt']
  path = "{b}/opt"
[plugins.'io.containerd.nri.v1.nri']
  disable = true
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{pause}"
[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = true
  cdi_spec_dirs = ["{cdi}"]
  # The kubelet asks for negative OOM scores that this machine does not let root set
  # (no CAP_SYS_RESOURCE): clamp them to containerd's own instead of failing the sandbox.
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "{netd}"
[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"#,
        b = base.display(),
        pause = crate::images::PAUSE_IMAGE,
        netd = netd.display(),
        cdi = cdi.display(),
    );
    let p = base.join("config.toml");
    std::fs::write(&p, toml)?;
    Ok(p)
}
