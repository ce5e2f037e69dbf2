//! A higher-priority GPU pod arrives at a GPU full of lower-priority slices, under the real
//! kube-scheduler with the shipped configuration.
//!
//! kube-scheduler 1.20.0 up to the fix of kubernetes#102971 (PR #103019, cherry-picked to 1.20
//! and 1.21 in August 2021) never calls an extender's `preempt` verb: its dry run, which does
//! not see GPU memory, finds that the pod "fits" once it reprieves every pod, nominates the node
//! and evicts nothing. That is what this tier's 1.20.2 does, and what the scenario asserts there.
//! A scheduler that asks the extender must evict exactly the pod whose slice frees room (the
//! larger one, though the other has the lower priority and alone would free too little), and
//! the preemptor then binds to that GPU; the scenario asserts that as soon as the scheduler
//! calls `preempt`.

use std::time::Duration;

use anyhow::{Result, ensure};
use gpuledger_e2e::gpuledger::counter;
use gpuledger_e2e::pods::{self, ledger_nodes};
use gpuledger_e2e::{E2e, Options, until};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::{Api, PostParams};
use serde_json::json;

const NS: &str = "team-p";

/// A pod asking for `mem` MiB of one GPU at priority class `class`.
fn gpu_pod(name: &str, mem: &str, class: &str) -> serde_json::Value {
    let mut p = pods::pod(name, &[("gpuledger.io/gpu-mem", mem)], None);
    p["spec"]["priorityClassName"] = json!(class);
    p
}

/// The GPU the ledger granted to `NS/name`, if it holds one.
fn gpu_of(l: &gpuledger_ledger::Ledger, name: &str) -> Option<String> {
    l.allocs()
        .values()
        .find(|a| a.pod.namespace == NS && a.pod.name == name)
        .and_then(|a| a.shares.first().map(|s| s.gpu_uuid.clone()))
}

async fn terminating(api: &Api<Pod>, name: &str) -> Result<bool> {
    Ok(api.get(name).await?.metadata.deletion_timestamp.is_some())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes (kube-apiserver, kube-scheduler 1.20.2): make test-e2e"]
async fn a_higher_priority_pod_on_a_full_gpu() -> Result<()> {
    // One node, one 16 GiB GPU.
    let (e, nodes) = E2e::with_gpu_nodes(Options::default(), 1, 1, NS).await?;
    let classes: Api<PriorityClass> = Api::all(e.client.clone());
    for (name, value) in [("e2e-lowest", 10), ("e2e-low", 20), ("e2e-in-budget", 1000)] {
        let pc: PriorityClass = serde_json::from_value(json!({
            "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
            "metadata": {"name": name}, "value": value,
        }))?;
        classes.create(&PostParams::default(), &pc).await?;
    }
    let big = "big-low";
    let small = "small-lowest";
    pods::create(&e.client, NS, &gpu_pod(big, "12000", "e2e-low")).await?;
    pods::create(&e.client, NS, &gpu_pod(small, "4000", "e2e-lowest")).await?;
    let names = [big.to_string(), small.to_string()];
    pods::wait_bound(&e.client, NS, &names, Duration::from_secs(60)).await?;
    let gpu = gpu_of(&e.gl.ledger().await?, big);
    ensure!(gpu.is_some(), "{big} holds no GPU in the ledger");

    // 8000 MiB: 384 free; evicting small-lowest frees 4000 (too little), big-low 12000.
    let pre = "in-budget";
    pods::create(&e.client, NS, &gpu_pod(pre, "8000", "e2e-in-budget")).await?;
    let api: Api<Pod> = Api::namespaced(e.client.clone(), NS);
    let nominated = until(
        "the preemptor nominated to a node",
        Duration::from_secs(60),
        || async {
            let p = api.get(pre).await?;
            Ok(p.status.and_then(|s| s.nominated_node_name))
        },
    )
    .await
    .map_err(|err| anyhow::anyhow!("{err}\n{}", e.log_tails(30)))?;
    ensure!(
        nominated == nodes[0],
        "nominated to {nominated}, not {}",
        nodes[0]
    );
    let asked = || async {
        let m = e.gl.extender_metrics().await?;
        anyhow::Ok(counter(
            &m,
            "gpuledger_extender_requests_total",
            &[("verb", "preempt")],
        ))
    };

    if asked().await? == 0.0 {
        // kubernetes#102971: the nomination came without the extender, and nothing is evicted.
        tokio::time::sleep(Duration::from_secs(5)).await;
        ensure!(
            asked().await? == 0.0,
            "the scheduler asked the extender late: the nomination did not wait for it"
        );
        for n in [big, small] {
            ensure!(
                !terminating(&api, n).await?,
                "{n} evicted without the extender"
            );
        }
        ensure!(
            api.get(pre).await?.spec.and_then(|s| s.node_name).is_none(),
            "{pre} bound to a GPU with no room"
        );
        return Ok(());
    }

    until("the victim evicted", Duration::from_secs(30), || async {
        Ok(terminating(&api, big).await?.then_some(()))
    })
    .await?;
    ensure!(
        !terminating(&api, small).await?,
        "{small} was evicted too, though its slice frees too little"
    );
    // No kubelet confirms the deletion on a kubelet-less node: do it as one would.
    pods::force_delete(&e.client, NS, big).await?;
    let bound =
        pods::wait_bound(&e.client, NS, &[pre.to_string()], Duration::from_secs(60)).await?;
    ensure!(
        bound.get(pre) == Some(&nodes[0]),
        "{pre} bound to {bound:?}"
    );
    let l = e.gl.ledger().await?;
    ensure!(
        gpu_of(&l, pre) == gpu,
        "{pre} is on {:?}, the GPU {big} left is {gpu:?}",
        gpu_of(&l, pre)
    );
    let held = ledger_nodes(&l);
    ensure!(
        held.contains_key(&format!("{NS}/{small}")) && !held.contains_key(&format!("{NS}/{big}")),
        "the ledger holds {held:?}"
    );
    ensure!(
        !terminating(&api, small).await?,
        "{small} was evicted after all"
    );
    Ok(())
}
