use std::sync::Arc;

use super::score::score_of;
use super::*;
use crate::state::GpuState;

pub(super) fn gpu(i: u32, mem: u64) -> GpuState {
    GpuState {
        uuid: format!("GPU-{i}"),
        index: i,
        model: "NVIDIA A100-SXM4-80GB".into(),
        memory_mib: mem,
        healthy: true,
        compute_capability: String::new(),
        mem_used: 0,
        core_used: 0,
        holders: 0,
    }
}

pub(super) fn node(gpus: Vec<GpuState>) -> NodeState {
    NodeState {
        mode: Default::default(),
        isolation: String::new(),
        dra_cores: String::new(),
        name: "n1".into(),
        gpus,
        cpu_milli: 0,
        memory_mib: 0,
        cpu_used: 0,
        memory_used: 0,
        allocs: Default::default(),
        devices: Default::default(),
        pod_kinds: Default::default(),
    }
}

fn req(slices: u32, mem: u64, policy: Policy) -> PodRequest {
    PodRequest {
        pod: pb::PodRef {
            uid: "u".into(),
            namespace: "ns".into(),
            name: "p".into(),
        },
        containers: vec![ContainerRequest {
            name: "c".into(),
            slices,
            mem_mib: mem,
            ..Default::default()
        }],
        policy,
        ..Default::default()
    }
}

#[test]
fn binpack_takes_the_tightest_gpu_and_spread_the_emptiest() {
    let mut n = node(vec![gpu(0, 16000), gpu(1, 16000), gpu(2, 16000)]);
    n.gpus[1].mem_used = 10000;
    let p = place_on_node(&n, &req(1, 4000, Policy::Binpack)).expect("fits");
    assert_eq!(p[0].shares[0].gpu_uuid, "GPU-1");
    let p = place_on_node(&n, &req(1, 4000, Policy::Spread)).expect("fits");
    assert_eq!(p[0].shares[0].gpu_uuid, "GPU-0");
}

#[test]
fn multi_slice_takes_distinct_gpus() {
    let n = node(vec![gpu(0, 16000), gpu(1, 16000)]);
    let p = place_on_node(&n, &req(2, 1000, Policy::Binpack)).expect("fits");
    assert_ne!(p[0].shares[0].gpu_uuid, p[0].shares[1].gpu_uuid);
    assert!(matches!(
        place_on_node(&n, &req(3, 1000, Policy::Binpack)),
        Err(Fit::Never(_))
    ));
}

#[test]
fn too_large_is_never_and_full_is_wait() {
    let mut n = node(vec![gpu(0, 16000)]);
    assert!(matches!(
        fit_node(&n, &req(1, 20000, Policy::Binpack)),
        Fit::Never(_)
    ));
    n.gpus[0].mem_used = 15000;
    assert!(matches!(
        fit_node(&n, &req(1, 2000, Policy::Binpack)),
        Fit::Wait(_)
    ));
    n.gpus[0].healthy = false;
    n.gpus[0].mem_used = 0;
    assert!(matches!(
        fit_node(&n, &req(1, 2000, Policy::Binpack)),
        Fit::Wait(_)
    ));
}

#[test]
fn selectors_filter_gpus() {
    let mut n = node(vec![gpu(0, 16000), gpu(1, 16000)]);
    n.gpus[0].model = "Tesla T4".into();
    let mut r = req(1, 1000, Policy::Spread);
    r.selector.types = vec!["a100".into()];
    let p = place_on_node(&n, &r).expect("fits");
    assert_eq!(p[0].shares[0].gpu_uuid, "GPU-1");
    r.selector.uuids_exclude = vec!["GPU-1".into()];
    assert!(matches!(fit_node(&n, &r), Fit::Never(_)));
}

#[test]
fn percent_memory_resolves_per_gpu_and_bare_slice_is_whole_gpu() {
    let n = node(vec![gpu(0, 16000)]);
    let mut r = req(1, 0, Policy::Binpack);
    r.containers[0].mem_percent = 50;
    let p = place_on_node(&n, &r).expect("fits");
    assert_eq!(p[0].shares[0].mem_mib, 8000);
    let p = place_on_node(&n, &req(1, 0, Policy::Binpack)).expect("fits");
    assert_eq!(p[0].shares[0].mem_mib, 16000);
    assert_eq!(p[0].shares[0].core_milli, 1000);
}

#[test]
fn validation_explains() {
    let mut r = req(1, 100, Policy::Binpack);
    r.containers[0].core_milli = 1500;
    assert!(r.validate().expect_err("bad core").contains("0-100"));
    let mut r = req(1, 100, Policy::Binpack);
    r.containers[0].mem_percent = 10;
    assert!(r.validate().expect_err("both").contains("both"));
    assert!("fastest".parse::<Policy>().is_err());
}

#[test]
fn defaults_fill_the_policy_and_give_fgd_alone_the_workload() {
    let w = Arc::new(Workload::prior());
    let d = Defaults {
        policy: Policy::Fgd,
        workload: Some(w.clone()),
    };
    let wire = |policy: &str| pb::PodRequest {
        pod: Some(pb::PodRef {
            uid: "u".into(),
            namespace: "ns".into(),
            name: "p".into(),
        }),
        containers: vec![pb::ContainerRequest {
            name: "c".into(),
            slices: 1,
            mem_mib: 100,
            ..Default::default()
        }],
        placement: Some(pb::Placement {
            policy: policy.into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let unnamed = d.request(wire("")).expect("valid");
    assert_eq!(unnamed.policy, Policy::Fgd);
    assert!(
        unnamed
            .workload
            .as_ref()
            .is_some_and(|x| Arc::ptr_eq(x, &w))
    );
    let named = d.request(wire("spread")).expect("valid");
    assert_eq!(named.policy, Policy::Spread);
    assert!(named.workload.is_none());
    let own = Arc::new(Workload::from_requests([&unnamed]));
    let mut brought = unnamed.clone();
    brought.workload = Some(own.clone());
    d.attach(&mut brought);
    assert!(brought.workload.is_some_and(|x| Arc::ptr_eq(&x, &own)));
}

fn share_req(core: u32, policy: Policy, w: &Arc<Workload>) -> PodRequest {
    let mut r = req(1, 0, policy);
    r.containers[0].core_milli = core;
    r.workload = Some(w.clone());
    r
}

fn shape(gpus: u32, core_milli: u32) -> PodShape {
    PodShape {
        gpus,
        core_milli,
        ..Default::default()
    }
}

#[test]
fn fragmentation_counts_what_typical_pods_cannot_use() {
    // Half the pods want a whole GPU, half want 0.6 of one.
    let w = Workload::from_counts([(shape(1, 1000), 1), (shape(1, 600), 1)], 1.0);
    let mut n = node(vec![gpu(0, 16000), gpu(1, 16000)]);
    n.gpus[0].core_used = 500;
    // Whole-GPU pods cannot use GPU 0's 500 free; 0.6-pods cannot either: 500 for both.
    assert!((w.node_fragmentation(&n) - 500.0).abs() < 1e-9);
    n.gpus[1].core_used = 500;
    // Nothing fits any more: all 1000 free is fragment.
    assert!((w.node_fragmentation(&n) - 1000.0).abs() < 1e-9);
}

#[test]
fn fgd_picks_the_gpu_that_fragments_least() {
    // 0.5-pods are typical.
    let w = Arc::new(Workload::from_counts([(shape(1, 500), 1)], 1.0));
    let mut n = node(vec![gpu(0, 16000), gpu(1, 16000)]);
    n.gpus[0].core_used = 300;
    n.gpus[1].core_used = 600;
    // A 0.4 pod: on GPU 0 it leaves (300, 400) free, where no 0.5 fits (fragment 700); on GPU 1
    // it leaves (700, 0) (fragment 0).
    let c = evaluate(&n, &share_req(400, Policy::Fgd, &w)).expect("fits");
    assert_eq!(c.gpus, vec![vec![1]]);
    n.gpus[1].core_used = 0;
    // Now GPU 1 is idle: 0.4 on GPU 0 -> free (300, 1000): frag 300; on GPU 1 -> (700, 600):
    // frag 0 (both still host a 0.5). FGD takes GPU 1; binpack takes the tighter GPU 0.
    let c = evaluate(&n, &share_req(400, Policy::Fgd, &w)).expect("fits");
    assert_eq!(c.gpus, vec![vec![1]]);
    let c = evaluate(&n, &share_req(400, Policy::Binpack, &w)).expect("fits");
    assert_eq!(c.gpus, vec![vec![0]]);
}

#[test]
fn fgd_scores_gpus_in_integers_and_ties_go_to_the_first() {
    // As in the paper's simulator: a GPU's score is the node score of the placement there,
    // truncated to an integer, and the first of equal GPUs wins.
    let w = Arc::new(Workload::from_counts(
        [(shape(1, 600), 99), (shape(1, 950), 1)],
        1.0,
    ));
    let mut n = node(vec![gpu(0, 16000), gpu(1, 16000), gpu(2, 16000)]);
    n.gpus[1].core_used = 50;
    n.gpus[2].core_used = 750;
    // Fragmentation before: 250 (GPU 2 hosts neither shape). A 0.3 pod on GPU 0 makes it 257,
    // on GPU 1 256.5: exactly, GPU 1 is better, but both score 49.
    let c = evaluate(&n, &share_req(300, Policy::Fgd, &w)).expect("fits");
    assert_eq!(c.gpus, vec![vec![0]]);
    assert_eq!(c.score, 49.0);
}

#[test]
fn fgd_prefers_the_node_where_fragmentation_grows_least() {
    let w = Arc::new(Workload::from_counts([(shape(1, 1000), 1)], 1.0));
    let idle = node(vec![gpu(0, 16000), gpu(1, 16000)]);
    let mut half = node(vec![gpu(0, 16000), gpu(1, 16000)]);
    half.name = "n2".into();
    half.gpus[0].core_used = 500;
    // A 0.5 pod on the idle node ruins a whole GPU (+500 fragment); on the half-used node it
    // fills the fragment (-500).
    let r = share_req(500, Policy::Fgd, &w);
    let (n, p) = choose_node([&idle, &half], &r).expect("fits");
    assert_eq!(n.name, "n2");
    assert_eq!(p[0].shares[0].gpu_uuid, "GPU-0");
}

#[test]
fn fgd_pack_breaks_ties_towards_nodes_in_use() {
    let w = Arc::new(Workload::from_counts([(shape(1, 1000), 1)], 1.0));
    let idle = node(vec![gpu(0, 16000), gpu(1, 16000), gpu(2, 16000)]);
    let mut used = node(vec![gpu(0, 16000), gpu(1, 16000), gpu(2, 16000)]);
    used.name = "used".into();
    used.gpus[0].core_used = 1000;
    let r = share_req(1000, Policy::Fgd, &w);
    assert_eq!(choose_node([&idle, &used], &r).expect("fits").0.name, "n1");
    // fgd-pack-cpu places pods that ask for GPUs as fgd-pack does.
    for policy in [Policy::FgdPack, Policy::FgdPackCpu] {
        let r = share_req(1000, policy, &w);
        assert_eq!(
            choose_node([&idle, &used], &r).expect("fits").0.name,
            "used"
        );
    }
}

#[test]
fn fgd_pack_cpu_puts_pods_without_gpus_where_the_least_gpu_is_free() {
    let w = Arc::new(Workload::from_counts([(shape(1, 500), 1)], 1.0));
    // A node in use with 3.5 GPUs free, then an idle node with one GPU.
    let mut big = node(vec![
        gpu(0, 16000),
        gpu(1, 16000),
        gpu(2, 16000),
        gpu(3, 16000),
    ]);
    big.name = "big".into();
    big.gpus[0].core_used = 500;
    let mut small = node(vec![gpu(0, 16000)]);
    small.name = "small".into();
    for n in [&mut big, &mut small] {
        n.cpu_milli = 32_000;
    }
    // A CPU-only pod leaves every GPU able to host the typical 0.5 pod: FGD scores both nodes
    // 50. fgd takes the first node, fgd-pack the one in use (the same), fgd-pack-cpu the node
    // where its CPU could strand the least GPU.
    let mut r = req(1, 0, Policy::Fgd);
    r.containers.clear();
    r.cpu_milli = 4000;
    r.workload = Some(w.clone());
    let pick = |policy| {
        let r = PodRequest {
            policy,
            ..r.clone()
        };
        let scores: Vec<f64> = [&big, &small]
            .iter()
            .map(|n| evaluate(n, &r).expect("fits").score.trunc())
            .collect();
        assert_eq!(scores, vec![50.0, 50.0]);
        choose_node([&big, &small], &r)
            .expect("fits")
            .0
            .name
            .clone()
    };
    assert_eq!(pick(Policy::Fgd), "big");
    assert_eq!(pick(Policy::FgdPack), "big");
    assert_eq!(pick(Policy::FgdPackCpu), "small");
    // The order among ties never outweighs FGD's own score: the extender sees the same 0..=10.
    r.policy = Policy::FgdPackCpu;
    assert_eq!(score_node(&small, &r), 5);
}

#[test]
fn cpu_only_pods_are_placed_on_cpu_and_memory() {
    let mut n = node(vec![gpu(0, 16000)]);
    n.cpu_milli = 4000;
    n.memory_mib = 1000;
    let mut r = req(1, 0, Policy::Fgd);
    r.containers.clear();
    r.cpu_milli = 3000;
    let c = evaluate(&n, &r).expect("fits");
    assert!(c.gpus.is_empty());
    r.memory_mib = 2000;
    assert!(matches!(fit_node(&n, &r), Fit::Never(_)));
    r.memory_mib = 0;
    n.cpu_used = 2000;
    assert!(matches!(fit_node(&n, &r), Fit::Wait(_)));
}

#[test]
fn models_match_exactly() {
    let mut n = node(vec![gpu(0, 16000)]);
    n.gpus[0].model = "V100M32".into();
    let mut r = req(1, 1000, Policy::BestFit);
    r.selector.models = vec!["V100M16".into()];
    assert!(matches!(fit_node(&n, &r), Fit::Never(_)));
    r.selector.models = vec!["T4".into(), "V100M32".into()];
    assert_eq!(fit_node(&n, &r), Fit::Fits);
}

#[test]
fn every_policy_name_round_trips() {
    for name in Policy::NAMES {
        let p: Policy = name.parse().expect("known name");
        assert_eq!(p.to_string(), *name);
    }
    assert_eq!("best-fit".parse::<Policy>(), Ok(Policy::BestFit));
}

#[test]
fn random_is_a_pure_function_of_the_salt() {
    let nodes: Vec<NodeState> = (0..8)
        .map(|i| {
            let mut n = node(vec![gpu(0, 16000)]);
            n.name = format!("n{i}");
            n
        })
        .collect();
    let mut r = req(1, 1000, Policy::Random);
    let pick = |r: &PodRequest| choose_node(&nodes, r).expect("fits").0.name.clone();
    let picks: std::collections::BTreeSet<String> = (0..32)
        .map(|s| {
            r.salt = s;
            pick(&r)
        })
        .collect();
    assert!(picks.len() > 3, "random should spread: {picks:?}");
    r.salt = 7;
    assert_eq!(pick(&r), pick(&r));
}

#[test]
fn workload_keeps_the_most_frequent_shapes() {
    let w = Workload::from_counts(
        [
            (shape(1, 1000), 90),
            (shape(1, 500), 6),
            (shape(8, 1000), 4),
        ],
        0.95,
    );
    let kept: Vec<(PodShape, f64)> = w.shapes().map(|(s, p)| (s.clone(), p)).collect();
    assert_eq!(kept.len(), 2);
    assert!((kept[0].1 - 90.0 / 96.0).abs() < 1e-12);
    assert!(!Workload::prior().is_empty());
    assert_eq!(Workload::from_requests([]), Workload::prior());
}

proptest::proptest! {
    /// Filter's and Prioritize's fast paths for one-slice pods answer exactly as the full
    /// evaluation does: "fits" when it accepts, and the same score.
    #[test]
    fn fast_paths_agree_with_evaluate(
        used in proptest::collection::vec((0u64..=16_000, 0u32..=1000, proptest::bool::ANY), 1..6),
        mem in 0u64..=17_000,
        percent in proptest::prop_oneof![proptest::strategy::Just(0u32), 1u32..=100],
        core in 0u32..=1000,
        cpu in 0u64..=4_000,
        node_cpu in proptest::prop_oneof![proptest::strategy::Just(0u64), 1_000u64..=8_000],
        cpu_used in 0u64..=4_000,
        typed in proptest::bool::ANY,
        spread in proptest::bool::ANY,
    ) {
        let mut n = node(
            used.iter()
                .enumerate()
                .map(|(i, (m, c, healthy))| {
                    // Two sizes, so that a percent of memory depends on the GPU chosen.
                    let mut g = gpu(i as u32, if i % 3 == 2 { 24_000 } else { 16_000 });
                    g.mem_used = *m;
                    g.core_used = *c;
                    g.healthy = *healthy;
                    if i % 2 == 1 {
                        g.model = "Tesla T4".into();
                    }
                    g
                })
                .collect(),
        );
        n.cpu_milli = node_cpu;
        n.cpu_used = cpu_used.min(node_cpu);
        let policy = if spread { Policy::Spread } else { Policy::Binpack };
        let mut r = req(1, if percent > 0 { 0 } else { mem }, policy);
        r.containers[0].mem_percent = percent;
        r.containers[0].core_milli = core;
        r.cpu_milli = cpu;
        if typed {
            r.selector.types = vec!["t4".into()];
        }
        let fast = matches!(fit_node(&n, &r), Fit::Fits);
        proptest::prop_assert_eq!(fast, evaluate(&n, &r).is_ok());
        proptest::prop_assert_eq!(score_node(&n, &r), score_of(evaluate(&n, &r), &r));
    }
}

fn cpu_node(name: &str, gpus: u32, cpu_milli: u64) -> NodeState {
    let mut n = node((0..gpus).map(|i| gpu(i, 16000)).collect());
    n.name = name.into();
    n.cpu_milli = cpu_milli;
    n
}

#[test]
fn strand_expects_only_the_pods_that_can_land_on_the_node() {
    // Pods pinned to T4 bring 32 cores per GPU, unpinned pods 4: an A100 node can only get the
    // unpinned ones, so its demand is 4 cores per GPU; a T4 node's is the mix.
    let pinned = PodShape {
        cpu_milli: 32_000,
        models: vec!["Tesla T4".into()],
        ..shape(1, 1000)
    };
    let any = PodShape {
        cpu_milli: 4000,
        ..shape(1, 1000)
    };
    let w = Workload::from_counts([(pinned, 1), (any, 1)], 1.0);
    let a100 = cpu_node("a", 4, 64_000);
    let mut t4 = cpu_node("t", 4, 64_000);
    for g in &mut t4.gpus {
        g.model = "Tesla T4".into();
    }
    let (da, dt) = (
        strand::Landing::of(&w, &a100)
            .demand
            .expect("unpinned pods fit"),
        strand::Landing::of(&w, &t4).demand.expect("both fit"),
    );
    // 4 GPUs free, 8 cores left: at 4 cores per GPU the A100 node feeds 2 GPUs (2000 stranded);
    // at 18 per GPU the T4 node feeds 8/18 of one.
    assert!((da.stranded(4000, 8000, u64::MAX) - 2000.0).abs() < 1e-6);
    assert!((dt.stranded(4000, 8000, u64::MAX) - (4000.0 - 8000.0 / 18.0)).abs() < 1e-6);
    // A node too small for every GPU shape expects nothing.
    let tiny = cpu_node("x", 4, 2000);
    assert_eq!(strand::Landing::of(&w, &tiny).demand, None);
}

#[test]
fn fgd_strand_keeps_the_cpu_that_a_nodes_gpus_need() {
    // Typical pods: one GPU and 8 cores. A 16-core one-GPU pod fits either idle node; on the
    // 32-core node it leaves 3 GPUs and 16 cores, enough for two typical pods only (1000 GPU
    // stranded); the 128-core node strands nothing. FGD sees no fragmentation either way.
    let typical = PodShape {
        cpu_milli: 8000,
        ..shape(1, 1000)
    };
    let w = Arc::new(Workload::from_counts([(typical, 1)], 1.0));
    let poor = cpu_node("poor", 4, 32_000);
    let rich = cpu_node("rich", 4, 128_000);
    let mut r = share_req(1000, Policy::Fgd, &w);
    r.cpu_milli = 16_000;
    let pick = |policy| {
        let r = PodRequest {
            policy,
            ..r.clone()
        };
        choose_node([&poor, &rich], &r)
            .expect("fits")
            .0
            .name
            .clone()
    };
    assert_eq!(pick(Policy::Fgd), "poor");
    assert_eq!(pick(Policy::FgdStrand), "rich");
    // The extender's 0..=10 sees the difference too.
    let r = PodRequest {
        policy: Policy::FgdStrand,
        ..r.clone()
    };
    assert!(score_node(&rich, &r) >= score_node(&poor, &r));
    let (p, q) = (
        evaluate(&poor, &r).expect("fits").score,
        evaluate(&rich, &r).expect("fits").score,
    );
    assert!(q > p, "rich {q} poor {p}");
}

#[test]
fn fgd_strand_shares_a_gpu_where_the_rest_still_packs() {
    // Typical shares: 0.7. A 0.3 pod on GPU 0 (0.7 free) leaves 0.4 that no typical pod can use;
    // on the idle GPU 1 it leaves 0.7, and on GPU 2 it fills the 0.3 nothing else could use.
    let w = Arc::new(Workload::from_counts([(shape(1, 700), 1)], 1.0));
    let mut n = node(vec![gpu(0, 16000), gpu(1, 16000), gpu(2, 16000)]);
    n.gpus[0].core_used = 300;
    n.gpus[2].core_used = 700;
    let c = evaluate(&n, &share_req(300, Policy::FgdStrand, &w)).expect("fits");
    assert_eq!(c.gpus, vec![vec![1]]);
    n.gpus[1].core_used = 1000;
    let c = evaluate(&n, &share_req(300, Policy::FgdStrand, &w)).expect("fits");
    assert_eq!(c.gpus, vec![vec![2]]);
}

#[test]
fn fgd_strand_puts_pods_without_gpus_where_the_least_gpu_is_free() {
    let w = Arc::new(Workload::from_counts([(shape(1, 500), 1)], 1.0));
    let big = cpu_node("big", 4, 32_000);
    let small = cpu_node("small", 1, 32_000);
    let mut r = req(1, 0, Policy::FgdStrand);
    r.containers.clear();
    r.cpu_milli = 4000;
    r.workload = Some(w);
    assert_eq!(
        choose_node([&big, &small], &r).expect("fits").0.name,
        "small"
    );
}

#[test]
fn gpus_alike_in_free_share_and_model_are_scored_once() {
    let mut n = node((0..6).map(|i| gpu(i, 16000)).collect());
    n.gpus[1].core_used = 300;
    n.gpus[3].core_used = 300;
    n.gpus[4].model = "Tesla T4".into();
    let free: Vec<u32> = n.gpus.iter().map(|g| g.core_free()).collect();
    let kept: Vec<usize> = distinct_gpus(&n, &free, 0..6).collect();
    // GPU 2 and 5 are idle A100s like GPU 0, GPU 3 is GPU 1 again; the idle T4 is new.
    assert_eq!(kept, vec![0, 1, 4]);
}

/// A node of `gpus` A100s with `cpu` cores, of which `cpu_used` taken, and `used` thousandths of
/// compute taken on each GPU (in order).
fn busy_node(used: &[u32], cpu: u64, cpu_used: u64) -> NodeState {
    let mut n = cpu_node("n", used.len() as u32, cpu * 1000);
    for (g, &u) in n.gpus.iter_mut().zip(used) {
        g.core_used = u;
        g.mem_used = u64::from(u) * 16;
    }
    n.cpu_used = cpu_used * 1000;
    n
}

fn mixed_workload() -> Arc<Workload> {
    let cpu = |gpus, core_milli, cpu_milli| PodShape {
        cpu_milli,
        gpus,
        core_milli,
        ..Default::default()
    };
    Arc::new(Workload::from_counts(
        [
            (cpu(1, 1000, 8000), 40),
            (cpu(1, 500, 4000), 30),
            (cpu(1, 250, 2000), 20),
            (cpu(2, 1000, 16_000), 6),
            (cpu(4, 1000, 32_000), 3),
            (cpu(0, 0, 6000), 10),
        ],
        1.0,
    ))
}

proptest::proptest! {
    /// Scoring many nodes remembers the scores of nodes alike: every node still gets exactly
    /// the score it gets alone, under every policy.
    #[test]
    fn remembered_scores_are_the_scores(
        nodes in proptest::collection::vec(
            (proptest::collection::vec(proptest::sample::select(vec![0u32, 500, 1000]), 1..4),
             proptest::sample::select(vec![0u64, 4, 12]), proptest::bool::ANY, proptest::bool::ANY),
            1..24),
        policy in proptest::sample::select(Policy::NAMES.to_vec()),
        slices in 1u32..=2,
        core in proptest::sample::select(vec![250u32, 500, 1000]),
        cpu in proptest::sample::select(vec![0u64, 2000, 8000]),
    ) {
        let nodes: Vec<NodeState> = nodes
            .iter()
            .map(|(used, cpu_used, t4, sick)| {
                let mut n = busy_node(used, 16, *cpu_used);
                n.gpus[0].healthy = !sick;
                if *t4 {
                    n.gpus[0].model = "Tesla T4".into();
                }
                n
            })
            .collect();
        let mut r = req(slices, 1000, policy.parse().expect("known name"));
        r.containers[0].core_milli = core;
        r.cpu_milli = cpu;
        r.workload = Some(mixed_workload());
        let mut score = super::score::scorer(&r);
        for n in &nodes {
            proptest::prop_assert_eq!(score(n), score_node(n, &r));
        }
    }

    /// fgd-strand measures a node against one baseline per decision: its choice and score are
    /// those of a baseline computed afresh, it never takes more than a GPU has, and it decides
    /// the same every time.
    #[test]
    fn fgd_strand_decides_as_from_scratch(
        used in proptest::collection::vec(proptest::sample::select(vec![0u32, 250, 500, 750, 1000]), 1..9),
        cpu_used in 0u64..=32,
        core in proptest::sample::select(vec![100u32, 250, 500, 1000]),
        slices in 1u32..=3,
        cpu in proptest::sample::select(vec![0u64, 2000, 8000, 16_000]),
        two_containers in proptest::bool::ANY,
    ) {
        let n = busy_node(&used, 32, cpu_used);
        let w = mixed_workload();
        let mut r = req(if core < 1000 { 1 } else { slices }, 0, Policy::FgdStrand);
        r.containers[0].core_milli = core;
        if two_containers {
            let mut c = r.containers[0].clone();
            c.name = "d".into();
            r.containers.push(c);
        }
        r.cpu_milli = cpu;
        r.workload = Some(w.clone());
        let Ok(c) = evaluate(&n, &r) else { return Ok(()) };
        proptest::prop_assert_eq!(Ok(c.clone()), evaluate(&n, &r));
        let before: Vec<u32> = n.gpus.iter().map(|g| g.core_free()).collect();
        let mut after = before.clone();
        for (cont, gpus) in r.containers.iter().zip(&c.gpus) {
            let cont = cont.normalized();
            let mut distinct = gpus.clone();
            distinct.sort_unstable();
            distinct.dedup();
            proptest::prop_assert_eq!(distinct.len(), gpus.len());
            for &i in gpus {
                proptest::prop_assert!(after[i] >= cont.core_milli);
                after[i] -= cont.core_milli;
            }
        }
        let start = strand::Start::of(&w, &n, &before);
        let fresh = strand::score(&w, &n, &r, &start, &before, &after);
        proptest::prop_assert!((fresh - c.score).abs() < 1e-9, "{} != {}", fresh, c.score);
    }
}

#[test]
fn blocked_counts_the_free_gpu_one_gpu_shapes_lose_to_cpu() {
    // mixed_workload: one-GPU shapes need 8, 4 and 2 cores (p 0.4, 0.3, 0.2 of 100 pods + 10
    // CPU-only); multi-GPU shapes do not count here.
    let w = mixed_workload();
    // A node with one GPU idle, one half used, two full.
    let free = [1000, 500, 0, 0];
    // 8 cores left: every one-GPU shape still fits.
    assert_eq!(w.cpu_blocked(&free, 8000, u64::MAX), 0.0);
    // 3 cores left: the 8- and 4-core shapes cannot run here; their share of the 1500 free.
    let p = (40.0 + 30.0) / 109.0;
    assert!((w.cpu_blocked(&free, 3000, u64::MAX) - p * 1500.0).abs() < 1e-9);
    // No free GPU, nothing to block.
    assert_eq!(w.cpu_blocked(&[0, 0, 0, 0], 0, 0), 0.0);
}

#[test]
fn fgd_strand_keeps_the_cores_one_gpu_pods_need() {
    // A CPU-only pod of 12 cores on two otherwise alike nodes, each with 1 GPU free: on the
    // 20-core node it leaves 8, enough for every one-GPU shape; on the 16-core node it leaves
    // 4 and blocks the 8-core shape from the free GPU there.
    let w = mixed_workload();
    let mut r = req(1, 0, Policy::FgdStrand);
    r.containers.clear();
    r.cpu_milli = 12_000;
    r.workload = Some(w.clone());
    let tight = busy_node(&[1000, 1000, 1000, 0], 16, 0);
    let roomy = busy_node(&[1000, 1000, 1000, 0], 20, 0);
    let free = [0, 0, 0, 1000];
    assert!(w.cpu_blocked(&free, 4000, u64::MAX) > 0.0);
    assert_eq!(w.cpu_blocked(&free, 8000, u64::MAX), 0.0);
    let s = |n: &NodeState| evaluate(n, &r).expect("fits").score;
    assert!(s(&roomy) > s(&tight), "{} <= {}", s(&roomy), s(&tight));
}

#[test]
fn fgd_strand_tells_nodes_apart_for_an_eight_gpu_pod() {
    // Typical pods: one whole GPU, 0.6 of one, or two GPUs. An 8-GPU pod on an idle 9-GPU node
    // leaves one GPU that the 2-GPU shape cannot use; on an idle 10-GPU node it leaves two that
    // it can. The GPUs the pod itself takes are worth the same on either node and must not
    // drown the difference (eight whole GPUs of value put every node at the floor of FGD's
    // sigmoid).
    let w = Arc::new(Workload::from_counts(
        [(shape(1, 1000), 2), (shape(1, 600), 2), (shape(2, 1000), 1)],
        1.0,
    ));
    assert!(w.gap_values().value(1000) > 0.0);
    let nine = cpu_node("nine", 9, 0);
    let ten = cpu_node("ten", 10, 0);
    let mut r = share_req(1000, Policy::FgdStrand, &w);
    r.containers[0].slices = 8;
    let s = |n: &NodeState| evaluate(n, &r).expect("fits").score;
    assert!(s(&ten) > s(&nine), "{} <= {}", s(&ten), s(&nine));
    assert_eq!(choose_node([&nine, &ten], &r).expect("fits").0.name, "ten");
}

#[test]
fn a_workload_on_a_cluster_knows_which_share_of_its_gpus_can_host_each_shape() {
    let big = PodShape {
        cpu_milli: 120_000,
        ..shape(8, 1000)
    };
    let t4 = PodShape {
        models: vec!["Tesla T4".into()],
        ..shape(1, 1000)
    };
    let any = PodShape {
        cpu_milli: 16_000,
        ..shape(2, 1000)
    };
    let w = Workload::from_counts([(big.clone(), 1), (t4.clone(), 1), (any.clone(), 1)], 1.0);
    let hosts = |w: &Workload, s: &PodShape| {
        w.shapes_with_hosts()
            .find(|(x, _, _)| *x == s)
            .map(|(_, _, h)| h)
            .expect("a typical shape")
    };
    // Unknown cluster: every shape can go anywhere.
    assert_eq!(hosts(&w, &big), 1.0);
    let mut small = cpu_node("t4", 2, 32_000);
    for g in &mut small.gpus {
        g.model = "Tesla T4".into();
    }
    let nodes = [
        cpu_node("rich", 8, 128_000),
        cpu_node("poor", 8, 96_000),
        small,
    ];
    let w = w.on_cluster(&nodes);
    // 18 GPUs: only the 128-core node's 8 host the 120-core pod, the T4 node's 2 the T4 pod.
    assert!((hosts(&w, &big) - 8.0 / 18.0).abs() < 1e-12);
    assert!((hosts(&w, &t4) - 2.0 / 18.0).abs() < 1e-12);
    assert_eq!(hosts(&w, &any), 1.0);
}

#[test]
fn fgd_strand_keeps_the_few_nodes_that_can_host_a_shape_for_it() {
    // One node of ten has the 120 cores that an 8-GPU shape asks for. A 4-GPU pod with 60 cores
    // fits it or an idle 96-core node; on the 128-core node it leaves more cores for the rest,
    // and FGD's weight (the shape's probability alone) lets that win. Weighted by how few GPUs
    // can host the 120-core shape, the pod goes to the 96-core node.
    let with_cpu = |gpus, cpu_milli| PodShape {
        cpu_milli,
        ..shape(gpus, 1000)
    };
    let w = Workload::from_counts(
        [
            (with_cpu(8, 120_000), 1),
            (with_cpu(8, 64_000), 2),
            (with_cpu(4, 60_000), 2),
            (with_cpu(4, 32_000), 2),
            (with_cpu(1, 12_000), 8),
        ],
        1.0,
    );
    let rich = cpu_node("rich", 8, 128_000);
    let mut cluster = vec![rich.clone()];
    cluster.extend((0..9).map(|i| cpu_node(&format!("poor{i}"), 8, 96_000)));
    let mut r = share_req(1000, Policy::FgdStrand, &Arc::new(w.clone()));
    r.containers[0].slices = 4;
    r.cpu_milli = 60_000;
    let pick = |w: Workload| {
        let r = PodRequest {
            workload: Some(Arc::new(w)),
            ..r.clone()
        };
        choose_node([&rich, &cluster[1]], &r)
            .expect("fits")
            .0
            .name
            .clone()
    };
    assert_eq!(
        pick(w.clone()),
        "rich",
        "without the cluster, the richer node wins"
    );
    assert_eq!(pick(w.on_cluster(&cluster)), "poor0");
}

#[test]
fn fgd_strand_leaves_a_small_pool_to_the_pods_pinned_to_it() {
    // A fifth of the one-GPU pods must run on T4, and one node of nine has T4s. A pod that can
    // run anywhere scores the same on an idle T4 node and an idle A100 node while the cluster is
    // unknown (the first wins); on the cluster, the T4 node is short for its pinned pods and the
    // pod goes to the A100 node.
    let pinned = PodShape {
        models: vec!["Tesla T4".into()],
        ..shape(1, 1000)
    };
    let w = Workload::from_counts([(shape(1, 1000), 4), (pinned, 1)], 1.0);
    let mut t4 = cpu_node("t4", 4, 64_000);
    for g in &mut t4.gpus {
        g.model = "Tesla T4".into();
    }
    let mut cluster = vec![t4.clone()];
    cluster.extend((0..8).map(|i| cpu_node(&format!("a100-{i}"), 4, 64_000)));
    let pick = |w: Workload| {
        let r = share_req(1000, Policy::FgdStrand, &Arc::new(w));
        choose_node([&t4, &cluster[1]], &r)
            .expect("fits")
            .0
            .name
            .clone()
    };
    assert_eq!(pick(w.clone()), "t4", "without the cluster, a tie");
    assert_eq!(pick(w.on_cluster(&cluster)), "a100-0");
}

#[test]
fn first_fit_takes_the_lowest_gpus_with_room_and_the_policy_scores_that_choice() {
    let w = Arc::new(Workload::from_counts([(shape(1, 500), 1)], 1.0));
    let mut n = node(vec![gpu(0, 16000), gpu(1, 16000), gpu(2, 16000)]);
    n.gpus[0].core_used = 800;
    n.gpus[1].core_used = 300;
    // A 0.4 pod: GPU 0 has no room; first fit takes GPU 1 where FGD takes the idle GPU 2
    // (on GPU 1 it leaves 300, where no 0.5 fits).
    let r = share_req(400, Policy::Fgd, &w);
    assert_eq!(evaluate(&n, &r).expect("fits").gpus, vec![vec![2]]);
    let ff = evaluate_with(&n, &r, DeviceChoice::FirstFit).expect("fits");
    assert_eq!(ff.gpus, vec![vec![1]]);
    // The node's score is FGD's score of GPU 1, which fragments more: lower than GPU 2's.
    assert!(ff.score < evaluate(&n, &r).expect("fits").score, "{ff:?}");
    // Two slices: the first two GPUs with room, in index order.
    let mut two = req(2, 4000, Policy::Spread);
    two.containers[0].core_milli = 200;
    assert_eq!(
        evaluate_with(&n, &two, DeviceChoice::FirstFit)
            .expect("fits")
            .gpus,
        vec![vec![0, 1]]
    );
    n.gpus[0].core_used = 900;
    assert_eq!(
        evaluate_with(&n, &two, DeviceChoice::FirstFit)
            .expect("fits")
            .gpus,
        vec![vec![1, 2]]
    );
    // The same refusals as the policy's own choice.
    n.gpus[1].core_used = 900;
    assert!(evaluate_with(&n, &two, DeviceChoice::FirstFit).is_err());
}
