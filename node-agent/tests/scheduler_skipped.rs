//! A pod that sets `spec.nodeName` itself skips the scheduler, so the ledger holds no
//! reservation for it; yet the kubelet admits it and calls Allocate for its `gpuledger.io/gpu`.
//! Allocate names no pod. Regression: the agent claimed the oldest reservation of that size on
//! the node, another pod's, still pending; the intruder was refused only at PreStartContainer,
//! the claim was never given back, and the rightful pod's own Allocate then failed for good
//! ("no pending gpuledger reservation of 1 slice(s)"). Now the agent claims a reservation only
//! for a pod PodResources shows the kubelet admitting: the intruder is refused at Allocate,
//! saying why, and the rightful pod is admitted with its reservation.

use crate::support;

use std::time::Duration;

use gpuledger_proto::ledger::v1 as pb;
use support::{Cluster, alloc_of};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_skipped_the_scheduler_is_refused_and_the_owner_keeps_its_reservation()
-> anyhow::Result<()> {
    let c = Cluster::start(1, &["--allocate-wait=1s"]).await?;
    let g0 = c.gpu(0);
    let owner = c.reserve("uid-owner", 10_000, Some(&g0)).await?;

    // The intruder reaches the kubelet first and asks for the same single slice.
    let skipped = c
        .kubelet
        .admit("default", "pod-uid-nodename", "main", 1)
        .await;
    match &skipped {
        Err(e) => assert!(
            format!("{e:#}").contains("not placed by the gpuledger scheduler"),
            "refused, but without saying it skipped the scheduler: {e:#}"
        ),
        Ok(a) => panic!(
            "the pod that skipped the scheduler starts, on {:?} (allocation {:?})",
            a.device_ids,
            a.response.envs.get("GPULEDGER_ALLOCATION_ID")
        ),
    }
    let s = c.wait_ledger(Duration::from_secs(5), |_| true).await?;
    assert!(
        alloc_of(&s, "uid-nodename").is_none(),
        "the ledger grants the pod that skipped the scheduler"
    );
    let o = alloc_of(&s, "uid-owner").expect("the owner's reservation");
    assert_eq!(o.id, owner.id);
    assert!(
        o.device_ids.is_empty() && o.state != pb::AllocationState::Assigned as i32,
        "the owner's reservation was handed to the intruder: {o:?}"
    );
    c.kubelet.remove_pod("default", "pod-uid-nodename");

    // Then the rightful pod: it is admitted with its own reservation.
    let got = c
        .kubelet
        .admit("default", "pod-uid-owner", "main", 1)
        .await
        .map_err(|e| anyhow::anyhow!("the owner is not admitted: {e:#}\n{}", c.agent_log()))?;
    assert_eq!(
        got.response.envs["GPULEDGER_ALLOCATION_ID"],
        owner.id.to_string()
    );
    let s = c
        .wait_ledger(Duration::from_secs(10), |s| {
            alloc_of(s, "uid-owner")
                .is_some_and(|x| x.state == pb::AllocationState::Assigned as i32)
        })
        .await?;
    assert_eq!(
        alloc_of(&s, "uid-owner").map(|x| x.device_ids.clone()),
        Some(got.device_ids)
    );
    Ok(())
}
