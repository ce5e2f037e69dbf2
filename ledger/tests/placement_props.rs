//! Properties of the FGD family of policies over random clusters and pod sequences: a placement
//! never breaks a node's invariants, and the same inputs place the same way.

use std::sync::Arc;

use gpuledger_ledger::placement::{ContainerPlacement, PodShape, Workload, choose_node};
use gpuledger_ledger::{
    CORE_MILLI_PER_GPU, ContainerRequest, GpuState, NodeState, PodRequest, Policy,
};
use proptest::prelude::*;

const MODELS: [&str; 3] = ["A100", "T4", "V100"];

fn cluster(spec: &[(u32, u64, usize)]) -> Vec<NodeState> {
    spec.iter()
        .enumerate()
        .map(|(k, &(gpus, cpu, model))| NodeState {
            mode: Default::default(),
            isolation: String::new(),
            dra_cores: String::new(),
            name: format!("n{k}"),
            gpus: (0..gpus)
                .map(|i| GpuState {
                    uuid: format!("n{k}-g{i}"),
                    index: i,
                    model: MODELS[model].into(),
                    memory_mib: 16_384,
                    healthy: true,
                    compute_capability: String::new(),
                    mem_used: 0,
                    core_used: 0,
                    holders: 0,
                })
                .collect(),
            cpu_milli: cpu,
            memory_mib: 0,
            cpu_used: 0,
            memory_used: 0,
            allocs: Default::default(),
            devices: Default::default(),
            pod_kinds: Default::default(),
        })
        .collect()
}

/// A pod: (GPUs, share per GPU in thousandths, CPU millicores, pinned model or none).
type Pod = (u32, u32, u64, Option<usize>);

fn request(p: &Pod, k: usize, policy: Policy, w: &Arc<Workload>) -> PodRequest {
    let &(gpus, core, cpu, model) = p;
    let mut r = PodRequest {
        containers: if gpus == 0 {
            Vec::new()
        } else {
            vec![ContainerRequest {
                name: "c".into(),
                slices: gpus,
                core_milli: if gpus > 1 { CORE_MILLI_PER_GPU } else { core },
                ..Default::default()
            }]
        },
        cpu_milli: cpu,
        policy,
        workload: Some(w.clone()),
        ..Default::default()
    };
    r.pod.name = format!("p{k}");
    if let Some(m) = model {
        r.selector.models = vec![MODELS[m].into()];
    }
    r
}

fn workload(pods: &[Pod]) -> Arc<Workload> {
    Arc::new(Workload::from_counts(
        pods.iter().map(|&(gpus, core, cpu, model)| {
            (
                PodShape {
                    cpu_milli: cpu,
                    memory_mib: 0,
                    gpus,
                    core_milli: if gpus > 1 { CORE_MILLI_PER_GPU } else { core },
                    models: model
                        .map(|m| vec![MODELS[m].to_string()])
                        .unwrap_or_default(),
                },
                1,
            )
        }),
        0.95,
    ))
}

/// Where a pod went: its node and shares, or nowhere.
type Placed = Option<(String, Vec<ContainerPlacement>)>;

/// Place every pod in turn, applying each placement to the cluster; the node and placement of each.
fn place_all(
    nodes: &mut [NodeState],
    pods: &[Pod],
    policy: Policy,
) -> Result<Vec<Placed>, TestCaseError> {
    let w = workload(pods);
    let mut out = Vec::new();
    for (k, p) in pods.iter().enumerate() {
        let r = request(p, k, policy, &w);
        let Some((n, placed)) = choose_node(nodes.iter(), &r) else {
            out.push(None);
            continue;
        };
        let name = n.name.clone();
        let at = nodes
            .iter()
            .position(|x| x.name == name)
            .expect("chosen from these");
        let node = &mut nodes[at];
        let shares: Vec<_> = placed.iter().flat_map(|c| c.shares.iter()).collect();
        prop_assert_eq!(shares.len() as u32, p.0, "one share per GPU asked");
        let mut seen = Vec::new();
        for s in &shares {
            prop_assert!(!seen.contains(&s.gpu_uuid), "a GPU twice in one pod");
            seen.push(s.gpu_uuid.clone());
            let g = node
                .gpus
                .iter_mut()
                .find(|g| g.uuid == s.gpu_uuid)
                .expect("its GPU");
            if let Some(m) = p.3 {
                prop_assert_eq!(g.model.as_str(), MODELS[m], "pinned model");
            }
            g.core_used += s.core_milli;
            prop_assert!(g.core_used <= CORE_MILLI_PER_GPU, "GPU over capacity");
        }
        node.cpu_used += p.2;
        prop_assert!(node.cpu_used <= node.cpu_milli, "node CPU over capacity");
        out.push(Some((name, placed)));
    }
    Ok(out)
}

fn pods() -> impl Strategy<Value = Vec<Pod>> {
    prop::collection::vec(
        (
            prop_oneof![Just(0u32), Just(1), Just(1), Just(2), Just(4)],
            prop_oneof![Just(1000u32), 100u32..=1000],
            0u64..=16_000,
            prop_oneof![Just(None), Just(None), (0usize..3).prop_map(Some)],
        ),
        1..60,
    )
}

fn nodes() -> impl Strategy<Value = Vec<(u32, u64, usize)>> {
    prop::collection::vec((1u32..=8, 8_000u64..=96_000, 0usize..3), 1..10)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// fgd-strand (and FGD, for comparison) never puts a pod where it does not fit, and the
    /// same cluster and pods always place the same way.
    #[test]
    fn fgd_strand_keeps_invariants_and_is_deterministic(spec in nodes(), pods in pods()) {
        for policy in [Policy::Fgd, Policy::FgdStrand] {
            let mut a = cluster(&spec);
            let first = place_all(&mut a, &pods, policy)?;
            let mut b = cluster(&spec);
            let again = place_all(&mut b, &pods, policy)?;
            prop_assert_eq!(first, again);
        }
    }
}
