//! The allocator leader is SIGKILLed while the real scheduler binds a batch of GPU pods: a
//! follower takes over, every pod is bound exactly once on the node the ledger holds for it,
//! and `gpuledger verify` finds the surviving replicas equal to the replayed log.

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use futures::StreamExt;
use gpuledger_e2e::gpuledger::verify;
use gpuledger_e2e::pods;
use gpuledger_e2e::{E2e, Options};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes (kube-apiserver, kube-scheduler): make test-e2e"]
async fn every_pod_is_bound_once_across_a_leader_kill() -> Result<()> {
    let o = Options {
        allocators: 3,
        ..Options::default()
    };
    let (mut e, _) = E2e::with_gpu_nodes(o, 4, 4, "batch").await?;

    let names: Vec<String> = (0..40).map(|i| format!("job-{i}")).collect();
    let client = e.client.clone();
    let creating = tokio::spawn({
        let names = names.clone();
        async move {
            futures::stream::iter(names.into_iter().map(|n| {
                let c = client.clone();
                async move {
                    pods::create(
                        &c,
                        "batch",
                        &pods::pod(&n, &[("gpuledger.io/gpu-mem", "2048")], None),
                    )
                    .await
                }
            }))
            .buffer_unordered(4)
            .collect::<Vec<_>>()
            .await
        }
    });
    // Kill the leader once some pods are bound and the rest are on their way.
    let api: Api<Pod> = Api::namespaced(e.client.clone(), "batch");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let n = api
            .list(&ListParams::default())
            .await?
            .items
            .iter()
            .filter(|p| p.spec.as_ref().is_some_and(|s| s.node_name.is_some()))
            .count();
        if n >= 8 {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "only {n} pods bound in 60 s before the kill\n{}",
            e.log_tails(20)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let leader = e.gl.allocs.wait_leader(Duration::from_secs(5)).await?;
    e.gl.allocs.procs[leader].kill();
    for c in creating.await? {
        c?;
    }
    let bound = pods::wait_bound(&e.client, "batch", &names, Duration::from_secs(180)).await?;

    let survivors: Vec<String> = (0..e.gl.allocs.addrs.len())
        .filter(|i| *i != leader)
        .map(|i| e.gl.allocs.addrs[i].clone())
        .collect();
    let new_leader =
        e.gl.allocs
            .wait_leader_except(Duration::from_secs(30), Some(leader))
            .await?;
    let ledger = e.gl.allocs.ledger(new_leader).await?;
    for p in api.list(&ListParams::default()).await?.items {
        let name = p.metadata.name.clone().unwrap_or_default();
        let uid = p.metadata.uid.clone().unwrap_or_default();
        let allocs = ledger.allocs_of_pod(&uid);
        ensure!(
            allocs.len() == 1,
            "{name} holds {} allocations",
            allocs.len()
        );
        ensure!(
            allocs[0].node == bound[&name],
            "{name} is bound to {}, the ledger has it on {}",
            bound[&name],
            allocs[0].node
        );
    }
    ensure!(
        ledger.allocs().len() == names.len(),
        "{} allocations for {} pods",
        ledger.allocs().len(),
        names.len()
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match verify(&e.gl, &survivors) {
            Ok(_) => break,
            // A follower may still be folding the new leader's last batch.
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(err) => return Err(err),
        }
    }
    Ok(())
}
