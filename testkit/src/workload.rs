//! Building blocks for driving the allocator: inventories, pod requests, retrying clients.

use std::time::{Duration, Instant};

use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use tonic::{Code, Status};

use crate::allocators::client;

/// An inventory of `gpus` identical GPUs of `mem_mib` on node `name`.
pub fn inventory(name: &str, gpus: u32, mem_mib: u64, model: &str) -> pb::NodeInventory {
    pb::NodeInventory {
        node: name.to_string(),
        gpus: (0..gpus)
            .map(|i| pb::Gpu {
                uuid: format!("GPU-{name}-{i}"),
                index: i,
                model: model.to_string(),
                memory_mib: mem_mib,
                healthy: true,
            })
            .collect(),
        cpu_milli: 0,
        memory_mib: 0,
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
    }
}

/// Whether a status means "try again (maybe elsewhere)".
pub fn retryable(s: &Status) -> bool {
    matches!(
        s.code(),
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown
    )
}

/// Reserve through any of `addrs`, starting at `start`, retrying retryable errors until
/// `deadline`. Returns the response and how many attempts it took.
pub async fn reserve_retry(
    addrs: &[String],
    start: usize,
    req: api::ReserveRequest,
    deadline: Instant,
) -> Result<(api::ReserveResponse, u32), Status> {
    let mut i = start;
    let mut attempts = 0;
    loop {
        attempts += 1;
        let addr = &addrs[i % addrs.len()];
        let res = match client(addr) {
            Ok(mut c) => c
                .reserve(req.clone())
                .await
                .map(tonic::Response::into_inner),
            Err(e) => Err(Status::unavailable(e.to_string())),
        };
        match res {
            Ok(r) => return Ok((r, attempts)),
            Err(s) if retryable(&s) && Instant::now() < deadline => {
                i += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(s) => return Err(s),
        }
    }
}

/// Churn on node `node` through replica `via`: pods `p<from>`..`p<from + n>`, each reserved
/// (100 MiB, no compute); three in four released again, so the state stays small while the
/// log grows.
pub async fn churn(
    allocs: &crate::Allocators,
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
        reserve_retry(
            &allocs.addrs,
            via,
            req,
            Instant::now() + Duration::from_secs(10),
        )
        .await?;
        if i % 4 != 0 {
            let rel = api::ReleaseRequest {
                pod_uid: format!("p{i}"),
                ..Default::default()
            };
            allocs.client(via)?.release(rel).await?;
        }
    }
    Ok(())
}
