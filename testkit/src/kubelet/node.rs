//! A GPU node for tests: the fake NVML state file and a `gpuledger-node-agent` process wired
//! to an emulated kubelet.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::json;

use crate::bins::bin_path;
use crate::process::Proc;

/// One fake GPU.
#[derive(Debug, Clone)]
pub struct FakeGpu {
    /// UUID.
    pub uuid: String,
    /// Model name.
    pub name: String,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// CUDA compute capability (major, minor); None: NVML answers NOT_SUPPORTED.
    pub compute_capability: Option<(u32, u32)>,
}

/// The state the fake NVML library reports (`FAKE_NVML_CONFIG`), rewritten atomically.
#[derive(Debug, Clone)]
pub struct FakeNvml {
    path: PathBuf,
    /// GPUs in index order.
    pub gpus: Vec<FakeGpu>,
    /// `(pid, used MiB, GPU UUID)`.
    pub processes: Vec<(u32, u64, String)>,
    /// `(GPU UUID, Xid)` in order of occurrence.
    pub xids: Vec<(String, u64)>,
    /// UUIDs of the GPUs fallen off the bus (NVML answers `GPU_IS_LOST` for them).
    pub lost: std::collections::BTreeSet<String>,
}

impl FakeNvml {
    /// `n` GPUs `GPU-<node>-<i>` of `memory_mib`, state file in `dir`.
    pub fn new(dir: &Path, node: &str, n: u32, memory_mib: u64) -> Result<FakeNvml> {
        let f = FakeNvml {
            path: dir.join(format!("fake-nvml-{node}.json")),
            gpus: (0..n)
                .map(|i| FakeGpu {
                    uuid: format!("GPU-{node}-{i}"),
                    name: "NVIDIA A100-SXM4-40GB".into(),
                    memory_mib,
                    compute_capability: Some((8, 0)),
                })
                .collect(),
            processes: Vec::new(),
            xids: Vec::new(),
            lost: Default::default(),
        };
        f.write()?;
        Ok(f)
    }

    /// The state file path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Write the state (temp file + rename).
    pub fn write(&self) -> Result<()> {
        let v = json!({
            "gpus": self.gpus.iter().map(|g| json!({"uuid": g.uuid, "name": g.name, "memory_mib": g.memory_mib, "compute_capability": g.compute_capability, "lost": self.lost.contains(&g.uuid)})).collect::<Vec<_>>(),
            "processes": self.processes.iter().map(|(pid, used, gpu)| json!({"pid": pid, "used_mib": used, "gpu": gpu})).collect::<Vec<_>>(),
            "xids": self.xids.iter().map(|(gpu, xid)| json!({"gpu": gpu, "xid": xid})).collect::<Vec<_>>(),
        });
        let tmp = self.path.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(&v)?)?;
        std::fs::rename(&tmp, &self.path)?;
        Ok(())
    }

    /// Report `pid` using `used_mib` on `gpu`, and write.
    pub fn set_process(&mut self, pid: u32, used_mib: u64, gpu: &str) -> Result<()> {
        self.processes.retain(|p| p.0 != pid);
        self.processes.push((pid, used_mib, gpu.to_string()));
        self.write()
    }

    /// Make `gpu` fall off the bus (`lost`) or answer again, and write.
    pub fn set_lost(&mut self, gpu: &str, lost: bool) -> Result<()> {
        if lost {
            self.lost.insert(gpu.to_string());
        } else {
            self.lost.remove(gpu);
        }
        self.write()
    }

    /// Inject an Xid on `gpu`, and write.
    pub fn add_xid(&mut self, gpu: &str, xid: u64) -> Result<()> {
        self.xids.push((gpu.to_string(), xid));
        self.write()
    }
}

/// Path of the fake NVML library built in this workspace.
pub fn fake_nvml_lib() -> Result<PathBuf> {
    bin_path("libnvidia_ml.so").context(
        "the fake NVML library is built by `cargo build -p gpuledger-fake-nvml` (or --workspace)",
    )
}

/// A stand-in `nvidia-cuda-mps-control` (and an `nvidia-cuda-mps-server` beside it) in `dir`;
/// the path to pass as `--mps-control`. With `-d` it starts a daemon that writes its PID where
/// the real one does; without arguments it is the control shell: it refuses when no daemon
/// runs, records each command in `$CUDA_MPS_LOG_DIRECTORY/control.log`, answers
/// `get_server_list` from `$CUDA_MPS_PIPE_DIRECTORY/servers` (PIDs of pretend servers a test
/// writes), and `quit` stops the daemon.
pub fn mps_stand_in(dir: &Path) -> Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    let control = dir.join("nvidia-cuda-mps-control");
    for (p, body) in [
        (control.clone(), include_str!("mps-control-stand-in.sh")),
        (dir.join("nvidia-cuda-mps-server"), "#!/bin/sh\nexit 0\n"),
    ] {
        std::fs::write(&p, body)?;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(control)
}

/// SIGKILL every stand-in MPS daemon under `mps_dir` (the agent's `--mps-dir`): they outlive
/// the agent, as real ones do. Best effort.
pub fn kill_mps_stand_ins(mps_dir: &Path) {
    let Ok(entries) = std::fs::read_dir(mps_dir) else {
        return;
    };
    for e in entries.flatten() {
        let pid = std::fs::read_to_string(e.path().join("pipe/nvidia-cuda-mps-control.pid"))
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok());
        if let Some(pid) = pid {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// Kills the stand-in MPS daemons under its `--mps-dir` when dropped (a test or bench that
/// ends, passed, failed or not).
pub struct MpsReaper(pub PathBuf);

impl Drop for MpsReaper {
    fn drop(&mut self) {
        kill_mps_stand_ins(&self.0);
    }
}

/// A node agent process.
pub struct NodeAgent {
    /// The process.
    pub proc: Proc,
}

impl NodeAgent {
    /// Start `gpuledger-node-agent` for `node` with logs in `dir`, NVML from the fake library
    /// reading `nvml`'s state, the kubelet emulator's sockets, and `extra` flags.
    pub fn start(
        dir: &Path,
        node: &str,
        allocators: &[String],
        nvml: &FakeNvml,
        kubelet: &super::Kubelet,
        extra: &[&str],
    ) -> Result<NodeAgent> {
        let bin = bin_path("gpuledger-node-agent")?;
        let mut args = vec![
            format!("--node-name={node}"),
            format!("--allocator={}", allocators.join(",")),
            format!("--nvml-lib={}", fake_nvml_lib()?.display()),
            format!("--kubelet-dir={}", kubelet.device_plugin_dir().display()),
            format!(
                "--pod-resources-socket={}",
                kubelet.pod_resources_socket().display()
            ),
        ];
        args.extend(extra.iter().map(|s| (*s).to_string()));
        let proc = Proc::spawn(
            dir,
            &format!("agent-{node}"),
            &bin,
            args,
            vec![
                ("FAKE_NVML_CONFIG".into(), nvml.path().display().to_string()),
                ("GPULEDGER_LOG".into(), "info".into()),
            ],
        )?;
        Ok(NodeAgent { proc })
    }

    /// SIGKILL and start again with the same command line.
    pub fn restart(&mut self) -> Result<()> {
        self.proc.kill();
        std::thread::sleep(Duration::from_millis(50));
        self.proc.start()
    }
}
