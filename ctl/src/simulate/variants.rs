//! Seeded variants of a pod list, made the way the openb traces of Weng et al. (ATC '23) differ
//! from their default list: more GPU-sharing pods, more multi-GPU pods, pods pinned to GPU models,
//! more or fewer CPU-only pods.
//!
//! A variant keeps the base list's pod sizes (CPU, memory, GPUs, share) and only changes how many
//! pods of each kind there are, by sampling the base's pods of that kind with replacement: the
//! published `gpushare100` list is made this way (its CPU-only pods are the default's, its GPU
//! pods are the default's sharing pods sampled to the default's count of GPU pods).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use anyhow::bail;
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};

use gpuledger_trace::{NodeRow, PodRow};

/// What a variant changes in the base pod list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// `gpushare-X`: X % of the GPU pods share a GPU (the base's sharing pods, resampled); the
    /// rest are the base's whole- and multi-GPU pods.
    GpuShare,
    /// `multigpu-X`: X % of the GPU pods ask for several GPUs.
    MultiGpu,
    /// `gpuspec-X`: X % of the GPU pods are pinned to GPU models, chosen in proportion to the
    /// cluster's GPUs of each model among those whose nodes can host the pod (a third of them
    /// accept a second model).
    GpuSpec,
    /// `gpuspec-rare-X`: as `gpuspec-X`, but every model the pod fits is equally likely, so small
    /// GPU pools are asked for as often as large ones.
    GpuSpecRare,
    /// `cpu-X`: X % of the base's count of CPU-only pods (0 removes them, 200 doubles them).
    CpuOnly,
}

/// One named variant: a kind and its percentage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Variant {
    /// What changes.
    pub kind: Kind,
    /// How much (percent).
    pub pct: u32,
}

/// The variants `--trace all` runs, besides the two published lists.
pub const STANDARD: &[&str] = &[
    "gpushare-20",
    "gpushare-40",
    "gpushare-60",
    "gpushare-80",
    "multigpu-20",
    "multigpu-30",
    "multigpu-50",
    "gpuspec-10",
    "gpuspec-20",
    "gpuspec-33",
    "gpuspec-rare-20",
    "cpu-0",
    "cpu-50",
    "cpu-200",
    "cpu-300",
];

impl Kind {
    fn prefix(self) -> &'static str {
        match self {
            Kind::GpuShare => "gpushare",
            Kind::MultiGpu => "multigpu",
            Kind::GpuSpec => "gpuspec",
            Kind::GpuSpecRare => "gpuspec-rare",
            Kind::CpuOnly => "cpu",
        }
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.kind.prefix(), self.pct)
    }
}

impl FromStr for Variant {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim().to_ascii_lowercase();
        let Some((prefix, pct)) = s.rsplit_once('-') else {
            return Err(format!(
                "{s:?} is not a variant (gpushare-X, multigpu-X, gpuspec-X, gpuspec-rare-X, cpu-X)"
            ));
        };
        let kind = match prefix {
            "gpushare" => Kind::GpuShare,
            "multigpu" => Kind::MultiGpu,
            "gpuspec" => Kind::GpuSpec,
            "gpuspec-rare" => Kind::GpuSpecRare,
            "cpu" => Kind::CpuOnly,
            other => {
                return Err(format!(
                    "unknown variant kind {other:?} (gpushare, multigpu, gpuspec, gpuspec-rare, cpu)"
                ));
            }
        };
        let pct: u32 = pct
            .parse()
            .map_err(|_| format!("{s:?}: {pct:?} is not a whole percentage"))?;
        let max = if kind == Kind::CpuOnly { 1000 } else { 100 };
        if pct > max {
            return Err(format!("{s:?}: the percentage is at most {max}"));
        }
        Ok(Variant { kind, pct })
    }
}

/// The pod classes a variant resamples.
fn is_sharing(p: &PodRow) -> bool {
    p.num_gpu == 1 && p.gpu_milli < 1000
}

/// The pod list of `variant`, from `base` on the cluster `nodes`, drawn from `seed`.
///
/// Pods are renamed `<variant>-pod-NNNNN` in a seeded order, so that the simulator's own
/// shuffles stay the only source of arrival order. Fails when the base has no pod of a kind the
/// variant needs.
pub fn generate(
    base: &[PodRow],
    nodes: &[NodeRow],
    variant: Variant,
    seed: u64,
) -> anyhow::Result<Vec<PodRow>> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x007E_41A7);
    let cpu_only: Vec<&PodRow> = base.iter().filter(|p| p.num_gpu == 0).collect();
    let gpu: Vec<&PodRow> = base.iter().filter(|p| p.num_gpu > 0).collect();
    let share = |pct: u32, n: usize| (u64::from(pct) * n as u64).div_ceil(100) as usize;
    let mut pods: Vec<PodRow> = match variant.kind {
        Kind::GpuShare | Kind::MultiGpu => {
            let is_a: fn(&PodRow) -> bool = if variant.kind == Kind::GpuShare {
                is_sharing
            } else {
                |p| p.num_gpu > 1
            };
            let (a, b): (Vec<&PodRow>, Vec<&PodRow>) = gpu.iter().partition(|p| is_a(p));
            let want_a = share(variant.pct, gpu.len());
            let want_b = gpu.len() - want_a;
            for (pool, want) in [(&a, want_a), (&b, want_b)] {
                if want > 0 && pool.is_empty() {
                    bail!("{variant}: the base pod list has no pod of the kind it needs");
                }
            }
            let mut out: Vec<PodRow> = cpu_only.iter().map(|&p| p.clone()).collect();
            out.extend((0..want_a).map(|_| (*a.choose(&mut rng).expect("not empty")).clone()));
            out.extend((0..want_b).map(|_| (*b.choose(&mut rng).expect("not empty")).clone()));
            out
        }
        Kind::CpuOnly => {
            let want = share(variant.pct, cpu_only.len());
            if want > 0 && cpu_only.is_empty() {
                bail!("{variant}: the base pod list has no CPU-only pod");
            }
            let mut out: Vec<PodRow> = gpu.iter().map(|&p| p.clone()).collect();
            out.extend((0..want).map(|_| (*cpu_only.choose(&mut rng).expect("not empty")).clone()));
            out
        }
        Kind::GpuSpec | Kind::GpuSpecRare => {
            let mut out: Vec<PodRow> = base.to_vec();
            let mut idx: Vec<usize> = (0..out.len()).filter(|&i| out[i].num_gpu > 0).collect();
            idx.shuffle(&mut rng);
            idx.truncate(share(variant.pct, idx.len()));
            let pools = model_pools(nodes);
            for i in idx {
                out[i].gpu_spec = pin(&out[i], &pools, variant.kind, &mut rng);
            }
            out
        }
    };
    pods.shuffle(&mut rng);
    for (i, p) in pods.iter_mut().enumerate() {
        p.name = format!("{variant}-pod-{i:05}");
    }
    Ok(pods)
}

/// Per GPU model: its GPUs in the cluster and the node shapes (GPUs, CPU, memory) that carry it.
type Pools<'a> = BTreeMap<&'a str, (u64, Vec<(u32, u64, u64)>)>;

fn model_pools(nodes: &[NodeRow]) -> Pools<'_> {
    let mut pools: Pools<'_> = BTreeMap::new();
    for n in nodes.iter().filter(|n| n.gpus > 0) {
        let e = pools.entry(n.model.as_str()).or_default();
        e.0 += u64::from(n.gpus);
        let shape = (n.gpus, n.cpu_milli, n.memory_mib);
        if !e.1.contains(&shape) {
            e.1.push(shape);
        }
    }
    pools
}

/// GPU models for one pod: one model its size fits on an empty node of, weighted by the model's
/// GPUs (or uniformly), and a third of the time a second one. Unpinned if none fits.
fn pin(p: &PodRow, pools: &Pools<'_>, kind: Kind, rng: &mut StdRng) -> Vec<String> {
    let mut fits: Vec<(&str, u64)> = pools
        .iter()
        .filter(|(_, (_, shapes))| {
            shapes
                .iter()
                .any(|&(g, c, m)| g >= p.num_gpu && c >= p.cpu_milli && m >= p.memory_mib)
        })
        .map(|(&model, &(gpus, _))| (model, if kind == Kind::GpuSpec { gpus } else { 1 }))
        .collect();
    let mut spec = Vec::new();
    for k in 0..2 {
        if fits.is_empty() || (k == 1 && !rng.random_ratio(1, 3)) {
            break;
        }
        let total: u64 = fits.iter().map(|f| f.1).sum();
        let mut x = rng.random_range(0..total);
        let at = fits
            .iter()
            .position(|f| {
                if x < f.1 {
                    true
                } else {
                    x -= f.1;
                    false
                }
            })
            .expect("x < total");
        spec.push(fits.remove(at).0.to_string());
    }
    spec.sort();
    spec
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, num_gpu: u32, gpu_milli: u32, cpu_milli: u64) -> PodRow {
        PodRow {
            name: name.into(),
            cpu_milli,
            memory_mib: 1024,
            num_gpu,
            gpu_milli,
            gpu_spec: Vec::new(),
            created_s: 0,
            lifetime_s: None,
        }
    }

    fn nodes() -> Vec<NodeRow> {
        let n = |name: &str, gpus, cpu, model: &str| NodeRow {
            name: name.into(),
            cpu_milli: cpu,
            memory_mib: 262_144,
            gpus,
            model: model.into(),
        };
        vec![
            n("a", 8, 96_000, "G2"),
            n("b", 8, 96_000, "G2"),
            n("c", 2, 104_000, "T4"),
            n("d", 1, 8_000, "P100"),
        ]
    }

    fn base() -> Vec<PodRow> {
        let mut v = Vec::new();
        for i in 0..40 {
            v.push(pod(&format!("s{i}"), 1, 100 + 20 * i, 4000));
        }
        for i in 0..50 {
            v.push(pod(&format!("w{i}"), 1, 1000, 8000));
        }
        for i in 0..10 {
            v.push(pod(&format!("m{i}"), 2 + (i % 3) * 2, 1000, 16_000));
        }
        for i in 0..20u32 {
            v.push(pod(&format!("c{i}"), 0, 0, 2000 + 1000 * u64::from(i)));
        }
        v
    }

    #[test]
    fn names_parse_and_print_back() {
        for name in STANDARD {
            let v: Variant = name.parse().expect("standard name");
            assert_eq!(v.to_string(), *name);
        }
        assert!("gpushare-101".parse::<Variant>().is_err());
        assert!("gpushare".parse::<Variant>().is_err());
        assert!("share-20".parse::<Variant>().is_err());
        assert!("cpu-x".parse::<Variant>().is_err());
        assert_eq!(
            "cpu-300".parse::<Variant>(),
            Ok(Variant {
                kind: Kind::CpuOnly,
                pct: 300
            })
        );
    }

    #[test]
    fn gpushare_sets_the_share_of_sharing_pods_and_keeps_the_rest() {
        let base = base();
        let v = generate(&base, &nodes(), "gpushare-80".parse().expect("name"), 1).expect("ok");
        let gpu = v.iter().filter(|p| p.num_gpu > 0).count();
        assert_eq!(gpu, 100);
        assert_eq!(v.iter().filter(|p| is_sharing(p)).count(), 80);
        assert_eq!(v.iter().filter(|p| p.num_gpu == 0).count(), 20);
        // Every pod is a base pod's size.
        let sizes = |p: &PodRow| (p.cpu_milli, p.memory_mib, p.num_gpu, p.gpu_milli);
        assert!(v.iter().all(|p| base.iter().any(|b| sizes(b) == sizes(p))));
    }

    #[test]
    fn multigpu_and_cpu_only_counts() {
        let base = base();
        let v = generate(&base, &nodes(), "multigpu-50".parse().expect("name"), 1).expect("ok");
        assert_eq!(v.iter().filter(|p| p.num_gpu > 1).count(), 50);
        assert_eq!(v.iter().filter(|p| p.num_gpu > 0).count(), 100);
        let v = generate(&base, &nodes(), "cpu-250".parse().expect("name"), 1).expect("ok");
        assert_eq!(v.iter().filter(|p| p.num_gpu == 0).count(), 50);
        assert_eq!(v.iter().filter(|p| p.num_gpu > 0).count(), 100);
        let v = generate(&base, &nodes(), "cpu-0".parse().expect("name"), 1).expect("ok");
        assert_eq!(v.len(), 100);
    }

    #[test]
    fn gpuspec_pins_only_to_models_that_can_host_the_pod() {
        let base = base();
        for name in ["gpuspec-33", "gpuspec-rare-100"] {
            let v = generate(&base, &nodes(), name.parse().expect("name"), 3).expect("ok");
            let pinned: Vec<&PodRow> = v.iter().filter(|p| !p.gpu_spec.is_empty()).collect();
            let want = if name == "gpuspec-33" { 33 } else { 100 };
            assert_eq!(pinned.len(), want, "{name}");
            for p in pinned {
                assert!(p.num_gpu > 0);
                for m in &p.gpu_spec {
                    assert!(
                        nodes().iter().any(|n| &n.model == m
                            && n.gpus >= p.num_gpu
                            && n.cpu_milli >= p.cpu_milli),
                        "{name}: {p:?} pinned to {m}, which cannot host it"
                    );
                }
            }
        }
    }

    #[test]
    fn same_seed_same_list_other_seed_other_list() {
        let base = base();
        let v: Variant = "gpushare-40".parse().expect("name");
        let a = generate(&base, &nodes(), v, 7).expect("ok");
        assert_eq!(a, generate(&base, &nodes(), v, 7).expect("ok"));
        assert_ne!(a, generate(&base, &nodes(), v, 8).expect("ok"));
    }

    #[test]
    fn a_missing_kind_is_an_error() {
        let only_whole: Vec<PodRow> = (0..5).map(|i| pod(&format!("w{i}"), 1, 1000, 1)).collect();
        let err = generate(
            &only_whole,
            &nodes(),
            "gpushare-50".parse().expect("name"),
            1,
        )
        .expect_err("no sharing pods");
        assert!(err.to_string().contains("no pod of the kind"), "{err}");
    }
}
