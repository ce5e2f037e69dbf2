//! Untested until now: a pod that sets `spec.nodeName` itself skips the scheduler, so the
//! ledger holds no reservation for it; yet the kubelet admits it and calls Allocate for its
//! `gpuledger.io/gpu`. Allocate names no pod, so the agent guesses the oldest reservation of
//! that size on the node, which belongs to another pod, still pending. What holds: the pod that
//! skipped the scheduler does not start (PreStartContainer finds through PodResources that it
//! has no allocation and refuses, saying so), and the ledger grants it nothing.
//!
//! What does not hold yet (reported, not asserted here): the guess's claim stays on the other
//! pod's reservation, so that pod's own Allocate later finds no pending reservation.

use crate::support;

use std::time::Duration;

use support::{Cluster, alloc_of};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_skipped_the_scheduler_does_not_start_on_another_pods_grant()
-> anyhow::Result<()> {
    let c = Cluster::start(1, &[]).await?;
    let g0 = c.gpu(0);
    let owner = c.reserve("uid-owner", 10_000, Some(&g0)).await?;

    let skipped = c
        .kubelet
        .admit("default", "pod-uid-nodename", "main", 1)
        .await;
    match &skipped {
        Err(e) => assert!(
            e.to_string().contains("has no gpuledger allocation"),
            "refused, but not for having no allocation: {e:#}"
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
    assert_eq!(
        alloc_of(&s, "uid-owner").map(|x| x.id),
        Some(owner.id),
        "the owner's reservation is still the owner's"
    );
    Ok(())
}
