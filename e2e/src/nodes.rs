//! Kubelet-less GPU nodes, for scheduling at scale: a Node object with the capacity a node
//! agent's device plugin would advertise, and the same GPUs registered with the allocator as
//! the node agent would register them. Pods bound there never run. kube-controller-manager's
//! node lifecycle controller watches them as any node: a [`Heartbeat`] renews their Leases as
//! their kubelets would, and a new node is used once the controller has lifted the
//! `not-ready` taint the API server put on it. A DRA node (`NodeShape::dra`) gets the
//! ResourceSlice its agent would publish instead of the device plugin's extended resource.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use gpuledger_node_agent::dra::slice;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, Patch, PatchParams, PostParams};
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
    /// DRA mode: registered as `NODE_MODE_DRA`, no `gpuledger.io/gpu` on the Node, and the
    /// ResourceSlice its node agent would publish (the agent's own builder) written for it.
    pub dra: bool,
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
            dra: false,
        }
    }
}

/// The inventory a node agent would register for `name`.
pub fn inventory(name: &str, shape: &NodeShape) -> pb::NodeInventory {
    let mode = match shape.dra {
        true => pb::NodeMode::Dra,
        false => pb::NodeMode::DevicePlugin,
    };
    pb::NodeInventory {
        mode: mode as i32,
        node: name.to_string(),
        gpus: (0..shape.gpus)
            .map(|i| pb::Gpu {
                uuid: format!("GPU-{name}-{i}"),
                index: i,
                model: shape.model.clone(),
                memory_mib: shape.gpu_mem_mib,
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

/// The Node object: Ready, with cpu, memory, pods and, on a device-plugin node,
/// `gpuledger.io/gpu` (GPUs × slots).
pub fn node_object(name: &str, shape: &NodeShape) -> Result<Node> {
    let slots = (shape.gpus * SLOTS_PER_GPU).to_string();
    let mut res: BTreeMap<&str, String> = [
        ("cpu", shape.cpus.to_string()),
        ("memory", format!("{}Gi", shape.memory_gib)),
        ("pods", shape.pods.to_string()),
    ]
    .into_iter()
    .collect();
    if !shape.dra {
        res.insert("gpuledger.io/gpu", slots);
    }
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "gpuledger.io/e2e": "kubelet-less"}},
        "status": {
            "capacity": res,
            "allocatable": res,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletLess",
                            "lastHeartbeatTime": now(),
                            "message": "created by the e2e tier; no kubelet runs here"}],
        },
    }))?)
}

/// Now as a Kubernetes `Time` (whole seconds).
fn now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

/// Now as a Kubernetes `MicroTime` (exactly six fractional digits).
fn micro_now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S%.6fZ")
        .to_string()
}

/// How often a kubelet-less node's Lease is renewed (kube-controller-manager's grace period is
/// 50 s, a kubelet's renewal interval 10 s).
pub const LEASE_RENEWAL: Duration = Duration::from_secs(15);

/// Renews the Leases of the kubelet-less nodes in `kube-node-lease`, as their kubelets would,
/// so that the node lifecycle controller keeps them Ready. Stops when dropped.
pub struct Heartbeat {
    names: Arc<Mutex<Vec<String>>>,
    leases: Api<Lease>,
    task: tokio::task::JoinHandle<()>,
}

impl Heartbeat {
    /// Start renewing (no node yet).
    pub fn start(client: &kube::Client) -> Heartbeat {
        let names: Arc<Mutex<Vec<String>>> = Arc::default();
        let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-node-lease");
        let task = tokio::spawn({
            let names = names.clone();
            async move {
                loop {
                    tokio::time::sleep(LEASE_RENEWAL).await;
                    let now: Vec<String> = names.lock().map(|n| n.clone()).unwrap_or_default();
                    futures::stream::iter(now)
                        .for_each_concurrent(32, |n| {
                            let leases = leases.clone();
                            async move {
                                if let Err(e) = renew(&leases, &n).await {
                                    eprintln!("renewing the Lease of kubelet-less node {n}: {e:#}");
                                }
                            }
                        })
                        .await;
                }
            }
        });
        Heartbeat {
            names,
            leases: Api::namespaced(client.clone(), "kube-node-lease"),
            task,
        }
    }

    fn add(&self, name: &str) {
        if let Ok(mut n) = self.names.lock() {
            n.push(name.to_string());
        }
    }

    /// Create the Lease of kubelet-less node `name` and renew it from now on.
    pub async fn keep(&self, name: &str) -> Result<()> {
        renew(&self.leases, name)
            .await
            .with_context(|| format!("creating the Lease of node {name}"))?;
        self.add(name);
        Ok(())
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Create or renew the node's Lease, as its kubelet does.
async fn renew(leases: &Api<Lease>, node: &str) -> Result<()> {
    let lease = json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": node, "namespace": "kube-node-lease"},
        "spec": {"holderIdentity": node, "leaseDurationSeconds": 40, "renewTime": micro_now()},
    });
    leases
        .patch(
            node,
            &PatchParams::apply("gpuledger-e2e-heartbeat").force(),
            &Patch::Apply(&lease),
        )
        .await?;
    Ok(())
}

/// Create `names` as kubelet-less nodes of `shape`, keep them alive with `heartbeat` and
/// register their GPUs with replica 0 of `allocs`, each as its node's agent would (up to 64 at
/// a time); return once the node lifecycle controller has lifted every new node's `not-ready`
/// taint.
pub async fn add(
    client: &kube::Client,
    (allocs, heartbeat): (&gpuledger_testkit::Allocators, &Heartbeat),
    names: &[String],
    shape: &NodeShape,
) -> Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let results = futures::stream::iter(names.iter().cloned().map(|n| {
        let nodes = nodes.clone();
        let slices = slices.clone();
        let shape = shape.clone();
        async move {
            let node = nodes
                .create(&PostParams::default(), &node_object(&n, &shape)?)
                .await
                .with_context(|| format!("creating node {n}"))?;
            heartbeat.keep(&n).await?;
            let mut c = allocs.node_agent(0, &n)?;
            c.register_node(api::RegisterNodeRequest {
                inventory: Some(inventory(&n, &shape)),
            })
            .await
            .with_context(|| format!("registering node {n} with the allocator"))?;
            if shape.dra {
                let inv = inventory(&n, &shape);
                let s = slice::slice(
                    &n,
                    Some(&node),
                    slice::devices(&inv, slice::Unhealthy::Omitted),
                    0,
                );
                slices
                    .create(&PostParams::default(), &s)
                    .await
                    .with_context(|| format!("creating the ResourceSlice of node {n}"))?;
            }
            anyhow::Ok(())
        }
    }))
    .buffer_unordered(64)
    .collect::<Vec<_>>()
    .await;
    results.into_iter().collect::<Result<Vec<_>>>()?;
    wait_untainted(client, names).await
}

/// Wait until the node lifecycle controller has lifted the `not-ready` taint the API server
/// put on each of the new nodes `names`.
pub async fn wait_untainted(client: &kube::Client, names: &[String]) -> Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    crate::until(
        "the node lifecycle controller lifts the new nodes' not-ready taint",
        Duration::from_secs(60 + names.len() as u64 / 20),
        || async {
            let list = nodes.list(&kube::api::ListParams::default()).await?;
            let tainted = list
                .items
                .iter()
                .filter(|n| names.iter().any(|x| Some(x) == n.metadata.name.as_ref()))
                .filter(|n| {
                    n.spec
                        .as_ref()
                        .and_then(|s| s.taints.as_ref())
                        .is_some_and(|t| !t.is_empty())
                })
                .count();
            Ok((tainted == 0).then_some(()))
        },
    )
    .await
}
