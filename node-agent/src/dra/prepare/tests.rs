//! The prepare decision against views folded from the events a real ledger commits.

use gpuledger_ledger::state::dra_device_name;
use gpuledger_ledger::{Command, Ledger};

use super::*;

fn inventory() -> pb::NodeInventory {
    pb::NodeInventory {
        node: "n1".into(),
        gpus: (0..2)
            .map(|i| pb::Gpu {
                uuid: format!("GPU-AB{i}"),
                index: i,
                model: "H100".into(),
                memory_mib: 80000,
                healthy: true,
                compute_capability: String::new(),
            })
            .collect(),
        cpu_milli: 0,
        memory_mib: 0,
        mode: pb::NodeMode::Dra as i32,
        isolation: String::new(),
        dra_cores: String::new(),
    }
}

fn grant(uid: &str, gpu: u32, share: &str) -> pb::ClaimGranted {
    let uuid = format!("GPU-AB{gpu}");
    pb::ClaimGranted {
        allocation_id: 0,
        claim: Some(pb::ClaimRef {
            uid: uid.into(),
            namespace: "team-a".into(),
            name: "gpu".into(),
        }),
        request: "c0".into(),
        node: "n1".into(),
        pool: "n1".into(),
        device: dra_device_name(&uuid),
        share_id: share.into(),
        share: Some(pb::GpuShare {
            gpu_uuid: uuid,
            mem_mib: 3000,
            core_milli: 300,
        }),
        consumers: vec![pb::PodRef {
            uid: "pod-1".into(),
            namespace: "team-a".into(),
            name: "p".into(),
        }],
        source: "claim".into(),
        priority: 0,
    }
}

fn result(gpu: u32, share: &str) -> ClaimResult {
    ClaimResult {
        request: "c0".into(),
        pool: "n1".into(),
        device: dra_device_name(&format!("GPU-AB{gpu}")),
        share_id: share.into(),
        consumed: None,
        admin_access: false,
    }
}

/// The agent's view after the ledger executed `cmds`, folded event by event.
fn view_after(cmds: Vec<Command>) -> View {
    let mut l = Ledger::new();
    let mut v = View::default();
    for (i, c) in cmds.into_iter().enumerate() {
        let (events, _) = l.execute(c, 1, i as i64).expect("the ledger takes it");
        for e in &events {
            v.apply(e);
        }
    }
    v
}

#[test]
fn a_granted_result_is_served_by_its_grant() {
    let v = view_after(vec![
        Command::RegisterNode(inventory()),
        Command::GrantClaim(grant("u1", 1, "s1")),
    ]);
    match decide("u1", &[result(1, "s1")], "n1", &v) {
        Decision::Granted(g) => {
            assert_eq!(g.len(), 1);
            assert_eq!(g[0].1.shares[0].gpu_uuid, "GPU-AB1");
            assert_eq!(g[0].1.shares[0].mem_mib, 3000);
        }
        other => panic!("not granted: {other:?}"),
    }
}

#[test]
fn an_allocation_that_differs_from_the_grant_is_not_served() {
    let v = view_after(vec![
        Command::RegisterNode(inventory()),
        Command::GrantClaim(grant("u1", 1, "s1")),
    ]);
    // Another GPU, another share id, another claim: none has a grant.
    for (uid, r) in [
        ("u1", result(0, "s1")),
        ("u1", result(1, "s2")),
        ("u2", result(1, "s1")),
    ] {
        match decide(uid, std::slice::from_ref(&r), "n1", &v) {
            Decision::NotYet(why) => assert!(why.contains("request c0"), "{why}"),
            other => panic!("{uid} {r:?} served: {other:?}"),
        }
    }
}

/// The view after the ledger refused claim u1's result on GPU 0, share s1.
fn refused_gpu0_s1() -> View {
    let refusal = pb::ClaimRefused {
        claim: grant("u1", 0, "s1").claim,
        request: "c0".into(),
        node: "n1".into(),
        device: dra_device_name("GPU-AB0"),
        share_id: "s1".into(),
        share: grant("u1", 0, "s1").share,
        reason: "GPU GPU-AB0 has 0 MiB free".into(),
    };
    view_after(vec![
        Command::RegisterNode(inventory()),
        Command::RefuseClaim(refusal),
    ])
}

#[test]
fn a_refusal_fails_at_once_with_the_allocators_reason() {
    let v = refused_gpu0_s1();
    match decide("u1", &[result(0, "s1")], "n1", &v) {
        Decision::Refused(why) => assert!(why.contains("has 0 MiB free"), "{why}"),
        other => panic!("not refused: {other:?}"),
    }
}

/// Regression: a refusal matched by claim UID and request alone failed a result the scheduler
/// allocated afresh after the refusal, before its grant reached the view.
#[test]
fn a_refusal_applies_only_to_the_result_it_refused() {
    let v = refused_gpu0_s1();
    for r in [result(1, "s2"), result(0, "s2"), result(1, "s1")] {
        match decide("u1", std::slice::from_ref(&r), "n1", &v) {
            Decision::NotYet(why) => assert!(why.contains("no grant"), "{why}"),
            other => panic!("{r:?} not waiting: {other:?}"),
        }
    }
}

#[test]
fn admin_access_and_other_pools_are_refused_even_when_granted() {
    let v = view_after(vec![
        Command::RegisterNode(inventory()),
        Command::GrantClaim(grant("u1", 1, "s1")),
    ]);
    let admin = ClaimResult {
        admin_access: true,
        ..result(1, "s1")
    };
    assert!(
        matches!(decide("u1", &[admin], "n1", &v), Decision::Refused(w) if w.contains("adminAccess"))
    );
    let elsewhere = ClaimResult {
        pool: "n2".into(),
        ..result(1, "s1")
    };
    assert!(
        matches!(decide("u1", &[elsewhere], "n1", &v), Decision::Refused(w) if w.contains("pool n2"))
    );
    assert!(matches!(decide("u1", &[], "n1", &v), Decision::Refused(_)));
}

#[test]
fn a_released_grant_serves_no_more_and_prepare_marks_fold() {
    let mut l = Ledger::new();
    let mut v = View::default();
    fn run(l: &mut Ledger, v: &mut View, c: Command) {
        let (events, _) = l.execute(c, 1, 0).expect("the ledger takes it");
        for e in &events {
            v.apply(e);
        }
    }
    run(&mut l, &mut v, Command::RegisterNode(inventory()));
    run(&mut l, &mut v, Command::GrantClaim(grant("u1", 1, "s1")));
    let id = l.seq();
    run(
        &mut l,
        &mut v,
        Command::PrepareClaim {
            node: "n1".into(),
            allocation_ids: vec![id],
            cdi_device_ids: vec!["gpuledger.io/claim=u1-c0".into()],
        },
    );
    let prepared = v.allocs[&id].claim.as_ref().expect("a claim grant");
    assert!(prepared.prepared);
    assert_eq!(prepared.cdi_device_ids, ["gpuledger.io/claim=u1-c0"]);
    run(
        &mut l,
        &mut v,
        Command::Release {
            pod_uid: String::new(),
            container: String::new(),
            allocation_id: id,
            reason: "claim-deleted".into(),
        },
    );
    assert!(matches!(
        decide("u1", &[result(1, "s1")], "n1", &v),
        Decision::NotYet(_)
    ));
}
