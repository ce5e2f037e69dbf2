//! The kubelet hands a finished pod's device IDs to the next pod at once, while the ledger still
//! records them on the finished container until its `Released` arrives. The next pod's Allocate
//! must not be taken for a repeat of the finished one (it would get the dead pod's allocation
//! and scramble identities): it waits for the release and claims its own reservation.

use crate::support;

use std::time::Duration;

use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use support::{Cluster, alloc_of};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_pod_on_a_finished_pods_devices_gets_its_own_allocation() -> anyhow::Result<()> {
    let c = Cluster::start(1, &[]).await?;
    let a = c.reserve("uid-a", 8_000, None).await?;
    let got_a = c.kubelet.admit("default", "pod-uid-a", "main", 1).await?;
    c.wait_ledger(Duration::from_secs(10), |s| {
        alloc_of(s, "uid-a").is_some_and(|x| x.state == pb::AllocationState::Assigned as i32)
    })
    .await?;

    // A ends: the kubelet forgets its devices; the ledger has not heard yet.
    c.kubelet.remove_pod("default", "pod-uid-a");
    let b = c.reserve("uid-b", 8_000, None).await?;
    let release_a = async {
        tokio::time::sleep(Duration::from_millis(700)).await;
        // What the allocator does when Kubernetes says the pod ended; no API server here.
        c.admin()?
            .release(api::ReleaseRequest {
                pod_uid: "uid-a".into(),
                reason: "pod succeeded".into(),
                ..Default::default()
            })
            .await?;
        anyhow::Ok(())
    };
    let (got_b, released) = tokio::join!(
        c.kubelet.admit("default", "pod-uid-b", "main", 1),
        release_a
    );
    released?;
    let got_b = got_b?;
    assert_eq!(
        got_b.device_ids, got_a.device_ids,
        "the kubelet reused the device IDs (the case under test)"
    );
    assert_eq!(
        got_b.response.envs["GPULEDGER_ALLOCATION_ID"],
        b.id.to_string(),
        "B got the finished pod's allocation {}\n{}",
        a.id,
        c.agent_log()
    );
    let s = c
        .wait_ledger(Duration::from_secs(10), |s| {
            alloc_of(s, "uid-b").is_some_and(|x| x.state == pb::AllocationState::Assigned as i32)
        })
        .await?;
    let lb = alloc_of(&s, "uid-b").expect("B");
    assert_eq!(lb.id, b.id);
    assert_eq!(lb.device_ids, got_b.device_ids);
    assert!(alloc_of(&s, "uid-a").is_none(), "A is released");
    Ok(())
}
