//! What another GPU scheduler recorded on a pod it placed: HAMi, gpushare and gpu-manager each
//! write the GPUs they chose into the pod's annotations, in their own encoding. `gpuledger
//! adopt` reads them here and turns them into grants on the registered GPUs. Pure: a pod in, the
//! peer's grant (or why it cannot be read) out; the GPUs are resolved against the ledger's
//! inventory by the caller.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod};

use crate::{ALIYUN_GPU_MEM, ContainerGpu, VCUDA_CORE, parse_quantity};

/// HAMi: the devices each container was given, `uuid,type,MiB,cores%` joined by `:` within a
/// container and `;` between containers (init containers first, then regular ones).
pub const HAMI_ALLOCATED: &str = "hami.io/vgpu-devices-allocated";
/// HAMi: the node its scheduler chose.
pub const HAMI_NODE: &str = "hami.io/vgpu-node";
/// HAMi: `allocating` until its device plugin handed the devices over, then `success`.
pub const HAMI_BIND_PHASE: &str = "hami.io/bind-phase";
/// gpushare: index of the GPU on the node.
pub const GPUSHARE_IDX: &str = "ALIYUN_COM_GPU_MEM_IDX";
/// gpushare: the pod's GPU memory, in its device plugin's unit (GiB, or MiB).
pub const GPUSHARE_POD: &str = "ALIYUN_COM_GPU_MEM_POD";
/// gpushare: one GPU's memory, in the same unit.
pub const GPUSHARE_DEV: &str = "ALIYUN_COM_GPU_MEM_DEV";
/// gpushare: `false` until its device plugin handed the GPU over, then `true`.
pub const GPUSHARE_ASSIGNED: &str = "ALIYUN_COM_GPU_MEM_ASSIGNED";
/// gpu-manager: prefix of the GPU indices chosen for container N (`…-idx-N`: `0` or `0,1`).
pub const GPU_MANAGER_IDX_PREFIX: &str = "tencent.com/predicate-gpu-idx-";
/// gpu-manager: the node gpu-admission chose.
pub const GPU_MANAGER_NODE: &str = "tencent.com/predicate-node";
/// gpu-manager: `false` until its device plugin handed the GPUs over, then `true`.
pub const GPU_MANAGER_ASSIGNED: &str = "tencent.com/gpu-assigned";

/// The schedulers whose placements can be adopted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Peer {
    /// Project HAMi (`hami.io/*` annotations, NVIDIA GPUs).
    Hami,
    /// AliyunContainerService gpushare-scheduler-extender (`ALIYUN_COM_GPU_MEM_*`).
    Gpushare,
    /// tkestack gpu-manager with gpu-admission (`tencent.com/*`).
    GpuManager,
}

impl Peer {
    /// The name recorded as the grant's source (`adopted-from=<name>`).
    pub fn as_str(self) -> &'static str {
        match self {
            Peer::Hami => "hami",
            Peer::Gpushare => "gpushare",
            Peer::GpuManager => "gpu-manager",
        }
    }
}

/// A GPU as the peer names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceRef {
    /// By NVML UUID (HAMi).
    Uuid(String),
    /// By index on the node (gpushare, gpu-manager).
    Index(u32),
}

/// GPU memory as the peer counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerMemory {
    /// MiB.
    Mib(u64),
    /// `units` of a GPU whose whole memory the peer counts as `per_gpu` units (gpushare, whose
    /// unit is its device plugin's choice): the share is that fraction of the GPU's memory.
    Fraction {
        /// The share.
        units: u64,
        /// The whole GPU.
        per_gpu: u64,
    },
    /// The whole GPU's memory (gpu-manager's exclusive GPUs).
    Whole,
}

/// One share of one GPU as the peer recorded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerShare {
    /// Which GPU.
    pub device: DeviceRef,
    /// How much of its memory.
    pub memory: PeerMemory,
    /// Compute in thousandths of the GPU (0: the peer promised none).
    pub core_milli: u32,
}

/// One container's shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerContainer {
    /// Container name.
    pub name: String,
    /// Its shares, on distinct GPUs.
    pub shares: Vec<PeerShare>,
}

/// What a peer recorded for a pod it placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerGrant {
    /// Who placed it.
    pub peer: Peer,
    /// The node it runs on.
    pub node: String,
    /// The GPU containers (regular containers: init containers have finished in a running pod).
    pub containers: Vec<PeerContainer>,
}

/// What the peer that placed `pod` recorded: None when no peer's annotations are on it, else
/// the grant, or why it cannot be adopted (partial or contradictory annotations, devices not
/// handed over yet).
pub fn recorded(pod: &Pod) -> Option<Result<PeerGrant, String>> {
    let empty = BTreeMap::new();
    let ann = pod.metadata.annotations.as_ref().unwrap_or(&empty);
    let peers: Vec<Peer> = [
        (
            Peer::Hami,
            ann.contains_key(HAMI_ALLOCATED) || ann.contains_key(HAMI_NODE),
        ),
        (
            Peer::Gpushare,
            [GPUSHARE_IDX, GPUSHARE_POD, GPUSHARE_DEV]
                .iter()
                .any(|k| ann.contains_key(*k)),
        ),
        (
            Peer::GpuManager,
            ann.contains_key(GPU_MANAGER_ASSIGNED)
                || ann.keys().any(|k| k.starts_with(GPU_MANAGER_IDX_PREFIX)),
        ),
    ]
    .into_iter()
    .filter_map(|(p, on)| on.then_some(p))
    .collect();
    let peer = match peers.as_slice() {
        [] => return None,
        [p] => *p,
        many => {
            let names: Vec<&str> = many.iter().map(|p| p.as_str()).collect();
            return Some(Err(format!(
                "annotations of {} at once: which placed it is unclear",
                names.join(" and ")
            )));
        }
    };
    let node = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    if node.is_empty() {
        return Some(Err(format!(
            "{} chose GPUs but the pod is not bound to a node yet",
            peer.as_str()
        )));
    }
    let containers = match peer {
        Peer::Hami => hami(pod, ann, &node),
        Peer::Gpushare => gpushare(pod, ann),
        Peer::GpuManager => gpu_manager(pod, ann, &node),
    };
    Some(containers.and_then(|containers| {
        if containers.iter().all(|c| c.shares.is_empty()) {
            return Err(format!(
                "{} recorded no GPU for any container",
                peer.as_str()
            ));
        }
        Ok(PeerGrant {
            peer,
            node,
            containers: containers
                .into_iter()
                .filter(|c| !c.shares.is_empty())
                .collect(),
        })
    }))
}

fn need<'a>(ann: &'a BTreeMap<String, String>, key: &str, peer: Peer) -> Result<&'a str, String> {
    ann.get(key)
        .map(|v| v.trim())
        .ok_or_else(|| format!("partial {} annotations: {key} is missing", peer.as_str()))
}

fn regular(pod: &Pod) -> &[Container] {
    match &pod.spec {
        Some(s) => &s.containers,
        None => &[],
    }
}

fn hami(
    pod: &Pod,
    ann: &BTreeMap<String, String>,
    node: &str,
) -> Result<Vec<PeerContainer>, String> {
    let chosen = need(ann, HAMI_NODE, Peer::Hami)?;
    if chosen != node {
        return Err(format!(
            "HAMi chose node {chosen:?} ({HAMI_NODE}) but the pod is bound to {node}"
        ));
    }
    match need(ann, HAMI_BIND_PHASE, Peer::Hami)? {
        "success" => {}
        "allocating" => {
            return Err(format!(
                "HAMi's device plugin has not handed the devices over yet ({HAMI_BIND_PHASE} \
                 allocating): adopt it once it runs"
            ));
        }
        other => return Err(format!("HAMi's bind failed ({HAMI_BIND_PHASE} {other:?})")),
    }
    let allocated = need(ann, HAMI_ALLOCATED, Peer::Hami)?;
    let inits = pod
        .spec
        .as_ref()
        .and_then(|s| s.init_containers.as_ref())
        .map_or(0, Vec::len);
    let regular = regular(pod);
    let mut out = Vec::new();
    for (i, part) in allocated.split(';').enumerate() {
        let mut shares: Vec<PeerShare> = Vec::new();
        for dev in part.split(':').filter(|d| !d.trim().is_empty()) {
            let f: Vec<&str> = dev.split(',').map(str::trim).collect();
            let [uuid, _kind, mem, cores, ..] = f.as_slice() else {
                return Err(format!(
                    "{HAMI_ALLOCATED}: device {dev:?} is not uuid,type,MiB,cores"
                ));
            };
            let mem: u64 = mem
                .parse()
                .map_err(|_| format!("{HAMI_ALLOCATED}: memory {mem:?} of {uuid} is not MiB"))?;
            let cores: u32 = cores
                .parse::<u32>()
                .ok()
                .filter(|c| *c <= 100)
                .ok_or_else(|| {
                    format!("{HAMI_ALLOCATED}: cores {cores:?} of {uuid} is not a percent")
                })?;
            if uuid.is_empty()
                || shares
                    .iter()
                    .any(|s| s.device == DeviceRef::Uuid((*uuid).into()))
            {
                return Err(format!(
                    "{HAMI_ALLOCATED}: empty or repeated GPU {uuid:?} in one container"
                ));
            }
            shares.push(PeerShare {
                device: DeviceRef::Uuid((*uuid).into()),
                memory: PeerMemory::Mib(mem),
                core_milli: cores * 10,
            });
        }
        if shares.is_empty() || i < inits {
            // Init containers have finished once the pod runs: what they held is free again.
            continue;
        }
        let c = regular.get(i - inits).ok_or_else(|| {
            format!(
                "{HAMI_ALLOCATED} names devices for container #{i}, but the pod has {} \
                 containers",
                inits + regular.len()
            )
        })?;
        out.push(PeerContainer {
            name: c.name.clone(),
            shares,
        });
    }
    Ok(out)
}

/// A container's limit (or request) of `key` as a whole number, if it names it.
fn whole_limit(c: &Container, key: &str) -> Result<Option<u64>, String> {
    let r = c.resources.as_ref();
    let q = r
        .and_then(|r| r.limits.as_ref())
        .and_then(|m| m.get(key))
        .or_else(|| r.and_then(|r| r.requests.as_ref()).and_then(|m| m.get(key)));
    let Some(q) = q else { return Ok(None) };
    let v = parse_quantity(&q.0).map_err(|e| format!("{key} of container {:?}: {e}", c.name))?;
    if v < 0.0 || v.fract() != 0.0 || v > u32::MAX as f64 {
        return Err(format!(
            "{key} of container {:?} is {v}, not a whole number",
            c.name
        ));
    }
    Ok(Some(v as u64))
}

fn number(ann: &BTreeMap<String, String>, key: &str, peer: Peer) -> Result<u64, String> {
    let v = need(ann, key, peer)?;
    v.parse()
        .map_err(|_| format!("{key} is {v:?}, not a whole number"))
}

fn gpushare(pod: &Pod, ann: &BTreeMap<String, String>) -> Result<Vec<PeerContainer>, String> {
    let p = Peer::Gpushare;
    if need(ann, GPUSHARE_ASSIGNED, p)? != "true" {
        return Err(format!(
            "gpushare's device plugin has not handed the GPU over yet ({GPUSHARE_ASSIGNED} is \
             not true): adopt it once it runs"
        ));
    }
    let idx = u32::try_from(number(ann, GPUSHARE_IDX, p)?)
        .map_err(|_| format!("{GPUSHARE_IDX} is out of range"))?;
    let pod_units = number(ann, GPUSHARE_POD, p)?;
    let per_gpu = number(ann, GPUSHARE_DEV, p)?;
    if per_gpu == 0 || pod_units > per_gpu {
        return Err(format!(
            "{GPUSHARE_POD} {pod_units} does not fit {GPUSHARE_DEV} {per_gpu}"
        ));
    }
    let mut out = Vec::new();
    let mut sum = 0u64;
    for c in regular(pod) {
        let Some(units) = whole_limit(c, ALIYUN_GPU_MEM)?.filter(|u| *u > 0) else {
            continue;
        };
        sum = sum.saturating_add(units);
        out.push(PeerContainer {
            name: c.name.clone(),
            shares: vec![PeerShare {
                device: DeviceRef::Index(idx),
                memory: PeerMemory::Fraction { units, per_gpu },
                // gpushare shares memory only: it promises no compute.
                core_milli: 0,
            }],
        });
    }
    if sum != pod_units {
        return Err(format!(
            "{GPUSHARE_POD} says {pod_units} but the containers' {ALIYUN_GPU_MEM} limits add up \
             to {sum}"
        ));
    }
    Ok(out)
}

fn gpu_manager(
    pod: &Pod,
    ann: &BTreeMap<String, String>,
    node: &str,
) -> Result<Vec<PeerContainer>, String> {
    let p = Peer::GpuManager;
    let chosen = need(ann, GPU_MANAGER_NODE, p)?;
    if chosen != node {
        return Err(format!(
            "gpu-admission chose node {chosen:?} ({GPU_MANAGER_NODE}) but the pod is bound to \
             {node}"
        ));
    }
    if need(ann, GPU_MANAGER_ASSIGNED, p)? != "true" {
        return Err(format!(
            "gpu-manager has not handed the GPUs over yet ({GPU_MANAGER_ASSIGNED} is not true): \
             adopt it once it runs"
        ));
    }
    let mut out = Vec::new();
    for (i, c) in regular(pod).iter().enumerate() {
        if whole_limit(c, VCUDA_CORE)?.unwrap_or(0) == 0 {
            continue;
        }
        // gpu-manager's own reading of vcuda-core and vcuda-memory (1-99: a share of one GPU
        // with memory in 256 MiB units; hundreds: whole GPUs).
        let g = ContainerGpu::of(c).map_err(|e| e.to_string())?;
        let key = format!("{GPU_MANAGER_IDX_PREFIX}{i}");
        let idx: Vec<u32> = need(ann, &key, p)?
            .split(',')
            .map(|s| s.trim().parse::<u32>())
            .collect::<Result<_, _>>()
            .map_err(|_| format!("{key} is not a list of GPU indices"))?;
        let want = g.slices.unwrap_or(1.0) as usize;
        if idx.len() != want || (1..idx.len()).any(|j| idx[..j].contains(&idx[j])) {
            return Err(format!(
                "{key} names GPUs {idx:?}, but container {:?} holds {want} distinct GPU(s)",
                c.name
            ));
        }
        let shared = g.slices.is_none();
        let core_milli = (g.core_percent.unwrap_or(100.0) * 10.0).round() as u32;
        let memory = match g.mem_mib {
            Some(m) if shared => PeerMemory::Mib(m as u64),
            _ => PeerMemory::Whole,
        };
        out.push(PeerContainer {
            name: c.name.clone(),
            shares: idx
                .into_iter()
                .map(|i| PeerShare {
                    device: DeviceRef::Index(i),
                    memory,
                    core_milli,
                })
                .collect(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
