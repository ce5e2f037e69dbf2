use super::*;
use crate::pb;
use crate::pb::event::Body;

fn inv(node: &str, gpus: &[(&str, u64)]) -> pb::NodeInventory {
    pb::NodeInventory {
        mode: Default::default(),
        isolation: String::new(),
        dra_cores: String::new(),
        node: node.into(),
        gpus: gpus
            .iter()
            .enumerate()
            .map(|(i, (u, m))| pb::Gpu {
                uuid: (*u).into(),
                index: i as u32,
                model: "A100".into(),
                memory_mib: *m,
                healthy: true,
                compute_capability: String::new(),
            })
            .collect(),
        cpu_milli: 0,
        memory_mib: 0,
    }
}

fn ev(seq: u64, body: Body) -> pb::Event {
    pb::Event {
        seq,
        epoch: 1,
        time_ms: 1000 + seq as i64,
        actor: None,
        body: Some(body),
    }
}

fn reserved(id: u64, uid: &str, gpu: &str, mem: u64) -> Body {
    Body::Reserved(pb::Reserved {
        allocation_id: id,
        pod: Some(pb::PodRef {
            uid: uid.into(),
            namespace: "ns".into(),
            name: uid.into(),
        }),
        container: "c".into(),
        node: "n1".into(),
        shares: vec![pb::GpuShare {
            gpu_uuid: gpu.into(),
            mem_mib: mem,
            core_milli: 0,
        }],
        deadline_ms: 0,
        cpu_milli: 0,
        memory_mib: 0,
        policy: "binpack".into(),
    })
}

fn registered(l: &mut Ledger) {
    l.apply(&ev(
        1,
        Body::NodeRegistered(pb::NodeRegistered {
            inventory: Some(inv("n1", &[("g0", 100), ("g1", 100)])),
        }),
    ))
    .expect("register");
}

#[test]
fn over_capacity_reservation_is_refused_and_changes_nothing() {
    let mut l = Ledger::new();
    registered(&mut l);
    l.apply(&ev(2, reserved(2, "p1", "g0", 60))).expect("fits");
    let before = l.clone();
    let err = l
        .apply(&ev(3, reserved(3, "p2", "g0", 50)))
        .expect_err("over");
    assert!(err.to_string().contains("over capacity"), "{err}");
    assert_eq!(l, before);
    l.check().expect("consistent");
}

#[test]
fn seq_gaps_and_epoch_regressions_are_refused() {
    let mut l = Ledger::new();
    registered(&mut l);
    assert!(matches!(
        l.apply(&ev(3, reserved(3, "p1", "g0", 1))),
        Err(ApplyError::SeqGap {
            expected: 2,
            got: 3
        })
    ));
    let mut e = ev(2, reserved(2, "p1", "g0", 1));
    e.epoch = 0;
    assert!(matches!(
        l.apply(&e),
        Err(ApplyError::EpochBackwards { .. })
    ));
}

#[test]
fn one_live_allocation_per_container_and_release_frees() {
    let mut l = Ledger::new();
    registered(&mut l);
    l.apply(&ev(2, reserved(2, "p1", "g0", 10))).expect("first");
    assert!(l.apply(&ev(3, reserved(3, "p1", "g1", 10))).is_err());
    l.apply(&ev(
        3,
        Body::Released(pb::Released {
            allocation_id: 2,
            reason: "done".into(),
            node: "n1".into(),
        }),
    ))
    .expect("release");
    assert_eq!(l.node("n1").expect("n1").gpus[0].mem_used, 0);
    l.apply(&ev(4, reserved(4, "p1", "g1", 10)))
        .expect("again after release");
    l.check().expect("consistent");
}

#[test]
fn unhealthy_gpu_gets_no_grant() {
    let mut l = Ledger::new();
    registered(&mut l);
    l.apply(&ev(
        2,
        Body::DeviceHealthChanged(pb::DeviceHealthChanged {
            node: "n1".into(),
            gpu_uuid: "g0".into(),
            healthy: false,
            reason: "xid 79".into(),
            xid: 79,
        }),
    ))
    .expect("health");
    assert!(l.apply(&ev(3, reserved(3, "p1", "g0", 1))).is_err());
}

#[test]
fn node_with_allocations_cannot_be_removed_or_lose_a_held_gpu() {
    let mut l = Ledger::new();
    registered(&mut l);
    l.apply(&ev(2, reserved(2, "p1", "g0", 10))).expect("fits");
    assert!(
        l.apply(&ev(
            3,
            Body::NodeRemoved(pb::NodeRemoved {
                node: "n1".into(),
                reason: String::new(),
            })
        ))
        .is_err()
    );
    let shrunk = inv("n1", &[("g1", 100)]);
    assert!(
        l.apply(&ev(
            3,
            Body::NodeRegistered(pb::NodeRegistered {
                inventory: Some(shrunk),
            })
        ))
        .is_err()
    );
}

#[test]
fn snapshot_round_trip_keeps_the_state() {
    let mut l = Ledger::new();
    registered(&mut l);
    l.apply(&ev(2, reserved(2, "p1", "g0", 10))).expect("fits");
    l.apply(&ev(3, reserved(3, "p2", "g1", 30))).expect("fits");
    let back = Ledger::from_snapshot(&l.to_snapshot()).expect("loads");
    assert!(back.same_state(&l));
    back.check().expect("consistent");
}

#[test]
fn a_nodes_isolation_is_kept_through_a_snapshot_and_a_change_of_it_registers_again() {
    let mut l = Ledger::new();
    let mut i = inv("n1", &[("g0", 100)]);
    i.isolation = "hami-core".into();
    l.apply(&ev(
        1,
        Body::NodeRegistered(pb::NodeRegistered {
            inventory: Some(i.clone()),
        }),
    ))
    .expect("register");
    assert_eq!(l.node("n1").expect("n1").isolation, "hami-core");
    let back = Ledger::from_snapshot(&l.to_snapshot()).expect("snapshot");
    assert_eq!(back.node("n1").expect("n1").isolation, "hami-core");
    assert_eq!(back.node("n1").expect("n1").inventory(), i);
    i.isolation = "nvml".into();
    assert_ne!(
        l.node("n1").expect("n1").inventory(),
        i,
        "a new isolation is a changed inventory"
    );
}
