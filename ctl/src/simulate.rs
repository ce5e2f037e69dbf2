//! `gpuledger simulate`: replays the openb trace experiment through the ledger's placement code.
//!
//! The procedure is the one published by Weng et al. (USENIX ATC '23) on Alibaba's
//! cluster-trace-gpu-v2023: see `testdata/traces/README.md`.

mod compare;
mod draws;
mod engine;
mod floor;
mod gorand;
mod paper;
mod plot;
mod probe;
mod variants;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use gpuledger_ledger::Policy;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use draws::{GO_INFORMER_DRAWS, Streams};
use engine::{DeviceChoice, POINTS, Procedure, RunResult, Setup, Ties, trace_workload};
use gpuledger_trace::{NodeRow, PodRow, read_nodes, read_pods};
use probe::{Cost, Probe};

/// Arguments of `gpuledger simulate`.
#[derive(clap::Args, Debug)]
#[command(
    about = "Replay a production GPU trace through the placement policies (offline)",
    long_about = "Replay a production GPU trace through the ledger's placement policies, with the \
procedure of Weng et al., USENIX ATC '23 (Alibaba cluster-trace-gpu-v2023, openb): pods sorted by \
name and shuffled by seed, sampled with replacement up to --tune x the cluster's GPU capacity, node \
order shuffled by seed, ties to the first node, pure fill (no pod ends). With --rng go (the default) \
the shuffles and samples are drawn from Go's math/rand exactly as the paper's simulator draws them, \
so each seed gives the pod and node orders of the published run with that seed. Prints, per policy, \
the GPU allocation ratio and the unallocated share at 50/80/90/100/130 % arrived workload (mean ± sd \
over seeds), the unallocated share at 100 % as the paper's table computes it, the fragmentation \
rate, and a last line `policy=<p> unallocated_pct_at_100=<x>` per policy. With --trace, one row per \
trace and policy, with the floor: the unallocated share at 100 % that no placement could avoid on \
the same pods (those that fit only a few kinds of node, more of them than those nodes can hold)."
)]
pub struct SimulateArgs {
    /// Node list CSV; columns by header name: sn, cpu_milli, memory_mib, gpu, model.
    #[arg(
        long,
        value_name = "CSV",
        default_value = "testdata/traces/openb/openb_node_list_gpu_node.csv"
    )]
    pub nodes: PathBuf,

    /// Pod list CSV; columns by header name: name, cpu_milli, memory_mib, num_gpu, gpu_milli,
    /// gpu_spec ('|'-separated exact GPU models, empty = any); other columns are ignored.
    #[arg(
        long,
        value_name = "CSV",
        default_value = "testdata/traces/openb/openb_pod_list_default.csv"
    )]
    pub pods: PathBuf,

    /// Placement policies to compare, comma-separated. Paper baselines: random, dotprod, bestfit,
    /// packing, clustering; the paper's policy: fgd; gpuledger's: binpack, spread, fgd-pack (FGD,
    /// ties to nodes already in use), fgd-pack-cpu (fgd-pack, and pods without GPUs to the tied
    /// node with the least free GPU), fgd-strand (FGD with shares valued by what still packs into
    /// them, a look-ahead for GPU that CPU and memory would strand, and the few hosts of a shape
    /// kept for it; see docs/placement.md).
    #[arg(
        long,
        value_name = "P[,P...]",
        value_delimiter = ',',
        default_value = "fgd"
    )]
    pub policy: Vec<Policy>,

    /// Seeds: an inclusive range `42..51` (also `42..=51`), a comma list `42,43`, or one seed.
    #[arg(long, value_name = "SEEDS", default_value = "42..51", value_parser = parse_seeds)]
    pub seeds: Seeds,

    /// Pods are sampled (with replacement) until their GPU request is this many times the
    /// cluster's GPU capacity.
    #[arg(long, value_name = "X", default_value_t = 1.3)]
    pub tune: f64,

    /// FGD's target workload: the most frequent pod shapes covering this share of pods (0-1].
    #[arg(long, value_name = "SHARE", default_value_t = 0.95)]
    pub coverage: f64,

    /// Let FGD's pod shapes carry host memory too (the paper's simulator ignores it; both check
    /// memory when placing).
    #[arg(long)]
    pub frag_memory: bool,

    /// Among nodes the policy scores equally: the first in the shuffled node order, or a random one.
    #[arg(long, value_enum, default_value = "first")]
    pub ties: Ties,

    /// Who picks the GPUs within the chosen node: the policy (the device-plugin path), or
    /// kube-scheduler's first fit (the DRA path, where the policy still chooses the node).
    #[arg(long, value_enum, default_value = "policy")]
    pub device_choice: DeviceChoice,

    /// Random streams for the pod and node orders: `go` draws them from Go's math/rand exactly as
    /// the paper's simulator does (same orders as its published runs, seed by seed); `chacha` is
    /// gpuledger's earlier procedure.
    #[arg(long, value_enum, default_value = "go")]
    pub rng: Streams,

    /// With `--rng go`: draws client-go makes on Go's global source between the pod sampling and
    /// the node shuffle (calibrated on the published runs).
    #[arg(long, value_name = "K", default_value_t = GO_INFORMER_DRAWS, hide = true)]
    pub go_informer_draws: usize,

    /// Write the plot of allocation ratio vs arrived workload (SVG) to this file.
    #[arg(long, value_name = "SVG", default_value = "gpuledger-simulate.svg")]
    pub plot: PathBuf,

    /// Also write every run's results (per seed and point) as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,

    /// Compare the policies on several workloads instead of `--pods` alone, one row per trace
    /// and policy, each against the first policy: `default` and `gpushare100` (published lists,
    /// `openb_pod_list_<name>.csv` next to `--nodes`; any such file can be named), generated
    /// variants of `--pods` (gpushare-X, multigpu-X, gpuspec-X, gpuspec-rare-X, cpu-X; see
    /// the docs), or `all` (both published lists and the standard variants).
    #[arg(long, value_name = "T[,T...]", value_delimiter = ',')]
    pub trace: Vec<String>,

    /// Seed of the variant generator (the pod lists it makes; `--seeds` orders them).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub variant_seed: u64,

    /// Time a decision with every node scored, uncached, every this many pods of each run, for
    /// every policy on the same states (0 = do not time).
    #[arg(long, value_name = "PODS", default_value_t = 500)]
    pub cost_stride: usize,

    /// Also print where the idle GPU is at 100 % arrived (per GPU model: usable, stranded by
    /// CPU or memory, fragment) and the GPU of the pods that failed by then, per pod class.
    #[arg(long)]
    pub diagnose: bool,
}

/// The seeds to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seeds(pub Vec<u64>);

/// Parse `a..b` / `a..=b` (inclusive), `a,b,c` or `a`.
pub fn parse_seeds(s: &str) -> Result<Seeds, String> {
    let s = s.trim();
    let num = |x: &str| {
        x.trim()
            .parse::<u64>()
            .map_err(|_| format!("{x:?} is not a seed (a non-negative integer)"))
    };
    let seeds: Vec<u64> = if let Some((a, b)) = s.split_once("..") {
        let (a, b) = (num(a)?, num(b.trim_start_matches('='))?);
        if b < a {
            return Err(format!("empty seed range {s:?}"));
        }
        (a..=b).collect()
    } else {
        s.split(',').map(num).collect::<Result<_, _>>()?
    };
    if seeds.is_empty() {
        return Err("no seeds".into());
    }
    Ok(Seeds(seeds))
}

/// Results of one policy over all seeds.
#[derive(Debug, Clone)]
pub struct PolicyReport {
    /// The policy.
    pub policy: Policy,
    /// One result per seed.
    pub runs: Vec<RunResult>,
    /// Wall time of all its runs.
    pub seconds: f64,
    /// Cost per decision of each policy of the probe, summed over these runs.
    pub cost: Vec<Cost>,
}

impl PolicyReport {
    /// Mean and sample standard deviation of `f` over the seeds.
    pub fn stat(&self, f: impl Fn(&RunResult) -> f64) -> (f64, f64) {
        mean_sd(&self.runs.iter().map(f).collect::<Vec<_>>())
    }

    /// Unallocated GPU share (percent) at 100 % arrived workload, mean over seeds.
    pub fn unallocated_pct_at_100(&self) -> f64 {
        let k = POINTS
            .iter()
            .position(|&p| p == 1.0)
            .expect("100 % is a point");
        self.stat(|r| 100.0 * (1.0 - r.alloc_at[k])).0
    }

    /// The unallocated GPU share (percent) at 100 % arrived workload that no placement could
    /// avoid ([`RunResult::floor`]), mean over seeds.
    pub fn floor_pct_at_100(&self) -> f64 {
        self.stat(|r| 100.0 * r.floor).0
    }

    /// The same as the paper's table states it: 100 − the mean over seeds of column 100 of
    /// [`RunResult::paper_columns`] (the mean allocation of the pods whose arrived workload rounds
    /// to 100 %). `None` if a run has no pod near 100 %.
    pub fn paper_unallocated_at_100(&self) -> Option<f64> {
        let cols: Option<Vec<f64>> = self.runs.iter().map(|r| r.paper_columns[100]).collect();
        cols.map(|c| 100.0 - c.iter().sum::<f64>() / c.len() as f64)
    }
}

fn mean_sd(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = if xs.len() > 1 {
        xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    (mean, var.sqrt())
}

/// Run every policy over every seed.
pub fn simulate(
    nodes: &[NodeRow],
    pods: &[PodRow],
    args: &SimulateArgs,
    progress: &ProgressBar,
) -> Vec<PolicyReport> {
    let workload = trace_workload(pods, args.coverage, args.frag_memory);
    let setup = Setup::new(nodes, pods, workload);
    let probe = Probe {
        policies: args.policy.clone(),
        stride: args.cost_stride,
    };
    args.policy
        .iter()
        .map(|&policy| {
            let start = Instant::now();
            let runs = args
                .seeds
                .0
                .iter()
                .map(|&seed| {
                    progress.set_message(format!("{policy} seed {seed}"));
                    let procedure = Procedure {
                        streams: args.rng,
                        informer_draws: args.go_informer_draws,
                        ties: args.ties,
                        devices: args.device_choice,
                    };
                    let r = setup.run(pods, policy, args.tune, seed, procedure, &probe);
                    progress.inc(1);
                    r
                })
                .collect::<Vec<RunResult>>();
            let mut cost = vec![Cost::default(); probe.policies.len()];
            for r in &runs {
                for (c, x) in cost.iter_mut().zip(&r.cost) {
                    c.add(x);
                }
            }
            PolicyReport {
                policy,
                runs,
                seconds: start.elapsed().as_secs_f64(),
                cost,
            }
        })
        .collect()
}

/// Run the simulation.
pub fn run(args: SimulateArgs) -> anyhow::Result<()> {
    if !(args.tune > 0.0 && args.tune.is_finite()) {
        bail!("--tune must be a positive number, got {}", args.tune);
    }
    if !(args.coverage > 0.0 && args.coverage <= 1.0) {
        bail!("--coverage must be in (0, 1], got {}", args.coverage);
    }
    if args.policy.is_empty() {
        bail!("--policy: name at least one policy");
    }
    let nodes = read_nodes(&args.nodes)?;
    let pods = read_pods(&args.pods)?;
    if !args.trace.is_empty() {
        return compare::run(&args, &nodes, &pods);
    }
    let gpus: usize = nodes.iter().map(|n| n.gpus as usize).sum();
    let progress = progress_bar((args.policy.len() * args.seeds.0.len()) as u64);
    let reports = simulate(&nodes, &pods, &args, &progress);
    progress.finish_and_clear();

    println!(
        "trace: {} ({} pods), {} ({} nodes, {} GPUs); seeds {}; tune {}; rng {}",
        args.pods.display(),
        pods.len(),
        args.nodes.display(),
        nodes.len(),
        gpus,
        describe_seeds(&args.seeds),
        args.tune,
        match args.rng {
            Streams::Go => format!("go (informer draws {})", args.go_informer_draws),
            Streams::Chacha => "chacha".to_string(),
        }
    );
    println!(
        "Method and trace: Weng et al., USENIX ATC '23; Alibaba cluster-trace-gpu-v2023 (openb)."
    );
    for r in &reports {
        print_report(r);
    }
    println!();
    println!(
        "{:<12} {:>22} {:>14} {:>16} {:>10} {:>13}",
        "policy",
        "unallocated @100% (%)",
        "as published",
        "frag rate (%)",
        "time (s)",
        "µs/decision"
    );
    let costs = compare::costs(&reports);
    for (r, cost) in reports.iter().zip(&costs) {
        let k = POINTS
            .iter()
            .position(|&p| p == 1.0)
            .expect("100 % is a point");
        let (m, sd) = r.stat(|x| 100.0 * (1.0 - x.alloc_at[k]));
        let (fm, fsd) = r.stat(|x| 100.0 * x.frag_rate_at_100);
        let published = r
            .paper_unallocated_at_100()
            .map_or_else(|| "-".to_string(), |x| format!("{x:.2}"));
        println!(
            "{:<12} {:>13.2} ± {:<6.2} {:>14} {:>8.2} ± {:<5.2} {:>10.1} {:>13.1}",
            r.policy.to_string(),
            m,
            sd,
            published,
            fm,
            fsd,
            r.seconds,
            cost.micros()
        );
    }
    if args.diagnose {
        for r in &reports {
            compare::print_diagnosis(r);
        }
    }
    plot::write(&args.plot, &reports)
        .with_context(|| format!("cannot write the plot to {}", args.plot.display()))?;
    println!("plot: {}", args.plot.display());
    if let Some(path) = &args.json {
        std::fs::write(path, json(&reports).to_string())
            .with_context(|| format!("cannot write {}", path.display()))?;
        println!("json: {}", path.display());
    }
    for r in &reports {
        println!(
            "policy={} unallocated_pct_at_100={:.2}",
            r.policy,
            r.unallocated_pct_at_100()
        );
    }
    Ok(())
}

/// A progress bar on stderr when it is a terminal, for `total` runs.
fn progress_bar(total: u64) -> ProgressBar {
    let progress = if std::io::stderr().is_terminal() {
        ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    progress.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} runs, {elapsed} elapsed, eta {eta} {msg}",
        )
        .expect("static template"),
    );
    progress
}

fn describe_seeds(s: &Seeds) -> String {
    let v = &s.0;
    let contiguous = v.windows(2).all(|w| w[1] == w[0] + 1);
    if v.len() > 2 && contiguous {
        format!("{}..{} ({} runs)", v[0], v[v.len() - 1], v.len())
    } else {
        v.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
    }
}

fn print_report(r: &PolicyReport) {
    println!();
    println!(
        "policy {}: {} seeds, {:.1} s, {:.0} pods/run, {:.1} failed/run",
        r.policy,
        r.runs.len(),
        r.seconds,
        r.stat(|x| x.pods as f64).0,
        r.stat(|x| x.failed as f64).0
    );
    println!(
        "  {:>8}  {:>22}  {:>22}",
        "arrived", "GPU allocation (%)", "unallocated (%)"
    );
    for (k, p) in POINTS.iter().enumerate() {
        let (m, sd) = r.stat(|x| 100.0 * x.alloc_at[k]);
        println!(
            "  {:>7.0}%  {:>13.2} ± {:<6.2}  {:>13.2} ± {:<6.2}",
            p * 100.0,
            m,
            sd,
            100.0 - m,
            sd
        );
    }
    let (fm, fsd) = r.stat(|x| 100.0 * x.frag_rate_at_100);
    println!("  fragmentation rate at 100% arrived: {fm:.2} ± {fsd:.2} % of idle GPU");
}

fn json(reports: &[PolicyReport]) -> serde_json::Value {
    serde_json::json!(
        reports
            .iter()
            .map(|r| serde_json::json!({
                "policy": r.policy.to_string(),
                "seconds": r.seconds,
                "points": POINTS,
                "runs": r.runs.iter().map(|x| serde_json::json!({
                    "seed": x.seed,
                    "alloc_at": x.alloc_at,
                    "frag_rate_at_100": x.frag_rate_at_100,
                    "pods": x.pods,
                    "failed": x.failed,
                    "paper_columns": x.paper_columns,
                })).collect::<Vec<_>>(),
            }))
            .collect::<Vec<_>>()
    )
}
