//! A kubelet that cannot reach the agent's device plugin: the node agent's DaemonSet mounts
//! another directory than the kubelet's device-plugin directory, so the agent reaches the
//! kubelet's registration socket but the kubelet, dialling the agent's endpoint in its own
//! directory, refuses the registration and advertises no GPU at all. The agent must say it is
//! not ready, say why in a warning, and keep registering; once its socket is where the kubelet
//! looks (the hostPath fixed), the next registration succeeds without a restart, the agent is
//! ready and the node advertises its GPUs.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use gpuledger_e2e::cluster::REAL_NODE;
use gpuledger_e2e::real_node::allocatable_gpu;
use gpuledger_e2e::{E2e, Options, until};
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;

fn log(p: &std::path::Path) -> Result<String> {
    Ok(std::fs::read_to_string(p)?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes with a real kubelet, containerd and root: make test-e2e"]
async fn the_agent_is_not_ready_until_the_kubelet_can_reach_its_plugin() -> Result<()> {
    let e = E2e::start(Options {
        real_node: true,
        misplaced_plugin_socket: true,
        ..Options::default()
    })
    .await?;
    let nodes: Api<Node> = Api::all(e.client.clone());
    let node = e.node.as_ref().context("no real node")?;
    until(
        "the agent warns that the kubelet refuses its registration",
        Duration::from_secs(60),
        || async {
            Ok(log(node.agent.log_path())?
                .contains("the kubelet refused the registration")
                .then_some(()))
        },
    )
    .await
    .with_context(|| e.log_tails(20))?;
    // Still refused after the kubelet's own dial timeout (10 s): not ready, nothing advertised.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let (code, body) = node.agent_readyz().await?;
    ensure!(
        code == 503,
        "ready while the kubelet cannot reach its plugin: {body}"
    );
    let advertised = allocatable_gpu(&nodes.get(REAL_NODE).await?);
    ensure!(
        advertised == 0,
        "the node advertises {advertised} gpuledger.io/gpu though the kubelet never reached the plugin"
    );
    ensure!(
        !log(node.agent.log_path())?.contains("registered with the kubelet"),
        "the agent says it registered:\n{}",
        node.agent.log_tail(20)
    );

    // The hostPath fixed: the agent's socket is where the kubelet looks.
    node.expose_plugin_socket()?;
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
