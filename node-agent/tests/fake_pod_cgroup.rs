//! Regression (issue 28): the agent found a pod in any cgroup path component shaped like
//! `pod<uid>`, wherever it was. Anyone who can make a cgroup (a node user's delegated
//! `user@1000.service`, a daemon in `system.slice`) could name one like the victim's pod, run a
//! GPU process there and have its memory counted as the victim's: the victim went "over its
//! limit" and its own processes were killed. Now a pod cgroup counts only where the kubelet puts
//! pods; the impostor is a process of no pod (rogue), and the victim is left alone.

use crate::support;

use std::time::Duration;

use support::cgroups::{Driver, TestCgroups};
use support::{Cluster, Options};

/// The victim: 10 000 MiB on GPU 0, using 8 000.
const VICTIM: &str = "aaaaaaaa-0000-4000-8000-00000000000a";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cgroup_named_like_a_pod_outside_kubepods_cannot_get_the_pod_killed() -> anyhow::Result<()>
{
    let cg = TestCgroups::new()?;
    let mut c = Cluster::start_opts(Options::default()).await?;
    let g0 = c.gpu(0);
    let victim_alloc = c.reserve(VICTIM, 10_000, Some(&g0)).await?;
    c.kubelet
        .admit("default", &format!("pod-{VICTIM}"), "main", 1)
        .await?;
    let victim = cg.spawn(
        &cg.container(Driver::Cgroupfs, "besteffort", VICTIM, "v")?,
        None,
    )?;
    // Named like the victim's pod, in a user's delegated subtree.
    let fake = cg.other(&format!(
        "user.slice/user-1000.slice/user@1000.service/pod{VICTIM}/x"
    ))?;
    let impostor = cg.spawn(&fake, None)?;
    // Together 14 000 MiB: over the victim's 10 000 if the impostor counted as the victim.
    for (s, mib) in [(&victim, 8_000), (&impostor, 6_000)] {
        c.nvml.processes.push((s.pid(), mib, g0.clone()));
    }
    c.nvml.write()?;

    // The impostor is a process of no pod: reported rogue (the default policy only reports).
    let v = c
        .wait_violations(&[impostor.pid()], Duration::from_secs(5))
        .await?;
    assert_eq!(
        (v[0].allocation_id, v[0].action.as_str()),
        (0, "rogue"),
        "the impostor was taken for the victim's pod: {v:?}"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut victim = victim;
    assert!(victim.alive(), "the victim was killed\n{}", c.agent_log());
    let against_victim: Vec<_> = c
        .violations()
        .await?
        .into_iter()
        .filter(|v| v.allocation_id == victim_alloc.id)
        .collect();
    assert!(
        against_victim.is_empty(),
        "the victim was charged for the impostor: {against_victim:?}"
    );
    Ok(())
}
