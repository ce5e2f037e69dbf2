//! The shell around `nvidia-cuda-mps-control`: one daemon per GPU started with `-d`
//! (`CUDA_VISIBLE_DEVICES=<UUID>`, its own pipe and log directories under `--mps-dir`), found
//! alive or dead through the PID it wrote, told its limits on its interactive shell (the same
//! program, commands on stdin), and asked to `quit`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tracing::{info, warn};

use super::{Limit, commands, server_pids, wanted};
use crate::agent::Agent;

/// The file the control daemon writes its PID to, in its pipe directory (MPS documentation).
const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// How long a daemon may take to write its PID, and a command to be answered.
const ANSWER_WAIT: Duration = Duration::from_secs(5);

/// Why a daemon could not be started or told something. Retried on the next round.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A directory or file of the daemon could not be made or read.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What it was.
        what: &'static str,
        /// Where.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// `nvidia-cuda-mps-control` did not do what it was asked.
    #[error("nvidia-cuda-mps-control for {gpu}: {why}")]
    Control {
        /// The GPU of the daemon.
        gpu: String,
        /// What went wrong.
        why: String,
    },
}

/// The node's MPS daemons: the control program and the directory holding one directory per
/// GPU (`<UUID>/pipe`, mounted into its containers; `<UUID>/log`; `<UUID>/daemon.pid`, the
/// agent's own note of the daemon it runs, outside what containers can write).
#[derive(Debug, Clone)]
pub struct Daemons {
    /// `nvidia-cuda-mps-control`.
    pub control: PathBuf,
    /// `--mps-dir`.
    pub dir: PathBuf,
}

impl Daemons {
    /// GPU `uuid`'s pipe directory: the one thing its containers get.
    pub fn pipe_dir(&self, uuid: &str) -> PathBuf {
        super::pipe_dir(&self.dir, uuid)
    }

    /// GPU `uuid`'s log directory (the daemon's `control.log`, its servers' `server.log`).
    pub fn log_dir(&self, uuid: &str) -> PathBuf {
        self.dir.join(uuid).join("log")
    }

    fn note(&self, uuid: &str) -> PathBuf {
        self.dir.join(uuid).join("daemon.pid")
    }

    /// The PID of GPU `uuid`'s daemon if it runs: the process the agent noted is alive and
    /// is the control program (a reused PID is not).
    pub fn running(&self, uuid: &str) -> Option<u32> {
        let pid: u32 = std::fs::read_to_string(self.note(uuid))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        is_control(pid).then_some(pid)
    }

    fn command(&self, uuid: &str) -> tokio::process::Command {
        let mut c = tokio::process::Command::new(&self.control);
        c.env("CUDA_VISIBLE_DEVICES", uuid)
            .env("CUDA_MPS_PIPE_DIRECTORY", self.pipe_dir(uuid))
            .env("CUDA_MPS_LOG_DIRECTORY", self.log_dir(uuid))
            .kill_on_drop(true);
        c
    }

    fn control_error(uuid: &str, why: impl Into<String>) -> Error {
        Error::Control {
            gpu: uuid.to_string(),
            why: why.into(),
        }
    }

    /// The output of a run of the control program (`what` it was asked), once it exited
    /// successfully within [`ANSWER_WAIT`].
    async fn answered(
        uuid: &str,
        what: &str,
        run: impl std::future::Future<Output = std::io::Result<std::process::Output>>,
    ) -> Result<std::process::Output, Error> {
        let out = tokio::time::timeout(ANSWER_WAIT, run)
            .await
            .map_err(|_| Self::control_error(uuid, format!("no answer to {what}")))?
            .map_err(|e| Self::control_error(uuid, format!("running {what}: {e}")))?;
        if !out.status.success() {
            return Err(Self::control_error(
                uuid,
                format!(
                    "{what} failed ({}): {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            ));
        }
        Ok(out)
    }

    /// Start GPU `uuid`'s daemon (`-d`) and note its PID.
    pub async fn start(&self, uuid: &str) -> Result<u32, Error> {
        use std::os::unix::fs::PermissionsExt;
        let (pipe, log) = (self.pipe_dir(uuid), self.log_dir(uuid));
        for d in [&pipe, &log] {
            std::fs::create_dir_all(d).map_err(|source| Error::Io {
                what: "creating",
                path: d.clone(),
                source,
            })?;
        }
        // Containers of any user connect through the pipes.
        std::fs::set_permissions(&pipe, std::fs::Permissions::from_mode(0o755)).map_err(
            |source| Error::Io {
                what: "opening up",
                path: pipe.clone(),
                source,
            },
        )?;
        let pid_file = pipe.join(PID_FILE);
        let _ = std::fs::remove_file(&pid_file);
        let out = self.command(uuid).arg("-d").output();
        Self::answered(uuid, "-d", out).await?;
        let deadline = tokio::time::Instant::now() + ANSWER_WAIT;
        let pid = loop {
            let pid = std::fs::read_to_string(&pid_file)
                .ok()
                .and_then(|s| s.trim().parse::<u32>().ok())
                .filter(|p| is_control(*p));
            if let Some(p) = pid {
                break p;
            }
            if tokio::time::Instant::now() > deadline {
                return Err(Self::control_error(
                    uuid,
                    format!("no live daemon wrote {}", pid_file.display()),
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let note = self.note(uuid);
        crate::dra::cdi::write_atomic(&note, pid.to_string().as_bytes()).map_err(|source| {
            Error::Io {
                what: "writing",
                path: note,
                source,
            }
        })?;
        Ok(pid)
    }

    /// Send `cmds` (one per line) to GPU `uuid`'s daemon; its answer.
    pub async fn send(&self, uuid: &str, cmds: &[String]) -> Result<String, Error> {
        let mut child = self
            .command(uuid)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| Self::control_error(uuid, format!("running: {e}")))?;
        let mut input = cmds.join("\n");
        input.push('\n');
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(input.as_bytes())
                .await
                .map_err(|e| Self::control_error(uuid, format!("writing commands: {e}")))?;
        }
        let out = Self::answered(uuid, &format!("{cmds:?}"), child.wait_with_output()).await?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Hold GPU `uuid`'s clients to `limit`: the default for its next servers and the limit
    /// of every running one.
    pub async fn set(&self, uuid: &str, limit: Limit) -> Result<(), Error> {
        let servers = server_pids(&self.send(uuid, &["get_server_list".into()]).await?);
        self.send(uuid, &commands(limit, &servers)).await?;
        Ok(())
    }

    /// Stop GPU `uuid`'s daemon (`quit`) and remove its directory.
    pub async fn quit(&self, uuid: &str) -> Result<(), Error> {
        if self.running(uuid).is_some() {
            self.send(uuid, &["quit".into()]).await?;
            let deadline = tokio::time::Instant::now() + ANSWER_WAIT;
            while self.running(uuid).is_some() {
                if tokio::time::Instant::now() > deadline {
                    return Err(Self::control_error(uuid, "still running after quit"));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let d = self.dir.join(uuid);
        match std::fs::remove_dir_all(&d) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::Io {
                what: "removing",
                path: d,
                source: e,
            }),
            _ => Ok(()),
        }
    }
}

/// Whether `pid` is a live (not zombie) `nvidia-cuda-mps-control`.
fn is_control(pid: u32) -> bool {
    let proc_dir = Path::new("/proc").join(pid.to_string());
    let named = std::fs::read(proc_dir.join("cmdline")).is_ok_and(|c| {
        c.split(|b| *b == 0)
            .take(2)
            .any(|arg| arg.ends_with(b"nvidia-cuda-mps-control"))
    });
    // /proc/<pid>/stat: `pid (comm) S ...`; the state follows the last ')'.
    let alive = std::fs::read_to_string(proc_dir.join("stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    });
    named && alive
}

/// The GPUs of the agent, by UUID.
fn gpu_uuids(agent: &Agent) -> Vec<String> {
    agent
        .gpus
        .borrow()
        .iter()
        .map(|g| g.info.uuid.clone())
        .collect()
}

/// Keep a daemon running on every GPU (one found dead is started again and told its limits)
/// and each daemon's limits equal to the ledger's shares on its GPU, checked on every change
/// of the view and every --enforce-interval.
pub async fn supervise(agent: Arc<Agent>, d: Arc<Daemons>) {
    let mut applied: HashMap<String, Limit> = HashMap::new();
    let mut seen: HashMap<String, u32> = HashMap::new();
    let mut changes = agent.view_changes();
    loop {
        changes.mark_unchanged();
        let gpus = gpu_uuids(&agent);
        let want = agent.with_view(|v| wanted(v, &gpus));
        for uuid in &gpus {
            let pid = match d.running(uuid) {
                Some(pid) => pid,
                None => {
                    if seen.remove(uuid).is_some() {
                        warn!(gpu = %uuid, "the MPS control daemon died; starting it again");
                        agent
                            .metrics
                            .mps_restarts
                            .get_or_create(&vec![("gpu", uuid.clone())])
                            .inc();
                    }
                    // A GPU found since the start, or reset by someone, is set again first.
                    let nvml = agent.nvml.clone();
                    let u = uuid.clone();
                    let mode =
                        tokio::task::spawn_blocking(move || nvml.set_exclusive_process(&u, true))
                            .await;
                    if let Ok(Err(e)) = mode {
                        warn!(gpu = %uuid, "no MPS daemon: EXCLUSIVE_PROCESS compute mode: {e}");
                        continue;
                    }
                    match d.start(uuid).await {
                        Ok(pid) => {
                            info!(gpu = %uuid, pid, "MPS control daemon started");
                            pid
                        }
                        Err(e) => {
                            warn!(gpu = %uuid, "starting the MPS control daemon: {e}");
                            continue;
                        }
                    }
                }
            };
            if seen.insert(uuid.clone(), pid) != Some(pid) {
                // A daemon new to this agent (started, or left by the agent before) has
                // limits this agent did not set.
                applied.remove(uuid);
            }
            let Some(limit) = want.get(uuid).copied() else {
                continue;
            };
            if !agent.synced() || applied.get(uuid) == Some(&limit) {
                continue;
            }
            match d.set(uuid, limit).await {
                Ok(()) => {
                    info!(gpu = %uuid, mem_mib = limit.mem_mib, thread_pct = limit.thread_pct,
                        "MPS daemon holds its clients to the GPU's largest share");
                    agent
                        .metrics
                        .isolation_limit
                        .get_or_create(&vec![("mode", "mps".into()), ("target", uuid.clone())])
                        .set(i64::try_from(limit.mem_mib << 20).unwrap_or(i64::MAX));
                    applied.insert(uuid.clone(), limit);
                }
                Err(e) => warn!(gpu = %uuid, "setting the MPS limits: {e}"),
            }
        }
        tokio::select! {
            _ = changes.changed() => {}
            _ = tokio::time::sleep(agent.cfg.enforce_interval) => {}
        }
    }
}

/// At exit: quit the daemon of every GPU no allocation is on, remove its directory and put
/// the GPU back in DEFAULT compute mode. A daemon with allocations on its GPU stays for its
/// clients (their containers keep running) and the next agent adopts it.
pub async fn stop(agent: &Agent, d: &Daemons) {
    let gpus = gpu_uuids(agent);
    let want = agent.with_view(|v| wanted(v, &gpus));
    for uuid in &gpus {
        if !agent.synced() || want.contains_key(uuid) {
            info!(gpu = %uuid, "leaving the MPS control daemon to its clients");
            continue;
        }
        if let Err(e) = d.quit(uuid).await {
            warn!(gpu = %uuid, "stopping the MPS control daemon: {e}");
            continue;
        }
        match agent.nvml.set_exclusive_process(uuid, false) {
            Ok(()) => {
                info!(gpu = %uuid, "MPS control daemon stopped, GPU back in DEFAULT compute mode")
            }
            Err(e) => warn!(gpu = %uuid, "putting the GPU back in DEFAULT compute mode: {e}"),
        }
    }
}
