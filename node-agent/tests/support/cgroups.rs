//! Real cgroups shaped like a kubelet's, for the enforcement tests: processes are put in
//! `…/kubepods…pod<uid>…` cgroups of the machine's cgroup v2 hierarchy, so the agent reads
//! their pods from `/proc/<pid>/cgroup` exactly as on a node. Everything lives under one
//! directory per test, removed (its processes killed) when the value drops. Needs root and a
//! writable cgroup v2 hierarchy, as on a VM or in a privileged container.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// How the kubelet names pod cgroups.
#[derive(Debug, Clone, Copy)]
pub enum Driver {
    /// `kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid_>.slice/cri-containerd-<id>.scope`.
    Systemd,
    /// `kubepods/<qos>/pod<uid>/<id>`.
    Cgroupfs,
}

/// A per-test tree in the cgroup v2 hierarchy.
pub struct TestCgroups {
    root: PathBuf,
}

/// Where the cgroup v2 hierarchy is mounted, from /proc/self/mountinfo.
fn cgroup2_mount() -> Result<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    info.lines()
        .find_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let mount = left.split_whitespace().nth(4)?;
            (right.split_whitespace().next()? == "cgroup2").then(|| PathBuf::from(mount))
        })
        .context("no cgroup v2 hierarchy is mounted (these tests put processes in pod cgroups)")
}

impl TestCgroups {
    /// A fresh tree `gpuledger-test-<pid>-<n>` under the cgroup v2 mount.
    pub fn new() -> Result<TestCgroups> {
        static N: AtomicU32 = AtomicU32::new(0);
        let root = cgroup2_mount()?.join(format!(
            "gpuledger-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir(&root).with_context(|| {
            format!(
                "creating {}: the enforcement tests need root and a writable cgroup v2 hierarchy (a VM, or a privileged container)",
                root.display()
            )
        })?;
        Ok(TestCgroups { root })
    }

    /// The cgroup of container `id` of pod `uid` in QoS class `qos`, as `driver` names it.
    pub fn container(&self, driver: Driver, qos: &str, uid: &str, id: &str) -> Result<PathBuf> {
        let rel = match driver {
            Driver::Systemd => format!(
                "kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{}.slice/cri-containerd-{id}.scope",
                uid.replace('-', "_")
            ),
            Driver::Cgroupfs => format!("kubepods/{qos}/pod{uid}/{id}"),
        };
        let dir = self.root.join(rel);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(dir)
    }

    /// The cgroup `rel` of the test's tree, wherever it is (e.g. where the kubelet would
    /// never put a pod).
    pub fn other(&self, rel: &str) -> Result<PathBuf> {
        let dir = self.root.join(rel);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(dir)
    }

    /// A `sleep` in cgroup `dir`, with `GPULEDGER_ALLOCATION_ID` set when `claim` is given.
    /// Returns once it runs `sleep` inside the cgroup.
    pub fn spawn(&self, dir: &Path, claim: Option<u64>) -> Result<Sleeper> {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", r#"echo $$ > "$0/cgroup.procs" && exec sleep 60"#])
            .arg(dir);
        if let Some(id) = claim {
            cmd.env("GPULEDGER_ALLOCATION_ID", id.to_string());
        }
        let s = Sleeper(cmd.spawn()?);
        s.wait_running_in(dir)?;
        Ok(s)
    }
}

impl Drop for TestCgroups {
    fn drop(&mut self) {
        // Kill whatever is left in the tree, then remove it leaves first.
        let _ = std::fs::write(self.root.join("cgroup.kill"), "1");
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline
            && std::fs::read_to_string(self.root.join("cgroup.events"))
                .is_ok_and(|e| e.contains("populated 1"))
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        remove_tree(&self.root);
    }
}

fn remove_tree(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_tree(&e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}

/// A child `sleep`, killed and reaped when dropped.
pub struct Sleeper(Child);

impl Sleeper {
    /// A `sleep` in the test's own cgroup (in no pod).
    pub fn outside_pods(claim: Option<u64>) -> Result<Sleeper> {
        let mut cmd = Command::new("sleep");
        cmd.arg("60");
        if let Some(id) = claim {
            cmd.env("GPULEDGER_ALLOCATION_ID", id.to_string());
        }
        let s = Sleeper(cmd.spawn()?);
        s.wait_exec()?;
        Ok(s)
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.0.id()
    }

    /// Whether it still runs.
    pub fn alive(&mut self) -> bool {
        matches!(self.0.try_wait(), Ok(None))
    }

    /// Wait up to `timeout` for it to end.
    pub async fn ended(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(s)) = self.0.try_wait() {
                return Some(s);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }

    /// Wait until it runs `sleep` (its environment set up by exec).
    fn wait_exec(&self) -> Result<()> {
        let pid = self.pid();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            if comm.trim() == "sleep" && !env.is_empty() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        bail!("pid {pid} did not exec sleep within 5 s")
    }

    /// Wait until it runs `sleep` inside cgroup `dir`.
    fn wait_running_in(&self, dir: &Path) -> Result<()> {
        self.wait_exec()?;
        let procs = std::fs::read_to_string(dir.join("cgroup.procs"))?;
        if !procs.lines().any(|l| l == self.pid().to_string()) {
            bail!("pid {} is not in {}", self.pid(), dir.display());
        }
        Ok(())
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
