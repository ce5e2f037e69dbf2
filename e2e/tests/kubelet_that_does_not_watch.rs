//! A kubelet that accepts the agent's registration but never reads its device list: stock
//! kubelets before 1.26 dial a device plugin with the socket path as the HTTP/2 `:authority`,
//! which the agent's server (Rust's h2) refuses, so the node advertises no GPU at all. The
//! agent must say it is not ready and keep registering; once the kubelet is one that can read
//! the list (here: the same kubelet with upstream's one-line fix), it is ready and the node
//! advertises its GPUs.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use gpuledger_e2e::cluster::REAL_NODE;
use gpuledger_e2e::real_node::{KubeletBuild, allocatable_gpu};
use gpuledger_e2e::{E2e, Options, until};
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;

fn registrations(log: &std::path::Path) -> Result<usize> {
    Ok(std::fs::read_to_string(log)?
        .matches("registered with the kubelet")
        .count())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes with a real kubelet, containerd and root: make test-e2e"]
async fn the_agent_is_not_ready_while_the_kubelet_does_not_watch_its_devices() -> Result<()> {
    let mut e = E2e::start(Options {
        real_node: Some(KubeletBuild::Unpatched),
        ..Options::default()
    })
    .await?;
    let nodes: Api<Node> = Api::all(e.client.clone());
    let node = e.node.as_ref().context("no real node")?;
    until(
        "the agent registers with the kubelet",
        Duration::from_secs(60),
        || async { Ok((registrations(node.agent.log_path())? >= 1).then_some(())) },
    )
    .await
    .with_context(|| e.log_tails(20))?;
    // Ready means the kubelet can hand out its GPUs: not so here.
    until(
        "the agent says it is not ready",
        Duration::from_secs(30),
        || async { Ok((node.agent_readyz().await?.0 == 503).then_some(())) },
    )
    .await
    .with_context(|| e.log_tails(20))?;
    until(
        "the agent registers again",
        Duration::from_secs(60),
        || async { Ok((registrations(node.agent.log_path())? >= 2).then_some(())) },
    )
    .await
    .with_context(|| e.log_tails(20))?;
    let (code, body) = node.agent_readyz().await?;
    ensure!(
        code == 503,
        "ready while the kubelet cannot read its devices: {body}"
    );
    let advertised = allocatable_gpu(&nodes.get(REAL_NODE).await?);
    ensure!(
        advertised == 0,
        "this kubelet advertises {advertised} gpuledger.io/gpu: it is not the stock 1.20.2 one"
    );

    // A kubelet that reads the list (the same build with upstream's fix).
    e.node
        .as_mut()
        .context("no real node")?
        .replace_kubelet(KubeletBuild::Patched)?;
    let node = e.node.as_ref().context("no real node")?;
    until(
        "ready, and the node advertises 2 GPUs x 64",
        Duration::from_secs(90),
        || async {
            let n = allocatable_gpu(&nodes.get(REAL_NODE).await?);
            Ok((node.agent_readyz().await?.0 == 200 && n == 128).then_some(()))
        },
    )
    .await
    .with_context(|| e.log_tails(20))?;
    Ok(())
}
