use super::*;
use crate::placement::{ContainerRequest, Policy};

/// A ledger with node n1 of two 16,000 MiB GPUs, GPU-0 and GPU-1.
pub(super) fn setup() -> Ledger {
    let mut l = Ledger::new();
    let inv = pb::NodeInventory {
        mode: Default::default(),
        node: "n1".into(),
        gpus: (0..2)
            .map(|i| pb::Gpu {
                uuid: format!("GPU-{i}"),
                index: i,
                model: "A100".into(),
                memory_mib: 16000,
                healthy: true,
                compute_capability: String::new(),
            })
            .collect(),
        cpu_milli: 0,
        memory_mib: 0,
        isolation: String::new(),
        dra_cores: String::new(),
    };
    l.execute(Command::RegisterNode(inv), 1, 0)
        .expect("register");
    l
}

fn pod(uid: &str, mem: u64) -> PodRequest {
    PodRequest {
        pod: pb::PodRef {
            uid: uid.into(),
            namespace: "default".into(),
            name: uid.into(),
        },
        containers: vec![ContainerRequest {
            name: "main".into(),
            slices: 1,
            mem_mib: mem,
            ..Default::default()
        }],
        policy: Policy::Binpack,
        ..Default::default()
    }
}

fn reserve(uid: &str, mem: u64, node: &str) -> Command {
    Command::Reserve {
        request: pod(uid, mem),
        node: node.into(),
        deadline_ms: 60_000,
    }
}

#[test]
fn reserve_is_idempotent_by_pod_uid() {
    let mut l = setup();
    let (ev1, r1) = l.execute(reserve("p1", 4000, "n1"), 1, 10).expect("first");
    assert_eq!(ev1.len(), 1);
    let (ev2, r2) = l.execute(reserve("p1", 4000, "n1"), 1, 20).expect("repeat");
    assert!(ev2.is_empty(), "a repeat writes nothing");
    let (
        Reply::Reserved {
            allocations: a1,
            created: true,
        },
        Reply::Reserved {
            allocations: a2,
            created: false,
        },
    ) = (r1, r2)
    else {
        panic!("unexpected replies");
    };
    assert_eq!(a1, a2);
    assert!(matches!(
        l.execute(reserve("p1", 4000, "n2"), 1, 30),
        Err(CommandError::Conflict(_))
    ));
}

#[test]
fn bad_reserves_are_refused_with_nothing_written() {
    let mut l = setup();
    let seq = l.seq();
    assert!(matches!(
        l.execute(reserve("p1", 1, "nope"), 1, 0),
        Err(CommandError::NotFound(_))
    ));
    assert!(matches!(
        l.execute(reserve("p1", 999_999, "n1"), 1, 0),
        Err(CommandError::Unsatisfiable(_))
    ));
    let mut bad = pod("p1", 10);
    bad.containers[0].slices = 0;
    assert!(matches!(
        l.execute(
            Command::Reserve {
                request: bad,
                node: "n1".into(),
                deadline_ms: 0
            },
            1,
            0
        ),
        Err(CommandError::Invalid(_))
    ));
    assert_eq!(l.seq(), seq);
}

#[test]
fn full_node_says_no_capacity_then_release_makes_room() {
    let mut l = setup();
    l.execute(reserve("a", 16000, "n1"), 1, 0).expect("a");
    l.execute(reserve("b", 16000, "n1"), 1, 0).expect("b");
    assert!(matches!(
        l.execute(reserve("c", 1, "n1"), 1, 0),
        Err(CommandError::NoCapacity(_))
    ));
    l.execute(
        Command::Release {
            pod_uid: "a".into(),
            container: String::new(),
            allocation_id: 0,
            reason: "deleted".into(),
        },
        1,
        0,
    )
    .expect("release");
    l.execute(reserve("c", 1, "n1"), 1, 0).expect("c fits now");
}

#[test]
fn assign_bound_and_identity_correction() {
    let mut l = setup();
    l.execute(reserve("a", 1000, "n1"), 1, 0).expect("a");
    l.execute(reserve("b", 1000, "n1"), 1, 0).expect("b");
    let a = l.alloc_of("a", "main").expect("a").id;
    let b = l.alloc_of("b", "main").expect("b").id;
    l.execute(
        Command::ConfirmBound {
            pod_uid: "a".into(),
            node: "n1".into(),
            reason: "t".into(),
        },
        1,
        0,
    )
    .expect("bound");
    let (ev, _) = l
        .execute(
            Command::ConfirmBound {
                pod_uid: "a".into(),
                node: "n1".into(),
                reason: "t".into(),
            },
            1,
            0,
        )
        .expect("repeat");
    assert!(ev.is_empty());
    let devs = vec!["GPU-0::1".to_string()];
    l.execute(
        Command::Assign {
            node: "n1".into(),
            allocation_id: a,
            device_ids: devs.clone(),
        },
        1,
        0,
    )
    .expect("assign");
    let (ev, _) = l
        .execute(
            Command::Assign {
                node: "n1".into(),
                allocation_id: a,
                device_ids: devs.clone(),
            },
            1,
            0,
        )
        .expect("repeat assign");
    assert!(ev.is_empty());
    assert!(matches!(
        l.execute(
            Command::Assign {
                node: "n1".into(),
                allocation_id: b,
                device_ids: devs.clone()
            },
            1,
            0
        ),
        Err(CommandError::Conflict(_))
    ));
    l.execute(
        Command::CorrectIdentity {
            node: "n1".into(),
            from_allocation_id: a,
            to_allocation_id: b,
            device_ids: devs,
        },
        1,
        0,
    )
    .expect("correct");
    assert_eq!(l.alloc_of("b", "main").expect("b").id, a);
    assert_eq!(l.alloc_of("a", "main").expect("a").id, b);
    l.check().expect("consistent");
}

/// An Allocate claimed the reservation of a pod that was never bound here (the extender died
/// between Reserve and Binding); the correction hands that pod another allocation. The pod's
/// reservation clock and its unbound state must go with it, or it could hold GPUs here forever
/// (each correction making its reservation young again, or Bound) and never be placed.
#[test]
fn a_correction_moves_the_pods_clock_and_bound_state_with_it() {
    let mut l = setup();
    let reserve_at = |uid: &str, deadline_ms| Command::Reserve {
        request: pod(uid, 1000),
        node: "n1".into(),
        deadline_ms,
    };
    // x: reserved at t=0, never bound. y: reserved at t=5000 and bound.
    l.execute(reserve_at("x", 30_000), 1, 0).expect("x");
    l.execute(reserve_at("y", 35_000), 1, 5_000).expect("y");
    let x = l.alloc_of("x", "main").expect("x").id;
    let y = l.alloc_of("y", "main").expect("y").id;
    let bound = Command::ConfirmBound {
        pod_uid: "y".into(),
        node: "n1".into(),
        reason: "t".into(),
    };
    l.execute(bound, 1, 5_100).expect("bound");
    // y's Allocate guessed x's reservation, PreStartContainer shows the devices went to y.
    let devs = vec!["GPU-0::0".to_string()];
    let assign = Command::Assign {
        node: "n1".into(),
        allocation_id: x,
        device_ids: devs.clone(),
    };
    l.execute(assign, 1, 5_200).expect("assign");
    let correct = Command::CorrectIdentity {
        node: "n1".into(),
        from_allocation_id: x,
        to_allocation_id: y,
        device_ids: devs.clone(),
    };
    l.execute(correct, 1, 5_300).expect("correct");
    let for_y = l.alloc_of("y", "main").expect("y");
    assert_eq!(for_y.id, x);
    assert_eq!(for_y.state, AllocState::Assigned);
    assert_eq!(for_y.device_ids, devs);
    assert_eq!((for_y.reserved_ms, for_y.deadline_ms), (5_000, 35_000));
    let for_x = l.alloc_of("x", "main").expect("x");
    assert_eq!(for_x.id, y);
    assert_eq!(
        for_x.state,
        AllocState::Reserved,
        "x was never bound: its reservation expires as before"
    );
    assert_eq!((for_x.reserved_ms, for_x.deadline_ms), (0, 30_000));
    l.check().expect("consistent");
}

#[test]
fn remove_node_releases_its_allocations_first() {
    let mut l = setup();
    l.execute(reserve("a", 1000, "n1"), 1, 0).expect("a");
    let (ev, _) = l
        .execute(
            Command::RemoveNode {
                node: "n1".into(),
                reason: "deleted".into(),
            },
            1,
            0,
        )
        .expect("remove");
    assert_eq!(ev.len(), 2);
    assert!(l.allocs().is_empty() && l.nodes().is_empty());
}

#[test]
fn cpu_and_memory_from_kubernetes_survive_an_agent_registration() {
    let mut l = setup();
    let mut from_k8s = l.node("n1").expect("n1").inventory();
    from_k8s.cpu_milli = 8000;
    from_k8s.memory_mib = 32_768;
    let (ev, _) = l
        .execute(Command::RegisterNode(from_k8s.clone()), 1, 1)
        .expect("capacity from k8s");
    assert_eq!(ev.len(), 1);
    // The node agent knows GPUs only: it registers with 0 CPU and memory, which keep the ledger's.
    let mut from_agent = from_k8s.clone();
    from_agent.cpu_milli = 0;
    from_agent.memory_mib = 0;
    let (ev, r) = l
        .execute(Command::RegisterNode(from_agent), 1, 2)
        .expect("agent");
    assert!(ev.is_empty(), "nothing changed: {r:?}");
    let n = l.node("n1").expect("n1");
    assert_eq!((n.cpu_milli, n.memory_mib), (8000, 32_768));
    // A pod larger than the node's CPU does not fit any more.
    let mut big = pod("big", 1000);
    big.cpu_milli = 9000;
    let err = l.execute(
        Command::Reserve {
            request: big,
            node: "n1".into(),
            deadline_ms: 60_000,
        },
        1,
        3,
    );
    assert!(err.is_err(), "{err:?}");
}

/// A pod whose bind did not finish holds a reservation; the scheduler's next try is filtered
/// to that node (a Reserve there answers what it holds; one elsewhere is refused), however
/// full the node looks, and the pod's other nodes say why not.
#[test]
fn a_pod_holding_a_reservation_is_filtered_to_its_node() {
    let mut l = setup();
    let mut inv = l.node("n1").expect("n1").inventory();
    inv.node = "n2".into();
    for g in &mut inv.gpus {
        g.uuid = g.uuid.replace("GPU-", "GPU-n2-");
    }
    l.execute(Command::RegisterNode(inv), 1, 0).expect("n2");
    l.execute(reserve("p1", 16000, "n1"), 1, 10).expect("p1");
    l.execute(reserve("p2", 16000, "n1"), 1, 10).expect("p2");
    let f = crate::placement::filter_nodes(&l, ["n1", "n2"], &pod("p1", 16000));
    assert_eq!(f.fits, ["n1"]);
    assert_eq!(f.never.len(), 1);
    assert_eq!(f.never[0].0, "n2");
    assert!(
        f.never[0].1.contains("already holds GPUs on node n1"),
        "{}",
        f.never[0].1
    );
    let (ev, r) = l
        .execute(reserve("p1", 16000, "n1"), 1, 20)
        .expect("repeat");
    assert!(ev.is_empty());
    assert!(matches!(r, Reply::Reserved { created: false, .. }));
    // Another pod sees n1 full and n2 free, as before.
    let f = crate::placement::filter_nodes(&l, ["n1", "n2"], &pod("p3", 16000));
    assert_eq!(f.fits, ["n2"]);
    assert_eq!(f.wait.len(), 1);
}
