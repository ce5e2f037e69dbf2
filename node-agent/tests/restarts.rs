//! Restarts on the node: the agent killed while pods run, and the kubelet restarting.

use crate::support;

use std::time::{Duration, Instant};

use gpuledger_proto::ledger::v1 as pb;
use support::{Cluster, alloc_of, granted};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_agent_comes_back_with_the_same_gpus_and_no_second_claim() -> anyhow::Result<()> {
    let mut c = Cluster::start(2, &[]).await?;
    c.reserve("uid-a", 10_000, None).await?;
    c.reserve("uid-b", 30_000, None).await?;
    let a = c.kubelet.admit("default", "pod-uid-a", "main", 1).await?;
    let b = c.kubelet.admit("default", "pod-uid-b", "main", 1).await?;
    let assigned_before = count_assigned(&c).await?;
    assert_eq!(assigned_before, 2);

    c.agent.restart()?;
    c.kubelet
        .wait_registrations(2, Duration::from_secs(15))
        .await
        .map_err(|e| anyhow::anyhow!("{e:#}\n{}", c.agent_log()))?;
    // A repeated Allocate for running containers' devices returns the same answer.
    let again_a = c.kubelet.reallocate(&a.device_ids).await?;
    let again_b = c.kubelet.reallocate(&b.device_ids).await?;
    assert_eq!(again_a, a.response);
    assert_eq!(again_b, b.response);
    assert_eq!(
        count_assigned(&c).await?,
        assigned_before,
        "no duplicate claim"
    );
    let s = c.dump().await?;
    for (uid, got) in [("uid-a", &a), ("uid-b", &b)] {
        let x = alloc_of(&s, uid).expect("still allocated");
        assert_eq!(x.device_ids, got.device_ids);
        assert_eq!(granted(&got.response), x.shares[0].gpu_uuid);
    }
    // And it still serves new pods.
    let cc = c.reserve("uid-c", 1_000, None).await?;
    let got_c = c.kubelet.admit("default", "pod-uid-c", "main", 1).await?;
    assert_eq!(
        got_c.response.envs["GPULEDGER_ALLOCATION_ID"],
        cc.id.to_string()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_restart_is_followed_by_a_new_registration_within_5s() -> anyhow::Result<()> {
    let mut c = Cluster::start(1, &[]).await?;
    assert_eq!(c.kubelet.registrations(), 1);
    let t = Instant::now();
    c.kubelet.restart().await?;
    c.kubelet
        .wait_registrations(2, Duration::from_secs(5))
        .await
        .map_err(|e| anyhow::anyhow!("{e:#}\n{}", c.agent_log()))?;
    eprintln!("re-registered {:?} after the kubelet restart", t.elapsed());
    // The new connection works end to end.
    c.kubelet
        .wait_devices(Duration::from_secs(5), |d| {
            d.len() == support::SLOTS as usize
        })
        .await?;
    c.reserve("uid-a", 1_000, None).await?;
    let got = c.kubelet.admit("default", "pod-uid-a", "main", 1).await?;
    assert!(got.response.envs.contains_key("GPULEDGER_ALLOCATION_ID"));
    Ok(())
}

async fn count_assigned(c: &Cluster) -> anyhow::Result<usize> {
    Ok(c.events()
        .await?
        .iter()
        .filter(|e| matches!(e.body, Some(pb::event::Body::Assigned(_))))
        .count())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_leaves_running_containers_their_gpus() -> anyhow::Result<()> {
    let mut c = Cluster::start(1, &[]).await?;
    c.reserve("uid-a", 1_000, None).await?;
    let a = c.kubelet.admit("default", "pod-uid-a", "main", 1).await?;
    let before = c.dump().await?;
    c.agent.proc.signal(nix::sys::signal::Signal::SIGTERM)?;
    let deadline = Instant::now() + Duration::from_secs(5);
    let status = loop {
        if let Some(s) = c.agent.proc.exited() {
            break s;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "no exit after SIGTERM\n{}",
            c.agent_log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "clean exit on SIGTERM: {status:?}");
    assert!(
        !c.kubelet
            .device_plugin_dir()
            .join("gpuledger.sock")
            .exists(),
        "the plugin socket is gone, so the kubelet sees the plugin stopped"
    );
    let after = c.dump().await?;
    assert_eq!(
        after.seq, before.seq,
        "stopping wrote nothing to the ledger"
    );
    assert_eq!(alloc_of(&after, "uid-a"), alloc_of(&before, "uid-a"));
    // Started again, the same container gets the same answer.
    c.agent.proc.start()?;
    c.kubelet
        .wait_registrations(2, Duration::from_secs(15))
        .await?;
    assert_eq!(
        c.kubelet.reallocate(&a.device_ids).await?.envs,
        a.response.envs
    );
    Ok(())
}
