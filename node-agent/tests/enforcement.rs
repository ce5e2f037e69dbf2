//! Memory limits from NVML process accounting: a real child process that the fake NVML
//! reports over its allocation's limit is SIGKILLed (or, with `report`, left alone); either way
//! a LimitViolated lands in the ledger. A GPU process on no allocation is reported as rogue.

use crate::support;

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use support::Cluster;

fn sleeper(allocation_id: Option<u64>) -> anyhow::Result<Child> {
    let mut cmd = Command::new("sleep");
    cmd.arg("60");
    if let Some(id) = allocation_id {
        cmd.env("GPULEDGER_ALLOCATION_ID", id.to_string());
    }
    Ok(cmd.spawn()?)
}

async fn wait_exit(child: &mut Child, timeout: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

async fn wait_violation(
    c: &Cluster,
    pid: u32,
    timeout: Duration,
) -> anyhow::Result<gpuledger_proto::ledger::v1::LimitViolated> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = c.violations().await?.into_iter().find(|v| v.pid == pid) {
            return Ok(v);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "no LimitViolated for pid {pid}\n{}",
            c.agent_log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_limit_is_killed_within_the_limit_lives_and_rogues_are_reported()
-> anyhow::Result<()> {
    let mut c = Cluster::start(1, &[]).await?;
    let gpu = c.gpu(0);
    let a = c.reserve("uid-a", 10_000, None).await?;
    let b = c.reserve("uid-b", 10_000, None).await?;
    c.kubelet.admit("default", "pod-uid-a", "main", 1).await?;
    c.kubelet.admit("default", "pod-uid-b", "main", 1).await?;

    let mut hog = sleeper(Some(a.id))?;
    let mut fine = sleeper(Some(b.id))?;
    let mut rogue = sleeper(None)?;
    c.nvml.set_process(hog.id(), 12_000, &gpu)?;
    c.nvml.set_process(fine.id(), 9_000, &gpu)?;
    c.nvml.set_process(rogue.id(), 100, &gpu)?;

    let status = wait_exit(&mut hog, Duration::from_secs(10)).await;
    let status = status.ok_or_else(|| {
        anyhow::anyhow!(
            "the process over its limit was not killed\n{}",
            c.agent_log()
        )
    })?;
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(9), "killed with SIGKILL");
    let v = wait_violation(&c, hog.id(), Duration::from_secs(5)).await?;
    assert_eq!(v.action, "kill");
    assert_eq!(v.allocation_id, a.id);
    assert_eq!((v.used_mib, v.limit_mib), (12_000, 10_000));
    assert_eq!(v.gpu_uuid, gpu);

    let r = wait_violation(&c, rogue.id(), Duration::from_secs(5)).await?;
    assert_eq!((r.action.as_str(), r.allocation_id), ("rogue", 0));
    // Neither the process within its limit nor the rogue one was killed.
    assert!(fine.try_wait()?.is_none(), "within its limit: untouched");
    assert!(
        rogue.try_wait()?.is_none(),
        "rogue processes are reported, not killed"
    );
    assert!(!c.violations().await?.iter().any(|v| v.pid == fine.id()));
    for ch in [&mut fine, &mut rogue] {
        let _ = ch.kill();
        let _ = ch.wait();
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_report_the_process_over_its_limit_lives_and_is_reported_once() -> anyhow::Result<()> {
    let mut c = Cluster::start(1, &["--on-violation=report"]).await?;
    let gpu = c.gpu(0);
    let a = c.reserve("uid-a", 10_000, None).await?;
    c.kubelet.admit("default", "pod-uid-a", "main", 1).await?;
    let mut hog = sleeper(Some(a.id))?;
    c.nvml.set_process(hog.id(), 15_000, &gpu)?;
    let v = wait_violation(&c, hog.id(), Duration::from_secs(10)).await?;
    assert_eq!(v.action, "report");
    assert_eq!(
        (v.allocation_id, v.used_mib, v.limit_mib),
        (a.id, 15_000, 10_000)
    );
    // Several enforcement passes later: still alive, still one event.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert!(hog.try_wait()?.is_none(), "report mode does not kill");
    let n = c
        .violations()
        .await?
        .iter()
        .filter(|v| v.pid == hog.id())
        .count();
    assert_eq!(n, 1, "a continuing violation is reported once");
    let _ = hog.kill();
    let _ = hog.wait();
    Ok(())
}
