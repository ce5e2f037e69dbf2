//! Property test: random mixes of pod reservations, claim grants, prepares, releases and node
//! mode changes on random nodes never over-commit a GPU, never leave a GPU held by both a pod
//! reservation and a claim grant, and replay to exactly the live state.

use std::collections::HashMap;

use gpuledger_ledger::pb;
use gpuledger_ledger::state::dra_device_name;
use gpuledger_ledger::{Command, CommandError, ContainerRequest, Ledger, PodRequest};
use proptest::prelude::*;

const NODES: usize = 3;
const GPUS: usize = 2;
const GPU_MIB: u64 = 16_000;

fn inventory(node: usize, dra: bool) -> pb::NodeInventory {
    pb::NodeInventory {
        node: format!("n{node}"),
        gpus: (0..GPUS)
            .map(|i| pb::Gpu {
                uuid: format!("GPU-{node}-{i}"),
                index: i as u32,
                model: "A100".into(),
                memory_mib: GPU_MIB,
                healthy: true,
                compute_capability: String::new(),
            })
            .collect(),
        cpu_milli: 0,
        memory_mib: 0,
        mode: if dra {
            pb::NodeMode::Dra as i32
        } else {
            pb::NodeMode::DevicePlugin as i32
        },
        isolation: String::new(),
        dra_cores: String::new(),
    }
}

fn reserve(pod: u8, node: usize, mem: u64, core: u32) -> Command {
    Command::Reserve {
        request: PodRequest {
            pod: pb::PodRef {
                uid: format!("pod-{pod}"),
                namespace: "ns".into(),
                name: format!("p{pod}"),
            },
            containers: vec![ContainerRequest {
                name: "main".into(),
                slices: 1,
                mem_mib: mem,
                mem_percent: 0,
                core_milli: core,
            }],
            ..Default::default()
        },
        node: format!("n{node}"),
        deadline_ms: 1_000,
    }
}

/// A grant of claim `claim`'s request c0 with share `share`, as the scheduler's first fit or a
/// forged allocation would name it: any GPU of any node, any size.
fn grant(claim: u8, share: u8, node: usize, gpu: usize, mem: u64, core: u32) -> Command {
    let uuid = format!("GPU-{node}-{gpu}");
    Command::GrantClaim(pb::ClaimGranted {
        allocation_id: 0,
        claim: Some(pb::ClaimRef {
            uid: format!("claim-{claim}"),
            namespace: "ns".into(),
            name: format!("c{claim}"),
        }),
        request: "c0".into(),
        node: format!("n{node}"),
        pool: format!("n{node}"),
        device: dra_device_name(&uuid),
        share_id: format!("s{share}"),
        share: Some(pb::GpuShare {
            gpu_uuid: uuid,
            mem_mib: mem,
            core_milli: core,
        }),
        consumers: vec![],
        source: "claim".into(),
        priority: 0,
    })
}

fn command() -> impl Strategy<Value = Command> {
    prop_oneof![
        4 => (0u8..16, 0..NODES, 1u64..12_000, 0u32..800)
            .prop_map(|(p, n, m, c)| reserve(p, n, m, c)),
        4 => (0u8..16, 0u8..3, 0..NODES, 0..GPUS, 1u64..12_000, 0u32..800)
            .prop_map(|(k, s, n, g, m, c)| grant(k, s, n, g, m, c)),
        2 => (0u8..16).prop_map(|p| Command::Release {
            pod_uid: format!("pod-{p}"), container: String::new(), allocation_id: 0, reason: "done".into()
        }),
        2 => (0u8..16).prop_map(|k| Command::Release {
            pod_uid: format!("claim-{k}"), container: String::new(), allocation_id: 0, reason: "claim-deleted".into()
        }),
        2 => (1u64..80).prop_map(|id| Command::Release {
            pod_uid: String::new(), container: String::new(), allocation_id: id, reason: "claim-deallocated".into()
        }),
        1 => (0..NODES, 1u64..80).prop_map(|(n, id)| Command::PrepareClaim {
            node: format!("n{n}"), allocation_ids: vec![id], cdi_device_ids: vec![format!("gpuledger.io/claim={id}")]
        }),
        1 => (0..NODES, 1u64..80).prop_map(|(n, id)| Command::UnprepareClaim {
            node: format!("n{n}"), allocation_ids: vec![id]
        }),
        1 => (0..NODES, 0..GPUS, any::<bool>()).prop_map(|(n, g, h)| Command::SetDeviceHealth(pb::DeviceHealthChanged {
            node: format!("n{n}"), gpu_uuid: format!("GPU-{n}-{g}"), healthy: h, reason: "xid".into(), xid: 79
        })),
        2 => (0..NODES, any::<bool>()).prop_map(|(n, dra)| Command::RegisterNode(inventory(n, dra))),
        1 => (0..NODES).prop_map(|n| Command::RemoveNode { node: format!("n{n}"), reason: "gone".into() }),
    ]
}

/// The invariants, re-derived here from the allocations rather than trusted from the ledger's
/// own counters: per GPU, memory and cores within capacity and one kind of holder only, of the
/// kind its node's mode serves.
fn no_overcommit_and_one_kind(l: &Ledger) -> Result<(), String> {
    let mut per_gpu: HashMap<&str, (u64, u32, bool, bool)> = HashMap::new();
    for a in l.allocs().values() {
        for s in &a.shares {
            let e = per_gpu.entry(&s.gpu_uuid).or_default();
            e.0 += s.mem_mib;
            e.1 += s.core_milli;
            if a.claim.is_some() {
                e.3 = true;
            } else {
                e.2 = true;
            }
        }
    }
    for n in l.nodes().values() {
        for g in &n.gpus {
            let (m, c, pods, claims) = per_gpu.get(g.uuid.as_str()).copied().unwrap_or_default();
            if m > g.memory_mib || c > 1000 {
                return Err(format!("GPU {} over-committed: {m} MiB, {c} cores", g.uuid));
            }
            if pods && claims {
                return Err(format!("GPU {} held by a pod and a claim", g.uuid));
            }
            let dra = n.mode == pb::NodeMode::Dra;
            if (dra && pods) || (!dra && claims) {
                return Err(format!(
                    "GPU {} holds the wrong kind for node {}'s mode",
                    g.uuid, n.name
                ));
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn claims_and_pods_never_overcommit_or_share_a_gpu_and_replay_equals_live(
        modes in prop::collection::vec(any::<bool>(), NODES),
        cmds in prop::collection::vec(command(), 1..150),
    ) {
        let mut live = Ledger::new();
        let mut log: Vec<pb::Event> = Vec::new();
        for (n, dra) in modes.into_iter().enumerate() {
            let (ev, _) = live.execute(Command::RegisterNode(inventory(n, dra)), 1, 0).expect("register");
            log.extend(ev);
        }
        for (i, cmd) in cmds.into_iter().enumerate() {
            let before = live.clone();
            match live.execute(cmd, 1 + i as u64 / 50, i as i64) {
                Ok((events, _)) => log.extend(events),
                Err(CommandError::Bug(e)) => panic!("decided an invalid event at step {i}: {e}"),
                Err(_) => prop_assert_eq!(&live, &before, "a refused command changed the state"),
            }
            if let Err(e) = no_overcommit_and_one_kind(&live).and_then(|()| live.check()) {
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

/// The generator reaches both kinds of grant and mode changes: a property that held only because
/// every grant was refused would prove nothing.
#[test]
fn the_generated_streams_grant_both_kinds() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let (mut grants, mut reservations, mut switches) = (0, 0, 0);
    for _ in 0..64 {
        let cmds = prop::collection::vec(command(), 100)
            .new_tree(&mut runner)
            .expect("a stream")
            .current();
        let mut l = Ledger::new();
        for n in 0..NODES {
            l.execute(Command::RegisterNode(inventory(n, n % 2 == 0)), 1, 0)
                .expect("register");
        }
        for cmd in cmds {
            let Ok((events, _)) = l.execute(cmd, 1, 0) else {
                continue;
            };
            for e in &events {
                match &e.body {
                    Some(pb::event::Body::ClaimGranted(_)) => grants += 1,
                    Some(pb::event::Body::Reserved(_)) => reservations += 1,
                    Some(pb::event::Body::NodeRegistered(r))
                        if r.inventory
                            .as_ref()
                            .is_some_and(|i| i.mode == pb::NodeMode::Dra as i32) =>
                    {
                        switches += 1
                    }
                    _ => {}
                }
            }
        }
    }
    assert!(
        grants > 100 && reservations > 100 && switches > 5,
        "grants {grants}, reservations {reservations}, registrations in DRA mode {switches}"
    );
}
