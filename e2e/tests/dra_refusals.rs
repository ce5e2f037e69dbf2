//! What the ledger did not grant never reaches a container on the DRA path, on a stock 1.37
//! kubelet: a claim whose allocation is written straight into `status.allocation` (no
//! scheduler, an under-declared share) is refused by the allocator's certification, and the
//! kubelet's prepare fails with a reason the user reads in the pod's events; and a namespace
//! that spent its GPU budget (policy deny) has its next DRA pod refused at admission, as on the
//! device-plugin path.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use gpuledger_e2e::cluster::REAL_NODE;
use gpuledger_e2e::gpuledger::{ADMIN_SA, ctl};
use gpuledger_e2e::pods;
use gpuledger_e2e::real_node::host_network;
use gpuledger_e2e::{E2e, Options, until};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

const NS: &str = "forgery";

/// The first device of the real node's ResourceSlice, once the agent published it.
async fn first_device(e: &E2e) -> Result<String> {
    let slices: Api<ResourceSlice> = Api::all(e.client.clone());
    until(
        "the real node's ResourceSlice is published",
        Duration::from_secs(60),
        || async {
            let list = slices.list(&ListParams::default()).await?;
            Ok(list.items.into_iter().find_map(|s| {
                (s.spec.node_name.as_deref() == Some(REAL_NODE))
                    .then(|| s.spec.devices?.into_iter().next().map(|d| d.name))
                    .flatten()
            }))
        },
    )
    .await
}

/// A claim allocated behind the ledger's back: created, its pod left unscheduled, then
/// `status.allocation` and `reservedFor` written by hand (1 MiB declared consumed for a
/// request of 1024 MiB), and the pod bound to the node directly. The kubelet's prepare must
/// fail with the ledger's reason, and the container must never start.
async fn forged_allocation_is_refused_at_prepare(e: &E2e) -> Result<()> {
    let device = first_device(e).await?;
    let claims: Api<ResourceClaim> = Api::namespaced(e.client.clone(), NS);
    let claim: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "forged"},
        "spec": {"devices": {"requests": [{"name": "r", "exactly": {
            "deviceClassName": "gpu.gpuledger.io",
            "capacity": {"requests": {"memory": "1024Mi", "cores": "100"}},
        }}]}},
    }))?;
    let claim = claims.create(&PostParams::default(), &claim).await?;
    let claim_uid = claim.metadata.uid.clone().context("claim without uid")?;

    let mut pod = host_network(pods::pod(
        "forged",
        &[],
        Some(&["sh", "-c", "echo STARTED; env; sleep 3600"]),
    ));
    pod["spec"]["schedulerName"] = json!("nobody");
    pod["spec"]["resourceClaims"] = json!([{"name": "gpu", "resourceClaimName": "forged"}]);
    pod["spec"]["containers"][0]["resources"] = json!({"claims": [{"name": "gpu"}]});
    let created = pods::create(&e.client, NS, &pod).await?;
    let pod_uid = created.metadata.uid.clone().context("pod without uid")?;

    let forged = json!({"status": {
        "allocation": {
            "devices": {"results": [{
                "request": "r", "driver": "gpu.gpuledger.io", "pool": REAL_NODE,
                "device": device, "shareID": "0f8fad5b-d9cb-469f-a165-70867728950e",
                "consumedCapacity": {"memory": "1Mi", "cores": "0"},
            }]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [REAL_NODE]}]}]},
        },
        "reservedFor": [{"resource": "pods", "name": "forged", "uid": pod_uid}],
    }});
    claims
        .patch_status("forged", &PatchParams::default(), &Patch::Merge(&forged))
        .await
        .context("writing the forged allocation")?;
    let binding = json!({
        "apiVersion": "v1", "kind": "Binding",
        "metadata": {"name": "forged"},
        "target": {"apiVersion": "v1", "kind": "Node", "name": REAL_NODE},
    });
    Api::<Pod>::namespaced(e.client.clone(), NS)
        .create_subresource::<_, serde_json::Value>(
            "binding",
            "forged",
            &PostParams::default(),
            &binding,
        )
        .await
        .context("binding the pod to the node by hand")?;

    let client = &e.client;
    let events = until(
        "the kubelet reports the failed prepare",
        Duration::from_secs(90),
        || async {
            let text = pods::events_text(client, NS, "forged").await?;
            Ok(text
                .contains("FailedPrepareDynamicResources")
                .then_some(text))
        },
    )
    .await
    .with_context(|| e.log_tails(30))?;
    eprintln!("the forged claim's pod events:\n{events}");
    let want = format!("ResourceClaim {NS}/forged ({claim_uid}): no gpuledger grant");
    ensure!(
        events.contains(&want) && events.contains("refused by the ledger"),
        "the pod's events do not carry the ledger's refusal ({want:?}):\n{events}"
    );
    // The allocator marked the result refused, the ledger granted nothing, and the container
    // never started.
    let stored = claims.get("forged").await?;
    let conditions = serde_json::to_string(&stored.status.and_then(|s| s.devices))?;
    ensure!(
        conditions.contains("gpuledger.io/Refused") && conditions.contains("LedgerShareMismatch"),
        "the forged result is not marked refused by the ledger: {conditions}"
    );
    let ledger = e.gl.ledger().await?;
    ensure!(
        !ledger
            .allocs()
            .values()
            .any(|a| a.claim.is_some() && a.pod.uid == claim_uid),
        "the ledger holds a grant for the forged claim"
    );
    let node = e.node.as_ref().context("no real node")?;
    let log = node
        .container_log(NS, "forged", &pod_uid, "main")
        .unwrap_or_default();
    ensure!(
        !log.contains("STARTED"),
        "the container of the forged claim ran:\n{log}"
    );
    Ok(())
}

/// A namespace with a deny budget of 1 GPU-MiB-hour: its first DRA pod runs, holds 8192 MiB
/// (the budget is spent in under half a second), and its next pod is refused when created,
/// with the budget named.
async fn spent_budget_denies_dra_pods(e: &E2e) -> Result<()> {
    const TEAM: &str = "team-dra";
    e.namespace(TEAM).await?;
    let admin = e
        .certs
        .token_flags(&e.cp.pki.request_token(&e.client, ADMIN_SA).await?);
    ctl(
        &e.gl.allocs.addrs,
        &admin,
        &[
            "budget", "set", TEAM, "--amount", "1", "--window", "day", "--policy", "deny",
        ],
    )?;
    let pod = |name: &str| {
        host_network(pods::pod(
            name,
            &[("gpuledger.io/gpu-mem", "8192")],
            Some(&["sh", "-c", "env; sleep 3600"]),
        ))
    };
    let first = pods::create(&e.client, TEAM, &pod("first")).await?;
    ensure!(
        first
            .spec
            .as_ref()
            .and_then(|s| s.resource_claims.as_ref())
            .is_some_and(|c| !c.is_empty()),
        "the webhook did not turn the in-budget pod into a claim pod"
    );
    let uid = first.metadata.uid.unwrap_or_default();
    let node = e.node.as_ref().context("no real node")?;
    until(
        "the in-budget DRA pod runs with its grant",
        Duration::from_secs(120),
        || async {
            let log = node
                .container_log(TEAM, "first", &uid, "main")
                .unwrap_or_default();
            Ok(log.contains("GPULEDGER_GPU_MEM_MIB=8192").then_some(()))
        },
    )
    .await
    .with_context(|| e.log_tails(30))?;

    // The extender's replica answers admission; it spends the budget as it folds the grant's
    // holding, so the refusal comes within a few seconds.
    let kubectl = e.kubectl();
    let refusal = until(
        "the over-budget namespace's next DRA pod is refused",
        Duration::from_secs(30),
        || async {
            let out = kubectl.run_with_input(
                &["-n", TEAM, "create", "-f", "-"],
                Some(&pod("late").to_string()),
            )?;
            if out.ok {
                // Admitted before the budget was spent: try again with that pod gone.
                pods::force_delete(&e.client, TEAM, "late").await?;
                return Ok(None);
            }
            Ok(Some(out.stderr))
        },
    )
    .await?;
    eprintln!("kubectl create of the over-budget pod:\n{refusal}");
    ensure!(
        refusal.contains(&format!("namespace {TEAM} has spent its GPU budget")),
        "kubectl create of an over-budget DRA pod failed without naming the budget:\n{refusal}"
    );
    let api: Api<Pod> = Api::namespaced(e.client.clone(), TEAM);
    ensure!(
        api.get_opt("late").await?.is_none(),
        "the refused pod exists"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes with a real kubelet, containerd and root: make test-e2e"]
async fn ungranted_claims_and_spent_budgets_are_refused_on_the_dra_path() -> Result<()> {
    let e = E2e::start(Options {
        real_node: true,
        dra: true,
        ..Options::default()
    })
    .await?;
    e.namespace(NS).await?;
    forged_allocation_is_refused_at_prepare(&e).await?;
    spent_budget_denies_dra_pods(&e).await?;
    Ok(())
}
