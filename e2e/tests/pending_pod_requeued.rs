//! A pending GPU pod waits for its GPU room, not for kube-scheduler's 5-minute flush: on one
//! GPU, a pod the extender found no room for is bound within kube-scheduler's backoff after the
//! pod holding the GPU is deleted, trial after trial. The deletion requeues it in kube-scheduler
//! at once, and that retry can come before the leader released the GPUs; the leader's
//! `gpuledger.io/RoomFreed` condition, set once the release commits, requeues it again. Prints
//! each trial's time from the deletion to the binding.

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use gpuledger_e2e::pods;
use gpuledger_e2e::{E2e, Options};
use gpuledger_testkit::eventually;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;

/// Trials, each a deletion and the binding of the pod that waited.
const TRIALS: usize = 5;

/// Whether kube-scheduler last found `name` unschedulable.
async fn unschedulable(api: &Api<Pod>, name: &str) -> Result<bool> {
    let p = api.get(name).await?;
    Ok(p.status
        .and_then(|s| s.conditions)
        .unwrap_or_default()
        .iter()
        .any(|c| {
            c.type_ == "PodScheduled"
                && c.status == "False"
                && c.reason.as_deref() == Some("Unschedulable")
        }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes (kube-apiserver, kube-scheduler): make test-e2e"]
async fn a_pending_pod_is_bound_within_its_backoff_once_the_gpu_is_freed() -> Result<()> {
    let (e, _) = E2e::with_gpu_nodes(Options::default(), 1, 1, "team-a").await?;
    let api: Api<Pod> = Api::namespaced(e.client.clone(), "team-a");
    let whole = |n: &str| pods::pod(n, &[("gpuledger.io/gpu-mem", "16384")], None);
    pods::create(&e.client, "team-a", &whole("pod-0")).await?;
    pods::wait_bound(
        &e.client,
        "team-a",
        &["pod-0".into()],
        Duration::from_secs(60),
    )
    .await?;
    let mut took = Vec::new();
    for i in 1..=TRIALS {
        let (holder, waiter) = (format!("pod-{}", i - 1), format!("pod-{i}"));
        pods::create(&e.client, "team-a", &whole(&waiter)).await?;
        eventually(
            "kube-scheduler finds the waiting pod unschedulable",
            Duration::from_secs(30),
            || async { unschedulable(&api, &waiter).await },
        )
        .await?;
        // Past the pod's backoff (1 s after its first try, at most 10 s): the deletion then
        // requeues it at once, racing the release.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let t = Instant::now();
        pods::force_delete(&e.client, "team-a", &holder).await?;
        pods::wait_bound(
            &e.client,
            "team-a",
            std::slice::from_ref(&waiter),
            Duration::from_secs(30),
        )
        .await
        .map_err(|err| anyhow::anyhow!("trial {i}: {err}\n{}", e.log_tails(30)))?;
        took.push(t.elapsed());
    }
    took.sort();
    eprintln!(
        "deletion to binding of the waiting pod, {TRIALS} trials: {:?}",
        took.iter().map(|d| d.as_millis()).collect::<Vec<_>>()
    );
    // kube-scheduler's backoff is at most 10 s; the 5-minute flush is far beyond.
    ensure!(
        took.last().is_some_and(|d| *d <= Duration::from_secs(15)),
        "the slowest trial took {:?}",
        took.last()
    );
    Ok(())
}
