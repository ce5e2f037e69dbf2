//! The meter against hand-computed integrals: window clipping, open allocations, identity
//! corrections, clock skew between leaders.

use gpuledger_ledger::pb;
use gpuledger_ledger::pb::event::Body;

use super::By;
use super::meter::{Meter, Step};
use super::report::{Report, core_hours};

fn ev(seq: u64, time_ms: i64, body: Body) -> pb::Event {
    pb::Event {
        seq,
        epoch: 1,
        time_ms,
        actor: None,
        body: Some(body),
    }
}

fn node() -> Body {
    Body::NodeRegistered(pb::NodeRegistered {
        inventory: Some(pb::NodeInventory {
            mode: Default::default(),
            node: "n1".into(),
            gpus: (0..2)
                .map(|i| pb::Gpu {
                    uuid: format!("G{i}"),
                    index: i,
                    model: "A100".into(),
                    memory_mib: 40_000,
                    healthy: true,
                    compute_capability: String::new(),
                })
                .collect(),
            cpu_milli: 0,
            memory_mib: 0,
            isolation: String::new(),
            dra_cores: String::new(),
        }),
    })
}

fn reserve(id: u64, ns: &str, name: &str, shares: &[(&str, u64, u32)]) -> Body {
    Body::Reserved(pb::Reserved {
        allocation_id: id,
        pod: Some(pb::PodRef {
            uid: format!("uid-{name}"),
            namespace: ns.into(),
            name: name.into(),
        }),
        container: "main".into(),
        node: "n1".into(),
        shares: shares
            .iter()
            .map(|(g, m, c)| pb::GpuShare {
                gpu_uuid: (*g).into(),
                mem_mib: *m,
                core_milli: *c,
            })
            .collect(),
        deadline_ms: 0,
        cpu_milli: 0,
        memory_mib: 0,
        policy: "binpack".into(),
    })
}

fn release(id: u64) -> Body {
    Body::Released(pb::Released {
        allocation_id: id,
        reason: "pod deleted".into(),
        node: "n1".into(),
    })
}

fn run(events: &[pb::Event], by: By, since: Option<i64>, until: i64) -> Report {
    let mut m = Meter::new(by, since, until);
    for e in events {
        if m.apply(e).expect("applies") == Step::Done {
            break;
        }
    }
    m.finish()
}

#[test]
fn clips_to_the_window_and_counts_open_allocations_to_until() {
    let events = [
        ev(1, 0, node()),
        ev(2, 1_000, reserve(2, "a", "p", &[("G0", 1_000, 250)])),
        ev(
            3,
            5_000,
            reserve(3, "b", "q", &[("G0", 2_000, 0), ("G1", 2_000, 0)]),
        ),
        ev(4, 9_000, release(2)),
    ];
    let r = run(&events, By::Namespace, Some(3_000), 20_000);
    // p: [3000, 9000) = 6000 ms × 1000 MiB, × 250 core_milli.
    let a = r.rows[&vec!["a".to_string()]];
    assert_eq!(a.mib_ms, 6_000_000);
    assert_eq!(a.core_milli_ms, 1_500_000);
    assert_eq!(a.allocations, 1);
    // q: [5000, 20000) open at until, on two GPUs: 15000 × 4000 MiB.
    let b = r.rows[&vec!["b".to_string()]];
    assert_eq!(b.mib_ms, 60_000_000);
    assert_eq!(b.core_milli_ms, 0);
    assert_eq!(r.total.mib_ms, 66_000_000);
}

#[test]
fn default_since_is_the_first_event_and_reading_stops_at_until() {
    let events = [
        ev(1, 500, node()),
        ev(2, 1_000, reserve(2, "a", "p", &[("G0", 1_000, 1_000)])),
        ev(3, 4_000, release(2)),
        ev(4, 4_000, reserve(4, "a", "p2", &[("G1", 10, 10)])),
    ];
    let r = run(&events, By::Pod, None, 4_000);
    assert_eq!(r.since_ms, 500);
    assert_eq!(r.rows.len(), 1, "p2 starts at until: {:?}", r.rows);
    let p = r.rows[&vec!["a".to_string(), "p".to_string()]];
    assert_eq!(p.core_milli_ms, 3_000_000);
    assert_eq!(core_hours(&p), "0.000833");
}

#[test]
fn a_backwards_timestamp_counts_as_the_one_before() {
    let events = [
        ev(1, 0, node()),
        ev(2, 10_000, reserve(2, "a", "p", &[("G0", 100, 0)])),
        ev(3, 7_000, release(2)),
    ];
    let r = run(&events, By::Node, None, 20_000);
    assert!(r.rows.is_empty(), "{:?}", r.rows);
}

#[test]
fn an_identity_correction_moves_the_rest_of_the_time() {
    let events = [
        ev(1, 0, node()),
        ev(2, 0, reserve(2, "a", "p", &[("G0", 100, 0)])),
        ev(3, 0, reserve(3, "b", "q", &[("G1", 300, 0)])),
        ev(
            4,
            1_000,
            Body::IdentityCorrected(pb::IdentityCorrected {
                from_allocation_id: 2,
                to_allocation_id: 3,
                device_ids: vec![],
                node: "n1".into(),
            }),
        ),
    ];
    let r = run(&events, By::Namespace, None, 3_000);
    // a: 100 MiB for 1 s, then 300 MiB for 2 s; b: the opposite.
    assert_eq!(r.rows[&vec!["a".to_string()]].mib_ms, 100_000 + 600_000);
    assert_eq!(r.rows[&vec!["b".to_string()]].mib_ms, 300_000 + 200_000);
    assert_eq!(r.rows[&vec!["a".to_string()]].allocations, 2);
}

#[test]
fn a_log_that_does_not_start_at_seq_1_is_refused() {
    let mut m = Meter::new(By::Namespace, None, 10);
    let err = m.apply(&ev(5, 0, node())).expect_err("refused");
    assert!(err.to_string().contains("starts at seq 5"), "{err}");
}

#[test]
fn claim_grants_are_metered_under_their_claims_namespace() {
    let Body::NodeRegistered(mut dra) = node() else {
        unreachable!("node() registers a node")
    };
    if let Some(inv) = dra.inventory.as_mut() {
        inv.mode = pb::NodeMode::Dra as i32;
    }
    let grant = Body::ClaimGranted(pb::ClaimGranted {
        allocation_id: 2,
        claim: Some(pb::ClaimRef {
            uid: "claim-uid".into(),
            namespace: "team-a".into(),
            name: "gpu".into(),
        }),
        request: "c0".into(),
        node: "n1".into(),
        pool: "n1".into(),
        device: "gpu-g0".into(),
        share_id: "s1".into(),
        share: Some(pb::GpuShare {
            gpu_uuid: "G0".into(),
            mem_mib: 3_000,
            core_milli: 300,
        }),
        consumers: vec![],
        source: "claim".into(),
        priority: 0,
    });
    let events = [
        ev(1, 0, Body::NodeRegistered(dra)),
        ev(2, 1_000, grant),
        ev(3, 3_000, release(2)),
    ];
    let r = run(&events, By::Namespace, None, 10_000);
    let a = r.rows[&vec!["team-a".to_string()]];
    assert_eq!((a.mib_ms, a.core_milli_ms), (6_000_000, 600_000));
    assert_eq!(a.allocations, 1);
}
