//! Regression (issue 18): the cgroup parser needed `kubepods` in an absolute path, so an agent
//! in a private cgroup namespace (cgroup v2's default for containers) found no pod for any
//! process and fell back to the environment a process sets itself. Here the agent runs in a
//! cgroup namespace rooted at its own pod's container cgroup, as a DaemonSet pod does, and
//! reads every other pod through `/../..` paths (with the cgroupfs driver, without `kubepods`
//! in them at all): pods are still told apart, a forged allocation id still reaches nobody.

use crate::support;

use std::process::Command;
use std::time::Duration;

use support::cgroups::{Driver, TestCgroups};
use support::{AgentIn, Cluster, Options};

const AGENT: &str = "99999999-0000-4000-8000-000000000099";
/// The victim: 10 000 MiB on GPU 0.
const A: &str = "aaaaaaaa-0000-4000-8000-00000000000a";
/// 2 000 MiB on GPU 0; its process claims A's allocation.
const B: &str = "bbbbbbbb-0000-4000-8000-00000000000b";
/// 5 000 MiB on GPU 1; its process, claiming nothing, goes over.
const D: &str = "dddddddd-0000-4000-8000-00000000000d";

/// `/proc/<pid>/cgroup` of `pid` as the process `reader` sees it (from its cgroup namespace).
fn cgroup_seen_by(reader: u32, pid: u32) -> anyhow::Result<String> {
    let out = Command::new("nsenter")
        .args(["--cgroup", "--target", &reader.to_string(), "cat"])
        .arg(format!("/proc/{pid}/cgroup"))
        .output()?;
    anyhow::ensure!(out.status.success(), "nsenter: {out:?}");
    Ok(String::from_utf8(out.stdout)?)
}

async fn pods_are_told_apart_through_relative_paths(driver: Driver) -> anyhow::Result<()> {
    let cg = TestCgroups::new()?;
    let agent_cgroup = cg.container(driver, "burstable", AGENT, "agent")?;
    let mut c = Cluster::start_opts(Options {
        gpus: 2,
        agent_in: AgentIn::CgroupNamespace(agent_cgroup),
        ..Options::default()
    })
    .await?;
    let (g0, g1) = (c.gpu(0), c.gpu(1));
    let a = c.reserve(A, 10_000, Some(&g0)).await?;
    c.kubelet
        .admit("default", &format!("pod-{A}"), "main", 1)
        .await?;
    let b = c.reserve(B, 2_000, Some(&g0)).await?;
    c.kubelet
        .admit("default", &format!("pod-{B}"), "main", 1)
        .await?;
    let d = c.reserve(D, 5_000, Some(&g1)).await?;
    c.kubelet
        .admit("default", &format!("pod-{D}"), "main", 1)
        .await?;

    let mut victim = cg.spawn(&cg.container(driver, "besteffort", A, "v")?, None)?;
    let mut forger = cg.spawn(&cg.container(driver, "besteffort", B, "b")?, Some(a.id))?;
    let mut over = cg.spawn(&cg.container(driver, "besteffort", D, "d")?, None)?;

    // What the agent reads really is relative to its own cgroup.
    let agent_pid = c.agent.proc.pid().expect("the agent runs");
    let seen = cgroup_seen_by(agent_pid, victim.pid())?;
    let v2 = seen.lines().find(|l| l.starts_with("0::")).unwrap_or("");
    assert!(v2.starts_with("0::/../"), "{seen}");
    if matches!(driver, Driver::Cgroupfs) {
        assert!(!v2.contains("kubepods"), "{seen}");
    }

    for (s, mib, gpu) in [
        (&victim, 9_000, &g0),
        (&forger, 12_000, &g0),
        (&over, 6_000, &g1),
    ] {
        c.nvml.processes.push((s.pid(), mib, gpu.clone()));
    }
    c.nvml.write()?;

    for (name, p) in [
        ("pod B's forger", &mut forger),
        ("pod D's process", &mut over),
    ] {
        c.killed(p, name).await?;
    }
    let v = c
        .wait_violations(&[forger.pid(), over.pid()], Duration::from_secs(5))
        .await?;
    assert_eq!(v[0].allocation_id, b.id, "pod B's own allocation");
    assert_eq!(v[1].allocation_id, d.id, "pod D, found by its cgroup alone");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(victim.alive(), "the victim was killed\n{}", c.agent_log());
    assert!(!c.violations().await?.iter().any(|v| v.pid == victim.pid()));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_private_cgroup_namespace_systemd_driver_pods_are_still_told_apart()
-> anyhow::Result<()> {
    pods_are_told_apart_through_relative_paths(Driver::Systemd).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_private_cgroup_namespace_cgroupfs_driver_pods_are_still_told_apart()
-> anyhow::Result<()> {
    pods_are_told_apart_through_relative_paths(Driver::Cgroupfs).await
}
