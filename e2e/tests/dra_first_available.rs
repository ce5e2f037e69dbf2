//! DRA mode on a stock 1.37 kubelet: a ResourceClaim written by hand (not by the webhook) whose
//! request `gpu` is a `firstAvailable` list. The scheduler allocates its subrequest `gpu/small`,
//! the allocator certifies it, and the kubelet asks the agent to prepare the claim for the
//! container that names the main request `gpu`: the container runs with the grant's
//! environment and the CDI device of the GPU the ledger granted. Fails without
//! `request::dra::main_request` in the agent's prepare (node-agent/src/dra/service.rs): the CDI
//! devices were reported for `gpu/small`, a request no container names, so the kubelet gave
//! the container none of them.

use std::time::Duration;

use anyhow::{Context, Result};
use gpuledger_e2e::pods;
use gpuledger_e2e::real_node::host_network;
use gpuledger_e2e::until;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, PostParams};
use serde_json::json;

const NS: &str = "first";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes with a real kubelet, containerd and root: make test-e2e"]
async fn a_first_available_claims_container_gets_its_gpu() -> Result<()> {
    let e = crate::dra_claims::dra_node().await?;
    let node = e.node.as_ref().context("no real node")?;
    e.namespace(NS).await?;

    let claims: Api<ResourceClaim> = Api::namespaced(e.client.clone(), NS);
    let claim: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "choice"},
        "spec": {"devices": {"requests": [{"name": "gpu", "firstAvailable": [{
            "name": "small",
            "deviceClassName": "gpu.gpuledger.io",
            "capacity": {"requests": {"memory": "2048Mi", "cores": "200"}},
        }]}]}},
    }))?;
    claims.create(&PostParams::default(), &claim).await?;

    let mut pod = host_network(pods::pod(
        "choice",
        &[],
        Some(&["sh", "-c", "env | sort; sleep 3600"]),
    ));
    pod["spec"]["schedulerName"] = json!("gpuledger-scheduler");
    pod["spec"]["resourceClaims"] = json!([{"name": "gpu-claim", "resourceClaimName": "choice"}]);
    pod["spec"]["containers"][0]["resources"] =
        json!({"claims": [{"name": "gpu-claim", "request": "gpu"}]});
    let uid = pods::create(&e.client, NS, &pod)
        .await?
        .metadata
        .uid
        .unwrap_or_default();

    let logs = until(
        "the container runs and prints its environment",
        Duration::from_secs(120),
        || async {
            let text = node
                .container_log(NS, "choice", &uid, "main")
                .unwrap_or_default();
            Ok(text.contains("PATH=").then_some(text))
        },
    )
    .await
    .with_context(|| e.log_tails(30))?;
    crate::dra_claims::runs_with_its_grant(&e, "choice", &uid, "2048", &logs).await
}
