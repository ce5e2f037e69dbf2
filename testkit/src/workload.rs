//! Building blocks for driving the allocator: inventories, pod requests, retried reservations.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use gpuledger_auth::identity::Role;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use tonic::Status;

use crate::Allocators;

/// An inventory of `gpus` identical GPUs of `mem_mib` on node `name`.
pub fn inventory(name: &str, gpus: u32, mem_mib: u64, model: &str) -> pb::NodeInventory {
    pb::NodeInventory {
        mode: Default::default(),
        node: name.to_string(),
        gpus: (0..gpus)
            .map(|i| pb::Gpu {
                uuid: format!("GPU-{name}-{i}"),
                index: i,
                model: model.to_string(),
                memory_mib: mem_mib,
                healthy: true,
                compute_capability: String::new(),
            })
            .collect(),
        cpu_milli: 0,
        memory_mib: 0,
        isolation: String::new(),
        dra_cores: String::new(),
    }
}

/// A pod with one container asking for one slice of `mem_mib` and `core_pct` % compute.
pub fn pod(uid: &str, mem_mib: u64, core_pct: u32) -> api::PodRequest {
    api::PodRequest {
        pod: Some(pb::PodRef {
            uid: uid.to_string(),
            namespace: "default".into(),
            name: format!("pod-{uid}"),
        }),
        containers: vec![api::ContainerRequest {
            name: "main".into(),
            slices: 1,
            mem_mib,
            mem_percent: 0,
            core_milli: core_pct * 10,
        }],
        placement: None,
        cpu_milli: 0,
        memory_mib: 0,
        priority: 0,
        dra: false,
    }
}

/// The `spec` of a pod, scheduled by `scheduler`, that asks for exactly what `r` asks for in
/// gpuledger's resource names: the allocator compares an extender's reservation with it.
pub fn pod_spec(r: &api::PodRequest, scheduler: &str) -> serde_json::Value {
    use serde_json::{Map, Value, json};
    let mut containers: Vec<Value> = r
        .containers
        .iter()
        .map(|c| {
            let mut limits = Map::new();
            limits.insert("gpuledger.io/gpu".into(), json!(c.slices.to_string()));
            if c.mem_mib > 0 {
                limits.insert("gpuledger.io/gpu-mem".into(), json!(c.mem_mib.to_string()));
            }
            if c.mem_percent > 0 {
                limits.insert(
                    "gpuledger.io/gpu-mem-percent".into(),
                    json!(c.mem_percent.to_string()),
                );
            }
            if c.core_milli > 0 {
                let pct = format!("{}.{}", c.core_milli / 10, c.core_milli % 10);
                limits.insert("gpuledger.io/gpu-core".into(), json!(pct));
            }
            json!({"name": c.name, "image": "x", "resources": {"limits": limits}})
        })
        .collect();
    let mut requests = Map::new();
    if r.cpu_milli > 0 {
        requests.insert("cpu".into(), json!(format!("{}m", r.cpu_milli)));
    }
    if r.memory_mib > 0 {
        requests.insert("memory".into(), json!(format!("{}Mi", r.memory_mib)));
    }
    if let Some(first) = containers.first_mut() {
        first["resources"]["requests"] = Value::Object(requests);
    }
    json!({"schedulerName": scheduler, "containers": containers})
}

/// Reserve as the extender through the one client to every replica of `allocs`, starting at
/// replica `start`, until `deadline`. Returns the response and how many attempts it took.
pub async fn reserve_retry(
    allocs: &Allocators,
    start: usize,
    req: api::ReserveRequest,
    deadline: Instant,
) -> Result<(api::ReserveResponse, u32), Status> {
    let pool = allocs
        .pool_as(&Role::Extender)
        .map_err(|e| Status::unavailable(format!("{e:#}")))?;
    reserve_retry_via(&pool, start, req, deadline).await
}

/// [`reserve_retry`] through `pool` (connected once, reused).
pub async fn reserve_retry_via(
    pool: &gpuledger_client::Allocators,
    start: usize,
    req: api::ReserveRequest,
    deadline: Instant,
) -> Result<(api::ReserveResponse, u32), Status> {
    let attempts = AtomicU32::new(0);
    let budget = deadline.saturating_duration_since(Instant::now());
    let r = pool
        .starting_at(start)
        .call("Reserve", budget, |mut c| {
            attempts.fetch_add(1, Ordering::Relaxed);
            let req = req.clone();
            async move { c.reserve(req).await }
        })
        .await?;
    Ok((r, attempts.load(Ordering::Relaxed)))
}

/// Churn on node `node` through replica `via`: pods `p<from>`..`p<from + n>`, each reserved
/// (100 MiB, no compute); three in four released again, so the state stays small while the
/// log grows.
pub async fn churn(
    allocs: &Allocators,
    via: usize,
    node: &str,
    from: usize,
    n: usize,
) -> anyhow::Result<()> {
    for i in from..from + n {
        let req = api::ReserveRequest {
            request: Some(pod(&format!("p{i}"), 100, 0)),
            node: node.into(),
            ttl_ms: 0,
        };
        reserve_retry(allocs, via, req, Instant::now() + Duration::from_secs(10)).await?;
        if i % 4 != 0 {
            let rel = api::ReleaseRequest {
                pod_uid: format!("p{i}"),
                ..Default::default()
            };
            allocs.extender(via)?.release(rel).await?;
        }
    }
    Ok(())
}
