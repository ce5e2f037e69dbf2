//! Kubelet-less GPU nodes, for scheduling at scale: a Node object with the capacity a node
//! agent's device plugin would advertise, and the same GPUs registered with the allocator as
//! the node agent would register them. Pods bound there never run.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use futures::StreamExt;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, PostParams};
use serde_json::json;

/// Device IDs the node agent advertises per GPU by default (`--slots-per-gpu`).
pub const SLOTS_PER_GPU: u32 = 64;

/// The shape of the kubelet-less nodes.
#[derive(Debug, Clone)]
pub struct NodeShape {
    /// GPUs per node.
    pub gpus: u32,
    /// Memory of each GPU, MiB.
    pub gpu_mem_mib: u64,
    /// GPU model.
    pub model: String,
    /// Allocatable CPUs.
    pub cpus: u32,
    /// Allocatable memory, GiB.
    pub memory_gib: u32,
    /// Allocatable pods.
    pub pods: u32,
}

impl Default for NodeShape {
    fn default() -> NodeShape {
        NodeShape {
            gpus: 8,
            gpu_mem_mib: 16_384,
            model: "NVIDIA A10".into(),
            cpus: 64,
            memory_gib: 256,
            pods: 110,
        }
    }
}

/// The inventory a node agent would register for `name`.
pub fn inventory(name: &str, shape: &NodeShape) -> pb::NodeInventory {
    pb::NodeInventory {
        node: name.to_string(),
        gpus: (0..shape.gpus)
            .map(|i| pb::Gpu {
                uuid: format!("GPU-{name}-{i}"),
                index: i,
                model: shape.model.clone(),
                memory_mib: shape.gpu_mem_mib,
                healthy: true,
            })
            .collect(),
        cpu_milli: 0,
        memory_mib: 0,
    }
}

/// The Node object: Ready, with cpu, memory, pods and `gpuledger.io/gpu` (GPUs × slots).
pub fn node_object(name: &str, shape: &NodeShape) -> Result<Node> {
    let slots = (shape.gpus * SLOTS_PER_GPU).to_string();
    let res: BTreeMap<&str, String> = [
        ("cpu", shape.cpus.to_string()),
        ("memory", format!("{}Gi", shape.memory_gib)),
        ("pods", shape.pods.to_string()),
        ("gpuledger.io/gpu", slots),
    ]
    .into_iter()
    .collect();
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "gpuledger.io/e2e": "kubelet-less"}},
        "status": {
            "capacity": res,
            "allocatable": res,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletLess",
                            "message": "created by the e2e tier; no kubelet runs here"}],
        },
    }))?)
}

/// Create `names` as kubelet-less nodes of `shape` and register their GPUs with the allocator
/// at `allocator` (up to 64 at a time).
pub async fn add(
    client: &kube::Client,
    allocator: &str,
    names: &[String],
    shape: &NodeShape,
) -> Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let results = futures::stream::iter(names.iter().cloned().map(|n| {
        let nodes = nodes.clone();
        let addr = allocator.to_string();
        let shape = shape.clone();
        async move {
            nodes
                .create(&PostParams::default(), &node_object(&n, &shape)?)
                .await
                .with_context(|| format!("creating node {n}"))?;
            let mut c = gpuledger_testkit::allocators::client(&addr)?;
            c.register_node(api::RegisterNodeRequest {
                inventory: Some(inventory(&n, &shape)),
            })
            .await
            .with_context(|| format!("registering node {n} with the allocator"))?;
            anyhow::Ok(())
        }
    }))
    .buffer_unordered(64)
    .collect::<Vec<_>>()
    .await;
    results.into_iter().collect::<Result<Vec<_>>>()?;
    Ok(())
}
