use super::*;

fn view() -> View {
    let mut v = View::default();
    for (id, uid, gpu, mem) in [(1, "uid-a", "G0", 1000), (2, "uid-b", "G0", 2000)] {
        v.upsert(pb::Allocation {
            id,
            pod: Some(pb::PodRef {
                uid: uid.into(),
                namespace: "ns".into(),
                name: uid.into(),
            }),
            container: "main".into(),
            node: "n1".into(),
            shares: vec![pb::GpuShare {
                gpu_uuid: gpu.into(),
                mem_mib: mem,
                core_milli: 0,
            }],
            state: pb::AllocationState::Assigned as i32,
            ..Default::default()
        });
    }
    v
}

fn p(pid: u32, used: u64) -> GpuProcess {
    GpuProcess {
        gpu: "G0".into(),
        pid,
        used_mib: used,
    }
}

#[test]
fn cgroup_paths_of_both_drivers_give_the_pod_uid() {
    let cgroupfs = "0::/kubepods/burstable/pod0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0/abcdef\n";
    assert_eq!(
        pod_uid_from_cgroup(cgroupfs).as_deref(),
        Some("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0")
    );
    let systemd = "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0f1e2d3c_4b5a_6978_8796_a5b4c3d2e1f0.slice/cri-containerd-1.scope\n";
    assert_eq!(
        pod_uid_from_cgroup(systemd).as_deref(),
        Some("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0")
    );
    assert_eq!(
        pod_uid_from_cgroup("0::/user.slice/session-1.scope\n"),
        None
    );
}

#[test]
fn environ_gives_the_allocation_id() {
    assert_eq!(
        allocation_from_environ(b"PATH=/bin\0GPULEDGER_ALLOCATION_ID=42\0HOME=/\0"),
        Some(42)
    );
    assert_eq!(allocation_from_environ(b"PATH=/bin\0"), None);
}

#[test]
fn usage_over_the_share_is_a_violation_and_unknown_processes_are_rogue() {
    let v = view();
    let by_uid = |uid: &str| ProcOwner {
        pod_uid: Some(uid.into()),
        allocation_id: None,
    };
    let by_env = |id: u64| ProcOwner {
        pod_uid: None,
        allocation_id: Some(id),
    };
    let f = judge(
        &v,
        &[
            (p(10, 600), by_uid("uid-a")),
            (p(11, 500), by_env(1)),
            (p(20, 1999), by_env(2)),
            (p(30, 10), ProcOwner::default()),
        ],
    );
    assert_eq!(
        f,
        vec![
            Finding::Rogue {
                gpu: "G0".into(),
                pid: 30,
                used_mib: 10
            },
            Finding::Over {
                allocation_id: 1,
                gpu: "G0".into(),
                pids: vec![10, 11],
                used_mib: 1100,
                limit_mib: 1000
            },
        ]
    );
    // An allocation id in the environment that is not on this GPU does not count.
    let f = judge(
        &v,
        &[(
            GpuProcess {
                gpu: "G9".into(),
                pid: 5,
                used_mib: 1,
            },
            by_env(1),
        )],
    );
    assert!(matches!(f[..], [Finding::Rogue { pid: 5, .. }]));
}
