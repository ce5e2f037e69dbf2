//! `--dra-cores=fraction` on a stock 1.37 cluster (`DRAFractionalCapacityRange`, beta, on):
//! with the allocator and the extender in the fraction unit, the node's slice publishes each
//! GPU's `cores` as `1` in steps of `1m`; a claim written by hand asking `cores: "0.3"` and a
//! pod the webhook turns into a claim (`gpuledger.io/gpu-core: 25`, a template asking `250m`)
//! are scheduled, certified and run with the share the ledger granted (`GPULEDGER_GPU_CORE`,
//! `CUDA_DEVICE_SM_LIMIT`); a claim asking more than one GPU's worth (`cores: "1.5"`) is not
//! scheduled, the pod's events say why, and the ledger grants it nothing. On 1.36, which has
//! no such gate, it proves the documented refusal instead: the whole GPU's `cores` that
//! kube-scheduler allocates to a claim asking 0.3 is refused by the certification.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use gpuledger_e2e::cluster::REAL_NODE;
use gpuledger_e2e::pods;
use gpuledger_e2e::real_node::host_network;
use gpuledger_e2e::{E2e, Options, until};
use gpuledger_ledger::pb;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;

use crate::dra_claims::{dra_node_of, slices};

const NS: &str = "fraction";

/// Create claim `name` asking 2048 MiB and `cores` of one gpuledger GPU, and a pod of the same
/// name using it, scheduled by the DRA scheduler; the pod's UID.
async fn claim_pod(e: &E2e, name: &str, cores: &str) -> Result<String> {
    let claims: Api<ResourceClaim> = Api::namespaced(e.client.clone(), NS);
    let claim: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu.gpuledger.io",
            "capacity": {"requests": {"memory": "2048Mi", "cores": cores}},
        }}]}},
    }))?;
    claims
        .create(&PostParams::default(), &claim)
        .await
        .with_context(|| format!("creating claim {name} (cores {cores})"))?;
    let mut pod = host_network(pods::pod(
        name,
        &[],
        Some(&["sh", "-c", "env | sort; sleep 3600"]),
    ));
    pod["spec"]["schedulerName"] = json!("gpuledger-scheduler");
    pod["spec"]["resourceClaims"] = json!([{"name": "gpu", "resourceClaimName": name}]);
    pod["spec"]["containers"][0]["resources"] = json!({"claims": [{"name": "gpu"}]});
    let p = pods::create(&e.client, NS, &pod).await?;
    p.metadata.uid.context("pod without uid")
}

/// The logs of pod `name` once its container printed its GPU environment.
async fn gpu_env(e: &E2e, name: &str, uid: &str) -> Result<String> {
    let node = e.node.as_ref().context("no real node")?;
    until(
        &format!("pod {name} runs with its GPU environment"),
        Duration::from_secs(90),
        || async {
            let text = node
                .container_log(NS, name, uid, "main")
                .unwrap_or_default();
            Ok(text.contains("GPULEDGER_").then_some(text))
        },
    )
    .await
    .with_context(|| e.log_tails(30))
}

/// Pod `name` runs with `pct` % of a GPU's compute, as the ledger's one prepared grant for it
/// says (`pct` × 10 core_milli).
async fn runs_with_share(e: &E2e, name: &str, uid: &str, pct: u32) -> Result<()> {
    let logs = gpu_env(e, name, uid).await?;
    let env = |k: &str| {
        logs.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .map(str::to_string)
    };
    let want = pct.to_string();
    for k in ["GPULEDGER_GPU_CORE", "CUDA_DEVICE_SM_LIMIT"] {
        ensure!(
            env(k).as_deref() == Some(want.as_str()),
            "pod {name}: {k} is {:?}, {pct} % was asked\n{logs}",
            env(k)
        );
    }
    ensure!(
        env("GPULEDGER_GPU_MEM_MIB").as_deref() == Some("2048"),
        "pod {name}: {logs}"
    );
    let ledger = e.gl.ledger().await?;
    let grants = pods::grants_consumed_by(&ledger, uid);
    ensure!(
        grants.len() == 1
            && grants[0].node == REAL_NODE
            && grants[0].claim.as_ref().is_some_and(|c| c.prepared)
            && grants[0].shares.first().map(|s| s.core_milli) == Some(pct * 10),
        "pod {name}: the ledger's grants {grants:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes with a real kubelet, containerd and root: make test-e2e"]
async fn fractional_cores_run_with_their_share_and_more_than_a_gpu_is_refused() -> Result<()> {
    let fraction = vec!["--dra-cores=fraction".to_string()];
    // 1.36 has no DRAFractionalCapacityRange: what the tier proves there is the documented
    // refusal (docs/dra.md), not a share.
    let version = gpuledger_e2e::bins::KubeBins::get()?.version()?;
    let gated = !version.starts_with("v1.35.") && !version.starts_with("v1.36.");
    let e = dra_node_of(Options {
        allocator_flags: fraction.clone(),
        extender_flags: fraction,
        // Beta in 1.37 but off unless --min-compatibility-version is 1.37 (its on-default
        // spec has MinCompatibilityVersion 1.37, pkg/features/kube_features.go): without it
        // the scheduler rounds cores 0.3 up to 1 and certification refuses every claim.
        scheduler_flags: if gated {
            vec!["--feature-gates=DRAFractionalCapacityRange=true".to_string()]
        } else {
            Vec::new()
        },
        ..Options::default()
    })
    .await?;
    // The slice states cores in the fraction unit.
    let list = slices(&e.client).list(&ListParams::default()).await?;
    let dev = list
        .items
        .iter()
        .find(|s| s.data["spec"]["nodeName"] == REAL_NODE)
        .and_then(|s| s.data["spec"]["devices"].get(0).cloned())
        .context("no device in the real node's slice")?;
    let cores = &dev["capacity"]["cores"];
    ensure!(
        matches!(cores["value"].as_str(), Some("1" | "1000m"))
            && cores["requestPolicy"]["validRange"]["step"] == "1m",
        "the slice's cores in the fraction unit: {dev}"
    );

    e.namespace(NS).await?;
    if !gated {
        return refused_without_the_gate(&e, &version).await;
    }
    // By hand: 0.3 of a GPU. Through the webhook: 25 %, a template asking 250m.
    let third = claim_pod(&e, "third", "0.3").await?;
    let quarter = pods::create(
        &e.client,
        NS,
        &host_network(pods::pod(
            "quarter",
            &[
                ("gpuledger.io/gpu-mem", "2048"),
                ("gpuledger.io/gpu-core", "25"),
            ],
            Some(&["sh", "-c", "env | sort; sleep 3600"]),
        )),
    )
    .await?;
    let template = quarter
        .spec
        .as_ref()
        .and_then(|s| s.resource_claims.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.resource_claim_template_name.clone())
        .context("the webhook made no claim pod of gpu-core 25")?;
    let too_much = claim_pod(&e, "too-much", "1.5").await?;

    runs_with_share(&e, "third", &third, 30).await?;
    let quarter_uid = quarter.metadata.uid.clone().unwrap_or_default();
    runs_with_share(&e, "quarter", &quarter_uid, 25).await?;
    let k = e.kubectl();
    let t = k.ok(&[
        "-n",
        NS,
        "get",
        "resourceclaimtemplate",
        &template,
        "-o",
        "json",
    ])?;
    ensure!(
        t.contains("\"cores\": \"250m\""),
        "the webhook's template does not ask 250m cores:\n{t}"
    );

    // More than the whole GPU: never scheduled, the reason in the pod's events, no grant.
    let why = until(
        "the pod asking 1.5 GPUs of compute is refused with a reason",
        Duration::from_secs(30),
        || async {
            let text = pods::events_text(&e.client, NS, "too-much").await?;
            Ok(text.contains("FailedScheduling").then_some(text))
        },
    )
    .await
    .with_context(|| e.log_tails(20))?;
    eprintln!("the pod asking cores 1.5 is refused: {why}");
    ensure!(
        why.contains("claim"),
        "the refusal does not say it is the claim that cannot be allocated: {why}"
    );
    let ledger = e.gl.ledger().await?;
    ensure!(
        pods::grants_consumed_by(&ledger, &too_much).is_empty(),
        "the ledger granted the pod asking cores 1.5"
    );
    gpuledger_e2e::gpuledger::verify(&e.gl, &e.gl.allocs.addrs)?;
    Ok(())
}

/// On a release without `DRAFractionalCapacityRange` (1.36): kube-scheduler reads the slice's
/// fractional step as 1 and allocates the whole GPU's `cores` to a claim asking 0.3; the
/// certification refuses that result (the ledger's `ClaimRefused`, its reason naming the
/// mismatch) and grants nothing, so the pod never runs with a share it did not ask for.
async fn refused_without_the_gate(e: &E2e, version: &str) -> Result<()> {
    let third = claim_pod(e, "third", "0.3").await?;
    let refusal = until(
        &format!("on {version}, the ledger refuses the claim asking cores 0.3"),
        Duration::from_secs(90),
        || async {
            let leader = e.gl.allocs.wait_leader(Duration::from_secs(20)).await?;
            let log = e.gl.allocs.events(leader).await?;
            Ok(log.into_iter().find_map(|ev| match ev.body {
                Some(pb::event::Body::ClaimRefused(r))
                    if r.claim.as_ref().is_some_and(|c| c.name == "third") =>
                {
                    Some(r.reason)
                }
                _ => None,
            }))
        },
    )
    .await
    .with_context(|| e.log_tails(30))?;
    eprintln!(
        "on {version} (no DRAFractionalCapacityRange) the claim asking 0.3 is refused: {refusal}"
    );
    ensure!(
        refusal.contains("cores"),
        "the refusal does not name the cores that differ: {refusal}"
    );
    let ledger = e.gl.ledger().await?;
    ensure!(
        pods::grants_consumed_by(&ledger, &third).is_empty(),
        "on {version} the ledger granted the claim asking 0.3"
    );
    gpuledger_e2e::gpuledger::verify(&e.gl, &e.gl.allocs.addrs)?;
    Ok(())
}
