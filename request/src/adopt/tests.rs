//! Pods carrying the annotations as each peer writes them (HAMi v2.10.0's
//! `EncodePodDevices`, gpushare-scheduler-extender's `PatchPodAnnotationSpec` plus its device
//! plugin's assigned flag, gpu-admission's `Allocate` plus gpu-manager's assigned flag).

use super::*;
use serde_json::json;

fn pod(
    node: &str,
    containers: &[(&str, &[(&str, &str)])],
    inits: usize,
    ann: &[(&str, &str)],
) -> Pod {
    let c = |name: &str, limits: &[(&str, &str)]| {
        let limits: serde_json::Map<String, serde_json::Value> = limits
            .iter()
            .map(|(k, v)| ((*k).to_string(), json!(v)))
            .collect();
        json!({"name": name, "image": "x", "resources": {"limits": limits}})
    };
    let ann: serde_json::Map<String, serde_json::Value> = ann
        .iter()
        .map(|(k, v)| ((*k).to_string(), json!(v)))
        .collect();
    serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "annotations": ann},
        "spec": {
            "nodeName": node,
            "initContainers": (0..inits).map(|i| c(&format!("init{i}"), &[])).collect::<Vec<_>>(),
            "containers": containers.iter().map(|(n, l)| c(n, l)).collect::<Vec<_>>(),
        }
    }))
    .expect("a pod")
}

fn mib(uuid: &str, m: u64, core_milli: u32) -> PeerShare {
    PeerShare {
        device: DeviceRef::Uuid(uuid.into()),
        memory: PeerMemory::Mib(m),
        core_milli,
    }
}

#[test]
fn hami_devices_map_to_containers_after_the_init_containers() {
    let p = pod(
        "n1",
        &[("a", &[]), ("b", &[])],
        1,
        &[
            (HAMI_NODE, "n1"),
            (HAMI_BIND_PHASE, "success"),
            (
                HAMI_ALLOCATED,
                "GPU-i,NVIDIA,100,0:;GPU-1,NVIDIA,4000,30:;GPU-2,NVIDIA,2000,0:GPU-3,NVIDIA,2000,100:;",
            ),
        ],
    );
    let g = recorded(&p).expect("a peer pod").expect("readable");
    assert_eq!(g.peer, Peer::Hami);
    assert_eq!(g.node, "n1");
    assert_eq!(
        g.containers,
        vec![
            PeerContainer {
                name: "a".into(),
                shares: vec![mib("GPU-1", 4000, 300)],
            },
            PeerContainer {
                name: "b".into(),
                shares: vec![mib("GPU-2", 2000, 0), mib("GPU-3", 2000, 1000)],
            },
        ],
        "the init container's GPU is free again once the pod runs"
    );
}

#[test]
fn hami_pods_not_yet_handed_over_or_partial_say_why() {
    let base = [
        (HAMI_NODE, "n1"),
        (HAMI_BIND_PHASE, "success"),
        (HAMI_ALLOCATED, "GPU-1,NVIDIA,4000,30:;"),
    ];
    // (annotations, the pod's node, what the refusal says)
    type Case<'a> = (Vec<(&'a str, &'a str)>, &'a str, &'a str);
    let cases: Vec<Case<'_>> = vec![
        (
            vec![base[0], (HAMI_BIND_PHASE, "allocating"), base[2]],
            "n1",
            "not handed",
        ),
        (
            vec![base[0], (HAMI_BIND_PHASE, "failed"), base[2]],
            "n1",
            "failed",
        ),
        (vec![base[0], base[2]], "n1", "bind-phase is missing"),
        (
            vec![base[0], base[1]],
            "n1",
            "vgpu-devices-allocated is missing",
        ),
        (vec![base[1], base[2]], "n1", "vgpu-node is missing"),
        (base.to_vec(), "n2", "bound to n2"),
        (base.to_vec(), "", "not bound"),
        (
            vec![base[0], base[1], (HAMI_ALLOCATED, "GPU-1,NVIDIA,4000:;")],
            "n1",
            "uuid,type",
        ),
        (
            vec![base[0], base[1], (HAMI_ALLOCATED, "GPU-1,NVIDIA,x,30:;")],
            "n1",
            "not MiB",
        ),
        (
            vec![base[0], base[1], (HAMI_ALLOCATED, "GPU-1,NVIDIA,1,130:;")],
            "n1",
            "percent",
        ),
        (
            vec![
                base[0],
                base[1],
                (HAMI_ALLOCATED, "GPU-1,NVIDIA,1,1:GPU-1,NVIDIA,1,1:;"),
            ],
            "n1",
            "repeated",
        ),
        (
            vec![base[0], base[1], (HAMI_ALLOCATED, ";GPU-1,NVIDIA,1,1:;")],
            "n1",
            "has 1 containers",
        ),
        (
            vec![base[0], base[1], (HAMI_ALLOCATED, ";")],
            "n1",
            "no GPU",
        ),
    ];
    for (ann, node, why) in cases {
        let e = recorded(&pod(node, &[("a", &[])], 0, &ann))
            .expect("a peer pod")
            .expect_err(why);
        assert!(e.contains(why), "{ann:?}: {e} (want {why:?})");
    }
}

#[test]
fn gpushare_memory_is_the_pods_fraction_of_the_gpu_by_index() {
    let ann = [
        (GPUSHARE_IDX, "1"),
        (GPUSHARE_POD, "6"),
        (GPUSHARE_DEV, "16"),
        (GPUSHARE_ASSIGNED, "true"),
        ("ALIYUN_COM_GPU_MEM_ASSUME_TIME", "1700000000000000000"),
    ];
    let p = pod(
        "n1",
        &[
            ("a", &[(ALIYUN_GPU_MEM, "4")]),
            ("side", &[]),
            ("b", &[(ALIYUN_GPU_MEM, "2")]),
        ],
        0,
        &ann,
    );
    let g = recorded(&p).expect("peer").expect("readable");
    assert_eq!(g.peer, Peer::Gpushare);
    let shares: Vec<(&str, &PeerShare)> = g
        .containers
        .iter()
        .map(|c| (c.name.as_str(), &c.shares[0]))
        .collect();
    assert_eq!(shares.len(), 2);
    assert_eq!(shares[0].0, "a");
    assert_eq!(shares[0].1.device, DeviceRef::Index(1));
    assert_eq!(
        shares[0].1.memory,
        PeerMemory::Fraction {
            units: 4,
            per_gpu: 16
        }
    );
    assert_eq!(shares[0].1.core_milli, 0);
    assert_eq!(shares[1].0, "b");

    let mut unassigned = ann;
    unassigned[3] = (GPUSHARE_ASSIGNED, "false");
    let e = recorded(&pod(
        "n1",
        &[("a", &[(ALIYUN_GPU_MEM, "6")])],
        0,
        &unassigned,
    ))
    .expect("peer")
    .expect_err("not assigned");
    assert!(e.contains("not handed"), "{e}");
    let e = recorded(&pod("n1", &[("a", &[(ALIYUN_GPU_MEM, "5")])], 0, &ann))
        .expect("peer")
        .expect_err("sum differs");
    assert!(e.contains("add up to 5"), "{e}");
    let e = recorded(&pod("n1", &[("a", &[(ALIYUN_GPU_MEM, "6")])], 0, &ann[1..]))
        .expect("peer")
        .expect_err("partial");
    assert!(e.contains("ALIYUN_COM_GPU_MEM_IDX is missing"), "{e}");
}

#[test]
fn gpu_manager_shares_and_whole_gpus_by_container_index() {
    let ann = [
        (GPU_MANAGER_NODE, "n1"),
        (GPU_MANAGER_ASSIGNED, "true"),
        ("tencent.com/predicate-time", "1700000000000000000"),
        ("tencent.com/predicate-gpu-idx-0", "1"),
        ("tencent.com/predicate-gpu-idx-2", "2,3"),
    ];
    let p = pod(
        "n1",
        &[
            (
                "a",
                &[(VCUDA_CORE, "30"), ("tencent.com/vcuda-memory", "8")],
            ),
            ("side", &[]),
            ("b", &[(VCUDA_CORE, "200")]),
        ],
        0,
        &ann,
    );
    let g = recorded(&p).expect("peer").expect("readable");
    assert_eq!(g.peer, Peer::GpuManager);
    assert_eq!(
        g.containers,
        vec![
            PeerContainer {
                name: "a".into(),
                shares: vec![PeerShare {
                    device: DeviceRef::Index(1),
                    memory: PeerMemory::Mib(8 * 256),
                    core_milli: 300,
                }],
            },
            PeerContainer {
                name: "b".into(),
                shares: [2, 3]
                    .into_iter()
                    .map(|i| PeerShare {
                        device: DeviceRef::Index(i),
                        memory: PeerMemory::Whole,
                        core_milli: 1000,
                    })
                    .collect(),
            },
        ]
    );
    let mut wrong = ann;
    wrong[4] = ("tencent.com/predicate-gpu-idx-2", "2");
    let e = recorded(&pod(
        "n1",
        &[
            (
                "a",
                &[(VCUDA_CORE, "30"), ("tencent.com/vcuda-memory", "8")],
            ),
            ("side", &[]),
            ("b", &[(VCUDA_CORE, "200")]),
        ],
        0,
        &wrong,
    ))
    .expect("peer")
    .expect_err("one index for two GPUs");
    assert!(e.contains("holds 2 distinct"), "{e}");
    let e = recorded(&pod(
        "n1",
        &[(
            "a",
            &[(VCUDA_CORE, "30"), ("tencent.com/vcuda-memory", "8")],
        )],
        0,
        &ann[..3],
    ))
    .expect("peer")
    .expect_err("no index");
    assert!(e.contains("predicate-gpu-idx-0 is missing"), "{e}");
    let mut pending = ann;
    pending[1] = (GPU_MANAGER_ASSIGNED, "false");
    let e = recorded(&pod(
        "n1",
        &[(
            "a",
            &[(VCUDA_CORE, "30"), ("tencent.com/vcuda-memory", "8")],
        )],
        0,
        &pending,
    ))
    .expect("peer")
    .expect_err("pending");
    assert!(e.contains("not handed"), "{e}");
}

#[test]
fn pods_of_no_peer_are_none_and_two_peers_at_once_are_refused() {
    assert!(recorded(&pod("n1", &[("a", &[])], 0, &[])).is_none());
    let e = recorded(&pod(
        "n1",
        &[("a", &[])],
        0,
        &[(HAMI_NODE, "n1"), (GPUSHARE_IDX, "0")],
    ))
    .expect("peer")
    .expect_err("two peers");
    assert!(e.contains("hami and gpushare"), "{e}");
}
