use proptest::prelude::*;

use super::*;
use crate::pb;
use crate::pb::event::Body;
use crate::placement::{ContainerRequest, Policy, place_on_node};
use crate::state::Ledger;

const GIB: u64 = 1024;

/// A pod on the test node: UID, its shares (GPU index, MiB, compute thousandths), priority.
#[derive(Debug)]
struct Pod {
    uid: String,
    shares: Vec<(usize, u64, u32)>,
    priority: i32,
}

fn pod(uid: &str, gpu: usize, mem: u64, priority: i32) -> Pod {
    Pod {
        uid: uid.into(),
        shares: vec![(gpu, mem, 0)],
        priority,
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

/// Node `n1` with `gpus` GPUs of `mem` MiB each, the pods reserved on it by the real fold.
fn ledger(gpus: usize, mem: u64, pods: &[Pod]) -> Ledger {
    let mut l = Ledger::new();
    let inv = pb::NodeInventory {
        mode: Default::default(),
        node: "n1".into(),
        gpus: (0..gpus)
            .map(|i| pb::Gpu {
                uuid: format!("GPU-{i}"),
                index: i as u32,
                model: "NVIDIA A100-SXM4-80GB".into(),
                memory_mib: mem,
                healthy: true,
                compute_capability: String::new(),
            })
            .collect(),
        cpu_milli: 0,
        memory_mib: 0,
        isolation: String::new(),
        dra_cores: String::new(),
    };
    l.apply(&ev(
        1,
        Body::NodeRegistered(pb::NodeRegistered {
            inventory: Some(inv),
        }),
    ))
    .expect("register");
    for p in pods {
        let seq = l.seq() + 1;
        let r = pb::Reserved {
            allocation_id: seq,
            pod: Some(pb::PodRef {
                uid: p.uid.clone(),
                namespace: "ns".into(),
                name: p.uid.clone(),
            }),
            container: "c".into(),
            node: "n1".into(),
            shares: p
                .shares
                .iter()
                .map(|&(g, mem, core)| pb::GpuShare {
                    gpu_uuid: format!("GPU-{g}"),
                    mem_mib: mem,
                    core_milli: core,
                })
                .collect(),
            deadline_ms: 0,
            cpu_milli: 0,
            memory_mib: 0,
            policy: "binpack".into(),
        };
        l.apply(&ev(seq, Body::Reserved(r))).expect("test pods fit");
    }
    l
}

fn req(slices: u32, mem: u64, core: u32) -> PodRequest {
    PodRequest {
        pod: pb::PodRef {
            uid: "preemptor".into(),
            namespace: "ns".into(),
            name: "preemptor".into(),
        },
        containers: vec![ContainerRequest {
            name: "c".into(),
            slices,
            mem_mib: mem,
            core_milli: core,
            ..Default::default()
        }],
        policy: Policy::Binpack,
        ..Default::default()
    }
}

fn evictable(pods: &[Pod]) -> Vec<Evictable> {
    pods.iter()
        .map(|p| Evictable {
            pod_uid: p.uid.clone(),
            priority: p.priority,
        })
        .collect()
}

fn choose(
    l: &Ledger,
    r: &PodRequest,
    prio: i32,
    leaving: &[&str],
    ev: &[Evictable],
) -> Option<Victims> {
    let node = l.node("n1").expect("n1");
    let allocs: Vec<&Alloc> = l.allocs().values().filter(|a| a.node == "n1").collect();
    let leaving: BTreeSet<String> = leaving.iter().map(|s| s.to_string()).collect();
    choose_victims(node, &allocs, r, prio, &leaving, ev)
}

fn uuids(v: &Victims) -> Vec<String> {
    v.placement
        .iter()
        .flat_map(|c| c.shares.iter().map(|s| s.gpu_uuid.clone()))
        .collect()
}

#[test]
fn two_victims_on_one_gpu_not_three_spread_and_the_lower_priority_pair() {
    // Two full 80 GiB GPUs of 20 GiB pods; evicting by priority alone would take a, e and f
    // (three pods on two GPUs) before the 40 GiB preemptor fits.
    let pods = [
        pod("a", 0, 20 * GIB, 1),
        pod("b", 0, 20 * GIB, 3),
        pod("c", 0, 20 * GIB, 10),
        pod("d", 0, 20 * GIB, 10),
        pod("e", 1, 20 * GIB, 2),
        pod("f", 1, 20 * GIB, 2),
        pod("g", 1, 20 * GIB, 10),
        pod("h", 1, 20 * GIB, 10),
    ];
    let l = ledger(2, 80 * GIB, &pods);
    let v = choose(&l, &req(1, 40 * GIB, 0), 100, &[], &evictable(&pods)).expect("fits");
    // {e, f} (highest 2) beats {a, b} (highest 3).
    assert_eq!(v.pods, ["e", "f"]);
    assert_eq!(uuids(&v), ["GPU-1"]);
}

#[test]
fn only_lower_priority_pods_with_an_allocation_here_are_victims() {
    let pods = [pod("low", 0, 40 * GIB, 5), pod("high", 0, 40 * GIB, 200)];
    let l = ledger(1, 80 * GIB, &pods);
    let mut ev = evictable(&pods);
    // A pod that holds no GPU here frees nothing, however low its priority.
    ev.push(Evictable {
        pod_uid: "cpu-only".into(),
        priority: -1000,
    });
    let v = choose(&l, &req(1, 40 * GIB, 0), 100, &[], &ev).expect("fits");
    assert_eq!(v.pods, ["low"]);
    // 60 GiB needs "high" gone too, which outranks the preemptor.
    assert_eq!(choose(&l, &req(1, 60 * GIB, 0), 100, &[], &ev), None);
    // Equal priority is no victim either.
    assert_eq!(choose(&l, &req(1, 40 * GIB, 0), 5, &[], &ev), None);
}

#[test]
fn a_pod_that_can_never_fit_gets_no_victims() {
    let pods = [pod("a", 0, 40 * GIB, 0)];
    let l = ledger(1, 80 * GIB, &pods);
    assert_eq!(
        choose(&l, &req(1, 100 * GIB, 0), 100, &[], &evictable(&pods)),
        None
    );
    assert_eq!(
        choose(&l, &req(2, 10 * GIB, 0), 100, &[], &evictable(&pods)),
        None
    );
}

#[test]
fn pods_already_leaving_count_as_gone_and_are_not_chosen() {
    let pods = [pod("a", 0, 40 * GIB, 0), pod("b", 0, 40 * GIB, 1)];
    let l = ledger(1, 80 * GIB, &pods);
    // The scheduler evicts b anyway: nothing more to evict.
    let v = choose(&l, &req(1, 40 * GIB, 0), 100, &["b"], &evictable(&pods)).expect("fits");
    assert!(v.pods.is_empty(), "{:?}", v.pods);
    // Without that, a (the lower priority) goes.
    let v = choose(&l, &req(1, 40 * GIB, 0), 100, &[], &evictable(&pods)).expect("fits");
    assert_eq!(v.pods, ["a"]);
}

#[test]
fn compute_is_freed_as_well_as_memory() {
    let pods = [
        Pod {
            uid: "x".into(),
            shares: vec![(0, GIB, 600)],
            priority: 1,
        },
        Pod {
            uid: "y".into(),
            shares: vec![(0, GIB, 400)],
            priority: 0,
        },
    ];
    let l = ledger(1, 80 * GIB, &pods);
    // 50 % of compute: y's 40 % is not enough, x's 60 % is.
    let v = choose(&l, &req(1, GIB, 500), 100, &[], &evictable(&pods)).expect("fits");
    assert_eq!(v.pods, ["x"]);
}

#[test]
fn a_multi_gpu_preemptor_frees_one_slot_on_each_of_two_gpus() {
    let pods = [
        pod("a", 0, 40 * GIB, 3),
        pod("b", 0, 40 * GIB, 1),
        pod("c", 1, 40 * GIB, 2),
        pod("d", 1, 40 * GIB, 4),
        pod("e", 2, 80 * GIB, 0),
    ];
    let l = ledger(3, 80 * GIB, &pods);
    // Two 40 GiB slices on distinct GPUs need two victims on two GPUs; of those pairs, {e, b}
    // (highest priority 1) is the lowest.
    let v = choose(&l, &req(2, 40 * GIB, 0), 100, &[], &evictable(&pods)).expect("fits");
    assert_eq!(v.pods, ["e", "b"]);
    let mut g = uuids(&v);
    g.sort();
    assert_eq!(g, ["GPU-0", "GPU-2"]);
    // A victim holding two GPUs frees both at once.
    let pods = [
        Pod {
            uid: "wide".into(),
            shares: vec![(0, 60 * GIB, 0), (1, 60 * GIB, 0)],
            priority: 5,
        },
        pod("p", 0, 20 * GIB, 0),
        pod("q", 1, 20 * GIB, 0),
    ];
    let l = ledger(2, 80 * GIB, &pods);
    let v = choose(&l, &req(2, 50 * GIB, 0), 100, &[], &evictable(&pods)).expect("fits");
    assert_eq!(v.pods, ["wide"]);
}

#[test]
fn a_large_node_past_the_exact_budget_still_gets_an_irreducible_set() {
    // 64 pods of 1 GiB on one GPU; 8 GiB needs 8 of them: C(64, 8) is far past the budget.
    let pods: Vec<Pod> = (0..64)
        .map(|i| pod(&format!("p{i:02}"), 0, GIB, i))
        .chain(std::iter::once(pod("rest", 0, 16 * GIB, 1000)))
        .collect();
    let l = ledger(1, 80 * GIB, &pods);
    let v = choose(&l, &req(1, 8 * GIB, 0), 500, &[], &evictable(&pods)).expect("fits");
    assert_eq!(v.pods.len(), 8, "{:?}", v.pods);
    assert_eq!(v.pods[0], "p00");
    assert_eq!(v.pods[7], "p07");
}

/// The ledger with the pods of `uids` released, as the allocator would after their eviction.
fn without(l: &Ledger, uids: &[String]) -> Ledger {
    let mut l = l.clone();
    let ids: Vec<u64> = l
        .allocs()
        .values()
        .filter(|a| uids.contains(&a.pod.uid))
        .map(|a| a.id)
        .collect();
    for id in ids {
        let seq = l.seq() + 1;
        let r = pb::Released {
            allocation_id: id,
            reason: "preempted".into(),
            node: "n1".into(),
        };
        l.apply(&ev(seq, Body::Released(r))).expect("release");
    }
    l
}

fn fits(l: &Ledger, r: &PodRequest) -> bool {
    evaluate(l.node("n1").expect("n1"), r).is_ok()
}

prop_compose! {
    fn arb_node()(gpus in 1usize..=3, picks in prop::collection::vec(
        (0usize..3, 1u64..=8, 0u32..=4, -3i32..=3, any::<bool>()), 0..9))
        -> (usize, Vec<Pod>) {
        // Memory in 10 GiB steps on 80 GiB GPUs, compute in 20 % steps; a pod that would not
        // fit is left out, so the fold accepts every reservation.
        let mut mem = vec![0u64; gpus];
        let mut core = vec![0u32; gpus];
        let mut pods = Vec::new();
        for (i, (g, m, c, prio, wide)) in picks.into_iter().enumerate() {
            let g = g % gpus;
            let h = (g + 1) % gpus;
            let mut shares = vec![(g, m * 10 * GIB, c * 200)];
            if wide && h != g {
                shares.push((h, m * 10 * GIB, c * 200));
            }
            if shares.iter().all(|&(x, sm, sc)| mem[x] + sm <= 80 * GIB && core[x] + sc <= 1000) {
                for &(x, sm, sc) in &shares {
                    mem[x] += sm;
                    core[x] += sc;
                }
                pods.push(Pod { uid: format!("p{i}"), shares, priority: prio });
            }
        }
        (gpus, pods)
    }
}

proptest! {
    #[test]
    fn victims_free_a_fit_none_is_spared_and_none_fewer_would_do(
        (gpus, pods) in arb_node(),
        slices in 1u32..=2,
        mem in 1u64..=8,
        core in 0u32..=5,
        prio in -2i32..=4,
    ) {
        let l = ledger(gpus, 80 * GIB, &pods);
        let r = req(slices, mem * 10 * GIB, core * 200);
        let ev = evictable(&pods);
        let eligible: Vec<String> = pods
            .iter()
            .filter(|p| p.priority < prio)
            .map(|p| p.uid.clone())
            .collect();
        match choose(&l, &r, prio, &[], &ev) {
            None => prop_assert!(!fits(&without(&l, &eligible), &r)),
            Some(v) => {
                for u in &v.pods {
                    prop_assert!(eligible.contains(u), "{u} is not evictable");
                }
                let after = without(&l, &v.pods);
                prop_assert!(fits(&after, &r));
                let placed = place_on_node(after.node("n1").expect("n1"), &r).expect("fits");
                prop_assert_eq!(&placed, &v.placement);
                let landing = uuids(&v);
                for u in &v.pods {
                    let p = pods.iter().find(|p| &p.uid == u).expect("a test pod");
                    prop_assert!(
                        p.shares.iter().any(|s| landing.contains(&format!("GPU-{}", s.0))),
                        "{u} holds nothing on {landing:?}"
                    );
                }
                for spared in &v.pods {
                    let rest: Vec<String> = v.pods.iter().filter(|u| *u != spared).cloned().collect();
                    prop_assert!(!fits(&without(&l, &rest), &r), "{spared} need not go");
                }
                // No smaller set of eligible pods would do.
                let n = eligible.len();
                for mask in 0u32..(1 << n) {
                    if (mask.count_ones() as usize) < v.pods.len() {
                        let s: Vec<String> = (0..n)
                            .filter(|i| mask & (1 << i) != 0)
                            .map(|i| eligible[i].clone())
                            .collect();
                        prop_assert!(!fits(&without(&l, &s), &r), "{s:?} is smaller");
                    }
                }
            }
        }
    }
}

/// Nodes `n1` and `n2`, one 80 GiB GPU each, each full with a 40 GiB pod of priority 1000
/// (`x1`, `x2`) and the 40 GiB pods `on_n1` and `on_n2` (uid, priority).
fn two_nodes(on_n1: (&str, i32), on_n2: (&str, i32)) -> (Ledger, Vec<NodePods>) {
    use crate::command::Command;
    let mut l = Ledger::new();
    let mut pods = Vec::new();
    for (n, (uid, prio)) in [("n1", on_n1), ("n2", on_n2)] {
        let inv = pb::NodeInventory {
            mode: Default::default(),
            isolation: String::new(),
            dra_cores: String::new(),
            node: n.into(),
            gpus: vec![pb::Gpu {
                uuid: format!("GPU-{n}"),
                index: 0,
                model: "A100".into(),
                memory_mib: 80 * GIB,
                healthy: true,
                compute_capability: String::new(),
            }],
            cpu_milli: 0,
            memory_mib: 0,
        };
        l.execute(Command::RegisterNode(inv), 1, 0)
            .expect("register");
        for u in [uid.to_string(), format!("x{}", &n[1..])] {
            let mut r = req(1, 40 * GIB, 0);
            r.pod.uid.clone_from(&u);
            r.pod.name.clone_from(&u);
            l.execute(
                Command::Reserve {
                    request: r,
                    node: n.into(),
                    deadline_ms: 0,
                },
                1,
                0,
            )
            .expect("reserve");
        }
        pods.push(NodePods {
            node: n.into(),
            evictable: vec![Evictable {
                pod_uid: uid.into(),
                priority: prio,
            }],
            leaving: BTreeSet::new(),
        });
    }
    (l, pods)
}

fn preemptor(prio: i32) -> PodRequest {
    PodRequest {
        priority: prio,
        ..req(1, 40 * GIB, 0)
    }
}

#[test]
fn the_node_whose_victims_matter_least_is_chosen() {
    let (l, mut pods) = two_nodes(("a", 10), ("b", 5));
    let p = choose_nomination(&l, &preemptor(100), &pods).expect("a plan");
    assert_eq!(p.node, "n2");
    assert_eq!(
        p.victims,
        [Evictable {
            pod_uid: "b".into(),
            priority: 5
        }]
    );
    assert_eq!(p.placement[0].shares[0].gpu_uuid, "GPU-n2");
    // b is protected (the caller leaves it out): a goes instead.
    pods[1].evictable.clear();
    assert_eq!(
        choose_nomination(&l, &preemptor(100), &pods)
            .expect("a plan")
            .node,
        "n1"
    );
    // Nobody below the preemptor's priority: no plan.
    assert!(choose_nomination(&l, &preemptor(5), &pods).is_none());
}

#[test]
fn a_node_whose_leaving_pods_free_the_room_needs_no_victim() {
    let (l, mut pods) = two_nodes(("a", 10), ("b", 5));
    pods[0].evictable.clear();
    pods[0].leaving.insert("a".into());
    let p = choose_nomination(&l, &preemptor(100), &pods).expect("a plan");
    assert_eq!((p.node.as_str(), p.victims.len()), ("n1", 0));
}

#[test]
fn room_kept_for_a_pod_that_outranks_is_not_offered_again() {
    use crate::command::Command;
    let (mut l, pods) = two_nodes(("a", 10), ("b", 5));
    let first = choose_nomination(&l, &preemptor(500), &pods).expect("a plan");
    assert_eq!(first.node, "n2");
    let mut high = preemptor(500);
    high.pod.uid = "high".into();
    let n = first.nomination(&high, 9_000, &|_| None);
    l.execute(
        Command::Nominate {
            nomination: n,
            leaving: Vec::new(),
        },
        1,
        1,
    )
    .expect("nominate");
    // n2's room is kept for `high`: a lower preemptor evicts a on n1 instead.
    let p = choose_nomination(&l, &preemptor(100), &pods).expect("a plan");
    assert_eq!(p.node, "n1");
    // One that outranks `high` may still take n2's room.
    assert_eq!(
        choose_nomination(&l, &preemptor(900), &pods)
            .expect("a plan")
            .node,
        "n2"
    );
}
