//! An Allocate whose answer never reached the kubelet (the agent was killed after committing
//! the claim, or the kubelet's call timed out): the ledger has the claim, the kubelet recorded
//! nothing and admits the pod again. Whether it offers the same devices or others, every pod
//! must end up admitted with its own allocation, not stuck behind a claim nobody will release.

use crate::support;

use std::time::{Duration, Instant};

use gpuledger_proto::ledger::v1 as pb;
use support::{Cluster, alloc_of};

fn assigned(s: &pb::Snapshot, uid: &str) -> bool {
    alloc_of(s, uid).is_some_and(|x| x.state == pb::AllocationState::Assigned as i32)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_admitted_again_on_the_same_devices_gets_its_claim() -> anyhow::Result<()> {
    let c = Cluster::start(1, &["--allocate-wait=2s"]).await?;
    let a = c.reserve("uid-a", 8_000, None).await?;
    let dev = vec![format!("{}::0", c.gpu(0))];
    // The answer is lost: the kubelet, admitting A, records nothing.
    c.kubelet.add_pod("default", "pod-uid-a", "main");
    let lost = c.kubelet.reallocate(&dev).await?;
    assert_eq!(lost.envs["GPULEDGER_ALLOCATION_ID"], a.id.to_string());
    c.wait_ledger(Duration::from_secs(10), |s| assigned(s, "uid-a"))
        .await?;

    // The kubelet admits the pod again with the same devices.
    let t = Instant::now();
    let again = c
        .kubelet
        .allocate_ids("default", "pod-uid-a", "main", dev.clone())
        .await;
    let again = match again {
        Ok(x) => x,
        Err(e) => anyhow::bail!("Allocate again failed: {e:#}\n{}", c.agent_log()),
    };
    assert_eq!(
        again.response.envs["GPULEDGER_ALLOCATION_ID"],
        a.id.to_string(),
        "the pod gets the claim already committed for it"
    );
    assert!(t.elapsed() < Duration::from_secs(8), "{:?}", t.elapsed());
    c.kubelet.pre_start(&dev).await?;
    let s = c.dump().await?;
    let la = alloc_of(&s, "uid-a").expect("A");
    assert_eq!((la.id, la.device_ids.clone()), (a.id, dev));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_answer_was_lost_does_not_block_its_devices() -> anyhow::Result<()> {
    let c = Cluster::start(1, &["--allocate-wait=2s"]).await?;
    let a = c.reserve("uid-a", 8_000, None).await?;
    let b = c.reserve("uid-b", 8_000, None).await?;
    let d0 = vec![format!("{}::0", c.gpu(0))];
    let d1 = vec![format!("{}::1", c.gpu(0))];
    // A's claim on d0 is committed, its answer lost.
    c.kubelet.add_pod("default", "pod-uid-a", "main");
    c.kubelet.reallocate(&d0).await?;
    c.wait_ledger(Duration::from_secs(10), |s| assigned(s, "uid-a"))
        .await?;

    // The kubelet admits pod A again, on other devices: the agent guesses B's reservation,
    // PreStartContainer finds the devices went to A and corrects the ledger.
    c.kubelet
        .allocate_ids("default", "pod-uid-a", "main", d1.clone())
        .await?;
    c.kubelet.pre_start(&d1).await?;
    // Then pod B is admitted on d0, the devices of the lost claim.
    let got_b = c
        .kubelet
        .allocate_ids("default", "pod-uid-b", "main", d0.clone())
        .await;
    let got_b = match got_b {
        Ok(x) => x,
        Err(e) => anyhow::bail!("B's Allocate failed: {e:#}\n{}", c.agent_log()),
    };
    c.kubelet.pre_start(&d0).await?;
    let s = c
        .wait_ledger(Duration::from_secs(10), |s| {
            alloc_of(s, "uid-a").is_some_and(|x| x.device_ids == d1)
                && alloc_of(s, "uid-b").is_some_and(|x| x.device_ids == d0)
        })
        .await;
    let s = match s {
        Ok(s) => s,
        Err(e) => anyhow::bail!("{e:#}\nledger: {:?}\n{}", c.dump().await?, c.agent_log()),
    };
    let (la, lb) = (
        alloc_of(&s, "uid-a").unwrap(),
        alloc_of(&s, "uid-b").unwrap(),
    );
    assert_eq!(
        got_b.response.envs["GPULEDGER_ALLOCATION_ID"],
        lb.id.to_string()
    );
    assert_ne!(la.id, lb.id);
    assert!([a.id, b.id].contains(&la.id) && [a.id, b.id].contains(&lb.id));
    assert_eq!(s.allocations.len(), 2, "{:?}", s.allocations);
    Ok(())
}
