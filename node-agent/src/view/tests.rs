use super::*;

/// A reservation of one slice of `gpu` for pod `uid`, allocation id = `seq`.
pub(crate) fn reserved(seq: u64, uid: &str, gpu: &str) -> pb::Event {
    pb::Event {
        seq,
        epoch: 1,
        time_ms: 0,
        actor: None,
        body: Some(Body::Reserved(pb::Reserved {
            allocation_id: seq,
            pod: Some(pb::PodRef {
                uid: uid.into(),
                namespace: "ns".into(),
                name: format!("pod-{uid}"),
            }),
            container: "main".into(),
            node: "n1".into(),
            shares: vec![pb::GpuShare {
                gpu_uuid: gpu.into(),
                mem_mib: 4096,
                core_milli: 300,
            }],
            deadline_ms: 0,
            cpu_milli: 0,
            memory_mib: 0,
            policy: String::new(),
        })),
    }
}

/// Event `seq` with `body`.
pub(crate) fn ev(seq: u64, body: Body) -> pb::Event {
    pb::Event {
        seq,
        epoch: 1,
        time_ms: 0,
        actor: None,
        body: Some(body),
    }
}

#[test]
fn oldest_pending_of_the_same_size_is_guessed_and_assigned_ones_are_skipped() {
    let mut v = View::default();
    v.apply(&reserved(5, "a", "G0"));
    v.apply(&reserved(7, "b", "G1"));
    assert_eq!(v.pending(1, &[]).map(|a| a.id), Some(5));
    assert_eq!(v.pending(2, &[]), None);
    v.apply(&ev(
        8,
        Body::Assigned(pb::Assigned {
            allocation_id: 5,
            device_ids: vec!["G0::3".into()],
            node: "n1".into(),
        }),
    ));
    assert_eq!(v.pending(1, &[]).map(|a| a.id), Some(7));
    assert_eq!(v.by_devices(&["G0::3".into()]).map(|a| a.id), Some(5));
    // An event already folded in is not applied twice.
    v.apply(&reserved(6, "c", "G0"));
    assert!(!v.allocs.contains_key(&6));
}

#[test]
fn identity_correction_swaps_pods_but_keeps_gpus_and_devices() {
    let mut v = View::default();
    v.apply(&reserved(1, "a", "G0"));
    v.apply(&reserved(2, "b", "G1"));
    v.apply(&ev(
        3,
        Body::IdentityCorrected(pb::IdentityCorrected {
            from_allocation_id: 1,
            to_allocation_id: 2,
            device_ids: vec![],
            node: "n1".into(),
        }),
    ));
    assert_eq!(v.by_pod("ns", "pod-b", "main").map(|a| a.id), Some(1));
    assert_eq!(v.by_pod("ns", "pod-a", "main").map(|a| a.id), Some(2));
    assert_eq!(v.allocs[&1].shares[0].gpu_uuid, "G0");
    v.apply(&ev(
        4,
        Body::Released(pb::Released {
            allocation_id: 1,
            reason: "deleted".into(),
            node: "n1".into(),
        }),
    ));
    assert!(v.by_pod("ns", "pod-b", "main").is_none());
}

#[test]
fn allocate_env_carries_every_limit_format() {
    let mut v = View::default();
    v.apply(&reserved(1, "a", "G0"));
    let inv = pb::NodeInventory {
        mode: Default::default(),
        isolation: String::new(),
        dra_cores: String::new(),
        node: "n1".into(),
        gpus: vec![pb::Gpu {
            uuid: "G0".into(),
            index: 0,
            model: "A100".into(),
            memory_mib: 40960,
            healthy: true,
            compute_capability: String::new(),
        }],
        cpu_milli: 0,
        memory_mib: 0,
    };
    let opts = AllocateOptions {
        mps: true,
        mps_pipe_dir: "/tmp/nvidia-mps".into(),
        strategies: vec![DeviceListStrategy::Envvar],
        cdi_kind: "nvidia.com/gpu".into(),
        hami_core: None,
        mps_daemons: None,
    };
    let r = container_response(&[&v.allocs[&1]], Some(&inv), &opts);
    let e = |k: &str| r.envs.get(k).map(String::as_str);
    assert_eq!(e("NVIDIA_VISIBLE_DEVICES"), Some("G0"));
    assert!(r.cdi_devices.is_empty(), "envvar only: no CDI devices");
    assert_eq!(e("GPULEDGER_ALLOCATION_ID"), Some("1"));
    assert_eq!(e("GPULEDGER_GPU_MEM_MIB"), Some("4096"));
    assert_eq!(e("GPULEDGER_GPU_CORE"), Some("30"));
    assert_eq!(e("CUDA_DEVICE_MEMORY_LIMIT_0"), Some("4096m"));
    assert_eq!(e("CUDA_DEVICE_SM_LIMIT"), Some("30"));
    assert_eq!(e("ALIYUN_COM_GPU_MEM_DEV"), Some("40"));
    assert_eq!(e("ALIYUN_COM_GPU_MEM_CONTAINER"), Some("4"));
    assert_eq!(e("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"), Some("0=4096M"));
    assert_eq!(e("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"), Some("30"));
    assert_eq!(r.mounts.len(), 1);
}

fn two_gpu_allocation() -> pb::Allocation {
    let mut v = View::default();
    v.apply(&reserved(9, "a", "GPU-0"));
    let mut a = v.allocs[&9].clone();
    a.shares.push(pb::GpuShare {
        gpu_uuid: "GPU-1".into(),
        mem_mib: 4096,
        core_milli: 300,
    });
    a
}

fn with(strategies: &[DeviceListStrategy], kind: &str) -> AllocateOptions {
    AllocateOptions {
        strategies: strategies.to_vec(),
        cdi_kind: kind.into(),
        ..AllocateOptions::default()
    }
}

#[test]
fn cdi_strategies_name_exactly_the_granted_gpus() {
    use DeviceListStrategy::*;
    let a = two_gpu_allocation();
    let r = container_response(&[&a], None, &with(&[CdiCri], "nvidia.com/gpu"));
    let names: Vec<&str> = r.cdi_devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["nvidia.com/gpu=GPU-0", "nvidia.com/gpu=GPU-1"]);
    assert!(!r.envs.contains_key("NVIDIA_VISIBLE_DEVICES"));
    assert!(
        !r.annotations
            .keys()
            .any(|k| k.starts_with(CDI_ANNOTATION_PREFIX))
    );
    // The limits go in the environment whatever the strategy.
    assert_eq!(r.envs["CUDA_DEVICE_MEMORY_LIMIT_1"], "4096m");
    assert_eq!(r.envs["GPULEDGER_ALLOCATION_ID"], "9");

    let r = container_response(
        &[&a],
        None,
        &with(&[CdiAnnotations], "k8s.device-plugin.nvidia.com/gpu"),
    );
    assert!(r.cdi_devices.is_empty());
    assert_eq!(
        r.annotations["cdi.k8s.io/gpuledger.gpu_9"],
        "k8s.device-plugin.nvidia.com/gpu=GPU-0,k8s.device-plugin.nvidia.com/gpu=GPU-1"
    );
    assert_eq!(r.annotations["gpuledger.io/allocation-id"], "9");

    let r = container_response(
        &[&a],
        None,
        &with(&[Envvar, CdiAnnotations, CdiCri], "nvidia.com/gpu"),
    );
    assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-0,GPU-1");
    assert_eq!(r.cdi_devices.len(), 2);
    assert_eq!(r.annotations.len(), 2);
}

#[test]
fn hami_core_rides_on_the_device_plugin_answer_and_the_claims_cdi_spec() {
    let a = two_gpu_allocation();
    let mut opts = with(&[DeviceListStrategy::CdiCri], "nvidia.com/gpu");
    let plain = container_response(&[&a], None, &opts);
    assert!(
        plain.mounts.is_empty(),
        "no HAMi-core without --isolation=hami-core"
    );
    assert!(!plain.envs.contains_key("CUDA_DEVICE_MEMORY_SHARED_CACHE"));
    opts.hami_core = Some(crate::isolation::HamiCore {
        lib: "/opt/libvgpu.so".into(),
        dir: "/var/lib/gpuledger/hami-core".into(),
    });
    let r = container_response(&[&a], None, &opts);
    assert_eq!(r.envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "4096m");
    assert_eq!(r.envs["CUDA_DEVICE_MEMORY_LIMIT_1"], "4096m");
    assert_eq!(
        r.envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"],
        "/usr/local/vgpu/9.cache"
    );
    let preload = r
        .mounts
        .iter()
        .find(|m| m.container_path == "/etc/ld.so.preload")
        .expect("the preload file");
    assert!(preload.read_only);
    // The DRA path writes the same edits into the claim's CDI spec.
    let spec = crate::dra::cdi::spec("u", &[("gpu".into(), r)]);
    let edits = &spec["devices"][0]["containerEdits"];
    let mounts = edits["mounts"].as_array().expect("mounts");
    assert!(
        mounts
            .iter()
            .any(|m| m["containerPath"] == "/etc/ld.so.preload"
                && m["hostPath"] == "/var/lib/gpuledger/hami-core/ld.so.preload"
                && m["options"][0] == "ro")
    );
    assert!(
        mounts
            .iter()
            .any(|m| m["containerPath"] == "/usr/local/vgpu/libvgpu.so"
                && m["hostPath"] == "/opt/libvgpu.so"
                && m["options"][0] == "ro")
    );
    let env: Vec<&str> = edits["env"]
        .as_array()
        .expect("env")
        .iter()
        .filter_map(|e| e.as_str())
        .collect();
    assert!(env.contains(&"CUDA_DEVICE_MEMORY_SHARED_CACHE=/usr/local/vgpu/9.cache"));
}

#[test]
fn cdi_annotation_keys_fit_the_cdi_syntax() {
    // The CDI specification: the part after the prefix is at most 63 characters, starts and
    // ends alphanumeric, and holds only alphanumerics, '-', '_' and '.'.
    let (key, value) = cdi_annotation(u64::MAX, &["nvidia.com/gpu=GPU-0".into()]);
    let name = key
        .strip_prefix(CDI_ANNOTATION_PREFIX)
        .expect("the CDI prefix");
    assert!(name.len() <= 63, "{name}");
    assert!(name.starts_with(|c: char| c.is_ascii_alphanumeric()));
    assert!(name.ends_with(|c: char| c.is_ascii_alphanumeric()));
    assert!(
        name.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    );
    assert_eq!(value, "nvidia.com/gpu=GPU-0");
}

#[test]
fn device_ids_round_trip_and_garbage_is_rejected() {
    assert_eq!(
        parse_device_id(&device_id("GPU-1-2", 7)),
        Some(("GPU-1-2", 7))
    );
    assert_eq!(parse_device_id("GPU-1"), None);
    assert_eq!(parse_device_id("::3"), None);
    assert_eq!(parse_device_id("GPU-1::x"), None);
}

#[test]
fn a_bound_reservation_is_guessed_before_an_older_unbound_one() {
    let mut v = View::default();
    v.apply(&reserved(5, "never-bound", "G0"));
    v.apply(&reserved(7, "b", "G1"));
    assert_eq!(
        v.pending(1, &[]).map(|a| a.id),
        Some(5),
        "nothing bound yet"
    );
    v.apply(&ev(
        8,
        Body::Bound(pb::Bound {
            allocation_id: 7,
            reason: "extender".into(),
            node: "n1".into(),
        }),
    ));
    assert_eq!(v.pending(1, &[]).map(|a| a.id), Some(7));
}

#[test]
fn an_adopted_allocation_is_never_guessed_for_an_allocate() {
    let mut v = View::default();
    let mut adopted = reserved(5, "hami-pod", "G0");
    if let Some(Body::Reserved(r)) = &mut adopted.body {
        r.policy = "adopted-from=hami".into();
    }
    v.apply(&adopted);
    let bound = |seq, id| {
        ev(
            seq,
            Body::Bound(pb::Bound {
                allocation_id: id,
                reason: "x".into(),
                node: "n1".into(),
            }),
        )
    };
    v.apply(&bound(6, 5));
    assert_eq!(v.pending(1, &[]), None, "only an adopted pod is bound here");
    v.apply(&reserved(7, "new", "G1"));
    v.apply(&bound(8, 7));
    assert_eq!(v.pending(1, &[]).map(|a| a.id), Some(7));
}

#[test]
fn a_lagging_replicas_view_does_not_roll_the_agents_back_but_the_first_is_taken() {
    let mut v = View::default();
    let mut newer = View::default();
    newer.apply(&reserved(9, "a", "G0"));
    let mut older = View::default();
    older.apply(&reserved(4, "b", "G1"));
    v.replay(&Change::Reset {
        view: newer.clone(),
        force: true,
    });
    assert_eq!(v, newer);
    v.replay(&Change::Reset {
        view: older.clone(),
        force: false,
    });
    assert_eq!(v, newer, "a view behind the agent's is ignored");
    v.replay(&Change::Reset {
        view: older.clone(),
        force: true,
    });
    assert_eq!(
        v, older,
        "the first view after a start is taken whatever its seq"
    );
    v.replay(&Change::Event(reserved(5, "c", "G0")));
    let mut assigned = v.allocs[&5].clone();
    assigned.device_ids = vec!["G0::1".into()];
    v.replay(&Change::Upsert(assigned));
    assert_eq!(v.by_devices(&["G0::1".into()]).map(|a| a.id), Some(5));
}

#[test]
fn a_pod_that_joins_a_claim_is_charged_to_its_grant() {
    let pod = |uid: &str| pb::PodRef {
        uid: uid.into(),
        namespace: "ns".into(),
        name: format!("pod-{uid}"),
    };
    let mut v = View::default();
    v.apply(&ev(
        7,
        Body::ClaimGranted(pb::ClaimGranted {
            allocation_id: 7,
            claim: Some(pb::ClaimRef {
                uid: "claim".into(),
                namespace: "ns".into(),
                name: "shared".into(),
            }),
            request: "c0".into(),
            node: "n1".into(),
            pool: "n1".into(),
            device: "gpu-g0".into(),
            share_id: "s".into(),
            share: Some(pb::GpuShare {
                gpu_uuid: "GPU-G0".into(),
                mem_mib: 1024,
                core_milli: 0,
            }),
            consumers: vec![pod("first")],
            source: "claim".into(),
            priority: 0,
        }),
    ));
    let serves = |v: &View, uid: &str| crate::enforce::serves_pod(&v.allocs[&7], uid);
    assert!(serves(&v, "first") && !serves(&v, "second"));
    v.apply(&ev(
        8,
        Body::ClaimConsumersChanged(pb::ClaimConsumersChanged {
            allocation_ids: vec![7],
            consumers: vec![pod("second")],
            node: "n1".into(),
        }),
    ));
    assert!(serves(&v, "second") && !serves(&v, "first"));
}
