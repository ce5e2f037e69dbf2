//! Every `gpuledger-bench` subcommand runs to its end with tiny sizes and prints its closing
//! `key=value` line. No figure is checked, only that the bench still runs: nothing else runs the
//! benches, and `failover` had stopped at its first step (its fake GPUs outgrew the inventory
//! ceilings) without anyone noticing.
//!
//! Not here: `e2e`, which needs the real Kubernetes binaries and root (`make test-e2e` builds
//! them; run it by hand, see docs/e2e.md).

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

/// Longest one smoke run may take; each takes 1–18 s on 2 busy cores.
const LIMIT: Duration = Duration::from_secs(90);

/// The bench's process group, killed whatever happens: a bench stopped half way leaves the etcd
/// members and allocators it started.
struct Group(Child);

impl Drop for Group {
    fn drop(&mut self) {
        let _ = killpg(Pid::from_raw(self.0.id() as i32), Signal::SIGKILL);
        let _ = self.0.wait();
    }
}

/// The last `n` lines of a file, for a failure message.
fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Run `gpuledger-bench <args>` and check that it exits 0 with a last line that starts with
/// `closing`.
fn smoke(args: &[&str], closing: &str) -> Result<()> {
    smoke_output(args, closing).map(drop)
}

/// [`smoke`], and what the bench printed.
fn smoke_output(args: &[&str], closing: &str) -> Result<String> {
    let dir = tempfile::tempdir()?;
    let (out, err) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let started = Instant::now();
    let child = Command::new(env!("CARGO_BIN_EXE_gpuledger-bench"))
        .args(args)
        .env_remove("GPULEDGER_KEEP_RUN")
        .env_remove("GPULEDGER_BENCH_AGENT_LOG")
        .stdin(Stdio::null())
        .stdout(File::create(&out)?)
        .stderr(File::create(&err)?)
        .process_group(0)
        .spawn()
        .context("starting gpuledger-bench")?;
    let mut group = Group(child);
    let status = loop {
        if let Some(status) = group.0.try_wait()? {
            break status;
        }
        if started.elapsed() > LIMIT {
            drop(group);
            bail!(
                "gpuledger-bench {} did not finish within {LIMIT:?}\n--- stdout tail:\n{}\n--- stderr tail:\n{}",
                args.join(" "),
                tail(&out, 20),
                tail(&err, 40)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    drop(group);
    let stdout = std::fs::read_to_string(&out)?;
    let last = stdout.lines().rev().find(|l| !l.trim().is_empty());
    if !status.success() || !last.is_some_and(|l| l.starts_with(closing)) {
        bail!(
            "gpuledger-bench {} exited with {status} and last line {last:?}, expected one \
             starting with {closing:?}\n--- stdout tail:\n{}\n--- stderr tail:\n{}",
            args.join(" "),
            tail(&out, 20),
            tail(&err, 40)
        );
    }
    eprintln!(
        "gpuledger-bench {}: {:.1} s",
        args[0],
        started.elapsed().as_secs_f64()
    );
    Ok(stdout)
}

#[test]
fn allocator() -> Result<()> {
    smoke(
        &[
            "allocator",
            "--clients=2",
            "--seconds=1",
            "--nodes=2",
            "--rss-nodes=0",
            "--ui-nodes=0",
        ],
        "reserve_per_s=",
    )
}

#[test]
fn failover() -> Result<()> {
    smoke(&["failover", "--trials=1"], "failover_ms p50=")
}

#[test]
fn replay() -> Result<()> {
    smoke(
        &[
            "replay",
            "--events=2000",
            "--nodes=4",
            "--live=100",
            "--snapshot-every=500",
        ],
        "fold_events_per_s=",
    )
}

#[test]
fn node_agent() -> Result<()> {
    // Each pod and its baseline keep a replica device; the default 64 per GPU leave room.
    smoke(
        &[
            "node-agent",
            "--pods=5",
            "--claims=5",
            "--gpus=1",
            "--idle-secs=1",
        ],
        "allocate_p50_ms=",
    )
}

#[test]
fn node_agent_in_every_mode_side_by_side() -> Result<()> {
    // The bench makes what each needs: MPS daemons (the tests' stand-in), a dmem cgroup tree.
    let out = smoke_output(
        &[
            "node-agent",
            "--pods=3",
            "--claims=3",
            "--gpus=1",
            "--idle-secs=1",
            "--isolation=all",
        ],
        "allocate_p50_ms=",
    )?;
    for mode in ["nvml", "hami-core", "mps", "dmem"] {
        let line = out.lines().find(|l| {
            l.starts_with("allocate_p50_ms=") && l.ends_with(&format!("isolation={mode}"))
        });
        assert!(
            line.is_some_and(
                |l| l.contains("allocate_p99_vs_nvml=") && l.contains("prepare_p99_ms=")
            ),
            "no closing line with both calls for {mode}:\n{out}"
        );
    }
    Ok(())
}

#[test]
fn extender() -> Result<()> {
    smoke(
        &[
            "extender",
            "--nodes=3",
            "--samples=5",
            "--pods=5",
            "--parallel=2",
            "--etcd-members=1",
            "--webhook-samples=4",
        ],
        "filter_p99_ms=",
    )
}

#[test]
fn scrape() -> Result<()> {
    smoke(
        &[
            "scrape",
            "--nodes=2",
            "--gpus=1",
            "--pods-per-gpu=1",
            "--scrapes=3",
            "--clients=2",
        ],
        "scrape_p50_ms=",
    )
}

#[test]
fn verify() -> Result<()> {
    smoke(
        &[
            "verify",
            "--events=2000",
            "--batch=16",
            "--nodes=4",
            "--live=100",
            "--snapshot-every=500",
            "--retain=500",
            "--runs=1",
        ],
        "verify_events=",
    )
}

#[test]
fn hostile() -> Result<()> {
    // One attack: each phase holds its attack 3 s and drains 2 s whatever the sizes, so all 18
    // would take minutes. The quiet and control phases always run.
    smoke(
        &[
            "hostile",
            "--seconds=1",
            "--concurrency=1",
            "--allocators=1",
            "--nodes=1",
            "--slow-connections=8",
            "--idle-connections=8",
            "--streams=8",
            "--only=idle-tcp",
        ],
        "attacks=1 ",
    )
}

/// Run `gpuledger-bench <args>`, which must refuse at once (before starting etcd) with a
/// message that holds `says`.
fn refused(args: &[&str], says: &str) -> Result<()> {
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_gpuledger-bench"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("running gpuledger-bench")?;
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.success() || !err.contains(says) {
        bail!(
            "gpuledger-bench {} should have been refused with {says:?}: {}\n{err}",
            args.join(" "),
            out.status
        );
    }
    if err.contains("panicked") || started.elapsed() > Duration::from_secs(10) {
        bail!(
            "gpuledger-bench {} did not refuse cleanly at once:\n{err}",
            args.join(" ")
        );
    }
    Ok(())
}

#[test]
fn sizes_a_run_cannot_finish_are_refused_before_it_starts() -> Result<()> {
    refused(&["failover", "--trials=0"], "--trials")?;
    refused(
        &["node-agent", "--pods=10", "--gpus=1", "--slots=4"],
        "raise --slots",
    )?;
    refused(
        &["node-agent", "--pods=300", "--gpus=1", "--slots=512"],
        "raise --gpus",
    )?;
    refused(
        &["node-agent", "--pods=1", "--claims=500", "--gpus=1"],
        "--claims=500",
    )?;
    refused(
        &["node-agent", "--isolation=nvml,mig"],
        "\"mig\" is not a mode",
    )
}
