//! Regression (issue 18): processes were killed by raw pid, seconds after NVML was sampled, so
//! a pid that the sampled process left behind and another process took in between got that
//! other process killed. Here the pid really is reused (the kernel is told which pid to hand
//! out next through `ns_last_pid`; needs root) between the sample and the kill, and nothing of
//! the new process is touched: the kill goes through the pidfd the sample opened.

use crate::support;

use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpuledger_node_agent::procs::{Killed, sample};
use nix::sys::signal::Signal;
use support::Cluster;
use support::cgroups::Sleeper;

/// Start a `sleep` that gets pid `pid` (free now), or fail after many tries.
fn take_pid(pid: u32) -> Result<Child> {
    for _ in 0..2_000 {
        if std::path::Path::new(&format!("/proc/{pid}")).exists() {
            // Another process on the machine took it first; wait for it to go.
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).context(
            "writing /proc/sys/kernel/ns_last_pid (the pid-reuse tests need root in the host pid namespace)",
        )?;
        let mut c = Command::new("sleep").arg("60").spawn()?;
        if c.id() == pid {
            return Ok(c);
        }
        let _ = c.kill();
        let _ = c.wait();
    }
    bail!("pid {pid} could not be taken again in 2000 tries")
}

/// Kill and reap `c`.
fn end(mut c: Child) -> Result<()> {
    c.kill()?;
    c.wait()?;
    Ok(())
}

#[test]
fn a_pid_reused_between_sample_and_kill_is_never_signalled() -> Result<()> {
    let first = Command::new("sleep").arg("60").spawn()?;
    let pid = first.id();
    let sampled = sample(pid)?;
    end(first)?;
    let mut second = take_pid(pid)?;
    assert_eq!(sampled.kill()?, Killed::AlreadyGone);
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        second.try_wait()?.is_none(),
        "the process that took the pid was killed"
    );
    // The same call does kill the process it sampled.
    let again = sample(pid)?;
    assert_eq!(again.kill()?, Killed::Now);
    assert_eq!(second.wait()?.signal(), Some(9));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_never_kills_a_process_that_took_a_sampled_pid() -> Result<()> {
    let mut c = Cluster::start(1, &[]).await?;
    let gpu = c.gpu(0);
    let a = c.reserve("uid-a", 1_000, None).await?;
    c.kubelet.admit("default", "pod-uid-a", "main", 1).await?;
    // With the allocator stopped, reporting the rogue process (first in the pass) stalls the
    // pass for seconds before it reaches the kill of the hog: the window a reused pid needs.
    let rogue = Sleeper::outside_pods(None)?;
    let hog = Command::new("sleep")
        .arg("60")
        .env("GPULEDGER_ALLOCATION_ID", a.id.to_string())
        .spawn()?;
    let pid = hog.id();
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.allocs.procs[0].signal(Signal::SIGSTOP)?;
    c.nvml.processes.push((rogue.pid(), 10, gpu.clone()));
    c.nvml.processes.push((pid, 5_000, gpu.clone()));
    c.nvml.write()?;
    wait_log(&c, "GPU process on no allocation (rogue)").await?;

    // The hog exits and another process takes its pid before the agent's kill.
    end(hog)?;
    let mut reuser = take_pid(pid)?;
    let gone = wait_log(
        &c,
        "the sampled process exited before the kill: nothing signalled",
    )
    .await;
    c.allocs.procs[0].signal(Signal::SIGCONT)?;
    gone?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let alive = reuser.try_wait()?.is_none();
    let _ = reuser.kill();
    let _ = reuser.wait();
    assert!(
        alive,
        "the process that took the pid was killed\n{}",
        c.agent_log()
    );
    Ok(())
}

async fn wait_log(c: &Cluster, line: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(40);
    while Instant::now() < deadline {
        if std::fs::read_to_string(c.agent.proc.log_path())?.contains(line) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    bail!("the agent never logged {line:?}\n{}", c.agent_log())
}
