use super::*;
use crate::command::Command;
use crate::command::tests::setup;
use crate::state::AllocState;

fn adopt(uid: &str, shares: &[(&str, &str, u64, u32)]) -> Command {
    let mut containers: Vec<pb::NominatedContainer> = Vec::new();
    for (c, gpu, mem, core) in shares {
        let share = pb::GpuShare {
            gpu_uuid: (*gpu).into(),
            mem_mib: *mem,
            core_milli: *core,
        };
        match containers.iter_mut().find(|x| x.container == *c) {
            Some(x) => x.shares.push(share),
            None => containers.push(pb::NominatedContainer {
                container: (*c).into(),
                shares: vec![share],
            }),
        }
    }
    Command::Adopt {
        pod: pb::PodRef {
            uid: uid.into(),
            namespace: "team".into(),
            name: uid.into(),
        },
        node: "n1".into(),
        containers,
        source: "hami".into(),
    }
}

#[test]
fn an_adopted_pod_is_bound_on_the_shares_named_and_says_who_placed_it() {
    let mut l = setup();
    let (ev, reply) = l
        .execute(
            adopt(
                "p1",
                &[
                    ("a", "GPU-1", 4000, 300),
                    ("b", "GPU-0", 1000, 0),
                    ("b", "GPU-1", 1000, 100),
                ],
            ),
            2,
            50,
        )
        .expect("adopted");
    assert_eq!(ev.len(), 4, "two Reserved and two Bound: {ev:?}");
    let Reply::Reserved {
        allocations,
        created: true,
    } = reply
    else {
        panic!("{reply:?}");
    };
    assert_eq!(allocations.len(), 2);
    for a in l.allocs_of_pod("p1") {
        assert_eq!(a.state, AllocState::Bound);
        assert_eq!(a.policy, "adopted-from=hami");
    }
    let g1 = l.node("n1").and_then(|n| n.gpu("GPU-1")).expect("gpu");
    assert_eq!((g1.mem_used, g1.core_used), (5000, 400));
    // Running it again adopts nothing twice.
    let (ev, reply) = l
        .execute(adopt("p1", &[("a", "GPU-1", 4000, 300)]), 2, 60)
        .expect("repeat");
    assert!(ev.is_empty());
    assert!(matches!(reply, Reply::Reserved { created: false, .. }));
    assert_eq!(
        l.node("n1")
            .and_then(|n| n.gpu("GPU-1"))
            .map(|g| g.mem_used),
        Some(5000)
    );
}

#[test]
fn an_over_committed_gpu_refuses_the_pod_that_does_not_fit() {
    let mut l = setup();
    l.execute(adopt("p1", &[("a", "GPU-0", 12000, 500)]), 1, 1)
        .expect("first fits");
    let e = l
        .execute(adopt("p2", &[("a", "GPU-0", 8000, 100)]), 1, 2)
        .expect_err("memory over");
    assert!(
        matches!(&e, CommandError::NoCapacity(m) if m.contains("GPU-0")),
        "{e}"
    );
    let e = l
        .execute(adopt("p3", &[("a", "GPU-0", 100, 600)]), 1, 3)
        .expect_err("compute over");
    assert!(matches!(e, CommandError::NoCapacity(_)), "{e}");
    // Two containers of one pod count together on one GPU.
    let e = l
        .execute(
            adopt("p4", &[("a", "GPU-1", 9000, 0), ("b", "GPU-1", 9000, 0)]),
            1,
            4,
        )
        .expect_err("together over");
    assert!(matches!(e, CommandError::NoCapacity(_)), "{e}");
    assert!(l.allocs_of_pod("p4").is_empty());
}

#[test]
fn unknown_gpus_nodes_and_empty_pods_are_refused_with_the_reason() {
    let mut l = setup();
    let e = l
        .execute(adopt("p1", &[("a", "GPU-9", 100, 0)]), 1, 1)
        .expect_err("unknown gpu");
    assert!(
        matches!(&e, CommandError::NotFound(m) if m.contains("GPU-9")),
        "{e}"
    );
    let Command::Adopt {
        pod, containers, ..
    } = adopt("p1", &[("a", "GPU-0", 100, 0)])
    else {
        unreachable!()
    };
    let e = l
        .execute(
            Command::Adopt {
                pod: pod.clone(),
                node: "n9".into(),
                containers: containers.clone(),
                source: "hami".into(),
            },
            1,
            1,
        )
        .expect_err("unknown node");
    assert!(matches!(e, CommandError::NotFound(_)), "{e}");
    let e = l
        .execute(
            Command::Adopt {
                pod: pod.clone(),
                node: "n1".into(),
                containers: Vec::new(),
                source: "hami".into(),
            },
            1,
            1,
        )
        .expect_err("no share");
    assert!(matches!(e, CommandError::Invalid(_)), "{e}");
    let e = l
        .execute(
            Command::Adopt {
                pod,
                node: "n1".into(),
                containers,
                source: String::new(),
            },
            1,
            1,
        )
        .expect_err("no source");
    assert!(matches!(e, CommandError::Invalid(_)), "{e}");
    assert_eq!(l.seq(), 1, "nothing written");
}

#[test]
fn a_pod_the_ledger_holds_on_another_node_is_a_conflict() {
    let mut l = setup();
    let mut inv = l.node("n1").expect("n1").inventory();
    inv.node = "n2".into();
    for g in &mut inv.gpus {
        g.uuid = format!("{}-n2", g.uuid);
    }
    l.execute(Command::RegisterNode(inv), 1, 0).expect("n2");
    let Command::Adopt {
        pod, containers, ..
    } = adopt("p1", &[("a", "GPU-0-n2", 100, 0)])
    else {
        unreachable!()
    };
    l.execute(
        Command::Adopt {
            pod,
            node: "n2".into(),
            containers,
            source: "gpushare".into(),
        },
        1,
        1,
    )
    .expect("on n2");
    let e = l
        .execute(adopt("p1", &[("a", "GPU-0", 100, 0)]), 1, 2)
        .expect_err("n1");
    assert!(matches!(e, CommandError::Conflict(_)), "{e}");
}
