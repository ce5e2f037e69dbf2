//! Allocate does not say which pod it is for. Two pending pods of the same size; the kubelet
//! admits them in the opposite order of their reservations. The agent guesses the oldest, and
//! PreStartContainer + PodResources must correct the ledger so each pod is recorded on the GPU
//! its container really got.

use crate::support;

use std::time::Duration;

use gpuledger_proto::ledger::v1 as pb;
use support::{Cluster, alloc_of, gpu_of, granted};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_admitted_out_of_order_end_up_on_the_gpus_they_really_got() -> anyhow::Result<()> {
    let c = Cluster::start(2, &[]).await?;
    let (g0, g1) = (c.gpu(0), c.gpu(1));
    // A is older (lower allocation id) than B; they are on different GPUs.
    let a = c.reserve("uid-a", 10_000, Some(&g0)).await?;
    let b = c.reserve("uid-b", 10_000, Some(&g1)).await?;
    assert!(a.id < b.id);

    // The kubelet knows both pods (A is listed by PodResources, without devices, as while it
    // waits for admission), so both reservations could be B's. It admits B first: the agent
    // steers it to, and claims, the oldest reservation (A's).
    c.kubelet.add_pod("default", "pod-uid-a", "main");
    let got_b = c.kubelet.admit("default", "pod-uid-b", "main", 1).await?;
    let env_b = &got_b.response.envs;
    assert_eq!(
        granted(&got_b.response),
        g0,
        "the guess: the oldest pending reservation"
    );
    assert_eq!(
        gpu_of(&got_b.device_ids[0]),
        g0,
        "GetPreferredAllocation steered to the reserved GPU"
    );
    let s = c
        .wait_ledger(Duration::from_secs(10), |s| {
            alloc_of(s, "uid-b").is_some_and(|x| x.state == pb::AllocationState::Assigned as i32)
        })
        .await?;
    let lb = alloc_of(&s, "uid-b").expect("B is in the ledger");
    assert_eq!(
        lb.shares[0].gpu_uuid, g0,
        "after PreStartContainer B is recorded on GPU 0, where it runs"
    );
    assert_eq!(lb.device_ids, got_b.device_ids);
    assert_eq!(env_b["GPULEDGER_ALLOCATION_ID"], lb.id.to_string());
    let la = alloc_of(&s, "uid-a").expect("A is in the ledger");
    assert_eq!(
        la.shares[0].gpu_uuid, g1,
        "A now holds the other reservation"
    );
    assert_ne!(la.state, pb::AllocationState::Assigned as i32);

    // Then A: it gets what is left, GPU 1, and no correction is needed.
    let got_a = c.kubelet.admit("default", "pod-uid-a", "main", 1).await?;
    assert_eq!(granted(&got_a.response), g1);
    let s = c
        .wait_ledger(Duration::from_secs(10), |s| {
            alloc_of(s, "uid-a").is_some_and(|x| x.state == pb::AllocationState::Assigned as i32)
        })
        .await?;
    let la = alloc_of(&s, "uid-a").expect("A");
    assert_eq!(la.shares[0].gpu_uuid, g1);
    assert_eq!(la.device_ids, got_a.device_ids);
    assert_eq!(
        got_a.response.envs["GPULEDGER_ALLOCATION_ID"],
        la.id.to_string()
    );

    let corrections = c
        .events()
        .await?
        .into_iter()
        .filter(|e| matches!(e.body, Some(pb::event::Body::IdentityCorrected(_))))
        .count();
    assert_eq!(corrections, 1, "exactly the one wrong guess was corrected");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_admitted_in_order_need_no_correction_and_get_full_env() -> anyhow::Result<()> {
    let c = Cluster::start(2, &[]).await?;
    let a = c.reserve("uid-a", 8_192, None).await?;
    let got = c.kubelet.admit("default", "pod-uid-a", "main", 1).await?;
    let e = &got.response.envs;
    let gpu = &a.shares[0].gpu_uuid;
    assert_eq!(&granted(&got.response), gpu);
    assert_eq!(e["GPULEDGER_ALLOCATION_ID"], a.id.to_string());
    assert_eq!(e["GPULEDGER_GPU_MEM_MIB"], "8192");
    assert_eq!(e["GPULEDGER_GPU_CORE"], "10");
    assert_eq!(e["CUDA_DEVICE_MEMORY_LIMIT_0"], "8192m");
    assert_eq!(e["CUDA_DEVICE_SM_LIMIT"], "10");
    assert_eq!(e["ALIYUN_COM_GPU_MEM_DEV"], "40");
    assert_eq!(e["ALIYUN_COM_GPU_MEM_CONTAINER"], "8");
    assert!(
        !e.contains_key("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
        "MPS vars only with --mps"
    );
    // Registration options as the kubelet needs them.
    let reg = c.kubelet.last_registration().expect("registered");
    assert_eq!(reg.version, "v1beta1");
    assert_eq!(reg.resource_name, "gpuledger.io/gpu");
    assert_eq!(reg.endpoint, "gpuledger.sock");
    let opts = reg.options.expect("options");
    assert!(opts.pre_start_required && opts.get_preferred_allocation_available);
    assert!(
        !c.events()
            .await?
            .iter()
            .any(|e| matches!(e.body, Some(pb::event::Body::IdentityCorrected(_))))
    );
    Ok(())
}
