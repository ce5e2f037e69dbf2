//! A GPU's health end to end on a DRA node, against real etcd, a real allocator, the fake API
//! server, the fake NVML library and the DRA kubelet emulator over real gRPC: a critical Xid or
//! a GPU that falls off the bus is marked unhealthy in the ledger by the node agent (the event
//! names it as its actor), tainted in the node's ResourceSlice instead of leaving it, reported
//! Unhealthy on the kubelet's health stream, and its pods are told; recovery lifts all of it.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::drahealth::{v1 as h1, v1alpha1 as hp};
use serde_json::{Value, json};

use crate::dra_plugin::{DraNode, NODE, on_each_slice_device};

/// The health of `device` in a stream answer.
fn health_of(r: &hp::NodeWatchResourcesResponse, device: &str) -> Option<hp::HealthStatus> {
    r.devices
        .iter()
        .find(|d| {
            d.device
                .as_ref()
                .is_some_and(|i| i.device_name == device && i.pool_name == NODE)
        })
        .map(|d| d.health())
}

/// Read the health stream until `device` is `want`; the time it took.
async fn wait_health(
    n: &DraNode,
    s: &mut tonic::Streaming<hp::NodeWatchResourcesResponse>,
    device: &str,
    want: hp::HealthStatus,
) -> Result<Duration> {
    let t0 = Instant::now();
    loop {
        let r = tokio::time::timeout(Duration::from_secs(15), s.message())
            .await
            .with_context(|| format!("{device} never {want:?} on the health stream\n{}", n.log()))??
            .context("the health stream ended")?;
        if health_of(&r, device) == Some(want) {
            return Ok(t0.elapsed());
        }
    }
}

/// The slice device `device` once `pred` holds for it; the time it took.
async fn wait_device(
    n: &DraNode,
    device: &str,
    pred: impl Fn(&Value) -> bool,
) -> Result<(Value, Duration)> {
    let t0 = Instant::now();
    loop {
        let found = n.slices().into_iter().find_map(|s| {
            s["spec"]["devices"]
                .as_array()?
                .iter()
                .find(|d| d["name"] == device)
                .cloned()
        });
        if let Some(d) = found.filter(|d| pred(d)) {
            return Ok((d, t0.elapsed()));
        }
        if t0.elapsed() > Duration::from_secs(15) {
            bail!(
                "slice device {device} never got there: {:?}\n{}",
                n.slices(),
                n.log()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `device`'s health and message in the first answer of a v1 stream, the version a 1.37
/// kubelet picks.
async fn v1_health(n: &DraNode, device: &str) -> Result<(hp::HealthStatus, String)> {
    let r =
        h1::dra_resource_health_client::DraResourceHealthClient::new(n.dra.plugin_channel().await?)
            .node_watch_resources(hp::NodeWatchResourcesRequest {})
            .await?
            .into_inner()
            .message()
            .await?
            .context("the v1 stream sent nothing")?;
    r.devices
        .into_iter()
        .find(|d| {
            d.device
                .as_ref()
                .is_some_and(|i| i.pool_name == NODE && i.device_name == device)
        })
        .map(|d| (d.health(), d.message))
        .with_context(|| format!("no {device} on the v1 stream"))
}

fn tainted(d: &Value) -> bool {
    d["taints"].as_array().is_some_and(|t| !t.is_empty())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unhealthy_gpu_is_tainted_reported_unhealthy_and_lifted_on_recovery() -> Result<()> {
    let n = DraNode::start().await?;
    n.wait_slice(None).await?;
    let (d0, d1) = (n.device(0), n.device(1));
    let mut s = n.dra.watch_health().await?;
    wait_health(&n, &mut s, &d0, hp::HealthStatus::Healthy).await?;

    // A critical Xid on GPU 0.
    let mut nvml = n.nvml.clone();
    let fault = Instant::now();
    nvml.add_xid(&nvml.gpus[0].uuid.clone(), 79)?;
    wait_health(&n, &mut s, &d0, hp::HealthStatus::Unhealthy).await?;
    let to_stream = fault.elapsed();
    let (dev, _) = wait_device(&n, &d0, tainted).await?;
    let to_taint = fault.elapsed();
    assert_eq!(
        dev["taints"],
        json!([{"key": "gpu.gpuledger.io/unhealthy", "value": "critical-Xid-79", "effect": "NoSchedule"}]),
        "{dev}"
    );
    let (other, _) = wait_device(&n, &d1, |_| true).await?;
    assert!(!tainted(&other), "the healthy GPU is untouched: {other}");
    eprintln!("Xid: fault to taint {to_taint:?}, to the health stream {to_stream:?}");
    assert!(to_taint < Duration::from_secs(2), "{to_taint:?}");

    // The ledger holds it, written by this node's agent.
    let events = n.allocs.events(0).await?;
    let (h, actor) = events
        .iter()
        .rev()
        .find_map(|e| match &e.body {
            Some(gpuledger_ledger::pb::event::Body::DeviceHealthChanged(h)) => {
                Some((h.clone(), e.actor.clone()))
            }
            _ => None,
        })
        .context("no DeviceHealthChanged in the ledger")?;
    assert_eq!(
        (h.healthy, h.xid, h.reason.as_str()),
        (false, 79, "critical Xid 79")
    );
    let actor = actor.context("the event's actor")?;
    assert_eq!(
        (actor.role.as_str(), actor.node.as_str()),
        ("node-agent", NODE)
    );
    // A kubelet on v1 reads the same, with the ledger's reason as the message.
    assert_eq!(
        v1_health(&n, &d0).await?,
        (hp::HealthStatus::Unhealthy, "critical Xid 79".to_string())
    );

    // An operator clears the Xid: healthy on the stream, the taint lifted.
    n.allocs
        .admin(0)?
        .set_device_health(api::SetDeviceHealthRequest {
            node: NODE.into(),
            gpu_uuid: n.nvml.gpus[0].uuid.clone(),
            healthy: true,
            reason: "GPU reset by the operator".into(),
            xid: 0,
        })
        .await?;
    wait_health(&n, &mut s, &d0, hp::HealthStatus::Healthy).await?;
    wait_device(&n, &d0, |d| !tainted(d)).await?;

    // GPU 1 falls off the bus (NVML answers GPU_IS_LOST), then answers again.
    let gpu1 = nvml.gpus[1].uuid.clone();
    nvml.set_lost(&gpu1, true)?;
    wait_health(&n, &mut s, &d1, hp::HealthStatus::Unhealthy).await?;
    let (dev, _) = wait_device(&n, &d1, tainted).await?;
    assert_eq!(
        dev["taints"][0]["value"], "GPU-is-lost--NVML--GPU_IS_LOST",
        "{dev}"
    );
    nvml.set_lost(&gpu1, false)?;
    wait_health(&n, &mut s, &d1, hp::HealthStatus::Healthy).await?;
    wait_device(&n, &d1, |d| !tainted(d)).await?;
    let l = n.allocs.ledger(0).await?;
    let node = l.node(NODE).context("node")?;
    assert!(node.gpus.iter().all(|g| g.healthy), "{:?}", node.gpus);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_execute_taints_and_tells_the_pods_on_the_gpu() -> Result<()> {
    let n = DraNode::start_with(|_| {}, &["--dra-unhealthy-taint=no-execute".to_string()]).await?;
    n.wait_slice(None).await?;
    let claim = n.add_claim("claim-uid-h", "gpu", 0, "share-h")?;
    n.api
        .store
        .update(
            "resource.k8s.io/v1",
            "resourceclaims",
            "team-a",
            "gpu",
            |c| {
                c["status"]["reservedFor"] =
                    json!([{"resource": "pods", "name": "trainer", "uid": "pod-uid-h"}]);
                Ok(())
            },
        )
        .map_err(|e| anyhow::anyhow!("{}", e.message()))?;
    n.allocs
        .admin(0)?
        .grant_claim(api::GrantClaimRequest {
            grant: Some(n.grant(&claim, 0, "share-h")),
        })
        .await?;
    let mut nvml = n.nvml.clone();
    nvml.add_xid(&nvml.gpus[0].uuid.clone(), 48)?;
    let (dev, _) = wait_device(&n, &n.device(0), tainted).await?;
    assert_eq!(dev["taints"][0]["effect"], "NoExecute", "{dev}");
    let t0 = Instant::now();
    let ev = loop {
        let events = n.api.store.objects("v1", "events");
        if let Some(e) = events
            .iter()
            .find(|e| e["involvedObject"]["name"] == "trainer" && e["reason"] == "GpuUnhealthy")
        {
            break e.clone();
        }
        if t0.elapsed() > Duration::from_secs(10) {
            bail!(
                "no GpuUnhealthy event for the pod: {events:#?}\n{}",
                n.log()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let msg = ev["message"].as_str().unwrap_or_default();
    assert!(msg.contains("NoExecute") && msg.contains("evicts"), "{msg}");
    assert_eq!(ev["involvedObject"]["uid"], "pod-uid-h", "{ev}");
    assert_eq!(ev["type"], "Warning", "{ev}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_device_taints_an_unhealthy_gpu_leaves_the_slice_and_dra_stays_on() -> Result<()> {
    // An API server with DRADeviceTaints off: taints vanish on every write.
    let n = DraNode::start_with(
        |api| {
            on_each_slice_device(api, |d| {
                if let Some(d) = d.as_object_mut() {
                    d.remove("taints");
                }
            })
        },
        &[],
    )
    .await?;
    n.wait_slice(None).await?;
    let mut nvml = n.nvml.clone();
    nvml.add_xid(&nvml.gpus[0].uuid.clone(), 79)?;
    let d0 = n.device(0);
    let t0 = Instant::now();
    loop {
        let names: Vec<String> = n
            .slices()
            .iter()
            .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
            .filter_map(|d| d["name"].as_str().map(String::from))
            .collect();
        if names.len() == 1 && !names.contains(&d0) {
            break;
        }
        if t0.elapsed() > Duration::from_secs(15) {
            bail!(
                "the unhealthy GPU never left the slice: {names:?}\n{}",
                n.log()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // DRA is still served on the healthy GPU.
    let claim = n.add_claim("claim-uid-t", "gpu", 1, "share-t")?;
    n.allocs
        .admin(0)?
        .grant_claim(api::GrantClaimRequest {
            grant: Some(n.grant(&claim, 1, "share-t")),
        })
        .await?;
    let r = n.dra.prepare(std::slice::from_ref(&claim)).await?;
    let a = &r.claims["claim-uid-t"];
    assert_eq!(a.error, "", "{}", n.log());
    assert_eq!(a.devices.len(), 1);
    Ok(())
}
