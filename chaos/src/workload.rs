//! The workloads of the demo and the chaos run: pod mixes, pods from the openb trace, and an
//! arrival stream into the fake API server.

use std::sync::Arc;
use std::time::Duration;

use gpuledger_testkit::cluster::pod_json;
use gpuledger_testkit::kube::store::Store;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio_util::sync::{CancellationToken, DropGuard};

/// One pod of a local-cluster workload.
#[derive(Debug, Clone)]
pub struct PodSpec {
    /// Pod name (namespace `default`).
    pub name: String,
    /// Container limits: resource name and quantity.
    pub resources: Vec<(&'static str, String)>,
    /// How long its container runs.
    pub secs: f64,
}

/// Sizes seen in shared inference/training clusters: mostly small slices, some whole GPUs;
/// some pods written for gpushare or HAMi (as the admission webhook admits them: their own
/// resource names plus `gpuledger.io/gpu: 1`).
pub fn mixed_pods(n: usize, seed: u64) -> Vec<PodSpec> {
    let mut rng = StdRng::seed_from_u64(seed);
    let shapes: [(u64, u32, u32, u32); 7] = [
        // (mem MiB, core %, slices, weight); mem 0 = a whole GPU
        (2_048, 10, 1, 25),
        (4_096, 20, 1, 25),
        (8_192, 30, 1, 20),
        (12_288, 50, 1, 12),
        (20_480, 50, 1, 8),
        (0, 100, 1, 6),
        (6_144, 50, 2, 4),
    ];
    let total: u32 = shapes.iter().map(|s| s.3).sum();
    (0..n)
        .map(|i| {
            let mut pick = rng.random_range(0..total);
            let mut s = shapes[0];
            for x in shapes {
                if pick < x.3 {
                    s = x;
                    break;
                }
                pick -= x.3;
            }
            let (mem, core, slices, _) = s;
            let style = rng.random_range(0..10);
            let resources: Vec<(&'static str, String)> = if mem == 0 {
                vec![
                    ("gpuledger.io/gpu", "1".into()),
                    ("gpuledger.io/gpu-mem-percent", "100".into()),
                    ("gpuledger.io/gpu-core", "100".into()),
                ]
            } else if slices == 1 && style == 0 && mem % 1024 == 0 {
                // gpushare: GiB.
                vec![
                    ("aliyun.com/gpu-mem", (mem / 1024).to_string()),
                    ("gpuledger.io/gpu", "1".into()),
                ]
            } else if slices == 1 && style == 1 {
                // HAMi: MiB and percent of compute.
                vec![
                    ("nvidia.com/gpumem", mem.to_string()),
                    ("nvidia.com/gpucores", core.to_string()),
                    ("gpuledger.io/gpu", "1".into()),
                ]
            } else {
                vec![
                    ("gpuledger.io/gpu", slices.to_string()),
                    ("gpuledger.io/gpu-mem", mem.to_string()),
                    ("gpuledger.io/gpu-core", core.to_string()),
                ]
            };
            PodSpec {
                name: format!("job-{i:03}"),
                resources,
                secs: rng.random_range(1_500..6_000) as f64 / 1000.0,
            }
        })
        .collect()
}

/// The arrival stream: create `pods` in the API server (namespace `default`) in order, while
/// fewer than `max_pending` pods wait to be scheduled, until all are created or the returned
/// guard is dropped.
pub fn feed(store: Arc<Store>, pods: Vec<PodSpec>, max_pending: usize) -> DropGuard {
    let max_pending = max_pending.max(1);
    let stop = CancellationToken::new();
    tokio::spawn(stop.clone().run_until_cancelled_owned(async move {
        for p in pods {
            loop {
                let pending = store
                    .objects("v1", "pods")
                    .iter()
                    .filter(|x| !x["spec"]["nodeName"].is_string())
                    .count();
                if pending < max_pending {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let body = pod_json(&p.name, &p.resources, p.secs);
            if let Err(e) = store.create("v1", "pods", "default", body) {
                anyhow::bail!("creating pod {}: {}", p.name, e.message());
            }
        }
        Ok(())
    }));
    stop.drop_guard()
}

/// Pods of the openb trace file `path` (`openb_pod_list_*.csv`): `n` GPU pods in creation
/// order, starting at a place chosen by `seed`, each with the trace's GPU count and share
/// (`gpu_milli` as percent of the GPU's memory and compute; whole GPUs for multi-GPU pods)
/// and its lifetime divided by `time_scale` (trace seconds per second, kept within
/// 0.5–12 s). Pods asking more GPUs than `max_gpus` (what one node has) are left out; how
/// many is the second value.
pub fn trace_pods(
    path: &std::path::Path,
    n: usize,
    seed: u64,
    time_scale: f64,
    max_gpus: u32,
) -> anyhow::Result<(Vec<PodSpec>, usize)> {
    let mut rows = gpuledger_trace::read_pods(path)?;
    rows.retain(|r| r.num_gpu > 0);
    let too_big = rows.iter().filter(|r| r.num_gpu > max_gpus).count();
    rows.retain(|r| r.num_gpu <= max_gpus);
    anyhow::ensure!(
        !rows.is_empty(),
        "{}: no GPU pod fits a node of {max_gpus} GPUs",
        path.display()
    );
    anyhow::ensure!(time_scale > 0.0, "--time-scale must be positive");
    rows.sort_by_key(|r| r.created_s);
    let start = StdRng::seed_from_u64(seed).random_range(0..rows.len());
    let pods = (0..n)
        .map(|i| {
            let r = &rows[(start + i) % rows.len()];
            let pct = r.gpu_milli.div_ceil(10).clamp(1, 100).to_string();
            let life = r.lifetime_s.unwrap_or(600) as f64 / time_scale;
            PodSpec {
                name: format!("{}-{i}", r.name),
                resources: vec![
                    ("gpuledger.io/gpu", r.num_gpu.to_string()),
                    ("gpuledger.io/gpu-mem-percent", pct.clone()),
                    ("gpuledger.io/gpu-core", pct),
                ],
                secs: life.clamp(0.5, 12.0),
            }
        })
        .collect();
    Ok((pods, too_big))
}
