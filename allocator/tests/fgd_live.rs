//! FGD in the live allocator: the workload it measures fragmentation against is learned from
//! the ledger's recent reservations (the prior until enough are in), and node CPU and memory come
//! from Kubernetes' node allocatable.

use crate::support;

use std::time::{Duration, Instant};

use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::kube::{KubeStack, StackOptions};
use gpuledger_testkit::workload::{inventory, pod};
use support::{add_api_pod, reserve_admitted};

fn placed(mut r: api::PodRequest, policy: &str) -> api::PodRequest {
    r.placement = Some(api::Placement {
        policy: policy.into(),
        ..Default::default()
    });
    r
}

async fn scores(stack: &KubeStack, req: &api::PodRequest) -> anyhow::Result<(u32, u32)> {
    let s = stack
        .allocs
        .extender(0)?
        .score(api::ScoreRequest {
            request: Some(req.clone()),
            nodes: vec!["x".into(), "y".into()],
        })
        .await?
        .into_inner();
    let of = |n: &str| s.scores.iter().find(|s| s.node == n).map_or(0, |s| s.score);
    Ok((of("x"), of("y")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fgd_learns_the_workload_and_node_capacity_comes_from_kubernetes() -> anyhow::Result<()> {
    let stack = KubeStack::start(StackOptions {
        etcd_members: 1,
        allocators: 1,
        allocator_flags: vec!["--fgd-min-samples=20".into(), "--fgd-window=50".into()],
        extender_flags: None,
    })
    .await?;
    let mut c = stack.allocs.extender(0)?;
    // x: one idle GPU. y: one GPU, half of it in use. w0..w9: room for the learning pods.
    for (n, gpus) in [("x", 1), ("y", 1)].into_iter().chain((0..10).map(|i| {
        (
            ["w0", "w1", "w2", "w3", "w4", "w5", "w6", "w7", "w8", "w9"][i],
            2,
        )
    })) {
        stack
            .allocs
            .node_agent(0, n)?
            .register_node(api::RegisterNodeRequest {
                inventory: Some(inventory(n, gpus, 16_000, "NVIDIA A10")),
            })
            .await?;
        stack.api.add_node(n, 8)?;
    }
    let half_on_y = pod("half-on-y", 4_000, 50);
    add_api_pod(&stack.api, &half_on_y)?;
    reserve_admitted(
        &mut c,
        api::ReserveRequest {
            request: Some(half_on_y),
            node: "y".into(),
            ttl_ms: 600_000,
        },
    )
    .await?;

    // A quarter-GPU pod under the prior (whole GPUs, halves, quarters, tenths, multi-GPU):
    // filling y's free half hurts least, x's idle GPU is worth keeping whole.
    let quarter = placed(pod("probe", 1_000, 25), "fgd");
    let (x, y) = scores(&stack, &quarter).await?;
    assert!(y > x, "prior: y ({y}) should beat x ({x})");

    // The cluster turns out to run half-GPU pods only. Leaving y with a quarter would strand
    // it; x's idle GPU still takes two halves after a quarter lands there.
    for i in 0..24 {
        let half = pod(&format!("half-{i}"), 4_000, 50);
        add_api_pod(&stack.api, &half)?;
        reserve_admitted(
            &mut c,
            api::ReserveRequest {
                request: Some(half),
                node: format!("w{}", i % 10),
                ttl_ms: 600_000,
            },
        )
        .await?;
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (x, y) = scores(&stack, &quarter).await?;
        if x > y {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "learned workload: x ({x}) should beat y ({y})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Binpack ignores the workload: y (in use) first, before and after.
    let (x, y) = scores(&stack, &placed(pod("probe", 1_000, 25), "binpack")).await?;
    assert!(y > x, "binpack: y ({y}) beats x ({x})");

    // Node CPU and memory: the fake API server's nodes have 64 CPUs and 512 GiB allocatable.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let snap = stack
            .allocs
            .viewer(0)?
            .dump(api::DumpRequest {})
            .await?
            .into_inner()
            .snapshot
            .expect("snapshot");
        let n = snap.nodes.iter().find(|n| n.node == "x").expect("x");
        if (n.cpu_milli, n.memory_mib) == (64_000, 512 * 1024) {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "x never got its allocatable: {} m, {} MiB",
            n.cpu_milli,
            n.memory_mib
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut hungry = pod("hungry", 1_000, 10);
    hungry.cpu_milli = 65_000;
    let f = c
        .filter(api::FilterRequest {
            request: Some(hungry),
            nodes: vec!["x".into()],
        })
        .await?
        .into_inner();
    assert!(f.nodes.is_empty(), "65 CPUs fit on a 64-CPU node: {f:?}");
    Ok(())
}
