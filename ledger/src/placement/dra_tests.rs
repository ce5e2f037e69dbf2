//! DRA requests: only DRA nodes fit, the GPU is kube-scheduler's first fit, and the ledger
//! refuses a first-fit GPU it would not grant.

use super::tests::gpu;
use super::*;
use crate::state::GpuState;

/// A node of `mode` with `gpus` (the placement tests' node, whose GPUs are A100s).
fn node(mode: pb::NodeMode, gpus: Vec<GpuState>) -> NodeState {
    NodeState {
        mode,
        ..super::tests::node(gpus)
    }
}

fn req(slices: u32, mem: u64, core: u32, policy: Policy, dra: bool) -> PodRequest {
    PodRequest {
        pod: pb::PodRef {
            uid: "u".into(),
            namespace: "ns".into(),
            name: "p".into(),
        },
        containers: vec![ContainerRequest {
            name: "c0".into(),
            slices,
            mem_mib: mem,
            core_milli: core,
            ..Default::default()
        }],
        policy,
        dra,
        ..Default::default()
    }
}

fn uuids(p: &[ContainerPlacement]) -> Vec<&str> {
    p[0].shares.iter().map(|s| s.gpu_uuid.as_str()).collect()
}

#[test]
fn a_dra_pod_fits_dra_nodes_only_and_a_device_plugin_pod_the_others() {
    let dp = node(pb::NodeMode::DevicePlugin, vec![gpu(0, 24000)]);
    let dra = node(pb::NodeMode::Dra, vec![gpu(0, 24000)]);
    let r = req(1, 3000, 300, Policy::Binpack, true);
    assert_eq!(fit_node(&dp, &r), Fit::Never(DEVICE_PLUGIN_NODE.into()));
    assert_eq!(fit_node(&dra, &r), Fit::Fits);
    let r = req(1, 3000, 300, Policy::Binpack, false);
    assert_eq!(fit_node(&dra, &r), Fit::Never(DRA_NODE.into()));
    assert_eq!(fit_node(&dp, &r), Fit::Fits);
}

#[test]
fn first_fit_takes_the_lowest_index_with_room_whatever_the_policy() {
    // Registered out of index order: first fit follows the index, not the list.
    let mut n = node(
        pb::NodeMode::Dra,
        vec![gpu(2, 24000), gpu(0, 24000), gpu(1, 24000)],
    );
    // Index 0 is nearly full: binpack would take it for 1000 MiB, first fit skips it for 3000.
    n.gpus[1].mem_used = 22000;
    for policy in [Policy::Binpack, Policy::Spread, Policy::FgdStrand] {
        let p = place_on_node(&n, &req(1, 3000, 300, policy, true)).expect("fits");
        assert_eq!(uuids(&p), ["GPU-1"], "{policy}");
        let p = place_on_node(&n, &req(1, 1000, 300, policy, true)).expect("fits");
        assert_eq!(uuids(&p), ["GPU-0"], "{policy}");
    }
    // The device-plugin path's spread takes the emptiest, for contrast.
    n.mode = pb::NodeMode::DevicePlugin;
    let p = place_on_node(&n, &req(1, 1000, 300, Policy::Spread, false)).expect("fits");
    assert_ne!(uuids(&p), ["GPU-0"]);
    // Two slices: the first two distinct GPUs with room.
    n.mode = pb::NodeMode::Dra;
    let p = place_on_node(&n, &req(2, 3000, 300, Policy::Binpack, true)).expect("fits");
    assert_eq!(uuids(&p), ["GPU-1", "GPU-2"]);
}

#[test]
fn first_fit_passes_an_unhealthy_gpu_by_as_the_scheduler_passes_its_taint() {
    let mut n = node(pb::NodeMode::Dra, vec![gpu(0, 24000), gpu(1, 24000)]);
    n.gpus[0].healthy = false;
    let p = place_on_node(&n, &req(1, 3000, 300, Policy::Binpack, true)).expect("fits");
    assert_eq!(uuids(&p), ["GPU-1"]);
    n.gpus[1].healthy = false;
    match fit_node(&n, &req(1, 3000, 300, Policy::Binpack, true)) {
        Fit::Wait(why) => {
            assert!(why.contains("healthy GPUs, node has 0"), "{why}")
        }
        other => panic!("expected no fit, got {other:?}"),
    }
}

#[test]
fn a_first_fit_gpu_the_ledger_would_refuse_fails_the_node() {
    let mut n = node(pb::NodeMode::Dra, vec![gpu(0, 24000), gpu(1, 24000)]);
    let mut r = req(1, 3000, 300, Policy::Binpack, true);
    r.selector.uuids_exclude = vec!["GPU-0".into()];
    match fit_node(&n, &r) {
        Fit::Wait(why) => assert!(why.contains("GPU-0") && why.contains("selectors"), "{why}"),
        other => panic!("expected Wait, got {other:?}"),
    }
    // No GPU with room: Wait, naming the shortfall.
    n.gpus[0].core_used = 900;
    n.gpus[1].core_used = 900;
    assert!(matches!(
        fit_node(&n, &req(1, 3000, 300, Policy::Binpack, true)),
        Fit::Wait(_)
    ));
}

#[test]
fn prioritize_scores_the_first_fit_gpu() {
    // a: GPU 0 has 30% compute left, which first fit fills exactly. b: the partly used GPU is
    // index 1, so first fit breaks into the idle GPU 0 and leaves two fragments.
    let mut a = node(pb::NodeMode::Dra, vec![gpu(0, 24000), gpu(1, 24000)]);
    let mut b = a.clone();
    b.name = "n2".into();
    a.gpus[0].core_used = 700;
    a.gpus[0].mem_used = 1000;
    b.gpus[1].core_used = 700;
    b.gpus[1].mem_used = 1000;
    let r = req(1, 1000, 300, Policy::Fgd, true);
    let (ca, cb) = (
        evaluate(&a, &r).expect("fits"),
        evaluate(&b, &r).expect("fits"),
    );
    assert_eq!(
        (ca.gpus.clone(), cb.gpus.clone()),
        (vec![vec![0]], vec![vec![0]])
    );
    assert!(
        ca.score > cb.score,
        "fgd: a {} should beat b {}",
        ca.score,
        cb.score
    );
    // Choosing by the policy (device plugin), FGD fills the partly used GPU on both: a tie.
    a.mode = pb::NodeMode::DevicePlugin;
    b.mode = pb::NodeMode::DevicePlugin;
    let r = req(1, 1000, 300, Policy::Fgd, false);
    let (da, db) = (
        evaluate(&a, &r).expect("fits"),
        evaluate(&b, &r).expect("fits"),
    );
    assert_eq!(db.gpus, vec![vec![1]]);
    assert_eq!(da.score, db.score);
}

#[test]
fn a_node_of_the_other_mode_scores_zero() {
    let dp = node(pb::NodeMode::DevicePlugin, vec![gpu(0, 24000)]);
    let dra = node(pb::NodeMode::Dra, vec![gpu(0, 24000)]);
    for policy in [Policy::Binpack, Policy::Spread, Policy::Fgd] {
        assert_eq!(
            score_node(&dp, &req(1, 3000, 300, policy, true)),
            0,
            "{policy}"
        );
        assert_eq!(
            score_node(&dra, &req(1, 3000, 300, policy, false)),
            0,
            "{policy}"
        );
        assert!(
            score_node(&dra, &req(1, 3000, 300, policy, true)) > 0,
            "{policy}"
        );
    }
    // Scoring many nodes never lends a node's score to an alike node of the other mode.
    let r = req(1, 3000, 300, Policy::Binpack, true);
    let mut score = super::score::scorer(&r);
    assert!(score(&dra) > 0);
    assert_eq!(score(&dp), 0);
}
