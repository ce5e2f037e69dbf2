use super::super::{Command, CommandError, Reply};
use crate::pb;
use crate::pb::event::Body;
use crate::placement::{ContainerRequest, PodRequest, Policy, filter_nodes};
use crate::state::Ledger;

const GIB: u64 = 1024;

/// Node `n1` with one 80 GiB GPU holding `v` (40 GiB, priority 5) and `o` (30 GiB).
fn setup() -> Ledger {
    let mut l = Ledger::new();
    l.execute(Command::RegisterNode(inventory(&["GPU-0"])), 1, 0)
        .expect("register");
    for (uid, gib) in [("v", 40), ("o", 30)] {
        l.execute(reserve(uid, gib, 0), 1, 1).expect("reserve");
    }
    l
}

fn inventory(gpus: &[&str]) -> pb::NodeInventory {
    pb::NodeInventory {
        mode: Default::default(),
        isolation: String::new(),
        dra_cores: String::new(),
        node: "n1".into(),
        gpus: gpus
            .iter()
            .enumerate()
            .map(|(i, u)| pb::Gpu {
                uuid: (*u).into(),
                index: i as u32,
                model: "A100".into(),
                memory_mib: 80 * GIB,
                healthy: true,
                compute_capability: String::new(),
            })
            .collect(),
        cpu_milli: 0,
        memory_mib: 0,
    }
}

fn pod(uid: &str, gib: u64, priority: i32) -> PodRequest {
    PodRequest {
        pod: pb::PodRef {
            uid: uid.into(),
            namespace: "ns".into(),
            name: uid.into(),
        },
        containers: vec![ContainerRequest {
            name: "main".into(),
            slices: 1,
            mem_mib: gib * GIB,
            ..Default::default()
        }],
        policy: Policy::Binpack,
        priority,
        ..Default::default()
    }
}

fn reserve(uid: &str, gib: u64, priority: i32) -> Command {
    Command::Reserve {
        request: pod(uid, gib, priority),
        node: "n1".into(),
        deadline_ms: 60_000,
    }
}

/// `p` (priority 100) nominated for 40 GiB of GPU-0, evicting `v` (priority 5).
fn nomination(gib: u64) -> pb::Nominated {
    pb::Nominated {
        pod: Some(pod("p", gib, 100).pod),
        priority: 100,
        node: "n1".into(),
        containers: vec![pb::NominatedContainer {
            container: "main".into(),
            shares: vec![pb::GpuShare {
                gpu_uuid: "GPU-0".into(),
                mem_mib: gib * GIB,
                core_milli: 0,
            }],
        }],
        victims: vec![pb::Victim {
            pod: Some(pod("v", 40, 5).pod),
            priority: 5,
        }],
        deadline_ms: 90_000,
        cpu_milli: 0,
        memory_mib: 0,
    }
}

fn nominate(n: pb::Nominated) -> Command {
    Command::Nominate {
        nomination: n,
        leaving: Vec::new(),
    }
}

fn release(uid: &str) -> Command {
    Command::Release {
        pod_uid: uid.into(),
        container: String::new(),
        allocation_id: 0,
        reason: "evicted".into(),
    }
}

#[test]
fn the_freed_room_goes_to_the_nominee_not_to_pods_it_outranks() {
    let mut l = setup();
    let (ev, r) = l
        .execute(nominate(nomination(40)), 1, 10)
        .expect("nominate");
    assert!(matches!(r, Reply::Done { changed: true }));
    assert!(matches!(&ev[0].body, Some(Body::Nominated(_))));
    assert!(l.check().is_ok());
    // The victim still holds its slice: a nomination takes no capacity.
    assert_eq!(l.node("n1").unwrap().gpus[0].mem_used, 70 * GIB);
    l.execute(release("v"), 1, 11).expect("victim gone");

    // 40 GiB are free, but they are kept for p: not for a pod of lower or equal priority.
    for prio in [50, 100] {
        let low = pod("low", 40, prio);
        let f = filter_nodes(&l, ["n1"], &low);
        assert!(f.fits.is_empty(), "priority {prio}: {f:?}");
        assert!(f.wait[0].1.contains("kept for ns/p"), "{f:?}");
        let e = l
            .execute(reserve("low", 40, prio), 1, 12)
            .expect_err("no room for it");
        assert!(
            matches!(e, CommandError::NoCapacity(ref m) if m.contains("kept for ns/p")),
            "{e}"
        );
        // A smaller pod still fits beside the nominated room.
        assert_eq!(
            filter_nodes(&l, ["n1"], &pod("small", 10, prio)).fits,
            ["n1"]
        );
    }
    // A pod that outranks the nominee is not held back.
    assert_eq!(filter_nodes(&l, ["n1"], &pod("high", 40, 200)).fits, ["n1"]);

    // The nominee fits, takes exactly its nominated share, and its nomination ends first.
    assert_eq!(filter_nodes(&l, ["n1"], &pod("p", 40, 100)).fits, ["n1"]);
    let (ev, r) = l
        .execute(reserve("p", 40, 100), 1, 13)
        .expect("nominee reserves");
    let kinds: Vec<&str> = ev
        .iter()
        .map(|e| match &e.body {
            Some(Body::NominationEnded(_)) => "ended",
            Some(Body::Reserved(_)) => "reserved",
            _ => "other",
        })
        .collect();
    assert_eq!(kinds, ["ended", "reserved"]);
    let Reply::Reserved { allocations, .. } = r else {
        panic!("{r:?}")
    };
    assert_eq!(
        allocations[0].id, ev[1].seq,
        "allocation id is the Reserved event's seq"
    );
    assert_eq!(allocations[0].shares[0].gpu_uuid, "GPU-0");
    assert!(l.nominations().is_empty());
    assert!(l.check().is_ok());
}

#[test]
fn a_nomination_whose_room_is_not_there_is_refused() {
    let mut l = setup();
    let before = l.clone();
    // Evicting v frees 40 GiB of the 10 free: 50 GiB, not 60.
    let e = l.execute(nominate(nomination(60)), 1, 10).unwrap_err();
    assert!(matches!(e, CommandError::NoCapacity(_)), "{e}");
    assert_eq!(l, before);
    // A pod already leaving counts as gone when it is named so.
    let mut n = nomination(60);
    n.victims.clear();
    let e = l
        .execute(
            Command::Nominate {
                nomination: n.clone(),
                leaving: vec!["v".into()],
            },
            1,
            10,
        )
        .unwrap_err();
    assert!(
        matches!(e, CommandError::NoCapacity(_)),
        "still 50 GiB: {e}"
    );
    n.containers[0].shares[0].mem_mib = 50 * GIB;
    l.execute(
        Command::Nominate {
            nomination: n,
            leaving: vec!["v".into()],
        },
        1,
        10,
    )
    .expect("50 GiB once v has left");
}

#[test]
fn nominations_of_pods_that_outrank_count_when_choosing_room() {
    let mut l = setup();
    l.execute(nominate(nomination(40)), 1, 10).expect("p");
    // q (priority 50) wants the same room through the same victim: p's nomination holds it.
    let mut q = nomination(40);
    q.pod = Some(pod("q", 40, 50).pod);
    q.priority = 50;
    let e = l.execute(nominate(q.clone()), 1, 11).unwrap_err();
    assert!(matches!(e, CommandError::NoCapacity(_)), "{e}");
    // r (priority 500) outranks p: p's room is r's for the taking.
    let mut r = q;
    r.pod = Some(pod("r", 40, 500).pod);
    r.priority = 500;
    l.execute(nominate(r), 1, 12).expect("r outranks p");
    assert_eq!(l.nominations().len(), 2);
}

#[test]
fn repeats_conflicts_and_bad_nominations() {
    let mut l = setup();
    l.execute(nominate(nomination(40)), 1, 10)
        .expect("nominate");
    let before = l.clone();
    // The same room again (a later deadline) is a repeat.
    let mut again = nomination(40);
    again.deadline_ms += 5_000;
    let (ev, r) = l.execute(nominate(again), 1, 11).expect("repeat");
    assert!(ev.is_empty() && matches!(r, Reply::Done { changed: false }));
    let cases: Vec<(pb::Nominated, &str)> = vec![
        (nomination(30), "conflict"),
        (
            {
                let mut n = nomination(40);
                n.pod = Some(pod("x", 40, 100).pod);
                n.victims[0].priority = 100;
                n
            },
            "invalid",
        ),
        (
            {
                let mut n = nomination(40);
                n.pod = Some(pod("x", 40, 100).pod);
                n.node = "n9".into();
                n
            },
            "not found",
        ),
        (
            {
                let mut n = nomination(40);
                n.pod = Some(pod("x", 40, 100).pod);
                n.containers[0].shares[0].gpu_uuid = "GPU-9".into();
                n
            },
            "invalid",
        ),
        (
            {
                let mut n = nomination(40);
                n.pod = Some(pod("o", 40, 100).pod);
                n
            },
            "conflict",
        ),
    ];
    for (n, want) in cases {
        let e = l.execute(nominate(n), 1, 12).unwrap_err();
        let got = match e {
            CommandError::Conflict(_) => "conflict",
            CommandError::Invalid(_) => "invalid",
            CommandError::NotFound(_) => "not found",
            _ => "other",
        };
        assert_eq!(got, want, "{e}");
        assert_eq!(l, before, "a refused nomination changed the state");
    }
}

#[test]
fn a_nomination_ends_with_its_node_or_its_gpu() {
    let mut l = setup();
    l.execute(Command::RegisterNode(inventory(&["GPU-0", "GPU-1"])), 1, 5)
        .expect("a second GPU");
    l.execute(nominate(nomination(40)), 1, 10)
        .expect("nominate");
    l.execute(
        Command::EndNomination {
            pod_uid: "p".into(),
            reason: "test".into(),
        },
        1,
        11,
    )
    .expect("end");
    let (ev, _) = l
        .execute(
            Command::EndNomination {
                pod_uid: "p".into(),
                reason: "test".into(),
            },
            1,
            12,
        )
        .expect("ending twice is a repeat");
    assert!(ev.is_empty());
    l.execute(nominate(nomination(40)), 1, 13).expect("again");
    let (ev, _) = l
        .execute(
            Command::RemoveNode {
                node: "n1".into(),
                reason: "drained".into(),
            },
            1,
            14,
        )
        .expect("remove");
    assert!(
        matches!(&ev[0].body, Some(Body::NominationEnded(e)) if e.reason.contains("node removed"))
    );
    assert!(matches!(
        &ev.last().unwrap().body,
        Some(Body::NodeRemoved(_))
    ));
    assert!(l.nominations().is_empty() && l.check().is_ok());
}

#[test]
fn a_nominated_gpu_leaving_the_inventory_ends_the_nomination() {
    let mut l = Ledger::new();
    l.execute(Command::RegisterNode(inventory(&["GPU-0", "GPU-1"])), 1, 0)
        .expect("register");
    let mut n = nomination(40);
    n.victims.clear();
    n.containers[0].shares[0].gpu_uuid = "GPU-1".into();
    l.execute(nominate(n), 1, 1).expect("nominate");
    let (ev, _) = l
        .execute(Command::RegisterNode(inventory(&["GPU-0"])), 1, 2)
        .expect("GPU-1 leaves");
    assert!(matches!(&ev[0].body, Some(Body::NominationEnded(_))));
    assert!(l.nominations().is_empty() && l.check().is_ok());
}

#[test]
fn the_fold_refuses_events_that_break_a_nomination_invariant() {
    let mut l = setup();
    l.execute(nominate(nomination(40)), 1, 10)
        .expect("nominate");
    let at = |seq: u64, body: Body| pb::Event {
        seq,
        epoch: 1,
        time_ms: 20,
        actor: None,
        body: Some(body),
    };
    let next = l.seq() + 1;
    let bad = [
        // The nominee reserving without its nomination ending first.
        Body::Reserved(pb::Reserved {
            allocation_id: next,
            pod: Some(pod("p", 40, 100).pod),
            container: "main".into(),
            node: "n1".into(),
            shares: vec![pb::GpuShare {
                gpu_uuid: "GPU-0".into(),
                mem_mib: GIB,
                core_milli: 0,
            }],
            ..Default::default()
        }),
        // A pod holding allocations nominated.
        Body::Nominated({
            let mut n = nomination(40);
            n.pod = Some(pod("o", 40, 100).pod);
            n
        }),
        // A second nomination of one pod.
        Body::Nominated(nomination(40)),
        // The end of a nomination that does not exist.
        Body::NominationEnded(pb::NominationEnded {
            pod: Some(pod("zz", 1, 0).pod),
            node: "n1".into(),
            reason: "x".into(),
        }),
        // The node of a live nomination removed.
        Body::NodeRemoved(pb::NodeRemoved {
            node: "n1".into(),
            reason: "x".into(),
        }),
    ];
    for b in bad {
        let before = l.clone();
        assert!(l.apply(&at(next, b.clone())).is_err(), "{b:?} was folded");
        assert_eq!(l, before);
    }
}

#[test]
fn nominations_survive_a_snapshot() {
    let mut l = setup();
    l.execute(nominate(nomination(40)), 1, 10)
        .expect("nominate");
    let back = Ledger::from_snapshot(&l.to_snapshot()).expect("loads");
    assert!(back.same_state(&l));
    assert_eq!(back.nominations().get("p"), l.nominations().get("p"));
    assert!(back.check().is_ok());
}
