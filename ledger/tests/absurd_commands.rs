//! Commands with absurd values from outside (a node agent's inventory, an extender's request, a
//! node agent's violation report) never panic the ledger and never get as far as an invariant
//! violation (`CommandError::Bug`, which ends a leadership): they are refused as invalid, or do
//! not fit, or are served. Run in debug, where an overflow panics.

use std::sync::atomic::{AtomicU64, Ordering};

use gpuledger_ledger::command::bounds::InventoryLimits;
use gpuledger_ledger::{Command, CommandError, ContainerRequest, Ledger, PodRequest, pb};
use proptest::prelude::*;
use proptest::test_runner::{TestCaseError, TestRunner};

/// Values at and around the edges of every width, where arithmetic goes wrong.
fn edgy_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(u64::MAX),
        Just(u64::MAX / 100 + 1),
        Just(u64::from(u32::MAX)),
        Just(InventoryLimits::CEILING.max_gpu_memory_mib),
        Just(InventoryLimits::CEILING.max_gpu_memory_mib + 1),
        any::<u64>(),
        0u64..100_000,
    ]
}

fn edgy_u32() -> impl Strategy<Value = u32> {
    prop_oneof![
        Just(0u32),
        Just(1),
        Just(100),
        Just(101),
        Just(1000),
        Just(1001),
        Just(u32::MAX),
        any::<u32>(),
        0u32..200,
    ]
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("n0".to_string()),
        Just("kill".to_string()),
        "[a-z0-9-]{0,12}",
        (0usize..3000).prop_map(|n| "x".repeat(n)),
    ]
}

fn inventory() -> impl Strategy<Value = pb::NodeInventory> {
    (
        0usize..3,
        prop::collection::vec((edgy_u64(), text()), 0..6),
        edgy_u64(),
        edgy_u64(),
    )
        .prop_map(|(n, gpus, cpu, mem)| pb::NodeInventory {
            mode: Default::default(),
            isolation: String::new(),
            dra_cores: String::new(),
            node: format!("n{n}"),
            gpus: gpus
                .into_iter()
                .enumerate()
                .map(|(i, (memory_mib, model))| pb::Gpu {
                    uuid: format!("GPU-{n}-{i}"),
                    index: i as u32,
                    model,
                    memory_mib,
                    healthy: true,
                    compute_capability: String::new(),
                })
                .collect(),
            cpu_milli: cpu,
            memory_mib: mem,
        })
}

fn request() -> impl Strategy<Value = PodRequest> {
    (
        0u8..8,
        prop::collection::vec(
            prop_oneof![
                (edgy_u32(), edgy_u64(), edgy_u32(), edgy_u32()),
                // Plausible shapes, so that absurd inventories meet requests that pass
                // validation (a percentage of a GPU of absurd memory overflowed).
                (
                    1u32..4,
                    prop_oneof![Just(0u64), edgy_u64()],
                    0u32..=100,
                    0u32..=1000
                ),
            ],
            0..4,
        ),
        edgy_u64(),
        edgy_u64(),
    )
        .prop_map(|(p, cs, cpu, mem)| PodRequest {
            pod: pb::PodRef {
                uid: format!("uid-{p}"),
                namespace: "ns".into(),
                name: format!("p{p}"),
            },
            containers: cs
                .into_iter()
                .enumerate()
                .map(
                    |(i, (slices, mem_mib, mem_percent, core_milli))| ContainerRequest {
                        name: format!("c{i}"),
                        slices,
                        mem_mib,
                        mem_percent,
                        core_milli,
                    },
                )
                .collect(),
            cpu_milli: cpu,
            memory_mib: mem,
            ..Default::default()
        })
}

fn command() -> impl Strategy<Value = Command> {
    prop_oneof![
        3 => inventory().prop_map(Command::RegisterNode),
        4 => (request(), 0usize..3).prop_map(|(request, n)| Command::Reserve {
            request,
            node: format!("n{n}"),
            deadline_ms: 1000,
        }),
        1 => (0u8..8, 0usize..3, text()).prop_map(|(p, n, reason)| Command::ConfirmBound {
            pod_uid: format!("uid-{p}"),
            node: format!("n{n}"),
            reason,
        }),
        1 => (0u8..8, text()).prop_map(|(p, reason)| Command::Release {
            pod_uid: format!("uid-{p}"),
            container: String::new(),
            allocation_id: 0,
            reason,
        }),
        2 => (0usize..3, text(), text(), edgy_u64(), edgy_u64(), edgy_u32(), edgy_u64())
            .prop_map(|(n, action, gpu_uuid, used_mib, limit_mib, pid, allocation_id)| {
                Command::ReportViolation(pb::LimitViolated {
                    allocation_id,
                    node: format!("n{n}"),
                    gpu_uuid,
                    pid,
                    used_mib,
                    limit_mib,
                    action,
                })
            }),
        1 => (0usize..3, edgy_u64(), prop::collection::vec(text(), 0..80)).prop_map(
            |(n, allocation_id, device_ids)| Command::Assign {
                node: format!("n{n}"),
                allocation_id,
                device_ids,
            }
        ),
        1 => (0usize..3, text()).prop_map(|(n, reason)| Command::RemoveNode {
            node: format!("n{n}"),
            reason,
        }),
        1 => (edgy_u64(), edgy_u64(), "[a-z]{1,8}").prop_map(|(mem_mib, core_milli, namespace)| {
            Command::SetQuota(pb::QuotaSet { namespace, mem_mib, core_milli })
        }),
    ]
}

/// 512 random streams of up to 40 commands each, from an empty ledger.
#[test]
fn absurd_commands_are_refused_never_a_bug() {
    let tried = AtomicU64::new(0);
    let mut runner = TestRunner::new(ProptestConfig {
        cases: 512,
        ..ProptestConfig::default()
    });
    let streams = prop::collection::vec(command(), 1..40);
    let outcome = runner.run(&streams, |cmds| {
        let mut live = Ledger::new();
        let mut log = Vec::new();
        for (i, cmd) in cmds.into_iter().enumerate() {
            tried.fetch_add(1, Ordering::Relaxed);
            match live.execute(cmd.clone(), 1, 1000 + i as i64) {
                Ok((events, _)) => log.extend(events),
                Err(CommandError::Bug(e)) => {
                    prop_assert!(false, "{cmd:?} broke an invariant: {e}");
                }
                Err(_) => {}
            }
        }
        // What was accepted replays to the same state.
        let mut replay = Ledger::new();
        for e in &log {
            replay
                .apply(e)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        prop_assert!(replay.same_state(&live));
        Ok(())
    });
    if let Err(e) = outcome {
        panic!("{e}");
    }
    let n = tried.load(Ordering::Relaxed);
    println!("absurd commands: {n} commands in 512 random streams, 0 panics, 0 invariant breaks");
    assert!(n >= 512, "only {n} commands were tried");
}

/// The overflow that crashed leaders: a GPU of absurd memory, then a percent-of-memory
/// request. Refused at registration; and were such a GPU in the ledger, a percentage of it
/// would saturate instead of wrapping.
#[test]
fn an_absurd_gpu_is_refused_and_percentages_never_wrap() {
    let mut l = Ledger::new();
    let inv = pb::NodeInventory {
        mode: Default::default(),
        isolation: String::new(),
        dra_cores: String::new(),
        node: "n0".into(),
        gpus: vec![pb::Gpu {
            uuid: "GPU-huge".into(),
            index: 0,
            model: "X".into(),
            memory_mib: u64::MAX / 2,
            healthy: true,
            compute_capability: String::new(),
        }],
        cpu_milli: 0,
        memory_mib: 0,
    };
    match l.execute(Command::RegisterNode(inv), 1, 0) {
        Err(CommandError::Invalid(m)) => assert!(m.contains("MiB per GPU"), "{m}"),
        other => panic!("an absurd GPU was not refused: {other:?}"),
    }
    let c = ContainerRequest {
        name: "c".into(),
        slices: 1,
        mem_percent: 100,
        ..Default::default()
    };
    let g = gpuledger_ledger::GpuState {
        uuid: "GPU-huge".into(),
        index: 0,
        model: "X".into(),
        memory_mib: u64::MAX / 2,
        healthy: true,
        compute_capability: String::new(),
        mem_used: 0,
        core_used: 0,
        holders: 0,
    };
    assert_eq!(
        c.mem_on(&g),
        u64::MAX.div_ceil(100),
        "100 % saturates, never wraps"
    );
}
