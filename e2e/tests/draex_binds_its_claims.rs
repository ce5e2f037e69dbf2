//! dra-example-driver (31914ce), beside gpuledger on the same control plane: its real
//! controller with binding conditions, its DeviceClass, and kubelet-less nodes with the
//! ResourceSlices its kubelet plugin publishes (shared devices with consumable memory and
//! compute, binding conditions). Claim pods written for it are allocated by kube-scheduler's
//! DynamicResources, their devices' binding conditions set True by its controller, and they are
//! bound: no device is given more memory than it has, and a pod of gpuledger's placed in the
//! same run is bound too. The DRA peer the `versus` bench measures gpuledger's DRA mode against.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Result, ensure};
use gpuledger_e2e::draex::{self, DEVICE_GIB, Draex};
use gpuledger_e2e::{E2e, Options, pods};
use kube::api::{Api, DynamicObject, ListParams, PostParams};

const NS: &str = "draex";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes and dra-example-driver's controller (e2e/peers/build.sh): make test-e2e"]
async fn the_example_drivers_claim_pods_are_allocated_and_bound_beside_gpuledger() -> Result<()> {
    let (e, _) = E2e::with_gpu_nodes(Options::default(), 1, 1, "gl").await?;
    let d = Draex::start(&e)?;
    let nodes: Vec<String> = (0..2).map(|i| format!("draex-{i}")).collect();
    d.add_nodes(&e, &nodes, 1).await?;
    e.namespace(NS).await?;

    // Two devices of 80 GiB: three 25 GiB claims fit on each, six in all.
    let templates: Api<DynamicObject> = Api::namespaced_with(
        e.client.clone(),
        NS,
        &draex::resource("ResourceClaimTemplate", "resourceclaimtemplates"),
    );
    let t: DynamicObject = serde_json::from_value(draex::claim_template("gpu-25g", 25, 30))?;
    templates.create(&PostParams::default(), &t).await?;
    let names: Vec<String> = (0..6).map(|i| format!("claim-{i}")).collect();
    for n in &names {
        pods::create(&e.client, NS, &draex::pod(n, "gpu-25g")).await?;
    }
    pods::create(
        &e.client,
        "gl",
        &pods::pod("gl-0", &[("gpuledger.io/gpu-mem", "2048")], None),
    )
    .await?;
    let bound = pods::wait_bound(&e.client, NS, &names, Duration::from_secs(120)).await;
    let bound = match bound {
        Ok(b) => b,
        Err(err) => return Err(err.context(d.log_tail(40) + &e.log_tails(20))),
    };
    pods::wait_bound(&e.client, "gl", &["gl-0".into()], Duration::from_secs(60)).await?;

    let claims: Api<DynamicObject> = Api::namespaced_with(
        e.client.clone(),
        NS,
        &draex::resource("ResourceClaim", "resourceclaims"),
    );
    let mut used: BTreeMap<(String, String), (u64, u64, usize)> = BTreeMap::new();
    let list = claims.list(&ListParams::default()).await?;
    ensure!(
        list.items.len() == names.len(),
        "claims: {}",
        list.items.len()
    );
    for c in &list.items {
        let v = serde_json::to_value(c)?;
        let (results, conditions) = draex::allocation(&v)?;
        ensure!(
            conditions,
            "claim {:?} is bound without its binding condition True: {}",
            c.metadata.name,
            v["status"]
        );
        ensure!(results.len() == 1, "one device per claim: {results:?}");
        let (pool, device, mem, compute) = results[0].clone();
        ensure!((mem, compute) == (25, 30), "asked 25 GiB / 30: {results:?}");
        let u = used.entry((pool, device)).or_default();
        *u = (u.0 + mem, u.1 + compute, u.2 + 1);
    }
    for ((pool, device), (mem, compute, n)) in &used {
        ensure!(
            *mem <= DEVICE_GIB && *compute <= 100,
            "{pool}/{device} is over-committed: {mem} GiB, {compute} compute by {n} claims"
        );
    }
    ensure!(
        bound.values().all(|n| nodes.contains(n)),
        "bound off the driver's nodes: {bound:?}"
    );
    ensure!(used.len() == 2, "six claims fill both devices: {used:?}");
    Ok(())
}
