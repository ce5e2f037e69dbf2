//! Child processes with their logs in a run directory, and the signals faults are made of.

use std::fs::File;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// A free TCP port on 127.0.0.1 (bound once and released). The kernel may hand the same
/// ephemeral port out again right after it is released, so this process never returns a port
/// twice (seen: two etcd members given one peer port).
pub fn free_port() -> Result<u16> {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    for _ in 0..1000 {
        let l = TcpListener::bind("127.0.0.1:0").context("binding a free loopback port")?;
        let port = l.local_addr()?.port();
        if !given.contains(&port) {
            given.push(port);
            return Ok(port);
        }
    }
    anyhow::bail!("no loopback port not handed out before, after 1000 tries")
}

/// A new run directory under the temp dir: deleted when the returned guard drops, unless
/// `keep` (then the guard is `None` and the directory stays for its logs).
pub fn run_dir(prefix: &str, keep: bool) -> Result<(PathBuf, Option<tempfile::TempDir>)> {
    let tmp = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .context("creating a run directory")?;
    let dir = tmp.path().to_path_buf();
    if keep {
        let _ = tmp.keep();
        Ok((dir, None))
    } else {
        Ok((dir, Some(tmp)))
    }
}

/// A running child process whose stdout and stderr go to `<dir>/<name>.log`.
pub struct Proc {
    /// Name used for the log file and in messages.
    pub name: String,
    program: PathBuf,
    args: Vec<String>,
    envs: Vec<(String, String)>,
    log: PathBuf,
    child: Option<Child>,
}

impl Proc {
    /// Start `program args…` with its output appended to `<dir>/<name>.log`.
    pub fn spawn(
        dir: &Path,
        name: &str,
        program: &Path,
        args: Vec<String>,
        envs: Vec<(String, String)>,
    ) -> Result<Proc> {
        let mut p = Proc {
            name: name.to_string(),
            program: program.to_path_buf(),
            args,
            envs,
            log: dir.join(format!("{name}.log")),
            child: None,
        };
        p.start()?;
        Ok(p)
    }

    /// (Re)start the process with the same command line.
    pub fn start(&mut self) -> Result<()> {
        let out = File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("opening {}", self.log.display()))?;
        let err = out.try_clone()?;
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        for (k, v) in &self.envs {
            cmd.env(k, v);
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {} ({})", self.name, self.program.display()))?;
        self.child = Some(child);
        Ok(())
    }

    /// Process id, while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Path of the log file.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Send a signal (SIGSTOP, SIGCONT, SIGTERM…) without waiting.
    pub fn signal(&self, sig: Signal) -> Result<()> {
        let pid = self
            .pid()
            .with_context(|| format!("{} is not running", self.name))?;
        kill(Pid::from_raw(pid as i32), sig).with_context(|| format!("{sig} to {}", self.name))?;
        Ok(())
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Whether the process has exited (reaps it if so).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(Some(st))) => {
                self.child = None;
                Some(st)
            }
            _ => None,
        }
    }

    /// SIGTERM, then wait up to `grace` for the exit, then SIGKILL.
    pub fn terminate(&mut self, grace: std::time::Duration) {
        if self.signal(Signal::SIGTERM).is_ok() {
            let deadline = std::time::Instant::now() + grace;
            while std::time::Instant::now() < deadline {
                if self.exited().is_some() {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
        self.kill();
    }

    /// The last `n` lines of the log (for failure messages).
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            // A stopped process would not die of SIGKILL until continued on some kernels'
            // accounting; continue it first so nothing is left behind.
            let _ = kill(Pid::from_raw(c.id() as i32), Signal::SIGCONT);
        }
        self.kill();
    }
}
