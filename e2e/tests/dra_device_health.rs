//! Device health end to end on a stock 1.37 kubelet in DRA mode: a claim pod runs on a GPU, a
//! critical Xid hits that GPU (the fake NVML library delivers it through the real nvml-wrapper
//! path), and the node agent marks it unhealthy in the ledger, taints its device in the
//! ResourceSlice (`NoSchedule`) and tells the kubelet over the DRA health stream, so the pod's
//! `allocatedResourcesStatus` reads Unhealthy. An operator clearing the mark lifts both. Each
//! trial times the fault to the taint and to the pod's status (goal: p99 within 2 s).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use gpuledger_e2e::cluster::REAL_NODE;
use gpuledger_e2e::pods;
use gpuledger_e2e::real_node::host_network;
use gpuledger_e2e::until;
use gpuledger_proto::allocator::v1 as api;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};

use crate::dra_claims::{dra_node, slices};

/// Fault and recovery rounds; each takes a few seconds.
const TRIALS: usize = 10;

/// Whether the real node's slice device `device` carries the unhealthy taint.
async fn tainted(client: &kube::Client, device: &str) -> Result<bool> {
    let list = slices(client).list(&ListParams::default()).await?;
    Ok(list
        .items
        .iter()
        .filter(|s| s.data["spec"]["nodeName"] == REAL_NODE)
        .flat_map(|s| {
            s.data["spec"]["devices"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter(|d| d["name"] == device)
        .flat_map(|d| d["taints"].as_array().cloned().unwrap_or_default())
        .any(|t| t["key"] == "gpu.gpuledger.io/unhealthy" && t["effect"] == "NoSchedule"))
}

/// The health the kubelet reports for `device` in the pod's `allocatedResourcesStatus`. The
/// kubelet names a prepared device by its first CDI id (the claim's `gpuledger.io/claim=…`),
/// else `<driver>/<pool>/<device>`; the pod holds one device.
async fn pod_health(pods: &Api<Pod>, name: &str, device: &str) -> Result<Option<String>> {
    let p = serde_json::to_value(pods.get(name).await?)?;
    let suffix = format!("/{device}");
    Ok(p["status"]["containerStatuses"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|c| {
            c["allocatedResourcesStatus"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .flat_map(|r| r["resources"].as_array().cloned().unwrap_or_default())
        .find(|r| {
            r["resourceID"]
                .as_str()
                .is_some_and(|id| id.ends_with(&suffix) || id.starts_with("gpuledger.io/claim="))
        })
        .and_then(|r| r["health"].as_str().map(String::from)))
}

/// Poll `what` every 20 ms until it holds (at most 30 s); the time from `t0`.
async fn time_until<F, Fut>(what: &str, t0: Instant, mut f: F) -> Result<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    loop {
        if f().await? {
            return Ok(t0.elapsed());
        }
        ensure!(t0.elapsed() < Duration::from_secs(30), "{what} within 30 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What each side holds now (the ledger's mark, the slice's taint, the pod's status), then the
/// processes' logs: the failure's cause comes first, before the long tails.
async fn state(
    e: &gpuledger_e2e::cluster::E2e,
    gpu: &str,
    device: &str,
    pods: &Api<Pod>,
) -> String {
    let ledger = match e.gl.ledger().await {
        Ok(l) => format!(
            "{:?}",
            l.node(REAL_NODE)
                .and_then(|n| n.gpu(gpu))
                .map(|g| g.healthy)
        ),
        Err(err) => format!("unread ({err:#})"),
    };
    let taint = tainted(&e.client, device)
        .await
        .map_or_else(|err| format!("unread ({err:#})"), |t| t.to_string());
    let pod = pod_health(pods, "job", device)
        .await
        .map_or_else(|err| format!("unread ({err:#})"), |h| format!("{h:?}"));
    format!(
        "now: ledger healthy={ledger}, slice tainted={taint}, pod reads {pod}\n{}",
        e.log_tails(40)
    )
}

fn p99(mut v: Vec<Duration>) -> Duration {
    v.sort();
    let i = (v.len() * 99).div_ceil(100).saturating_sub(1);
    v[i.min(v.len() - 1)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes with a real kubelet, containerd and root: make test-e2e"]
async fn an_unhealthy_gpu_taints_its_device_and_the_pods_status_then_recovers() -> Result<()> {
    let e = dra_node().await?;
    let node = e.node.as_ref().context("no real node")?;
    e.namespace("health").await?;
    let spec = host_network(pods::pod(
        "job",
        &[("gpuledger.io/gpu-mem", "2048")],
        Some(&["sh", "-c", "env | sort; sleep 3600"]),
    ));
    let p = pods::create(&e.client, "health", &spec).await?;
    let uid = p.metadata.uid.unwrap_or_default();
    until(
        "the pod runs with its GPU",
        Duration::from_secs(120),
        || async {
            let text = node
                .container_log("health", "job", &uid, "main")
                .unwrap_or_default();
            Ok(text.contains("GPULEDGER_").then_some(()))
        },
    )
    .await
    .with_context(|| e.log_tails(30))?;
    let ledger = e.gl.ledger().await?;
    let grants = pods::grants_consumed_by(&ledger, &uid);
    ensure!(grants.len() == 1, "the pod's grants: {grants:?}");
    let gpu = grants[0].shares[0].gpu_uuid.clone();
    let device = gpuledger_ledger::state::dra_device_name(&gpu);
    let pods_api: Api<Pod> = Api::namespaced(e.client.clone(), "health");
    // The kubelet reports the device Healthy before any fault.
    until(
        "the pod's device reads Healthy",
        Duration::from_secs(60),
        || async {
            Ok(
                (pod_health(&pods_api, "job", &device).await?.as_deref() == Some("Healthy"))
                    .then_some(()),
            )
        },
    )
    .await
    .with_context(|| e.log_tails(30))?;

    let mut nvml = node.nvml.clone();
    let admin = e.gl.allocs.admin(0)?;
    let (mut to_taint, mut to_pod, mut to_heal) = (Vec::new(), Vec::new(), Vec::new());
    for trial in 0..TRIALS {
        let fault = Instant::now();
        nvml.add_xid(&gpu, 79)?;
        let (c, pa) = (&e.client, &pods_api);
        let (d, dv) = (&device, &device);
        let taint_and_pod = tokio::try_join!(
            time_until("the device tainted", fault, || async move {
                tainted(c, d).await
            }),
            time_until("the pod's device Unhealthy", fault, || async move {
                Ok(pod_health(pa, "job", dv).await?.as_deref() == Some("Unhealthy"))
            }),
        )
        .map_err(|err| anyhow::anyhow!("trial {trial}: {err:#}"));
        if let Err(err) = taint_and_pod {
            return Err(err.context(state(&e, &gpu, &device, &pods_api).await));
        }
        let (taint, pod) = taint_and_pod?;
        to_taint.push(taint);
        to_pod.push(pod);
        // The operator clears the mark: the taint lifts and the pod reads Healthy again.
        let mut a = admin.clone();
        a.set_device_health(api::SetDeviceHealthRequest {
            node: REAL_NODE.into(),
            gpu_uuid: gpu.clone(),
            healthy: true,
            reason: "GPU reset by the operator".into(),
            xid: 0,
        })
        .await?;
        let healed = Instant::now();
        let recovered = tokio::try_join!(
            time_until("the taint lifted", healed, || async move {
                Ok(!tainted(c, d).await?)
            }),
            time_until("the pod's device Healthy again", healed, || async move {
                Ok(pod_health(pa, "job", dv).await?.as_deref() == Some("Healthy"))
            }),
        )
        .map_err(|err| anyhow::anyhow!("trial {trial} recovery: {err:#}"));
        match recovered {
            Ok((lifted, healthy)) => {
                // The slice is checked every 30 s anyway: a lift that slow means the clear
                // was not acted on when it reached the agent.
                ensure!(
                    lifted < Duration::from_secs(15),
                    "trial {trial}: the taint lifted only {lifted:?} after the clear, by the slice's periodic resync rather than on the change"
                );
                to_heal.push(lifted.max(healthy));
            }
            Err(err) => return Err(err.context(state(&e, &gpu, &device, &pods_api).await)),
        }
    }
    let (t, p, h) = (
        p99(to_taint.clone()),
        p99(to_pod.clone()),
        p99(to_heal.clone()),
    );
    eprintln!(
        "device health over {TRIALS} trials: fault to taint p99 {t:?} (all {to_taint:?}); fault to pod status p99 {p:?} (all {to_pod:?}); cleared to taint lifted and pod Healthy p99 {h:?} (all {to_heal:?})"
    );
    // The pod kept running on its GPU (NoSchedule evicts nothing).
    let pod = pods_api.get("job").await?;
    ensure!(
        pod.status.and_then(|s| s.phase).as_deref() == Some("Running"),
        "the pod stopped running"
    );
    Ok(())
}
