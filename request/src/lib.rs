//! What a pod asks of gpuledger: Kubernetes quantities, gpuledger resource names and the
//! gpushare/HAMi/gpu-manager aliases, placement annotations, turned into the allocator's
//! `PodRequest`. The extender sends what it reads here; the allocator reads the same pod from
//! the API server and checks that a reservation asks for exactly this.

use std::collections::BTreeMap;

use gpuledger_ledger::command::bounds::{
    InventoryLimits, MAX_CONTAINERS, MAX_CPU_MILLI, MAX_HOST_MEMORY_MIB,
};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

pub mod adopt;
pub mod dra;

/// Number of GPU slices of a container (each on a distinct GPU).
pub const GPU: &str = "gpuledger.io/gpu";
/// MiB of GPU memory per slice.
pub const GPU_MEM: &str = "gpuledger.io/gpu-mem";
/// Percent of each chosen GPU's memory.
pub const GPU_MEM_PERCENT: &str = "gpuledger.io/gpu-mem-percent";
/// Percent of a GPU's compute per slice (0-100).
pub const GPU_CORE: &str = "gpuledger.io/gpu-core";
/// gpushare: GiB of GPU memory.
pub const ALIYUN_GPU_MEM: &str = "aliyun.com/gpu-mem";
/// HAMi: number of GPUs. Read only beside HAMi's memory or compute names: alone, it is a
/// request to NVIDIA's own device plugin.
pub const HAMI_GPU: &str = "nvidia.com/gpu";
/// HAMi: MiB of GPU memory per GPU.
pub const HAMI_GPU_MEM: &str = "nvidia.com/gpumem";
/// HAMi: percent of each GPU's memory.
pub const HAMI_GPU_MEM_PERCENT: &str = "nvidia.com/gpumem-percentage";
/// HAMi: percent of each GPU's compute.
pub const HAMI_GPU_CORES: &str = "nvidia.com/gpucores";
/// gpu-manager: percent of one GPU's compute (1-99), or whole GPUs in hundreds (100 = one).
pub const VCUDA_CORE: &str = "tencent.com/vcuda-core";
/// gpu-manager: GPU memory in units of 256 MiB.
pub const VCUDA_MEMORY: &str = "tencent.com/vcuda-memory";
/// MiB in one `tencent.com/vcuda-memory` unit (gpu-manager's `MemoryBlockSize`).
const VCUDA_MEMORY_UNIT_MIB: f64 = 256.0;

/// Every resource name gpuledger reads (canonical names first).
pub const ALL_RESOURCES: [&str; 10] = [
    GPU,
    GPU_MEM,
    GPU_MEM_PERCENT,
    GPU_CORE,
    ALIYUN_GPU_MEM,
    HAMI_GPU_MEM,
    HAMI_GPU_MEM_PERCENT,
    HAMI_GPU_CORES,
    VCUDA_CORE,
    VCUDA_MEMORY,
];

/// The status condition the allocator leader sets on a pending GPU pod kube-scheduler found
/// unschedulable, when the ledger freed room: kube-scheduler retries the pod on the update.
pub const ROOM_FREED: &str = "gpuledger.io/RoomFreed";

/// The message of a [`ROOM_FREED`] condition; it names the ledger seq that freed the room.
pub fn room_freed_message(seq: u64) -> String {
    format!(
        "the GPU ledger freed room (seq {seq}); kube-scheduler retries the pod after its backoff"
    )
}

/// The ledger seq named by `pod`'s [`ROOM_FREED`] condition: an answer to the retry it causes
/// must reflect at least that seq.
pub fn room_freed_seq(pod: &Pod) -> Option<u64> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == ROOM_FREED && c.status == "True")?
        .message
        .as_deref()?
        .split_once("(seq ")?
        .1
        .split_once(')')?
        .0
        .parse()
        .ok()
}

/// The marker resource of a pod whose GPUs come through DRA (ResourceClaims of the
/// `gpu.gpuledger.io` DeviceClass): the webhook puts it in requests and limits of each GPU
/// container it converts, so that kube-scheduler consults the extender (a managed resource
/// the scheduler ignores, and the kubelet strips as no node advertises it).
pub const DRA_MARKER: &str = "gpuledger.io/dra";

/// Annotation: GPU model names to use (comma list, substring match).
pub const ANN_GPU_TYPE: &str = "gpuledger.io/gpu-type";
/// Annotation: GPU model names to avoid.
pub const ANN_GPU_TYPE_EXCLUDE: &str = "gpuledger.io/gpu-type-exclude";
/// Annotation: GPU UUIDs to use.
pub const ANN_GPU_UUID: &str = "gpuledger.io/gpu-uuid";
/// Annotation: GPU UUIDs to avoid.
pub const ANN_GPU_UUID_EXCLUDE: &str = "gpuledger.io/gpu-uuid-exclude";
/// Annotation: placement policy.
pub const ANN_POLICY: &str = "gpuledger.io/policy";

/// Why a pod's GPU request cannot be understood. Not retryable: the pod must change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// A quantity that is not a Kubernetes quantity, or out of range.
    #[error("{0}")]
    Invalid(String),
}

pub use gpuledger_ops::quantity::parse as parse_quantity;

/// One container's GPU request, as written (before defaults).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ContainerGpu {
    /// Container name.
    pub name: String,
    /// Slices asked for, if the container names `gpuledger.io/gpu` (or HAMi's `nvidia.com/gpu`).
    pub slices: Option<f64>,
    /// MiB per slice, from `gpu-mem`, `nvidia.com/gpumem` or `aliyun.com/gpu-mem` (GiB).
    pub mem_mib: Option<f64>,
    /// Percent of memory.
    pub mem_percent: Option<f64>,
    /// Percent of compute.
    pub core_percent: Option<f64>,
}

impl ContainerGpu {
    /// Whether the container asks for anything gpuledger manages.
    pub fn wants_gpu(&self) -> bool {
        self.slices.is_some_and(|s| s > 0.0)
            || self.mem_mib.is_some()
            || self.mem_percent.is_some()
            || self.core_percent.is_some()
    }

    /// Read a container's resources (limits win over requests; aliases after canonical names).
    pub fn of(c: &Container) -> Result<ContainerGpu, RequestError> {
        let res = c.resources.as_ref();
        let empty = BTreeMap::new();
        let limits = res.and_then(|r| r.limits.as_ref()).unwrap_or(&empty);
        let requests = res.and_then(|r| r.requests.as_ref()).unwrap_or(&empty);
        let get = |key: &str| -> Result<Option<f64>, RequestError> {
            match limits.get(key).or_else(|| requests.get(key)) {
                None => Ok(None),
                Some(Quantity(q)) => parse_quantity(q).map(Some).map_err(|e| {
                    RequestError::Invalid(format!("{key}: {e} in container {:?}", c.name))
                }),
            }
        };
        let first = |keys: &[(&str, f64)]| -> Result<Option<f64>, RequestError> {
            for (k, scale) in keys {
                if let Some(v) = get(k)? {
                    return Ok(Some(v * scale));
                }
            }
            Ok(None)
        };
        let hami = [HAMI_GPU_MEM, HAMI_GPU_MEM_PERCENT, HAMI_GPU_CORES]
            .iter()
            .any(|k| limits.contains_key(*k) || requests.contains_key(*k));
        let vcuda = Vcuda::of(get(VCUDA_CORE)?, get(VCUDA_MEMORY)?, &c.name)?;
        let mut g = ContainerGpu {
            name: c.name.clone(),
            slices: match get(GPU)? {
                None if hami => get(HAMI_GPU)?,
                s => s,
            },
            mem_mib: first(&[
                (GPU_MEM, 1.0),
                (HAMI_GPU_MEM, 1.0),
                (ALIYUN_GPU_MEM, 1024.0),
            ])?,
            mem_percent: first(&[(GPU_MEM_PERCENT, 1.0), (HAMI_GPU_MEM_PERCENT, 1.0)])?,
            core_percent: first(&[(GPU_CORE, 1.0), (HAMI_GPU_CORES, 1.0)])?,
        };
        if let Some(v) = vcuda {
            // After every other name, as the other aliases are.
            g.slices = g.slices.or(v.slices);
            g.core_percent = g.core_percent.or(Some(v.core_percent));
            if g.mem_mib.is_none() && g.mem_percent.is_none() {
                g.mem_mib = v.mem_mib;
                g.mem_percent = v.mem_percent;
            }
        }
        Ok(g)
    }

    /// Check the request and turn it into the allocator's form.
    pub fn to_api(&self) -> Result<api::ContainerRequest, RequestError> {
        let name = &self.name;
        let err = |m: String| Err(RequestError::Invalid(m));
        let slices = self.slices.unwrap_or(1.0);
        if slices < 1.0 || slices.fract() != 0.0 {
            return err(format!(
                "{GPU} must be a whole number of at least 1 (got {slices}) in container {name:?}"
            ));
        }
        if slices > 64.0 {
            return err(format!(
                "{GPU} asks for {slices} GPU slices in container {name:?}; no node has that many GPUs"
            ));
        }
        if let Some(core) = self.core_percent
            && !(0.0..=100.0).contains(&core)
        {
            return err(format!(
                "{GPU_CORE} must be between 0 and 100 (got {core}) in container {name:?}"
            ));
        }
        if let Some(mem) = self.mem_mib
            && mem <= 0.0
        {
            return err(format!(
                "{GPU_MEM} must be more than 0 MiB (got {mem}) in container {name:?}"
            ));
        }
        let most = InventoryLimits::CEILING.max_gpu_memory_mib;
        if let Some(mem) = self.mem_mib
            && mem > most as f64
        {
            return err(format!(
                "{GPU_MEM} asks for {mem} MiB per GPU in container {name:?}; no GPU has more \
                 than {most} MiB"
            ));
        }
        if let Some(p) = self.mem_percent
            && !(p > 0.0 && p <= 100.0)
        {
            return err(format!(
                "{GPU_MEM_PERCENT} must be between 1 and 100 (got {p}) in container {name:?}"
            ));
        }
        if self.mem_mib.is_some() && self.mem_percent.is_some() {
            return err(format!(
                "container {name:?} sets both GPU memory in MiB ({GPU_MEM}) and in percent \
                 ({GPU_MEM_PERCENT}); set one of them"
            ));
        }
        Ok(api::ContainerRequest {
            name: name.clone(),
            slices: slices as u32,
            mem_mib: self.mem_mib.map_or(0, |m| m.ceil() as u64),
            mem_percent: self.mem_percent.map_or(0, |p| p.ceil() as u32),
            core_milli: self.core_percent.map_or(0, |c| (c * 10.0).round() as u32),
        })
    }
}

/// A gpu-manager request (`tencent.com/vcuda-core`, `tencent.com/vcuda-memory`) in gpuledger's
/// terms, with gpu-manager's rule: the core count is 1-99 (a share of one GPU, which then needs
/// memory too) or a multiple of 100 (that many whole GPUs, whose memory is theirs entirely).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Vcuda {
    slices: Option<f64>,
    core_percent: f64,
    mem_mib: Option<f64>,
    mem_percent: Option<f64>,
}

impl Vcuda {
    fn of(
        core: Option<f64>,
        memory: Option<f64>,
        name: &str,
    ) -> Result<Option<Vcuda>, RequestError> {
        let err = |m: String| Err(RequestError::Invalid(m));
        if let Some(m) = memory
            && !(m >= 1.0 && m.fract() == 0.0)
        {
            return err(format!(
                "{VCUDA_MEMORY} must be a whole number of 256 MiB units, at least 1 (got {m}) in container {name:?}"
            ));
        }
        let Some(core) = core else {
            return match memory {
                None => Ok(None),
                Some(_) => err(format!(
                    "{VCUDA_MEMORY} needs {VCUDA_CORE} beside it in container {name:?} \
                     (gpu-manager's rule: 1-99 for a share of one GPU, 100 per whole GPU)"
                )),
            };
        };
        let whole = core >= 100.0 && core % 100.0 == 0.0;
        if !(whole || (1.0..100.0).contains(&core) && core.fract() == 0.0) {
            return err(format!(
                "{VCUDA_CORE} must be 1-99 (percent of one GPU) or a multiple of 100 (whole GPUs: \
                 100 = one) (got {core}) in container {name:?}"
            ));
        }
        if whole {
            return Ok(Some(Vcuda {
                slices: Some(core / 100.0),
                core_percent: 100.0,
                mem_mib: None,
                mem_percent: Some(100.0),
            }));
        }
        let Some(memory) = memory else {
            return err(format!(
                "{VCUDA_CORE} {core} (a share of one GPU) needs {VCUDA_MEMORY} beside it in \
                 container {name:?} (gpu-manager's rule)"
            ));
        };
        Ok(Some(Vcuda {
            slices: None,
            core_percent: core,
            mem_mib: Some(memory * VCUDA_MEMORY_UNIT_MIB),
            mem_percent: None,
        }))
    }
}

fn comma_list(v: Option<&String>) -> Vec<String> {
    v.map(|s| {
        s.split(',')
            .map(str::trim)
            .filter(|x| !x.is_empty())
            .map(String::from)
            .collect()
    })
    .unwrap_or_default()
}

/// The pod's placement annotations.
pub fn placement(pod: &Pod) -> Result<api::Placement, RequestError> {
    let empty = BTreeMap::new();
    let ann = pod.metadata.annotations.as_ref().unwrap_or(&empty);
    let policy = ann
        .get(ANN_POLICY)
        .map(|p| p.trim().to_string())
        .unwrap_or_default();
    if let Err(e) = policy.parse::<gpuledger_ledger::placement::Policy>() {
        return Err(RequestError::Invalid(format!(
            "annotation {ANN_POLICY}: {e}"
        )));
    }
    Ok(api::Placement {
        gpu_types: comma_list(ann.get(ANN_GPU_TYPE)),
        gpu_types_exclude: comma_list(ann.get(ANN_GPU_TYPE_EXCLUDE)),
        gpu_uuids: comma_list(ann.get(ANN_GPU_UUID)),
        gpu_uuids_exclude: comma_list(ann.get(ANN_GPU_UUID_EXCLUDE)),
        policy,
    })
}

/// The GPU-asking containers of a pod (regular containers; init containers get no GPU), at
/// most [`MAX_CONTAINERS`] of them.
pub fn containers(pod: &Pod) -> Result<Vec<ContainerGpu>, RequestError> {
    let Some(spec) = pod.spec.as_ref() else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for c in &spec.containers {
        let g = ContainerGpu::of(c)?;
        if g.wants_gpu() {
            out.push(g);
        }
    }
    if out.len() > MAX_CONTAINERS {
        return Err(RequestError::Invalid(format!(
            "{} containers of the pod ask for GPUs; gpuledger places at most {MAX_CONTAINERS} \
             per pod",
            out.len()
        )));
    }
    Ok(out)
}

fn sum_requests(pod: &Pod, key: &str) -> f64 {
    pod.spec.as_ref().map_or(0.0, |s| {
        s.containers
            .iter()
            .filter_map(|c| {
                let r = c.resources.as_ref()?;
                r.requests
                    .as_ref()
                    .and_then(|m| m.get(key))
                    .or_else(|| r.limits.as_ref().and_then(|m| m.get(key)))
            })
            .filter_map(|q| parse_quantity(&q.0).ok())
            .sum()
    })
}

/// Whether a container of the pod carries the DRA marker ([`DRA_MARKER`]).
pub fn has_dra_marker(pod: &Pod) -> bool {
    pod.spec.as_ref().is_some_and(|s| {
        s.containers.iter().any(|c| {
            c.resources.as_ref().is_some_and(|r| {
                [r.limits.as_ref(), r.requests.as_ref()]
                    .into_iter()
                    .flatten()
                    .any(|m| m.contains_key(DRA_MARKER))
            })
        })
    })
}

/// The allocator request for `pod`, or None when it asks for no gpuledger resource.
pub fn pod_request(pod: &Pod) -> Result<Option<api::PodRequest>, RequestError> {
    let cs = containers(pod)?;
    if cs.is_empty() {
        return Ok(None);
    }
    let containers = cs
        .iter()
        .map(ContainerGpu::to_api)
        .collect::<Result<Vec<_>, _>>()?;
    request_of(pod, containers).map(Some)
}

/// The allocator request of `pod` for `containers` (read from its resources, or from its
/// ResourceClaims on the DRA path): the pod, its placement annotations, CPU, memory and
/// priority.
pub fn request_of(
    pod: &Pod,
    containers: Vec<api::ContainerRequest>,
) -> Result<api::PodRequest, RequestError> {
    let cpu_milli = sum_requests(pod, "cpu") * 1000.0;
    let memory_mib = sum_requests(pod, "memory") / (1024.0 * 1024.0);
    if cpu_milli > MAX_CPU_MILLI as f64 || memory_mib > MAX_HOST_MEMORY_MIB as f64 {
        return Err(RequestError::Invalid(format!(
            "the pod requests {cpu_milli}m CPU and {memory_mib} MiB memory; no node has that much"
        )));
    }
    let m = &pod.metadata;
    Ok(api::PodRequest {
        pod: Some(pb::PodRef {
            uid: m.uid.clone().unwrap_or_default(),
            namespace: m.namespace.clone().unwrap_or_else(|| "default".into()),
            name: m.name.clone().unwrap_or_default(),
        }),
        containers,
        placement: Some(placement(pod)?),
        cpu_milli: cpu_milli.ceil() as u64,
        memory_mib: memory_mib.ceil() as u64,
        priority: pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0),
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_room_freed_condition_names_its_seq() {
        let mut p = pod(&[], &[]);
        assert_eq!(room_freed_seq(&p), None);
        p.status = Some(
            serde_json::from_value(serde_json::json!({"conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"},
                {"type": ROOM_FREED, "status": "True", "message": room_freed_message(15)},
            ]}))
            .expect("valid status"),
        );
        assert_eq!(room_freed_seq(&p), Some(15));
    }

    fn pod(limits: &[(&str, &str)], ann: &[(&str, &str)]) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1",
                "annotations": ann.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>()},
            "spec": {"containers": [
                {"name": "c", "resources": {"limits": limits.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>()}},
                {"name": "side", "resources": {"limits": {"cpu": "100m"}}}
            ]}
        }))
        .expect("valid pod")
    }

    #[test]
    fn canonical_and_aliases() {
        let r = pod_request(&pod(&[(GPU, "1"), (GPU_MEM, "3k"), (GPU_CORE, "30")], &[]))
            .expect("ok")
            .expect("gpu");
        assert_eq!(r.containers.len(), 1, "the sidecar asks for nothing");
        let c = &r.containers[0];
        assert_eq!((c.slices, c.mem_mib, c.core_milli), (1, 3000, 300));
        let g = pod_request(&pod(&[(ALIYUN_GPU_MEM, "3")], &[]))
            .expect("ok")
            .expect("gpu");
        assert_eq!((g.containers[0].slices, g.containers[0].mem_mib), (1, 3072));
        let h = pod_request(&pod(&[(HAMI_GPU_MEM, "3000"), (HAMI_GPU_CORES, "30")], &[]))
            .expect("ok")
            .expect("gpu");
        assert_eq!(
            (
                h.containers[0].slices,
                h.containers[0].mem_mib,
                h.containers[0].core_milli
            ),
            (1, 3000, 300)
        );
        let two = pod_request(&pod(&[(HAMI_GPU, "2"), (HAMI_GPU_MEM, "4096")], &[]))
            .expect("ok")
            .expect("gpu");
        assert_eq!(
            (two.containers[0].slices, two.containers[0].mem_mib),
            (2, 4096)
        );
        // Alone, nvidia.com/gpu belongs to NVIDIA's device plugin, not to gpuledger.
        assert_eq!(pod_request(&pod(&[(HAMI_GPU, "1")], &[])), Ok(None));
        let p = pod_request(&pod(&[(HAMI_GPU_MEM_PERCENT, "25")], &[]))
            .expect("ok")
            .expect("gpu");
        assert_eq!(p.containers[0].mem_percent, 25);
        assert_eq!(pod_request(&pod(&[("cpu", "1")], &[])), Ok(None));
    }

    #[test]
    fn gpu_manager_names_read_as_gpu_manager_means_them() {
        // (slices, MiB, memory %, compute ‰) of a pod with `limits`.
        let shape = |limits: &[(&str, &str)]| {
            let r = pod_request(&pod(limits, &[])).expect("ok").expect("gpu");
            let c = &r.containers[0];
            (c.slices, c.mem_mib, c.mem_percent, c.core_milli)
        };
        // kubernetes-gpusharing's example pod: 50 % of a GPU, 15 units of 256 MiB.
        assert_eq!(
            shape(&[(VCUDA_CORE, "50"), (VCUDA_MEMORY, "15")]),
            (1, 3840, 0, 500)
        );
        // Hundreds are whole GPUs, memory and all (gpu-manager ignores vcuda-memory there).
        assert_eq!(
            shape(&[(VCUDA_CORE, "200"), (VCUDA_MEMORY, "60")]),
            (2, 0, 100, 1000)
        );
        assert_eq!(shape(&[(VCUDA_CORE, "100")]), (1, 0, 100, 1000));
        // gpuledger's own names win over the alias, as with the other peers' names.
        assert_eq!(
            shape(&[(VCUDA_CORE, "50"), (VCUDA_MEMORY, "15"), (GPU_MEM, "1000")]),
            (1, 1000, 0, 500)
        );
    }

    #[test]
    fn gpu_manager_rule_refuses_what_gpu_manager_refuses() {
        let e = |l: &[(&str, &str)]| match pod_request(&pod(l, &[])) {
            Err(RequestError::Invalid(m)) => m,
            other => panic!("accepted {l:?}: {other:?}"),
        };
        for core in ["150", "250", "0", "-50", "99.5", "1000.5"] {
            let m = e(&[(VCUDA_CORE, core), (VCUDA_MEMORY, "4")]);
            assert!(
                m.starts_with(
                    "tencent.com/vcuda-core must be 1-99 (percent of one GPU) or a multiple of 100"
                ),
                "{core}: {m}"
            );
            assert!(
                m.contains(&format!("(got {})", parse_quantity(core).expect("number"))),
                "{m}"
            );
        }
        assert!(e(&[(VCUDA_CORE, "30")]).contains("needs tencent.com/vcuda-memory"));
        assert!(e(&[(VCUDA_MEMORY, "4")]).contains("needs tencent.com/vcuda-core"));
        for mem in ["0", "1.5", "-2"] {
            let m = e(&[(VCUDA_CORE, "30"), (VCUDA_MEMORY, mem)]);
            assert!(m.contains("256 MiB units"), "{mem}: {m}");
        }
    }

    #[test]
    fn annotations_map_to_placement() {
        let r = pod_request(&pod(
            &[(GPU_MEM, "1Ki")],
            &[
                (ANN_GPU_TYPE, "A100, H100"),
                (ANN_GPU_TYPE_EXCLUDE, "T4"),
                (ANN_GPU_UUID, "GPU-1"),
                (ANN_GPU_UUID_EXCLUDE, "GPU-2,GPU-3"),
                (ANN_POLICY, "spread"),
            ],
        ))
        .expect("ok")
        .expect("gpu");
        let p = r.placement.expect("placement");
        assert_eq!(p.gpu_types, vec!["A100", "H100"]);
        assert_eq!(p.gpu_types_exclude, vec!["T4"]);
        assert_eq!(p.gpu_uuids, vec!["GPU-1"]);
        assert_eq!(p.gpu_uuids_exclude, vec!["GPU-2", "GPU-3"]);
        assert_eq!(p.policy, "spread");
        assert_eq!(r.containers[0].mem_mib, 1024);
    }

    #[test]
    fn malformed_requests_say_why() {
        let e = |l: &[(&str, &str)], a: &[(&str, &str)]| match pod_request(&pod(l, a)) {
            Err(RequestError::Invalid(m)) => m,
            other => panic!("accepted {l:?} {a:?}: {other:?}"),
        };
        assert_eq!(
            e(&[(GPU, "1"), (GPU_CORE, "150")], &[]),
            "gpuledger.io/gpu-core must be between 0 and 100 (got 150) in container \"c\""
        );
        assert!(e(&[(GPU_MEM, "0")], &[]).contains("more than 0"));
        assert!(e(&[(GPU_MEM, "-5")], &[]).contains("more than 0"));
        assert!(e(&[(GPU_MEM, "100"), (GPU_MEM_PERCENT, "10")], &[]).contains("set one"));
        assert!(e(&[(GPU, "1.5")], &[]).contains("whole number"));
        assert!(e(&[(GPU, "100")], &[]).contains("no node has that many"));
        assert!(e(&[(GPU_MEM, "lots")], &[]).contains("not a Kubernetes quantity"));
        assert!(e(&[(GPU, "1")], &[(ANN_POLICY, "fastest")]).contains("unknown placement policy"));
        // Absurd quantities are refused, not saturated into a size that can never fit.
        assert!(e(&[(GPU_MEM, "1e30")], &[]).contains("no GPU has more than"));
        assert!(e(&[(ALIYUN_GPU_MEM, "9E")], &[]).contains("no GPU has more than"));
        assert!(e(&[(GPU_MEM, "1"), ("cpu", "1e20")], &[]).contains("no node has that much"));
    }

    #[test]
    fn more_than_64_gpu_containers_are_refused_with_a_reason() {
        let c = |i: usize| {
            serde_json::json!({"name": format!("c{i}"),
            "resources": {"limits": {GPU_MEM: "1000"}}})
        };
        let pod = |n: usize| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
                "spec": {"containers": (0..n).map(c).collect::<Vec<_>>()}
            }))
            .expect("valid pod")
        };
        assert_eq!(
            pod_request(&pod(64))
                .expect("64 are fine")
                .map(|r| r.containers.len()),
            Some(64)
        );
        match pod_request(&pod(65)) {
            Err(RequestError::Invalid(m)) => assert!(m.contains("at most 64"), "{m}"),
            other => panic!("65 GPU containers were accepted: {other:?}"),
        }
    }
}
