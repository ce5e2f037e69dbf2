//! kube-scheduler binds asynchronously: the next pod's filter and prioritize run while the
//! previous pod's bind (the extender's reservation) is still in flight. With binpack, pods
//! created together all aim at the tightest GPU; unless the extender counts the reservations in
//! flight, binds are refused for capacity that is already promised, and retried.

use std::time::Duration;

use anyhow::{Result, ensure};
use futures::StreamExt;
use gpuledger_e2e::gpuledger::counter;
use gpuledger_e2e::pods::{self, ledger_nodes};
use gpuledger_e2e::{E2e, Options};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes (kube-apiserver, kube-scheduler): make test-e2e"]
async fn pods_created_together_are_bound_without_a_rejected_bind() -> Result<()> {
    let (e, _) = E2e::with_gpu_nodes(Options::default(), 6, 4, "burst").await?;

    let names: Vec<String> = (0..60).map(|i| format!("burst-{i}")).collect();
    let created = futures::stream::iter(names.iter().map(|n| {
        let c = e.client.clone();
        async move {
            pods::create(
                &c,
                "burst",
                &pods::pod(n, &[("gpuledger.io/gpu-mem", "4096")], None),
            )
            .await
        }
    }))
    .buffer_unordered(16)
    .collect::<Vec<_>>()
    .await;
    for c in created {
        c?;
    }
    let bound = pods::wait_bound(&e.client, "burst", &names, Duration::from_secs(180)).await?;
    let held = ledger_nodes(&e.gl.ledger().await?);
    for (pod, node) in &bound {
        ensure!(
            held.get(&format!("burst/{pod}")) == Some(node),
            "{pod}: bound to {node}, ledger {:?}",
            held.get(&format!("burst/{pod}"))
        );
    }
    let m = e.gl.extender_metrics().await?;
    let binds = counter(&m, "gpuledger_extender_requests_total", &[("verb", "bind")]);
    let refused = counter(
        &m,
        "gpuledger_extender_requests_total",
        &[("verb", "bind"), ("outcome", "error")],
    );
    let answers: Vec<&str> = m
        .lines()
        .filter(|l| {
            l.starts_with("gpuledger_extender_answers_total")
                || l.starts_with("gpuledger_extender_filtered_pods_unverified")
        })
        .collect();
    ensure!(
        refused == 0.0,
        "{refused} of {binds} binds were refused for {} pods (capacity already promised to a bind in flight)\n{answers:?}\n{}",
        names.len(),
        e.log_tails(30)
    );
    Ok(())
}
