//! DRA mode on a stock 1.37 kubelet (containerd 2 with CDI): the `dra` overlay installed, its
//! second scheduler with DynamicResources, and the node agent as a kubelet DRA plugin. A pod
//! written for gpuledger and one written for gpushare become claims (the webhook), the
//! scheduler allocates a share of the node's ResourceSlice, the allocator certifies it in the
//! ledger, the agent prepares it through a per-claim CDI spec, and each container runs with its
//! limits; deleting the pods releases their grants, and `gpuledger audit` shows who did what.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use gpuledger_e2e::cluster::REAL_NODE;
use gpuledger_e2e::gpuledger::ctl;
use gpuledger_e2e::pods;
use gpuledger_e2e::real_node::{CDI_ENV, host_network};
use gpuledger_e2e::{E2e, Options, until};
use gpuledger_testkit::eventually;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::discovery::ApiResource;
use serde_json::json;

/// The ResourceSlices of the cluster.
pub(crate) fn slices(client: &kube::Client) -> Api<DynamicObject> {
    let ar = ApiResource {
        group: "resource.k8s.io".into(),
        version: "v1".into(),
        api_version: "resource.k8s.io/v1".into(),
        kind: "ResourceSlice".into(),
        plural: "resourceslices".into(),
    };
    Api::all_with(client.clone(), &ar)
}

/// A DRA-mode cluster whose real node's agent is ready and has published its ResourceSlice.
pub(crate) async fn dra_node() -> Result<E2e> {
    dra_node_with(Vec::new()).await
}

/// [`dra_node`] whose agent has these extra flags.
pub(crate) async fn dra_node_with(agent_flags: Vec<String>) -> Result<E2e> {
    dra_node_of(Options {
        agent_flags,
        ..Options::default()
    })
    .await
}

/// [`dra_node`] started with `o` (its real node and DRA mode set here).
pub(crate) async fn dra_node_of(o: Options) -> Result<E2e> {
    let e = E2e::start(Options {
        real_node: true,
        dra: true,
        ..o
    })
    .await?;
    let node = e.node.as_ref().context("no real node")?;
    let sl = slices(&e.client);
    eventually(
        "the agent is ready and the node's ResourceSlice is published",
        Duration::from_secs(60),
        || async {
            let list = sl.list(&ListParams::default()).await?;
            let ours = list.items.iter().any(|s| {
                s.data["spec"]["nodeName"] == REAL_NODE
                    && s.data["spec"]["driver"] == "gpu.gpuledger.io"
                    && s.data["spec"]["devices"].as_array().map_or(0, Vec::len) == 2
            });
            Ok(ours && node.agent_readyz().await?.0 == 200)
        },
    )
    .await
    .with_context(|| e.log_tails(20))?;
    Ok(e)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes with a real kubelet, containerd and root: make test-e2e"]
async fn claim_pods_run_with_ledger_grants_on_a_real_kubelet() -> Result<()> {
    let e = dra_node().await?;
    let node = e.node.as_ref().context("no real node")?;

    e.namespace("dra").await?;
    let print = ["sh", "-c", "env | sort; sleep 3600"];
    let own = host_network(pods::pod(
        "own",
        &[
            ("gpuledger.io/gpu-mem", "2048"),
            ("gpuledger.io/gpu-core", "25"),
        ],
        Some(&print),
    ));
    let peer = host_network(pods::pod(
        "gpushare",
        &[("aliyun.com/gpu-mem", "3")],
        Some(&print),
    ));
    let mut uids = Vec::new();
    for spec in [&own, &peer] {
        let p = pods::create(&e.client, "dra", spec).await?;
        let claims = p
            .spec
            .as_ref()
            .and_then(|s| s.resource_claims.clone())
            .unwrap_or_default();
        ensure!(
            claims.len() == 1 && claims[0].resource_claim_template_name.is_some(),
            "the webhook did not turn {:?} into a claim pod: {claims:?}",
            p.metadata.name
        );
        uids.push(p.metadata.uid.unwrap_or_default());
    }
    for (name, uid, mib) in [("own", &uids[0], "2048"), ("gpushare", &uids[1], "3072")] {
        let logs = until(
            &format!("pod {name} runs with its GPU environment"),
            Duration::from_secs(120),
            || async {
                let text = node
                    .container_log("dra", name, uid, "main")
                    .unwrap_or_default();
                Ok(text.contains("GPULEDGER_").then_some(text))
            },
        )
        .await
        .with_context(|| e.log_tails(30))?;
        runs_with_its_grant(&e, name, uid, mib, &logs).await?;
    }

    // The audit trail names the allocator's grant and the node agent's prepare.
    let addrs = e.gl.allocs.addrs.clone();
    let audit = ctl(&addrs, &e.gl.viewer_flags, &["audit", "--pod", "dra/own"])?;
    let by = |actor: &str, what: &str| audit.lines().any(|l| l.contains(actor) && l.contains(what));
    ensure!(
        by("allocator", "granted to claim dra/own")
            && by(
                &format!("node-agent/{REAL_NODE}"),
                "prepared with CDI devices"
            ),
        "audit --pod dra/own does not show the allocator's grant and the agent's prepare:\n{audit}"
    );

    delete_until_released(&e, &["own", "gpushare"]).await?;
    gpuledger_e2e::gpuledger::verify(&e.gl, &addrs)?;
    extended_resource_pod_gets_a_whole_gpu(&e).await?;
    gpuledger_e2e::gpuledger::verify(&e.gl, &addrs)?;
    Ok(())
}

/// The container of pod `name` (`uid`) printed `logs`: its environment says `mib` MiB, and the one
/// prepared grant the ledger holds for the pod names the GPU whose CDI device containerd gave it.
pub(crate) async fn runs_with_its_grant(
    e: &E2e,
    name: &str,
    uid: &str,
    mib: &str,
    logs: &str,
) -> Result<()> {
    let env = |k: &str| {
        logs.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .map(str::to_string)
    };
    ensure!(
        env("GPULEDGER_GPU_MEM_MIB").as_deref() == Some(mib),
        "pod {name}: {mib} MiB asked, the container's environment says {:?}\n{logs}",
        env("GPULEDGER_GPU_MEM_MIB")
    );
    // The grant the ledger holds for the pod's claim names the GPU containerd gave it.
    let ledger = e.gl.ledger().await?;
    let grants = pods::grants_consumed_by(&ledger, uid);
    ensure!(
        grants.len() == 1,
        "pod {name}: {} ledger grants name it",
        grants.len()
    );
    let g = grants[0];
    ensure!(
        g.node == REAL_NODE && g.claim.as_ref().is_some_and(|c| c.prepared),
        "pod {name}: grant {g:?}"
    );
    ensure!(
        env(CDI_ENV).as_ref() == Some(&g.shares[0].gpu_uuid),
        "pod {name}: the container got GPU {:?}, the ledger granted {}",
        env(CDI_ENV),
        g.shares[0].gpu_uuid
    );
    Ok(())
}

/// KEP-5004 as the chart's `dra.extendedResourceName` sets it up: the DeviceClass also serves
/// an extended resource. A pod asking `example.com/gpu: 1` (no webhook involved) gets a claim
/// the scheduler makes itself; the allocator certifies it as an `extended-resource` grant of a
/// whole GPU, the agent prepares it, the container runs with the GPU's whole memory, and
/// deleting the pod releases the grant.
async fn extended_resource_pod_gets_a_whole_gpu(e: &E2e) -> Result<()> {
    let classes: Api<DynamicObject> = Api::all_with(
        e.client.clone(),
        &ApiResource {
            group: "resource.k8s.io".into(),
            version: "v1".into(),
            api_version: "resource.k8s.io/v1".into(),
            kind: "DeviceClass".into(),
            plural: "deviceclasses".into(),
        },
    );
    classes
        .patch(
            "gpu.gpuledger.io",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"extendedResourceName": "example.com/gpu"}})),
        )
        .await
        .context("setting the DeviceClass's extendedResourceName")?;
    let node = e.node.as_ref().context("no real node")?;
    let mut pod = host_network(pods::pod(
        "whole",
        &[("example.com/gpu", "1")],
        Some(&["sh", "-c", "env | sort; sleep 3600"]),
    ));
    pod["spec"]["schedulerName"] = json!("gpuledger-scheduler");
    let p = pods::create(&e.client, "dra", &pod).await?;
    ensure!(
        p.spec
            .as_ref()
            .and_then(|s| s.resource_claims.as_ref())
            .is_none(),
        "the webhook touched a pod asking only for example.com/gpu"
    );
    let uid = p.metadata.uid.unwrap_or_default();
    let logs = until(
        "the extended-resource pod runs with its GPU environment",
        Duration::from_secs(120),
        || async {
            let text = node
                .container_log("dra", "whole", &uid, "main")
                .unwrap_or_default();
            Ok(text.contains("GPULEDGER_").then_some(text))
        },
    )
    .await
    .with_context(|| e.log_tails(30))?;
    ensure!(
        logs.contains("GPULEDGER_GPU_MEM_MIB=16384"),
        "a whole 16384 MiB GPU was asked for:\n{logs}"
    );
    let ledger = e.gl.ledger().await?;
    let grants = pods::grants_consumed_by(&ledger, &uid);
    ensure!(
        grants.len() == 1
            && grants[0]
                .claim
                .as_ref()
                .is_some_and(|c| c.source == "extended-resource" && c.prepared)
            && grants[0].shares[0].mem_mib == 16_384
            && grants[0].shares[0].core_milli == 1000,
        "the extended-resource pod's grants: {grants:?}"
    );
    delete_until_released(e, &["whole"]).await
}

/// Delete the pods `names` of namespace `dra` and wait until the ledger holds no grant.
async fn delete_until_released(e: &E2e, names: &[&str]) -> Result<()> {
    let api: Api<Pod> = Api::namespaced(e.client.clone(), "dra");
    for name in names {
        api.delete(name, &DeleteParams::default()).await?;
    }
    let gl = &e.gl;
    eventually(
        &format!("the grants of {names:?} released"),
        Duration::from_secs(90),
        || async { Ok(gl.ledger().await?.allocs().is_empty()) },
    )
    .await
    .with_context(|| e.log_tails(30))
}
