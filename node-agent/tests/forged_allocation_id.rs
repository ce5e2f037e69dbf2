//! Regression (issue 18, "enforcement can be turned against an innocent pod"): a process that
//! sets a victim's `GPULEDGER_ALLOCATION_ID` in its environment used to be charged to the
//! victim's allocation whenever its own pod had none on the GPU, and in kill mode the victim's
//! processes were killed with it. Processes now run in real kubelet-shaped cgroups: whatever a
//! process claims, it is charged to the pod its cgroup names, a pod with nothing on the GPU is
//! rogue, and a claimer in no pod can take nobody down but itself.

use crate::support;

use std::time::Duration;

use gpuledger_proto::ledger::v1 as pb;
use support::Cluster;
use support::cgroups::{Driver, Sleeper, TestCgroups};

/// The victim, with 10 000 MiB on the GPU.
const A: &str = "aaaaaaaa-0000-4000-8000-00000000000a";
/// A pod with its own 2 000 MiB on the GPU.
const B: &str = "bbbbbbbb-0000-4000-8000-00000000000b";
/// A pod with nothing on the GPU.
const C: &str = "cccccccc-0000-4000-8000-00000000000c";

/// Everyone on the one GPU.
struct Scene {
    a: pb::Allocation,
    b: pb::Allocation,
    /// Pod A's own process, within its limit, claiming nothing: charged by its cgroup alone.
    victim: Sleeper,
    /// Pod B's process (systemd driver), over A's limit, claiming A's allocation.
    forger_b: Sleeper,
    /// Pod C's process (cgroupfs driver), over A's limit, claiming A's allocation.
    forger_c: Sleeper,
    /// A process in no pod that claims A's allocation and takes it over its limit.
    claimer: Sleeper,
}

async fn attack(c: &mut Cluster, cg: &TestCgroups) -> anyhow::Result<Scene> {
    let gpu = c.gpu(0);
    let a = c.reserve(A, 10_000, None).await?;
    c.kubelet
        .admit("default", &format!("pod-{A}"), "main", 1)
        .await?;
    let b = c.reserve(B, 2_000, None).await?;
    c.kubelet
        .admit("default", &format!("pod-{B}"), "main", 1)
        .await?;
    let victim = cg.spawn(&cg.container(Driver::Systemd, "burstable", A, "v")?, None)?;
    let forger_b = cg.spawn(
        &cg.container(Driver::Systemd, "besteffort", B, "b")?,
        Some(a.id),
    )?;
    let forger_c = cg.spawn(
        &cg.container(Driver::Cgroupfs, "besteffort", C, "c")?,
        Some(a.id),
    )?;
    let claimer = Sleeper::outside_pods(Some(a.id))?;
    // A's own use stays within 10 000 (+ its context allowance); the claimer's 3 000 on top
    // take the allocation over 10 000 + 2 x 520.
    for (s, mib) in [
        (&victim, 9_000),
        (&forger_b, 12_000),
        (&forger_c, 11_000),
        (&claimer, 3_000),
    ] {
        c.nvml.processes.push((s.pid(), mib, gpu.clone()));
    }
    c.nvml.write()?;
    Ok(Scene {
        a,
        b,
        victim,
        forger_b,
        forger_c,
        claimer,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_sets_a_victims_allocation_id_is_killed_itself_and_the_victim_is_untouched()
-> anyhow::Result<()> {
    let cg = TestCgroups::new()?;
    let mut c = Cluster::start(1, &["--rogue-policy=kill"]).await?;
    let mut s = attack(&mut c, &cg).await?;
    for (name, p) in [
        ("pod B's forger", &mut s.forger_b),
        ("pod C's forger", &mut s.forger_c),
        ("the claimer in no pod", &mut s.claimer),
    ] {
        c.killed(p, name).await?;
    }
    let v = c
        .wait_violations(
            &[s.forger_b.pid(), s.forger_c.pid(), s.claimer.pid()],
            Duration::from_secs(5),
        )
        .await?;
    assert_eq!(
        (v[0].allocation_id, v[0].action.as_str()),
        (s.b.id, "kill"),
        "pod B is charged to its own allocation"
    );
    assert_eq!(
        (v[1].allocation_id, v[1].action.as_str()),
        (0, "rogue-kill"),
        "pod C has none: rogue"
    );
    assert_eq!(
        (v[2].allocation_id, v[2].action.as_str()),
        (s.a.id, "kill"),
        "the claimer took A over and only it went"
    );
    // Several enforcement passes later the victim still runs and was never named.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(s.victim.alive(), "the victim was killed\n{}", c.agent_log());
    assert!(
        !c.violations()
            .await?
            .iter()
            .any(|v| v.pid == s.victim.pid()),
        "the victim was reported"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_report_policies_a_forger_is_reported_under_its_own_name_and_nothing_is_killed()
-> anyhow::Result<()> {
    let cg = TestCgroups::new()?;
    let mut c = Cluster::start(1, &["--on-violation=report", "--rogue-policy=report"]).await?;
    let mut s = attack(&mut c, &cg).await?;
    let v = c
        .wait_violations(
            &[s.forger_b.pid(), s.forger_c.pid(), s.claimer.pid()],
            Duration::from_secs(10),
        )
        .await?;
    let got: Vec<(u64, &str)> = v
        .iter()
        .map(|v| (v.allocation_id, v.action.as_str()))
        .collect();
    assert_eq!(got, [(s.b.id, "report"), (0, "rogue"), (s.a.id, "report")]);
    tokio::time::sleep(Duration::from_secs(1)).await;
    for p in [
        &mut s.victim,
        &mut s.forger_b,
        &mut s.forger_c,
        &mut s.claimer,
    ] {
        assert!(p.alive(), "pid {} was killed in report mode", p.pid());
    }
    assert!(
        !c.violations()
            .await?
            .iter()
            .any(|v| v.pid == s.victim.pid())
    );
    Ok(())
}
