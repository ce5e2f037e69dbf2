//! Property tests: random command streams never break an invariant, and replaying the events
//! they produced from an empty ledger gives exactly the live state.

use gpuledger_ledger::pb;
use gpuledger_ledger::{Command, ContainerRequest, Ledger, PodRequest, Policy, Selector};
use proptest::prelude::*;

const NODES: usize = 3;

fn inventory(node: usize, gpus: usize, mem: u64) -> pb::NodeInventory {
    pb::NodeInventory {
        mode: Default::default(),
        node: format!("n{node}"),
        gpus: (0..gpus)
            .map(|i| pb::Gpu {
                uuid: format!("GPU-{node}-{i}"),
                index: i as u32,
                model: if i % 2 == 0 {
                    "A100".into()
                } else {
                    "T4".into()
                },
                memory_mib: mem,
                healthy: true,
                compute_capability: String::new(),
            })
            .collect(),
        cpu_milli: 16_000,
        memory_mib: 64_000,
        isolation: String::new(),
        dra_cores: String::new(),
    }
}

fn pod_request(
    pod: u8,
    slices: u32,
    mem: u64,
    core: u32,
    percent: bool,
    spread: bool,
    t4: bool,
) -> PodRequest {
    PodRequest {
        pod: pb::PodRef {
            uid: format!("uid-{pod}"),
            namespace: "ns".into(),
            name: format!("p{pod}"),
        },
        containers: vec![ContainerRequest {
            name: "main".into(),
            slices,
            mem_mib: if percent { 0 } else { mem },
            mem_percent: if percent { (mem % 100) as u32 + 1 } else { 0 },
            core_milli: core,
        }],
        selector: Selector {
            types: if t4 { vec!["t4".into()] } else { vec![] },
            ..Default::default()
        },
        policy: if spread {
            Policy::Spread
        } else {
            Policy::Binpack
        },
        cpu_milli: u64::from(pod % 4) * 1000,
        memory_mib: u64::from(pod % 3) * 4000,
        ..Default::default()
    }
}

/// Pod `p` nominated on node `n` for `m` MiB and `c` thousandths of GPU `g`, evicting `victims`
/// (pod, priority).
fn nomination(
    p: u8,
    n: usize,
    g: usize,
    m: u64,
    c: u32,
    prio: i32,
    victims: &[(u8, i32)],
) -> pb::Nominated {
    let r = |uid: u8| pb::PodRef {
        uid: format!("uid-{uid}"),
        namespace: "ns".into(),
        name: format!("p{uid}"),
    };
    pb::Nominated {
        pod: Some(r(p)),
        priority: prio,
        node: format!("n{n}"),
        containers: vec![pb::NominatedContainer {
            container: "main".into(),
            shares: vec![pb::GpuShare {
                gpu_uuid: format!("GPU-{n}-{g}"),
                mem_mib: m,
                core_milli: c,
            }],
        }],
        victims: victims
            .iter()
            .map(|&(v, vp)| pb::Victim {
                pod: Some(r(v)),
                priority: vp,
            })
            .collect(),
        deadline_ms: 5_000,
        cpu_milli: 0,
        memory_mib: 0,
    }
}

fn command() -> impl Strategy<Value = Command> {
    prop_oneof![
        4 => (0u8..24, 0..NODES, 1u32..3, 0u64..20_000, 0u32..700, any::<bool>(), any::<bool>(), any::<bool>(), -2i32..3)
            .prop_map(|(p, n, s, m, c, pc, sp, t4, prio)| Command::Reserve {
                request: PodRequest { priority: prio, ..pod_request(p, s, m, c, pc, sp, t4) },
                node: format!("n{n}"),
                deadline_ms: 1000,
            }),
        2 => (0u8..24, 0..NODES, 0usize..4, 0u64..24_000, 0u32..1000, -2i32..3, prop::collection::vec((0u8..24, -3i32..3), 0..3), prop::collection::vec(0u8..24, 0..2))
            .prop_map(|(p, n, g, m, c, prio, victims, leaving)| Command::Nominate {
                nomination: nomination(p, n, g, m, c, prio, &victims),
                leaving: leaving.into_iter().map(|v| format!("uid-{v}")).collect(),
            }),
        // Pods another scheduler placed, adopted on GPUs they name (some over-committed,
        // unhealthy or not registered, some already held: those are refused or repeats).
        2 => (0u8..24, 0..NODES, prop::collection::vec((0usize..5, 0u64..20_000, 0u32..1100), 1..3), 1usize..3)
            .prop_map(|(p, n, shares, containers)| Command::Adopt {
                pod: pb::PodRef { uid: format!("uid-{p}"), namespace: "ns".into(), name: format!("p{p}") },
                node: format!("n{n}"),
                containers: (0..containers).map(|c| pb::NominatedContainer {
                    container: format!("c{c}"),
                    shares: shares.iter().skip(c).map(|(g, m, core)| pb::GpuShare {
                        gpu_uuid: format!("GPU-{n}-{g}"), mem_mib: *m, core_milli: *core,
                    }).collect(),
                }).collect(),
                source: "hami".into(),
            }),
        1 => (0u8..24).prop_map(|p| Command::EndNomination {
            pod_uid: format!("uid-{p}"), reason: "expired".into()
        }),
        2 => (0u8..24).prop_map(|p| Command::Release {
            pod_uid: format!("uid-{p}"), container: String::new(), allocation_id: 0, reason: "done".into()
        }),
        1 => (0u8..24, 0..NODES).prop_map(|(p, n)| Command::ConfirmBound {
            pod_uid: format!("uid-{p}"), node: format!("n{n}"), reason: "bind".into()
        }),
        1 => (1u64..60, 0..NODES, 0u32..4).prop_map(|(id, n, d)| Command::Assign {
            node: format!("n{n}"), allocation_id: id, device_ids: vec![format!("dev-{d}")]
        }),
        1 => (1u64..60, 1u64..60, 0..NODES).prop_map(|(a, b, n)| Command::CorrectIdentity {
            node: format!("n{n}"), from_allocation_id: a, to_allocation_id: b, device_ids: vec![]
        }),
        1 => (0..NODES, 0usize..4, any::<bool>()).prop_map(|(n, g, h)| Command::SetDeviceHealth(pb::DeviceHealthChanged {
            node: format!("n{n}"), gpu_uuid: format!("GPU-{n}-{g}"), healthy: h, reason: "xid".into(), xid: 79
        })),
        1 => (0..NODES, 1usize..5, 8_000u64..40_000).prop_map(|(n, g, m)| Command::RegisterNode(inventory(n, g, m))),
        1 => (0..NODES).prop_map(|n| Command::RemoveNode { node: format!("n{n}"), reason: "gone".into() }),
        1 => (0..NODES).prop_map(|n| Command::ReportViolation(pb::LimitViolated {
            allocation_id: 1, node: format!("n{n}"), gpu_uuid: String::new(), pid: 7, used_mib: 9, limit_mib: 8, action: "report".into()
        })),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_commands_keep_invariants_and_replay_equals_live(cmds in prop::collection::vec(command(), 1..120)) {
        let mut live = Ledger::new();
        let mut log: Vec<pb::Event> = Vec::new();
        for n in 0..NODES {
            let (ev, _) = live.execute(Command::RegisterNode(inventory(n, 4, 24_000)), 1, 0).expect("register");
            log.extend(ev);
        }
        for (i, cmd) in cmds.into_iter().enumerate() {
            let epoch = 1 + (i as u64 / 40);
            let before = live.clone();
            match live.execute(cmd, epoch, i as i64) {
                Ok((events, _)) => log.extend(events),
                Err(gpuledger_ledger::CommandError::Bug(e)) => panic!("decided an invalid event: {e}"),
                Err(_) => prop_assert_eq!(&live, &before, "a refused command changed the state"),
            }
            if let Err(e) = live.check() {
                panic!("invariant broken after step {i}: {e}");
            }
        }
        let mut replayed = Ledger::new();
        replayed.apply_all(&log).expect("the log replays");
        prop_assert_eq!(&replayed, &live);
        let from_snap = Ledger::from_snapshot(&live.to_snapshot()).expect("snapshot loads");
        prop_assert!(from_snap.same_state(&live));
    }
}
