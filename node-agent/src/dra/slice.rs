//! The node's ResourceSlice (`resource.k8s.io/v1`): one pool named after the node, one device
//! per healthy GPU of the ledger's registered inventory, shared by consumable capacity and
//! bound only once the ledger certifies an allocation. Republished when it goes missing (the
//! kubelet wipes a node's slices when it starts or loses the plugin) or is changed, and read
//! back: an API server with a feature gate off drops gated fields without an error, and the
//! agent then serves no DRA rather than let the scheduler hand out uncertified or exclusive
//! devices.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;
use gpuledger_proto::ledger::v1 as pb;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity,
    DeviceTaint, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::runtime::watcher;
use tokio::sync::Notify;
use tracing::{info, warn};

use super::DRIVER;
use crate::agent::Agent;
use gpuledger_request::dra;

/// The conditions the allocator sets once the ledger granted, or refused, an allocation.
pub use gpuledger_request::dra::{
    GRANTED as BINDING_CONDITION, REFUSED as BINDING_FAILURE_CONDITION,
};

/// How often the slice is checked even when nothing was heard.
const RESYNC: Duration = Duration::from_secs(30);
/// How long to wait after a failed API call.
const RETRY: Duration = Duration::from_secs(2);

/// The field selector of this node's slices of our driver.
pub fn selector(node: &str) -> String {
    format!("spec.nodeName={node},spec.driver={DRIVER}")
}

/// A ledger capacity and its request policy as a ResourceSlice capacity, amounts in `unit`.
fn capacity(c: &gpuledger_ledger::capacity::DeviceCapacity, unit: &str) -> DeviceCapacity {
    use gpuledger_ledger::capacity::Valid;
    let q = |v: u64| Quantity(format!("{v}{unit}"));
    DeviceCapacity {
        value: q(c.value),
        request_policy: c.policy.as_ref().map(|p| {
            let (valid_range, valid_values) = match &p.valid {
                Valid::Any => (None, None),
                Valid::Range { min, max, step } => (
                    Some(CapacityRequestPolicyRange {
                        min: q(*min),
                        max: max.map(q),
                        step: step.map(q),
                    }),
                    None,
                ),
                Valid::Values(v) => (None, Some(v.iter().copied().map(q).collect())),
            };
            CapacityRequestPolicy {
                default: p.default.map(q),
                valid_range,
                valid_values,
            }
        }),
    }
}

/// `"9.0"` as the semantic version `"9.0.0"`; None when it is not `major.minor`.
fn semver_of(cc: &str) -> Option<String> {
    let (major, minor) = cc.split_once('.')?;
    let (major, minor) = (major.parse::<u32>().ok()?, minor.parse::<u32>().ok()?);
    Some(format!("{major}.{minor}.0"))
}

/// The feature gate that keeps device taints in a slice (KEP-5055).
pub const TAINTS_GATE: &str = "DRADeviceTaints";

/// How the slice shows the GPUs the ledger holds unhealthy.
#[derive(Debug, Clone, Copy)]
pub enum Unhealthy<'a> {
    /// Left out of the slice: the API server drops device taints (their feature gate is off),
    /// and an untainted device would be handed out.
    Omitted,
    /// Published with the [`dra::UNHEALTHY_TAINT`] taint of `effect` (`NoSchedule` or
    /// `NoExecute`), its value the ledger's reason by GPU UUID where known.
    Tainted {
        /// The taint's effect.
        effect: &'a str,
        /// Why each unhealthy GPU is so.
        reasons: &'a BTreeMap<String, String>,
    },
}

/// `reason` as a taint value (a label value: at most 63 of `[A-Za-z0-9._-]`, alphanumeric at
/// both ends); None when nothing of it is left.
pub fn taint_value(reason: &str) -> Option<String> {
    let v: String = reason
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '_' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    let v = v.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    (!v.is_empty()).then(|| v.to_string())
}

/// The devices of `inv` in index order (the scheduler's first-fit order): every GPU, an
/// unhealthy one tainted, or left out as `unhealthy` says.
pub fn devices(inv: &pb::NodeInventory, unhealthy: Unhealthy<'_>) -> Vec<Device> {
    // An unknown unit (from a newer allocator) publishes thousandths, which certification of
    // that allocator refuses by name rather than mis-reading.
    let cores = dra::CoresUnit::of_record(&inv.dra_cores).unwrap_or_default();
    let mut gpus: Vec<&pb::Gpu> = inv
        .gpus
        .iter()
        .filter(|g| g.healthy || matches!(unhealthy, Unhealthy::Tainted { .. }))
        .collect();
    gpus.sort_by_key(|g| g.index);
    gpus.into_iter()
        .map(|g| {
            let attributes = BTreeMap::from([
                (
                    "uuid".to_string(),
                    DeviceAttribute {
                        string: Some(g.uuid.clone()),
                        ..Default::default()
                    },
                ),
                (
                    "index".to_string(),
                    DeviceAttribute {
                        int: Some(i64::from(g.index)),
                        ..Default::default()
                    },
                ),
                (
                    "productName".to_string(),
                    DeviceAttribute {
                        string: Some(g.model.clone()),
                        ..Default::default()
                    },
                ),
                (
                    "memoryMiB".to_string(),
                    DeviceAttribute {
                        int: Some(i64::try_from(g.memory_mib).unwrap_or(i64::MAX)),
                        ..Default::default()
                    },
                ),
            ]);
            let mut attributes = attributes;
            // A version attribute (semver), as NVIDIA's driver publishes it: CEL selectors
            // compare it, e.g. `device.attributes["gpu.gpuledger.io"].cudaComputeCapability
            // .isGreaterThan(semver("8.0.0"))`.
            if let Some(v) = semver_of(&g.compute_capability) {
                attributes.insert(
                    "cudaComputeCapability".to_string(),
                    DeviceAttribute {
                        version: Some(v),
                        ..Default::default()
                    },
                );
            }
            // The policy the allocator checks every grant against: one definition, in the ledger.
            // `cores` in the unit the allocator recorded for the cluster: thousandths (1000),
            // or milli-units of the GPU (1000m = 1), which makes the scheduler use
            // DRAFractionalCapacityRange's milli arithmetic.
            let caps = gpuledger_ledger::capacity::GpuCapacities::of_gpu(g.memory_mib);
            let capacity = BTreeMap::from([
                (dra::MEMORY.to_string(), capacity(&caps.memory, "Mi")),
                (
                    dra::CORES.to_string(),
                    capacity(&caps.cores, cores.suffix()),
                ),
            ]);
            let taints = match unhealthy {
                Unhealthy::Tainted { effect, reasons } if !g.healthy => Some(vec![DeviceTaint {
                    key: dra::UNHEALTHY_TAINT.into(),
                    value: reasons.get(&g.uuid).and_then(|r| taint_value(r)),
                    effect: effect.into(),
                    // Set by the API server when the taint is added.
                    time_added: None,
                }]),
                _ => None,
            };
            Device {
                name: gpuledger_ledger::state::dra_device_name(&g.uuid),
                allow_multiple_allocations: Some(true),
                attributes: Some(attributes),
                capacity: Some(capacity),
                binding_conditions: Some(vec![BINDING_CONDITION.into()]),
                binding_failure_conditions: Some(vec![BINDING_FAILURE_CONDITION.into()]),
                taints,
                ..Default::default()
            }
        })
        .collect()
}

/// The feature gates whose fields `stored` lost against what was written (`sent`), with the
/// fields; empty when every gated field survived.
pub fn dropped_gates(sent: &[Device], stored: &[Device]) -> Vec<(&'static str, &'static str)> {
    let mut out = Vec::new();
    let mut note = |gate, field| {
        if !out.contains(&(gate, field)) {
            out.push((gate, field));
        }
    };
    for s in sent {
        let Some(d) = stored.iter().find(|d| d.name == s.name) else {
            continue;
        };
        if s.allow_multiple_allocations.is_some() && d.allow_multiple_allocations.is_none() {
            note("DRAConsumableCapacity", "allowMultipleAllocations");
        }
        let policies = |d: &Device| {
            d.capacity
                .iter()
                .flatten()
                .filter(|(_, c)| c.request_policy.is_some())
                .count()
        };
        if policies(d) < policies(s) {
            note("DRAConsumableCapacity", "capacity.requestPolicy");
        }
        if s.binding_conditions.is_some() && d.binding_conditions.is_none() {
            note("DRADeviceBindingConditions", "bindingConditions");
        }
        if s.binding_failure_conditions.is_some() && d.binding_failure_conditions.is_none() {
            note("DRADeviceBindingConditions", "bindingFailureConditions");
        }
        if s.taints.is_some() && d.taints.is_none() {
            note(TAINTS_GATE, "taints");
        }
    }
    out
}

/// The slice to write for `node` with `devices`, owned by the Node `owner` when known (also
/// what the e2e tier and the benchmark write for kubelet-less nodes).
pub fn slice(
    node: &str,
    owner: Option<&Node>,
    devices: Vec<Device>,
    generation: i64,
) -> ResourceSlice {
    let owner_references = owner.and_then(|n| {
        Some(vec![OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: node.into(),
            uid: n.metadata.uid.clone()?,
            controller: Some(true),
            block_owner_deletion: None,
        }])
    });
    ResourceSlice {
        metadata: ObjectMeta {
            generate_name: Some(format!("{node}-{DRIVER}-")),
            owner_references,
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: DRIVER.into(),
            node_name: Some(node.into()),
            pool: ResourcePool {
                name: node.into(),
                generation,
                resource_slice_count: 1,
            },
            devices: Some(devices),
            ..Default::default()
        },
    }
}

/// Publish and keep the node's slice until the task is dropped.
pub async fn publish(agent: Arc<Agent>) {
    let client = loop {
        if let Some(c) = agent.kube.get() {
            break c.clone();
        }
        if !agent.synced() {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        warn!(
            "--mode=dra without a Kubernetes API client (--kubeconfig): no ResourceSlice, every prepare fails"
        );
        return;
    };
    let node = agent.cfg.node_name.clone();
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let heard = Arc::new(Notify::new());
    let h = heard.clone();
    let w = watcher(
        api.clone(),
        watcher::Config::default().fields(&selector(&node)),
    );
    // Stopped with this task.
    let _watching = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
        let mut w = std::pin::pin!(w);
        while let Some(ev) = w.next().await {
            if let Err(e) = ev {
                tracing::debug!("watching the node's ResourceSlices: {e}");
            }
            h.notify_one();
        }
    }));
    let mut changes = agent.view_changes();
    // What the last write asked for, and what the server stored.
    let mut wrote: Option<(Vec<Device>, Vec<Device>)> = None;
    let mut generation = 0i64;
    // Whether the API server's copy must be looked at (heard of, due, or after an error);
    // otherwise only a changed inventory is written. Allocations change the view often and
    // the slice never.
    let mut look = true;
    // The GPUs whose taint the pods on them were told of.
    let mut told = BTreeSet::new();
    loop {
        // Before the view is read: a change that lands while the slice is being written (an
        // operator clearing the mark just tainted) wakes the wait below at once, rather than
        // being lost until the next resync.
        changes.mark_unchanged();
        let (inv, reasons) = agent.with_view(|v| (v.inventory.clone(), v.health_reasons.clone()));
        let unhealthy = if agent.dra_taints_off.load(Ordering::Acquire) {
            Unhealthy::Omitted
        } else {
            Unhealthy::Tainted {
                effect: agent.cfg.dra_unhealthy_taint.as_str(),
                reasons: &reasons,
            }
        };
        let wanted = match &inv {
            Some(i) if i.mode == pb::NodeMode::Dra as i32 => Some(devices(i, unhealthy)),
            _ => None,
        };
        let tainted_now: BTreeSet<String> = match (&wanted, unhealthy) {
            (Some(w), Unhealthy::Tainted { .. }) => w
                .iter()
                .filter(|d| d.taints.is_some())
                .filter_map(|d| d.attributes.as_ref()?.get("uuid")?.string.clone())
                .collect(),
            _ => BTreeSet::new(),
        };
        if let Some(wanted) = wanted
            && (look || wrote.as_ref().is_none_or(|(sent, _)| *sent != wanted))
        {
            let r = sync(
                &agent,
                &api,
                &client,
                &node,
                wanted,
                &mut wrote,
                &mut generation,
            )
            .await;
            if let Err(e) = r {
                warn!(node = %node, "publishing the node's ResourceSlice: {e}");
                tokio::time::sleep(RETRY).await;
                continue;
            }
        }
        // The taint is on the slice now: tell the pods on each newly tainted GPU.
        let effect = agent.cfg.dra_unhealthy_taint.as_str();
        for gpu in tainted_now.difference(&told) {
            let (agent, client, gpu) = (agent.clone(), client.clone(), gpu.clone());
            tokio::spawn(
                async move { super::unhealthy::tell(&agent, &client, &gpu, effect).await },
            );
        }
        told = tainted_now;
        look = tokio::select! {
            _ = heard.notified() => true,
            _ = changes.changed() => false,
            _ = tokio::time::sleep(RESYNC) => true,
        };
    }
}

/// Make the node's slice what `wanted` says, when it is missing or not what was last written.
async fn sync(
    agent: &Agent,
    api: &Api<ResourceSlice>,
    client: &kube::Client,
    node: &str,
    wanted: Vec<Device>,
    wrote: &mut Option<(Vec<Device>, Vec<Device>)>,
    generation: &mut i64,
) -> Result<(), kube::Error> {
    let mut mine = api
        .list(&ListParams::default().fields(&selector(node)))
        .await?
        .items;
    mine.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    // One slice per node: extra ones (a write whose answer was lost) go.
    for extra in mine.iter().skip(1) {
        if let Some(n) = &extra.metadata.name {
            let _ = api.delete(n, &DeleteParams::default()).await;
        }
    }
    let current = mine.into_iter().next();
    let stored_devices = current.as_ref().and_then(|s| s.spec.devices.clone());
    let up_to_date = match (wrote.as_ref(), &stored_devices) {
        (Some((sent, stored)), Some(now)) => *sent == wanted && stored == now,
        _ => false,
    };
    if up_to_date {
        return Ok(());
    }
    let owner = Api::<Node>::all(client.clone())
        .get_opt(node)
        .await
        .ok()
        .flatten();
    if owner.is_none() {
        warn!(
            node,
            "no Node object to own the ResourceSlice: publishing it without an owner"
        );
    }
    *generation = (*generation).max(current.as_ref().map_or(0, |s| s.spec.pool.generation)) + 1;
    let mut want = slice(node, owner.as_ref(), wanted.clone(), *generation);
    let (why, written) = match current {
        None => ("missing", api.create(&PostParams::default(), &want).await?),
        Some(cur) => {
            want.metadata.name = cur.metadata.name.clone();
            want.metadata.generate_name = None;
            want.metadata.resource_version = cur.metadata.resource_version.clone();
            let name = cur.metadata.name.clone().unwrap_or_default();
            (
                "changed",
                api.replace(&name, &PostParams::default(), &want).await?,
            )
        }
    };
    agent
        .metrics
        .slice_writes
        .get_or_create(&vec![("why", why.to_string())])
        .inc();
    let stored = written.spec.devices.clone().unwrap_or_default();
    let mut dropped = dropped_gates(&wanted, &stored);
    // Without taints an unhealthy GPU would look usable: leave it out instead (the next pass
    // writes the slice again), and keep serving DRA on the healthy ones.
    if dropped.iter().any(|(g, _)| *g == TAINTS_GATE) {
        warn!(
            node,
            slice = %written.metadata.name.as_deref().unwrap_or_default(),
            "the API server dropped device taints (feature gate {TAINTS_GATE} off): unhealthy GPUs are left out of the slice instead"
        );
        agent.dra_taints_off.store(true, Ordering::Release);
        dropped.retain(|(g, _)| *g != TAINTS_GATE);
    }
    let taints_off = agent.dra_taints_off.load(Ordering::Acquire);
    agent
        .metrics
        .dra_gate_off
        .get_or_create(&vec![("gate", TAINTS_GATE.to_string())])
        .set(i64::from(taints_off));
    for gate in ["DRAConsumableCapacity", "DRADeviceBindingConditions"] {
        let off = dropped.iter().any(|(g, _)| *g == gate);
        agent
            .metrics
            .dra_gate_off
            .get_or_create(&vec![("gate", gate.to_string())])
            .set(i64::from(off));
    }
    let name = written.metadata.name.clone().unwrap_or_default();
    let off = (!dropped.is_empty()).then(|| {
        let what: Vec<String> = dropped
            .iter()
            .map(|(g, f)| format!("{f} (feature gate {g})"))
            .collect();
        format!(
            "the API server dropped {} from ResourceSlice {name}: turn the feature gate on in kube-apiserver, kube-scheduler and the kubelet",
            what.join(", ")
        )
    });
    match &off {
        Some(why) => warn!(node, "serving no DRA: {why}"),
        None => {
            info!(node, slice = %name, generation = *generation, devices = wanted.len(), why, "ResourceSlice published")
        }
    }
    *agent.dra_off.lock().unwrap_or_else(|p| p.into_inner()) = off;
    *wrote = Some((wanted, stored));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_per_gpu_in_index_order_with_the_gated_fields_and_unhealthy_ones_tainted() {
        let inv = pb::NodeInventory {
            node: "n1".into(),
            gpus: vec![
                pb::Gpu {
                    uuid: "GPU-BB".into(),
                    index: 1,
                    model: "H100".into(),
                    memory_mib: 81079,
                    healthy: true,
                    compute_capability: String::new(),
                },
                pb::Gpu {
                    uuid: "GPU-AA".into(),
                    index: 0,
                    model: "H100".into(),
                    memory_mib: 81079,
                    healthy: true,
                    compute_capability: String::new(),
                },
                pb::Gpu {
                    uuid: "GPU-CC".into(),
                    index: 2,
                    model: "H100".into(),
                    memory_mib: 81079,
                    healthy: false,
                    compute_capability: String::new(),
                },
            ],
            ..Default::default()
        };
        let reasons = BTreeMap::from([("GPU-CC".to_string(), "critical Xid 79".to_string())]);
        let tainted = devices(
            &inv,
            Unhealthy::Tainted {
                effect: "NoSchedule",
                reasons: &reasons,
            },
        );
        let names: Vec<&str> = tainted.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["gpu-aa", "gpu-bb", "gpu-cc"]);
        assert_eq!(tainted[0].taints, None, "a healthy GPU carries no taint");
        let t = tainted[2]
            .taints
            .as_deref()
            .expect("the unhealthy GPU is tainted");
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].key, "gpu.gpuledger.io/unhealthy");
        assert_eq!(t[0].effect, "NoSchedule");
        assert_eq!(t[0].value.as_deref(), Some("critical-Xid-79"));
        let mut stored = tainted.clone();
        stored[2].taints = None;
        assert_eq!(dropped_gates(&tainted, &stored), [(TAINTS_GATE, "taints")]);
        let d = devices(&inv, Unhealthy::Omitted);
        let names: Vec<&str> = d.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(
            names,
            ["gpu-aa", "gpu-bb"],
            "no taints: the unhealthy GPU is left out"
        );
        let cap = d[0].capacity.as_ref().expect("capacity");
        assert_eq!(cap["memory"].value.0, "81079Mi");
        assert_eq!(cap["cores"].value.0, "1000");
        let range = |cap: &BTreeMap<String, DeviceCapacity>| {
            let p = cap["cores"].request_policy.clone().expect("policy");
            let r = p.valid_range.expect("range");
            (
                p.default.expect("default").0,
                r.min.0,
                r.step.expect("step").0,
            )
        };
        assert_eq!(range(cap), ("1000".into(), "0".into(), "1".into()));
        // In the fraction unit the GPU is 1 (1000m), requested in steps of 0.001.
        let fraction = devices(
            &pb::NodeInventory {
                dra_cores: "fraction".into(),
                ..inv.clone()
            },
            Unhealthy::Omitted,
        );
        let cap = fraction[0].capacity.as_ref().expect("capacity");
        assert_eq!(cap["cores"].value.0, "1000m");
        assert_eq!(range(cap), ("1000m".into(), "0m".into(), "1m".into()));
        assert_eq!(cap["memory"].value.0, "81079Mi");
        assert!(dropped_gates(&d, &d).is_empty());
        let mut stripped = d.clone();
        for s in &mut stripped {
            s.allow_multiple_allocations = None;
            s.binding_conditions = None;
        }
        let gates: Vec<&str> = dropped_gates(&d, &stripped)
            .iter()
            .map(|(g, _)| *g)
            .collect();
        assert_eq!(
            gates,
            ["DRAConsumableCapacity", "DRADeviceBindingConditions"]
        );
    }

    #[test]
    fn taint_values_are_label_values() {
        assert_eq!(taint_value("GPU is lost").as_deref(), Some("GPU-is-lost"));
        assert_eq!(taint_value("  (Xid 79)  ").as_deref(), Some("Xid-79"));
        assert_eq!(taint_value("::"), None);
        assert_eq!(taint_value(""), None);
        let long = taint_value(&"x".repeat(100)).expect("long");
        assert_eq!(long.len(), 63);
        assert_eq!(
            taint_value(&format!("{}-tail", "a".repeat(62))).as_deref(),
            Some(&*"a".repeat(62))
        );
    }
}
