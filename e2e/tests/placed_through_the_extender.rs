//! GPU pods go through the real kube-scheduler (the shipped configuration) to the extender:
//! each is bound to the node the ledger reserved for it, with the memory it asked for there,
//! the pod left unannotated (the extender has no right to change pods) and told so in an Event; a
//! CPU pod on the same scheduler never reaches the extender; deleted pods give their GPUs back;
//! `gpuledger verify` agrees with every replica.

use std::time::Duration;

use anyhow::{Result, ensure};
use gpuledger_e2e::gpuledger::{counter, verify};
use gpuledger_e2e::pods::{self, ledger_nodes};
use gpuledger_e2e::{E2e, Options};
use gpuledger_testkit::eventually;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes (kube-apiserver, kube-scheduler): make test-e2e"]
async fn gpu_pods_land_where_the_ledger_reserved_and_come_back_when_deleted() -> Result<()> {
    let (e, _) = E2e::with_gpu_nodes(Options::default(), 4, 2, "team-a").await?;

    let names: Vec<String> = (0..12).map(|i| format!("train-{i}")).collect();
    for n in &names {
        pods::create(
            &e.client,
            "team-a",
            &pods::pod(n, &[("gpuledger.io/gpu-mem", "4096")], None),
        )
        .await?;
    }
    let cpu = pods::pod("cpu-only", &[("cpu", "100m")], None);
    pods::create(&e.client, "team-a", &cpu).await?;
    let bound = pods::wait_bound(&e.client, "team-a", &names, Duration::from_secs(120)).await?;
    pods::wait_bound(
        &e.client,
        "team-a",
        &["cpu-only".to_string()],
        Duration::from_secs(60),
    )
    .await?;

    let ledger = e.gl.ledger().await?;
    let held = ledger_nodes(&ledger);
    for (pod, node) in &bound {
        let key = format!("team-a/{pod}");
        ensure!(
            held.get(&key) == Some(node),
            "{key} is bound to {node}, the ledger has it on {:?}\n{}",
            held.get(&key),
            e.log_tails(20)
        );
    }
    ensure!(
        held.len() == names.len(),
        "the ledger holds {} allocations for {} GPU pods (the CPU pod must have none): {held:?}",
        held.len(),
        names.len()
    );
    let api: Api<Pod> = Api::namespaced(e.client.clone(), "team-a");
    for n in &names {
        let grant: Vec<(u64, &str)> = (ledger.allocs().values())
            .filter(|a| a.pod.namespace == "team-a" && &a.pod.name == n)
            .flat_map(|a| a.shares.iter().map(|s| (s.mem_mib, s.gpu_uuid.as_str())))
            .collect();
        ensure!(
            grant.len() == 1 && grant[0].0 == 4096,
            "{n}: the ledger grants {grant:?}, not one 4096 MiB share"
        );
        let ann = api.get(n).await?.metadata.annotations.unwrap_or_default();
        ensure!(
            !ann.keys().any(|k| k.starts_with("gpuledger.io/")),
            "{n} was annotated: {ann:?}"
        );
    }
    eventually(
        "a GpuPlaced Event on every GPU pod",
        Duration::from_secs(20),
        || async {
            for n in &names {
                if !pods::events_text(&e.client, "team-a", n)
                    .await?
                    .contains("GpuPlaced: placed on ")
                {
                    return Ok(false);
                }
            }
            Ok(true)
        },
    )
    .await?;
    let m = e.gl.extender_metrics().await?;
    let filters = counter(
        &m,
        "gpuledger_extender_requests_total",
        &[("verb", "filter")],
    );
    ensure!(
        filters >= names.len() as f64,
        "only {filters} filter calls for {} GPU pods",
        names.len()
    );

    for n in names.iter().take(6) {
        pods::force_delete(&e.client, "team-a", n).await?;
    }
    let gl = &e.gl;
    eventually(
        "the deleted pods' allocations released",
        Duration::from_secs(30),
        || async {
            let held = ledger_nodes(&gl.ledger().await?);
            Ok(held.len() == 6
                && names
                    .iter()
                    .take(6)
                    .all(|n| !held.contains_key(&format!("team-a/{n}"))))
        },
    )
    .await?;
    let out = verify(&e.gl, &e.gl.allocs.addrs)?;
    ensure!(out.contains("compared 2 replica(s)"), "{out}");
    Ok(())
}
