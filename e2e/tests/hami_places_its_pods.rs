//! HAMi v2.10.0's real scheduler, beside gpuledger on the same control plane, places pods
//! written in HAMi's own YAML (`nvidia.com/gpu`, `nvidia.com/gpumem`, `nvidia.com/gpucores`,
//! `schedulerName: hami-scheduler`) on kubelet-less nodes registered as its device plugin
//! registers real ones: every bound pod carries HAMi's allocation for its own node, no GPU is
//! given more memory or cores than it has, and pods that fit no GPU stay Pending with HAMi's
//! reason. The peer the `versus` bench measures gpuledger against, proven to run as it does in
//! a cluster.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Result, ensure};
use gpuledger_e2e::hami::{self, Hami, NodeShape};
use gpuledger_e2e::{E2e, Options, pods};
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;

const NS: &str = "hami";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes and HAMi's scheduler (e2e/peers/build.sh): make test-e2e"]
async fn hamis_scheduler_places_its_pods_without_overcommitting_a_gpu() -> Result<()> {
    let e = E2e::start(Options::default()).await?;
    let h = Hami::start(&e).await?;
    let shape = NodeShape::default();
    let nodes: Vec<String> = (0..2).map(|i| format!("hami-{i}")).collect();
    h.add_nodes(&e, &nodes, &shape).await?;
    h.namespace(&e, NS).await?;

    // 4 GPUs of 16 GiB: three 5000 MiB / 30 % pods fit on each, twelve in all.
    let names: Vec<String> = (0..12).map(|i| format!("vgpu-{i}")).collect();
    for n in &names {
        pods::create(&e.client, NS, &hami::pod(n, 1, 5000, 30)).await?;
    }
    let bound = pods::wait_bound(&e.client, NS, &names, Duration::from_secs(120)).await;
    let bound = match bound {
        Ok(b) => b,
        Err(err) => return Err(err.context(h.log_tails(40))),
    };
    ensure!(bound.len() == names.len(), "bound: {bound:?}");

    // What HAMi wrote on each pod, against what each node registered.
    let allocs = hami::allocations(&e.client, NS).await?;
    let mut used: BTreeMap<String, (u64, u32, usize)> = BTreeMap::new();
    for (node, pods) in &allocs {
        let gpus: Vec<String> = (0..shape.gpus).map(|i| hami::gpu_uuid(node, i)).collect();
        for (pod, containers) in pods {
            ensure!(
                containers.len() == 1 && containers[0].len() == 1,
                "{pod} on {node}: one container asking one GPU got {containers:?}"
            );
            let g = &containers[0][0];
            ensure!(
                gpus.contains(&g.uuid),
                "{pod} on {node} got GPU {} of another node",
                g.uuid
            );
            ensure!(
                (g.mem_mib, g.cores) == (5000, 30),
                "{pod} asked 5000 MiB and 30 % and got {g:?}"
            );
            let u = used.entry(g.uuid.clone()).or_default();
            *u = (u.0 + g.mem_mib, u.1 + g.cores, u.2 + 1);
        }
    }
    ensure!(
        allocs.values().map(BTreeMap::len).sum::<usize>() == names.len(),
        "HAMi's allocations: {allocs:?}"
    );
    for (gpu, (mem, cores, tasks)) in &used {
        ensure!(
            *mem <= u64::from(shape.gpu_mem_mib) && *cores <= 100 && *tasks <= shape.split as usize,
            "{gpu} is over-committed: {mem} MiB, {cores} % cores, {tasks} tasks"
        );
    }
    ensure!(used.len() == 4, "twelve pods fill the four GPUs: {used:?}");

    // A pod larger than any GPU, and one more of the twelve's size that no GPU has room left
    // for: both stay Pending, told why by HAMi.
    for (name, mem) in [("too-big", 20_000), ("one-too-many", 5000)] {
        pods::create(&e.client, NS, &hami::pod(name, 1, mem, 30)).await?;
    }
    let api: Api<Pod> = Api::namespaced(e.client.clone(), NS);
    for name in ["too-big", "one-too-many"] {
        let why = gpuledger_e2e::until(
            &format!("{name} is refused with HAMi's reason"),
            Duration::from_secs(60),
            || async {
                let text = pods::events_text(&e.client, NS, name).await?;
                Ok(text.contains("CardInsufficientMemory").then_some(text))
            },
        )
        .await;
        let why = match why {
            Ok(w) => w,
            Err(err) => return Err(err.context(h.log_tails(40))),
        };
        let p = api.get(name).await?;
        let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
        ensure!(node.is_none(), "{name} was bound to {node:?}: {why}");
        ensure!(
            why.contains("FailedScheduling"),
            "{name}'s refusal is no FailedScheduling event: {why}"
        );
    }
    Ok(())
}
