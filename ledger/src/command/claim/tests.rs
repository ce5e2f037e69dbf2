use super::*;
use crate::Command;
use crate::command::bounds;
use crate::placement::{ContainerRequest, PodRequest};

/// Node `dra` in DRA mode and node `dp` in device-plugin mode, two 16000 MiB GPUs each.
fn setup() -> Ledger {
    let mut l = Ledger::new();
    for (node, mode) in [
        ("dra", pb::NodeMode::Dra),
        ("dp", pb::NodeMode::DevicePlugin),
    ] {
        l.execute(Command::RegisterNode(inventory(node, mode)), 1, 0)
            .expect("register");
    }
    l
}

fn inventory(node: &str, mode: pb::NodeMode) -> pb::NodeInventory {
    pb::NodeInventory {
        node: node.into(),
        gpus: (0..2)
            .map(|i| pb::Gpu {
                uuid: format!("GPU-{node}-{i}"),
                index: i,
                model: "A100".into(),
                memory_mib: 16000,
                healthy: true,
                compute_capability: String::new(),
            })
            .collect(),
        cpu_milli: 0,
        memory_mib: 0,
        mode: mode as i32,
        isolation: String::new(),
        dra_cores: String::new(),
    }
}

fn grant(uid: &str, node: &str, gpu: u32, mem: u64, core: u32) -> pb::ClaimGranted {
    let uuid = format!("GPU-{node}-{gpu}");
    pb::ClaimGranted {
        allocation_id: 0,
        claim: Some(pb::ClaimRef {
            uid: uid.into(),
            namespace: "team-a".into(),
            name: format!("claim-{uid}"),
        }),
        request: "c0".into(),
        node: node.into(),
        pool: node.into(),
        device: dra_device_name(&uuid),
        share_id: format!("share-{uid}"),
        share: Some(pb::GpuShare {
            gpu_uuid: uuid,
            mem_mib: mem,
            core_milli: core,
        }),
        consumers: vec![pb::PodRef {
            uid: format!("pod-{uid}"),
            namespace: "team-a".into(),
            name: "p".into(),
        }],
        source: "claim".into(),
        priority: 0,
    }
}

fn granted_id(r: &Reply) -> u64 {
    match r {
        Reply::Reserved { allocations, .. } => allocations[0].id,
        other => panic!("not a grant: {other:?}"),
    }
}

#[test]
fn device_names_follow_the_slice_convention() {
    assert_eq!(
        dra_device_name("GPU-8A3F-01BC"),
        "gpu-8a3f-01bc",
        "lower case, without GPU-"
    );
}

#[test]
fn a_repeated_grant_returns_the_same_allocation_and_writes_nothing() {
    let mut l = setup();
    let (ev1, r1) = l
        .execute(Command::GrantClaim(grant("u1", "dra", 0, 4000, 300)), 1, 10)
        .expect("grant");
    assert!(matches!(ev1[0].body, Some(Body::ClaimGranted(_))));
    let (ev2, r2) = l
        .execute(Command::GrantClaim(grant("u1", "dra", 0, 4000, 300)), 1, 20)
        .expect("repeat");
    assert!(ev2.is_empty());
    let (
        Reply::Reserved {
            allocations: a1,
            created: true,
        },
        Reply::Reserved {
            allocations: a2,
            created: false,
        },
    ) = (&r1, &r2)
    else {
        panic!("unexpected replies {r1:?} {r2:?}");
    };
    assert_eq!(a1, a2);
    assert_eq!(a1[0].id, ev1[0].seq, "the grant's id is its seq");
    let c = a1[0].claim.as_ref().expect("claim side");
    assert_eq!(
        (c.request.as_str(), c.share_id.as_str()),
        ("c0", "share-u1")
    );
    assert_eq!(a1[0].shares[0].mem_mib, 4000);
    // The same key on another GPU is a conflict, not a second grant.
    assert!(matches!(
        l.execute(Command::GrantClaim(grant("u1", "dra", 1, 4000, 300)), 1, 30),
        Err(CommandError::Conflict(_))
    ));
    // Another share of the same claim request is another grant.
    let mut other = grant("u1", "dra", 1, 4000, 300);
    other.share_id = "share-2".into();
    l.execute(Command::GrantClaim(other), 1, 40)
        .expect("second share");
    assert_eq!(l.allocs_of_pod("u1").len(), 2);
}

#[test]
fn bad_grants_are_refused_with_nothing_written() {
    type Case = (
        &'static str,
        fn(&mut pb::ClaimGranted),
        fn(&CommandError) -> bool,
    );
    let cases: &[Case] = &[
        (
            "device-plugin node",
            |g| *g = grant("u1", "dp", 0, 4000, 300),
            |e| matches!(e, CommandError::Unsatisfiable(_)),
        ),
        (
            "unknown node",
            |g| {
                g.node = "nope".into();
                g.pool = "nope".into();
            },
            |e| matches!(e, CommandError::NotFound(_)),
        ),
        (
            "GPU not on the node",
            |g| {
                let uuid = "GPU-dp-0".to_string();
                g.device = dra_device_name(&uuid);
                g.share.as_mut().expect("share").gpu_uuid = uuid;
            },
            |e| matches!(e, CommandError::NotFound(_)),
        ),
        (
            "device is not the share's GPU",
            |g| g.device = "gpu-other".into(),
            |e| matches!(e, CommandError::Invalid(_)),
        ),
        (
            "pool is not the node",
            |g| g.pool = "elsewhere".into(),
            |e| matches!(e, CommandError::Invalid(_)),
        ),
        (
            "more memory than the GPU has",
            |g| g.share.as_mut().expect("share").mem_mib = 16001,
            |e| matches!(e, CommandError::Unsatisfiable(_)),
        ),
        (
            "over the GPU's free memory",
            |g| g.share.as_mut().expect("share").mem_mib = 12001,
            |e| matches!(e, CommandError::NoCapacity(_)),
        ),
        (
            "over the GPU's free cores",
            |g| g.share.as_mut().expect("share").core_milli = 801,
            |e| matches!(e, CommandError::NoCapacity(_)),
        ),
        (
            "cores past a whole GPU",
            |g| g.share.as_mut().expect("share").core_milli = 1001,
            |e| matches!(e, CommandError::Invalid(_)),
        ),
        (
            "no memory",
            |g| g.share.as_mut().expect("share").mem_mib = 0,
            |e| matches!(e, CommandError::Invalid(_)),
        ),
        (
            "no claim",
            |g| g.claim = None,
            |e| matches!(e, CommandError::Invalid(_)),
        ),
        (
            "empty claim uid",
            |g| g.claim.as_mut().expect("claim").uid.clear(),
            |e| matches!(e, CommandError::Invalid(_)),
        ),
        (
            "namespace not a DNS label",
            |g| g.claim.as_mut().expect("claim").namespace = "A_B".into(),
            |e| matches!(e, CommandError::Invalid(_)),
        ),
        (
            "no request",
            |g| g.request.clear(),
            |e| matches!(e, CommandError::Invalid(_)),
        ),
        (
            "unknown source",
            |g| g.source = "guess".into(),
            |e| matches!(e, CommandError::Invalid(_)),
        ),
        (
            "overlong share id",
            |g| g.share_id = "s".repeat(200),
            |e| matches!(e, CommandError::Invalid(_)),
        ),
        (
            "too many consumers",
            |g| g.consumers = vec![pb::PodRef::default(); bounds::MAX_CLAIM_CONSUMERS + 1],
            |e| matches!(e, CommandError::Invalid(_)),
        ),
    ];
    for (what, edit, want) in cases {
        let mut l = setup();
        // 4000 MiB and 200 cores of GPU 0 already held by another claim.
        l.execute(Command::GrantClaim(grant("u0", "dra", 0, 4000, 200)), 1, 5)
            .expect("first grant");
        let before = l.clone();
        let mut g = grant("u1", "dra", 0, 4000, 300);
        edit(&mut g);
        match l.execute(Command::GrantClaim(g), 1, 10) {
            Err(e) => assert!(want(&e), "{what}: wrong refusal {e:?}"),
            Ok(r) => panic!("{what}: granted {r:?}"),
        }
        assert_eq!(l, before, "{what}: a refusal changed the state");
    }
}

#[test]
fn grants_refused_on_unhealthy_gpus_and_over_quota() {
    let mut l = setup();
    l.execute(
        Command::SetDeviceHealth(pb::DeviceHealthChanged {
            node: "dra".into(),
            gpu_uuid: "GPU-dra-0".into(),
            healthy: false,
            reason: "xid 79".into(),
            xid: 79,
        }),
        1,
        1,
    )
    .expect("health");
    let e = l.execute(Command::GrantClaim(grant("u1", "dra", 0, 4000, 0)), 1, 2);
    assert!(
        matches!(e, Err(CommandError::NoCapacity(ref m)) if m.contains("unhealthy")),
        "{e:?}"
    );
    l.execute(
        Command::SetQuota(pb::QuotaSet {
            namespace: "team-a".into(),
            mem_mib: 6000,
            core_milli: 0,
        }),
        1,
        3,
    )
    .expect("quota");
    l.execute(Command::GrantClaim(grant("u1", "dra", 1, 4000, 0)), 1, 4)
        .expect("within quota");
    let e = l.execute(Command::GrantClaim(grant("u2", "dra", 1, 4000, 0)), 1, 5);
    assert!(
        matches!(e, Err(CommandError::NoCapacity(ref m)) if m.contains("quota")),
        "{e:?}"
    );
    // Claim grants count against the namespace as pods do.
    assert_eq!(l.budgets().held("team-a"), (4000, 0));
}

#[test]
fn pods_are_not_reserved_on_dra_nodes() {
    let mut l = setup();
    let request = PodRequest {
        pod: pb::PodRef {
            uid: "p1".into(),
            namespace: "team-a".into(),
            name: "p1".into(),
        },
        containers: vec![ContainerRequest {
            name: "main".into(),
            slices: 1,
            mem_mib: 1000,
            ..Default::default()
        }],
        ..Default::default()
    };
    let reserve = |node: &str| Command::Reserve {
        request: request.clone(),
        node: node.into(),
        deadline_ms: 1000,
    };
    assert!(matches!(
        l.execute(reserve("dra"), 1, 1),
        Err(CommandError::Unsatisfiable(_))
    ));
    let filtered = crate::placement::filter_nodes(&l, ["dra", "dp"], &request);
    assert_eq!(
        filtered
            .never
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>(),
        ["dra"]
    );
    l.execute(reserve("dp"), 1, 2).expect("device-plugin node");
    let nomination = pb::Nominated {
        pod: Some(pb::PodRef {
            uid: "p2".into(),
            namespace: "team-a".into(),
            name: "p2".into(),
        }),
        priority: 10,
        node: "dra".into(),
        containers: vec![pb::NominatedContainer {
            container: "main".into(),
            shares: vec![pb::GpuShare {
                gpu_uuid: "GPU-dra-0".into(),
                mem_mib: 1000,
                core_milli: 0,
            }],
        }],
        ..Default::default()
    };
    let e = l.execute(
        Command::Nominate {
            nomination,
            leaving: vec![],
        },
        1,
        3,
    );
    // The DRA twin of preemption: a nomination keeps room on a DRA node too
    // (`nominate/dra_tests.rs`).
    assert!(matches!(e, Ok((_, Reply::Done { changed: true }))), "{e:?}");
}

#[test]
fn a_mode_change_waits_until_the_node_holds_nothing() {
    let mut l = setup();
    let (_, r) = l
        .execute(Command::GrantClaim(grant("u1", "dra", 0, 4000, 300)), 1, 1)
        .expect("grant");
    let before = l.clone();
    let e = l.execute(
        Command::RegisterNode(inventory("dra", pb::NodeMode::DevicePlugin)),
        1,
        2,
    );
    assert!(matches!(e, Err(CommandError::Conflict(_))), "{e:?}");
    assert_eq!(l, before);
    l.execute(
        Command::Release {
            pod_uid: String::new(),
            container: String::new(),
            allocation_id: granted_id(&r),
            reason: "claim-deleted".into(),
        },
        1,
        3,
    )
    .expect("release");
    l.execute(
        Command::RegisterNode(inventory("dra", pb::NodeMode::DevicePlugin)),
        1,
        4,
    )
    .expect("empty node changes mode");
    assert_eq!(
        l.node("dra").expect("node").mode,
        pb::NodeMode::DevicePlugin
    );
    let e = l.execute(
        Command::RegisterNode(pb::NodeInventory {
            mode: 7,
            ..inventory("dp", pb::NodeMode::Dra)
        }),
        1,
        5,
    );
    assert!(matches!(e, Err(CommandError::Invalid(_))), "{e:?}");
}

#[test]
fn refusals_are_recorded_unless_the_result_is_granted() {
    let mut l = setup();
    let refusal = |uid: &str| pb::ClaimRefused {
        claim: grant(uid, "dra", 0, 1, 0).claim,
        request: "c0".into(),
        node: "dra".into(),
        device: dra_device_name("GPU-dra-0"),
        share_id: format!("share-{uid}"),
        share: grant(uid, "dra", 0, 20000, 0).share,
        reason: "GPU GPU-dra-0 has 16000 MiB".into(),
    };
    let (ev, _) = l
        .execute(Command::RefuseClaim(refusal("u1")), 1, 1)
        .expect("refuse");
    assert!(matches!(ev[0].body, Some(Body::ClaimRefused(_))));
    assert!(l.allocs().is_empty(), "a refusal holds nothing");
    assert!(matches!(
        l.execute(
            Command::RefuseClaim(pb::ClaimRefused {
                reason: String::new(),
                ..refusal("u1")
            }),
            1,
            2
        ),
        Err(CommandError::Invalid(_))
    ));
    // A device the inventory lacks has no share to name.
    let unknown = pb::ClaimRefused {
        device: "gpu-nope".into(),
        share: None,
        ..refusal("u3")
    };
    l.execute(Command::RefuseClaim(unknown), 1, 2)
        .expect("refused without a share");
    l.execute(Command::GrantClaim(grant("u2", "dra", 0, 4000, 0)), 1, 3)
        .expect("grant");
    assert!(matches!(
        l.execute(Command::RefuseClaim(refusal("u2")), 1, 4),
        Err(CommandError::Conflict(_))
    ));
}

#[test]
fn prepare_and_unprepare_are_idempotent_and_node_bound() {
    let mut l = setup();
    let (_, r) = l
        .execute(Command::GrantClaim(grant("u1", "dra", 0, 4000, 300)), 1, 1)
        .expect("grant");
    let id = granted_id(&r);
    let cdi = vec!["gpuledger.io/claim=u1-c0".to_string()];
    let prepare = |node: &str, ids: Vec<u64>, cdi: Vec<String>| Command::PrepareClaim {
        node: node.into(),
        allocation_ids: ids,
        cdi_device_ids: cdi,
    };
    type Case = (&'static str, Command, fn(&CommandError) -> bool);
    let refused: Vec<Case> = vec![
        ("other node", prepare("dp", vec![id], cdi.clone()), |e| {
            matches!(e, CommandError::Conflict(_))
        }),
        (
            "unknown grant",
            prepare("dra", vec![999], cdi.clone()),
            |e| matches!(e, CommandError::NotFound(_)),
        ),
        ("no CDI ids", prepare("dra", vec![id], vec![]), |e| {
            matches!(e, CommandError::Invalid(_))
        }),
        ("no grants", prepare("dra", vec![], cdi.clone()), |e| {
            matches!(e, CommandError::Invalid(_))
        }),
        (
            "too many grants",
            prepare("dra", vec![id; bounds::MAX_CLAIM_GRANTS + 1], cdi.clone()),
            |e| matches!(e, CommandError::Invalid(_)),
        ),
    ];
    for (what, cmd, want) in refused {
        let before = l.clone();
        match l.execute(cmd, 1, 2) {
            Err(e) => assert!(want(&e), "{what}: wrong refusal {e:?}"),
            Ok(r) => panic!("{what}: accepted {r:?}"),
        }
        assert_eq!(l, before, "{what}");
    }
    let (ev, _) = l
        .execute(prepare("dra", vec![id], cdi.clone()), 1, 3)
        .expect("prepare");
    assert!(matches!(ev[0].body, Some(Body::ClaimPrepared(_))));
    let c = l.alloc(id).and_then(|a| a.claim.as_deref()).expect("claim");
    assert!(c.prepared);
    assert_eq!(c.cdi_device_ids, cdi);
    // The kubelet prepares again after a restart: nothing new.
    let (ev, r) = l
        .execute(prepare("dra", vec![id], cdi.clone()), 1, 4)
        .expect("again");
    assert!(ev.is_empty());
    assert_eq!(r, Reply::Done { changed: false });
    assert!(matches!(
        l.execute(prepare("dra", vec![id], vec!["other=x".into()]), 1, 5),
        Err(CommandError::Conflict(_))
    ));
    let unprepare = |ids: Vec<u64>| Command::UnprepareClaim {
        node: "dra".into(),
        allocation_ids: ids,
    };
    let (ev, _) = l.execute(unprepare(vec![id]), 1, 6).expect("unprepare");
    assert!(matches!(ev[0].body, Some(Body::ClaimUnprepared(_))));
    let (ev, _) = l
        .execute(unprepare(vec![id]), 1, 7)
        .expect("unprepare again");
    assert!(ev.is_empty());
    // After the claim is gone: unprepare still succeeds, with nothing to write.
    l.execute(
        Command::Release {
            pod_uid: "u1".into(),
            container: String::new(),
            allocation_id: 0,
            reason: "claim-deleted".into(),
        },
        1,
        8,
    )
    .expect("release by claim uid");
    assert!(l.allocs().is_empty());
    let (ev, _) = l
        .execute(unprepare(vec![id]), 1, 9)
        .expect("unprepare of a released grant");
    assert!(ev.is_empty());
}

#[test]
fn pod_events_are_refused_on_claim_grants() {
    let mut l = setup();
    let (_, r) = l
        .execute(Command::GrantClaim(grant("u1", "dra", 0, 4000, 300)), 1, 1)
        .expect("grant");
    let id = granted_id(&r);
    let ev = |body| pb::Event {
        seq: l.seq() + 1,
        epoch: 1,
        time_ms: 2,
        actor: None,
        body: Some(body),
    };
    for body in [
        Body::Assigned(pb::Assigned {
            allocation_id: id,
            device_ids: vec!["d".into()],
            node: "dra".into(),
        }),
        Body::Bound(pb::Bound {
            allocation_id: id,
            reason: "x".into(),
            node: "dra".into(),
        }),
    ] {
        let e = ev(body);
        let mut m = l.clone();
        assert!(m.apply(&e).is_err(), "{e:?} applied to a claim grant");
    }
}

#[test]
fn a_claims_consumers_follow_its_reserved_for() {
    let mut l = setup();
    let (_, r) = l
        .execute(Command::GrantClaim(grant("u1", "dra", 0, 4000, 300)), 1, 1)
        .expect("grant");
    let id = granted_id(&r);
    let pod = |uid: &str| pb::PodRef {
        uid: uid.into(),
        namespace: "team-a".into(),
        name: format!("name-{uid}"),
    };
    let set = |pods: Vec<pb::PodRef>| Command::SetClaimConsumers {
        claim_uid: "u1".into(),
        consumers: pods,
    };
    // A second pod joins the claim: one event naming the grant, on its node.
    let (evs, _) = l
        .execute(set(vec![pod("pod-u1"), pod("late")]), 2, 2)
        .expect("set");
    match evs.as_slice() {
        [e] => match &e.body {
            Some(Body::ClaimConsumersChanged(c)) => {
                assert_eq!(
                    (c.allocation_ids.as_slice(), c.node.as_str()),
                    (&[id][..], "dra")
                );
            }
            other => panic!("not ClaimConsumersChanged: {other:?}"),
        },
        other => panic!("{} events", other.len()),
    }
    let consumers = |l: &Ledger| -> Vec<String> {
        l.alloc(id)
            .and_then(|a| a.claim.as_ref())
            .map(|c| c.consumers.iter().map(|p| p.uid.clone()).collect())
            .unwrap_or_default()
    };
    assert_eq!(consumers(&l), ["pod-u1", "late"]);
    // The same pods in another order: nothing to write.
    let (evs, _) = l
        .execute(set(vec![pod("late"), pod("pod-u1")]), 3, 3)
        .expect("same set");
    assert!(evs.is_empty(), "{evs:?}");
    // The first pod leaves.
    l.execute(set(vec![pod("late")]), 4, 4).expect("leave");
    assert_eq!(consumers(&l), ["late"]);
    // A claim with no grant, and too many consumers, are refused with nothing written.
    let seq = l.seq();
    let none = Command::SetClaimConsumers {
        claim_uid: "nobody".into(),
        consumers: vec![pod("x")],
    };
    assert!(matches!(
        l.execute(none, 5, 5),
        Err(CommandError::NotFound(_))
    ));
    let many = set((0..=bounds::MAX_CLAIM_CONSUMERS)
        .map(|i| pod(&format!("p{i}")))
        .collect());
    assert!(matches!(
        l.execute(many, 5, 5),
        Err(CommandError::Invalid(_))
    ));
    assert_eq!(l.seq(), seq);
}
