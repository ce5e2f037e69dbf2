use super::*;
use gpuledger_ledger::Command;

/// Node `dra` (DRA mode) and node `dp` (device plugin), one 16000 MiB GPU each
/// (`GPU-<node>-0`).
fn ledger() -> Ledger {
    let mut l = Ledger::new();
    for (node, mode) in [
        ("dra", pb::NodeMode::Dra),
        ("dp", pb::NodeMode::DevicePlugin),
    ] {
        let mut inv = gpuledger_testkit::workload::inventory(node, 1, 16_000, "A100");
        inv.mode = mode as i32;
        l.execute(Command::RegisterNode(inv), 1, 0)
            .expect("register");
    }
    l
}

/// A claim `uid` asking `capacity` in request c0, allocated by the scheduler on `node`'s GPU
/// as share `share` declaring `consumed` (None: no consumedCapacity).
fn claim_json(
    uid: &str,
    node: &str,
    capacity: Value,
    share: &str,
    consumed: Option<Value>,
) -> Value {
    let mut result = json!({"request": "c0", "driver": DRIVER, "pool": node,
        "device": format!("gpu-{node}-0"), "bindingConditions": [GRANTED],
        "bindingFailureConditions": [REFUSED]});
    if !share.is_empty() {
        result["shareID"] = json!(share);
    }
    if let Some(c) = consumed {
        result["consumedCapacity"] = c;
    }
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": format!("claim-{uid}"), "namespace": "team-a", "uid": uid,
                     "resourceVersion": "7", "generation": 1},
        "spec": {"devices": {"requests": [{"name": "c0", "exactly": {
            "deviceClassName": DRIVER, "capacity": {"requests": capacity}}}]}},
        "status": {
            "allocation": {"devices": {"results": [
                result,
                {"request": "c0", "driver": "other.example.com", "pool": "x", "device": "y"}
            ]}},
            "reservedFor": [{"resource": "pods", "name": "p", "uid": "pod-1"}],
            "devices": [{"driver": "other.example.com", "pool": "x", "device": "y",
                         "data": {"kept": true}, "futureField": 1}]
        }
    })
}

fn claim(uid: &str, consumed: Value) -> Claim {
    let j = claim_json(
        uid,
        "dra",
        json!({"memory": "4000Mi", "cores": "300"}),
        "s-1",
        Some(consumed),
    );
    Claim::from_json(&j).expect("claim")
}

fn only_step(p: &Plan) -> &Step {
    assert_eq!(p.steps.len(), 1, "{p:?}");
    &p.steps[0].1
}

#[test]
fn a_claim_is_read_with_only_our_results() {
    let c = claim("u1", json!({"memory": "4000Mi", "cores": "300"}));
    assert_eq!(c.results.len(), 1);
    assert_eq!(c.results[0].share_id, "s-1");
    assert_eq!(c.results[0].device, "gpu-dra-0");
    assert_eq!(c.consumers.len(), 1);
    assert_eq!(c.consumers[0].uid, "pod-1");
    assert_eq!(c.consumers[0].namespace, "team-a");
    assert_eq!(c.source, "claim");
    assert_eq!(c.resource_version, "7");
    assert_eq!(
        c.devices.len(),
        1,
        "other drivers' entries are kept as read"
    );
    assert!(Claim::from_json(&json!({"kind": "Pod", "apiVersion": "v1"})).is_err());
}

#[test]
fn a_share_that_matches_the_request_is_granted() {
    let l = ledger();
    let c = claim("u1", json!({"memory": "4000Mi", "cores": "300"}));
    let p = plan_claim(&l, &c);
    assert!(p.releases.is_empty());
    match only_step(&p) {
        Step::Grant { grant } => {
            let s = grant.share.as_ref().expect("share");
            assert_eq!(
                (s.gpu_uuid.as_str(), s.mem_mib, s.core_milli),
                ("GPU-dra-0", 4000, 300)
            );
            assert_eq!(grant.share_id, "s-1");
            assert_eq!(grant.consumers.len(), 1);
            assert_eq!(grant.node, "dra");
        }
        s => panic!("not a grant: {s:?}"),
    }
}

#[test]
fn an_under_declared_or_missing_share_is_refused() {
    let l = ledger();
    for consumed in [
        json!({"memory": "2000Mi", "cores": "300"}),
        json!({"memory": "4000Mi"}),
        json!({"memory": "4000Mi", "cores": "100"}),
    ] {
        let p = plan_claim(&l, &claim("u1", consumed.clone()));
        match only_step(&p) {
            Step::Refuse { reason, refusal } => {
                assert_eq!(*reason, "LedgerShareMismatch", "{consumed}");
                assert!(
                    refusal.reason.contains("memory=4000Mi, cores=300"),
                    "{}",
                    refusal.reason
                );
            }
            s => panic!("{consumed}: not refused: {s:?}"),
        }
    }
    let j = claim_json("u2", "dra", json!({"memory": "4000Mi"}), "s-2", None);
    let p = plan_claim(&l, &Claim::from_json(&j).expect("claim"));
    assert!(matches!(
        only_step(&p),
        Step::Refuse {
            reason: "LedgerShareMismatch",
            ..
        }
    ));
}

#[test]
fn requests_round_up_and_default_to_the_whole_gpu() {
    let l = ledger();
    // 1G is 953.67 MiB: the 1 MiB step rounds it to 954; cores left out take the whole GPU.
    let j = claim_json(
        "u1",
        "dra",
        json!({"memory": "1G"}),
        "s-1",
        Some(json!({"memory": "954Mi", "cores": "1000"})),
    );
    let p = plan_claim(&l, &Claim::from_json(&j).expect("claim"));
    match only_step(&p) {
        Step::Grant { grant, .. } => {
            let s = grant.share.as_ref().expect("share");
            assert_eq!((s.mem_mib, s.core_milli), (954, 1000));
        }
        s => panic!("not a grant: {s:?}"),
    }
    // No shareID: the device was allocated whole.
    let j = claim_json("u2", "dra", json!({}), "", None);
    match only_step(&plan_claim(&l, &Claim::from_json(&j).expect("claim"))) {
        Step::Grant { grant, .. } => {
            let s = grant.share.as_ref().expect("share");
            assert_eq!((s.mem_mib, s.core_milli), (16_000, 1000));
        }
        s => panic!("not a grant: {s:?}"),
    }
    // More than the GPU has: the policy refuses it.
    let j = claim_json(
        "u3",
        "dra",
        json!({"memory": "20000Mi"}),
        "s-3",
        Some(json!({"memory": "20000Mi", "cores": "1000"})),
    );
    assert!(matches!(
        only_step(&plan_claim(&l, &Claim::from_json(&j).expect("claim"))),
        Step::Refuse {
            reason: "LedgerCapacityPolicy",
            ..
        }
    ));
}

/// A capacity named as no device of ours names it fits none of them at the scheduler: the
/// certification refuses such an allocation (written by hand) instead of reading the name
/// as `memory`, and declares nothing the scheduler would not.
#[test]
fn a_capacity_named_otherwise_than_our_devices_is_refused() {
    let l = ledger();
    let j = claim_json(
        "u1",
        "dra",
        json!({"gpu.gpuledger.io/memory": "4000Mi", "cores": "300"}),
        "s-1",
        Some(json!({"memory": "4000Mi", "cores": "300"})),
    );
    match only_step(&plan_claim(&l, &Claim::from_json(&j).expect("claim"))) {
        Step::Refuse {
            reason: "LedgerInvalidRequest",
            refusal,
        } => assert!(
            refusal.reason.contains("gpu.gpuledger.io/memory"),
            "{}",
            refusal.reason
        ),
        s => panic!("not refused: {s:?}"),
    }
}

#[test]
fn wrong_nodes_and_devices_are_refused_with_their_reason() {
    let l = ledger();
    let ok = json!({"memory": "4000Mi", "cores": "300"});
    for (node, reason) in [("dp", "LedgerNodeMode"), ("ghost", "LedgerUnknownDevice")] {
        let j = claim_json("u1", node, ok.clone(), "s-1", Some(ok.clone()));
        match only_step(&plan_claim(&l, &Claim::from_json(&j).expect("claim"))) {
            Step::Refuse { reason: r, .. } => assert_eq!(*r, reason, "{node}"),
            s => panic!("{node}: {s:?}"),
        }
    }
    let mut j = claim_json("u1", "dra", ok.clone(), "s-1", Some(ok.clone()));
    j["status"]["allocation"]["devices"]["results"][0]["device"] = json!("gpu-nope");
    assert!(matches!(
        only_step(&plan_claim(&l, &Claim::from_json(&j).expect("claim"))),
        Step::Refuse {
            reason: "LedgerUnknownDevice",
            ..
        }
    ));
}

#[test]
fn a_condition_always_names_the_ledgers_decision() {
    let mut l = ledger();
    let c = claim("u1", json!({"memory": "4000Mi", "cores": "300"}));
    let Step::Grant { grant, .. } = only_step(&plan_claim(&l, &c)).clone() else {
        panic!("no grant");
    };
    let r = c.results[0].clone();
    let marked = |c: &Claim, kind: &str, reason: &str, message: &str| {
        let mut c = c.clone();
        c.devices = devices_with(&c.devices, &r, condition(kind, reason, message, 1, "t"));
        c
    };
    let forged = "granted by the GPU ledger as allocation 999 (seq 999, epoch 1): …";
    // A Granted the ledger does not hold (forged, or from before the allocation changed):
    // the result is decided anew, and that decision written.
    assert!(matches!(
        only_step(&plan_claim(&l, &marked(&c, GRANTED, REASON_GRANT, forged))),
        Step::Grant { .. }
    ));
    // Under-declared and marked Granted by someone else: refused, and the refusal written.
    let under = claim("u2", json!({"memory": "1000Mi", "cores": "300"}));
    let mut under_marked = under.clone();
    under_marked.devices = devices_with(
        &under.devices,
        &under.results[0],
        condition(GRANTED, REASON_GRANT, forged, 1, "t"),
    );
    assert!(matches!(
        only_step(&plan_claim(&l, &under_marked)),
        Step::Refuse {
            reason: "LedgerShareMismatch",
            ..
        }
    ));

    l.execute(Command::GrantClaim(grant), 1, 0).expect("grant");
    let a = l.alloc_of_claim("u1", "c0", "s-1").expect("granted");
    let real = granted_message(a.id, a.epoch, &a.node, &a.shares);
    assert!(real.contains(&format!("allocation {}", a.id)), "{real}");
    // The condition names the live grant: nothing to do.
    assert!(plan_claim(&l, &marked(&c, GRANTED, REASON_GRANT, &real)).is_empty());
    // Not marked yet (the leader died between), marked with another allocation's text, with
    // another reason, or Refused while the ledger holds the grant: named anew.
    for wrong in [
        c.clone(),
        marked(&c, GRANTED, REASON_GRANT, forged),
        marked(&c, GRANTED, "Forged", &real),
        marked(&marked(&c, GRANTED, REASON_GRANT, &real), REFUSED, "X", "m"),
    ] {
        assert_eq!(
            only_step(&plan_claim(&l, &wrong)),
            &Step::Name {
                message: real.clone()
            },
            "{:?}",
            wrong.devices
        );
    }
    // A Refused without a grant stands: the scheduler allocates the claim afresh.
    let refused = marked(&under, REFUSED, "LedgerShareMismatch", "m");
    assert!(plan_claim(&l, &refused).is_empty());
}

#[test]
fn grants_without_their_share_or_claim_are_released() {
    let mut l = ledger();
    let c = claim("u1", json!({"memory": "4000Mi", "cores": "300"}));
    let Step::Grant { grant, .. } = only_step(&plan_claim(&l, &c)).clone() else {
        panic!("no grant");
    };
    l.execute(Command::GrantClaim(grant), 1, 0).expect("grant");
    let id = l.allocs_of_pod("u1")[0].id;
    let (gone, todo) = plan_all(&l, std::slice::from_ref(&c));
    assert!(gone.is_empty());
    assert_eq!(todo, vec![0], "granted but not marked: certify");
    // The scheduler cleared the allocation.
    let mut cleared = c.clone();
    cleared.results.clear();
    let p = plan_claim(&l, &cleared);
    assert_eq!(p.releases.len(), 1);
    assert_eq!(
        (p.releases[0].allocation_id, p.releases[0].reason),
        (id, "claim-deallocated")
    );
    // The claim is gone.
    let (gone, todo) = plan_all(&l, &[]);
    assert_eq!(gone.len(), 1);
    assert_eq!(
        (gone[0].allocation_id, gone[0].reason),
        (id, "claim-deleted")
    );
    assert!(todo.is_empty());
    assert_eq!(releases_of_deleted(&l, "u1", "x").len(), 1);
    assert!(releases_of_deleted(&l, "u2", "x").is_empty());
}

#[test]
fn our_condition_is_set_and_other_entries_kept_unchanged() {
    let c = claim("u1", json!({"memory": "4000Mi", "cores": "300"}));
    let r = &c.results[0];
    assert_eq!(mark_of(&c.devices, r), None);
    let d = devices_with(
        &c.devices,
        r,
        condition(REFUSED, "LedgerNoCapacity", "full", 1, "t"),
    );
    assert_eq!(d.len(), 2);
    assert_eq!(d[0], c.devices[0], "another driver's entry is untouched");
    assert_eq!(d[1]["shareID"], "s-1");
    assert_eq!(mark_of(&d, r), Some(Mark::Refused));
    // A later condition of the same type replaces it; one of another type is added.
    let d2 = devices_with(&d, r, condition(REFUSED, "LedgerQuota", "q", 1, "t"));
    assert_eq!(d2[1]["conditions"].as_array().map(Vec::len), Some(1));
    assert_eq!(d2[1]["conditions"][0]["reason"], "LedgerQuota");
    // The other of ours replaces it too (an entry names one decision); another's is kept.
    let mut d2 = d2;
    d2[1]["conditions"]
        .as_array_mut()
        .expect("conditions")
        .push(json!({"type": "example.com/Ready", "status": "True"}));
    let d3 = devices_with(&d2, r, condition(GRANTED, REASON_GRANT, "g", 1, "t"));
    let types: Vec<&Value> = d3[1]["conditions"]
        .as_array()
        .expect("conditions")
        .iter()
        .map(|c| &c["type"])
        .collect();
    assert_eq!(types, [&json!("example.com/Ready"), &json!(GRANTED)]);
    assert_eq!(mark_of(&d3, r), Some(Mark::Granted));
    // A False condition is no mark.
    let mut f = condition(GRANTED, REASON_GRANT, "g", 1, "t");
    f["status"] = json!("False");
    assert_eq!(mark_of(&devices_with(&c.devices, r, f), r), None);
}

#[test]
fn ledger_refusals_map_to_condition_reasons() {
    let r = |e| refusal_reason(&e);
    assert_eq!(
        r(CommandError::NoCapacity("GPU full".into())),
        Some("LedgerNoCapacity")
    );
    assert_eq!(
        r(CommandError::NoCapacity(
            "namespace a is over its GPU memory quota".into()
        )),
        Some("LedgerQuota")
    );
    assert_eq!(
        r(CommandError::Unsatisfiable("x".into())),
        Some("LedgerUnsatisfiable")
    );
    assert_eq!(r(CommandError::Conflict("x".into())), None);
}

/// `ledger()` with 14000 MiB of GPU-dra-0 nominated for pod `nominee` (priority 100).
fn nominated() -> Ledger {
    let mut l = ledger();
    let n = pb::Nominated {
        pod: Some(pb::PodRef {
            uid: "nominee".into(),
            namespace: "team-a".into(),
            name: "nominee".into(),
        }),
        priority: 100,
        node: "dra".into(),
        containers: vec![pb::NominatedContainer {
            container: "gpuledger/c0".into(),
            shares: vec![pb::GpuShare {
                gpu_uuid: "GPU-dra-0".into(),
                mem_mib: 14_000,
                core_milli: 300,
            }],
        }],
        deadline_ms: 60_000,
        ..Default::default()
    };
    l.execute(
        Command::Nominate {
            nomination: n,
            leaving: Vec::new(),
        },
        1,
        1,
    )
    .expect("nominate");
    l
}

/// The grant the plan makes for `c`.
fn planned_grant(l: &Ledger, c: &Claim) -> pb::ClaimGranted {
    match only_step(&plan_claim(l, c)) {
        Step::Grant { grant } => grant.clone(),
        s => panic!("not a grant: {s:?}"),
    }
}

#[test]
fn room_kept_for_a_preemptor_is_refused_to_pods_it_outranks_with_a_reason() {
    let mut l = nominated();
    let mut c = claim("u1", json!({"memory": "4000Mi", "cores": "300"}));
    c.priority = 50;
    let g = planned_grant(&l, &c);
    assert_eq!(g.priority, 50, "the grant carries its pods' priority");
    let e = l
        .execute(Command::GrantClaim(g), 1, 2)
        .expect_err("2000 MiB are free beside the kept room");
    assert_eq!(refusal_reason(&e), Some("LedgerRoomKept"), "{e}");
    assert!(
        e.to_string()
            .contains("kept for pod team-a/nominee (priority 100)"),
        "{e}"
    );
    // A pod that outranks the preemptor is not held back.
    c.priority = 200;
    l.execute(Command::GrantClaim(planned_grant(&l, &c)), 1, 3)
        .expect("granted to a pod of higher priority");
}

#[test]
fn the_nomination_ends_once_every_result_of_the_preemptors_claim_is_granted() {
    let mut l = nominated();
    let mut c = claim("u1", json!({"memory": "4000Mi", "cores": "300"}));
    c.consumers[0].uid = "nominee".into();
    c.priority = 100;
    assert!(
        nominees_certified(&l, &c).is_empty(),
        "nothing is granted yet"
    );
    l.execute(Command::GrantClaim(planned_grant(&l, &c)), 1, 2)
        .expect("the preemptor takes its own room");
    assert_eq!(nominees_certified(&l, &c), ["nominee"]);
}
