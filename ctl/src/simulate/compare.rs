//! `gpuledger simulate --trace …`: the policies side by side on several workloads, each against
//! the first policy named, with the cost of a decision measured in the same runs.

use std::path::Path;

use anyhow::{Context, bail};
use gpuledger_trace::{NodeRow, PodRow, read_pods};

use super::probe::{CLASSES, Cost};
use super::variants::{self, Variant};
use super::{PolicyReport, SimulateArgs, describe_seeds, json, progress_bar, simulate};

/// The published pod lists `--trace all` runs, besides the standard variants.
const PUBLISHED: [&str; 2] = ["default", "gpushare100"];

/// The pod list of each named trace, in order.
fn resolve(
    args: &SimulateArgs,
    nodes: &[NodeRow],
    base: &[PodRow],
) -> anyhow::Result<Vec<(String, Vec<PodRow>)>> {
    let mut names: Vec<String> = Vec::new();
    for t in &args.trace {
        let t = t.trim();
        if t == "all" {
            names.extend(PUBLISHED.iter().map(|s| s.to_string()));
            names.extend(variants::STANDARD.iter().map(|s| s.to_string()));
        } else if !t.is_empty() {
            names.push(t.to_string());
        }
    }
    if names.is_empty() {
        bail!("--trace: name at least one trace");
    }
    let dir = args.nodes.parent().unwrap_or(Path::new("."));
    names
        .into_iter()
        .map(|name| {
            let pods = match name.parse::<Variant>() {
                Ok(v) => variants::generate(base, nodes, v, args.variant_seed)?,
                Err(why) => {
                    let file = dir.join(format!("openb_pod_list_{name}.csv"));
                    if !file.exists() {
                        bail!(
                            "--trace {name:?}: neither a generated variant ({why}) nor a pod list \
                             ({} does not exist)",
                            file.display()
                        );
                    }
                    read_pods(&file)?
                }
            };
            Ok((name, pods))
        })
        .collect()
}

/// Cost per decision of each policy of the probe, over every run of every report.
pub fn costs(reports: &[PolicyReport]) -> Vec<Cost> {
    let mut out = vec![Cost::default(); reports.first().map_or(0, |r| r.cost.len())];
    for r in reports {
        for (o, c) in out.iter_mut().zip(&r.cost) {
            o.add(c);
        }
    }
    out
}

/// Run every policy on every trace and print them side by side.
pub fn run(args: &SimulateArgs, nodes: &[NodeRow], base: &[PodRow]) -> anyhow::Result<()> {
    let traces = resolve(args, nodes, base)?;
    let gpus: u64 = nodes.iter().map(|n| u64::from(n.gpus)).sum();
    println!(
        "nodes: {} ({} nodes, {gpus} GPUs); seeds {}; tune {}; variants of {} with seed {}",
        args.nodes.display(),
        nodes.len(),
        describe_seeds(&args.seeds),
        args.tune,
        args.pods.display(),
        args.variant_seed
    );
    let first = args.policy[0];
    println!(
        "unallocated GPU (%) at 100 % arrived workload, mean ± sd over seeds; ratios against \
         {first}; floor: what no placement could allocate of the same pods (pods that fit only a \
         few nodes, more of them than those nodes hold)"
    );
    println!(
        "{:<16} {:<13} {:>16} {:>9} {:>9} {:>12} {:>9}",
        "trace", "policy", "unallocated (%)", "ratio", "floor (%)", "µs/decision", "ratio"
    );
    let progress = progress_bar((traces.len() * args.policy.len() * args.seeds.0.len()) as u64);
    let mut all = Vec::new();
    let mut lines = Vec::new();
    for (name, pods) in &traces {
        let reports = simulate(nodes, pods, args, &progress);
        let cost = costs(&reports);
        let base_u = reports[0].unallocated_pct_at_100();
        let base_c = cost[0].micros();
        for (r, c) in reports.iter().zip(&cost) {
            let (u, sd) = (r.unallocated_pct_at_100(), r.stat(unallocated).1);
            let ratio = u / base_u;
            let floor = r.floor_pct_at_100();
            let cratio = c.micros() / base_c;
            progress.suspend(|| {
                println!(
                    "{:<16} {:<13} {:>8.2} ± {:<5.2} {:>9.3} {:>9.2} {:>12.1} {:>9.2}",
                    name,
                    r.policy.to_string(),
                    u,
                    sd,
                    ratio,
                    floor,
                    c.micros(),
                    cratio
                );
            });
            lines.push(format!(
                "trace={name} policy={} unallocated_pct_at_100={u:.2} ratio={ratio:.3} \
                 floor_pct={floor:.2} us_per_decision={:.1} cost_ratio={cratio:.2}",
                r.policy,
                c.micros()
            ));
        }
        if args.diagnose {
            progress.suspend(|| {
                for r in &reports {
                    println!("  {name}:");
                    print_diagnosis(r);
                }
            });
        }
        all.push((name.clone(), reports));
    }
    progress.finish_and_clear();
    summarize(&all);
    if let Some(path) = &args.json {
        let v = serde_json::json!(
            all.iter()
                .map(
                    |(name, reports)| serde_json::json!({"trace": name, "policies": json(reports)})
                )
                .collect::<Vec<_>>()
        );
        std::fs::write(path, v.to_string())
            .with_context(|| format!("cannot write {}", path.display()))?;
        println!("json: {}", path.display());
    }
    for l in lines {
        println!("{l}");
    }
    Ok(())
}

fn unallocated(r: &super::RunResult) -> f64 {
    let k = super::POINTS
        .iter()
        .position(|&p| p == 1.0)
        .expect("100 % is a point");
    100.0 * (1.0 - r.alloc_at[k])
}

/// Per policy after the first: its worst and best ratio, and on how many traces it is at least
/// 10 % better and how many worse.
fn summarize(all: &[(String, Vec<PolicyReport>)]) {
    let Some((_, first)) = all.first() else {
        return;
    };
    println!();
    for k in 1..first.len() {
        let ratios: Vec<(&str, f64)> = all
            .iter()
            .map(|(name, rs)| {
                (
                    name.as_str(),
                    rs[k].unallocated_pct_at_100() / rs[0].unallocated_pct_at_100(),
                )
            })
            .collect();
        let worst = ratios
            .iter()
            .copied()
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .expect("one trace at least");
        let best = ratios
            .iter()
            .copied()
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .expect("one trace at least");
        let tenth = ratios.iter().filter(|r| r.1 <= 0.9).count();
        let worse = ratios.iter().filter(|r| r.1 > 1.0).count();
        println!(
            "{} vs {}: ratio ≤ 0.9 on {tenth}/{} traces, > 1 on {worse}; worst {:.3} ({}), best {:.3} ({})",
            first[k].policy,
            first[0].policy,
            ratios.len(),
            worst.1,
            worst.0,
            best.1,
            best.0
        );
    }
    // Where 0.9 × the first policy is below the floor, no policy can get there.
    let out_of_reach: Vec<String> = all
        .iter()
        .filter(|(_, rs)| rs[0].floor_pct_at_100() > 0.9 * rs[0].unallocated_pct_at_100())
        .map(|(name, rs)| {
            format!(
                "{name} (floor {:.2} %, {:.3} × {})",
                rs[0].floor_pct_at_100(),
                rs[0].floor_pct_at_100() / rs[0].unallocated_pct_at_100(),
                rs[0].policy
            )
        })
        .collect();
    if !out_of_reach.is_empty() {
        println!(
            "0.9 × {} is below the floor, out of any placement's reach, on: {}",
            first[0].policy,
            out_of_reach.join(", ")
        );
    }
}

/// Where the idle GPU was at 100 % arrived, per GPU model, and the GPU of the pods that had
/// failed by then, mean over the seeds.
pub fn print_diagnosis(r: &PolicyReport) {
    let n = r.runs.len() as f64;
    println!(
        "  {}: idle GPUs at 100 % arrived, by why (mean of {} seeds)",
        r.policy,
        r.runs.len()
    );
    println!(
        "    {:<10} {:>6} {:>9} {:>9} {:>9} {:>11}",
        "model", "GPUs", "usable", "stranded", "fragment", "cores left"
    );
    let Some(first) = r.runs.first() else {
        return;
    };
    for (i, m) in first.diagnosis.models.iter().enumerate() {
        let sum = |f: &dyn Fn(&super::probe::ModelIdle) -> u64| {
            r.runs
                .iter()
                .map(|x| f(&x.diagnosis.models[i]) as f64)
                .sum::<f64>()
                / n
                / 1000.0
        };
        println!(
            "    {:<10} {:>6} {:>9.1} {:>9.1} {:>9.1} {:>11.0}",
            m.model,
            m.gpus,
            sum(&|m| m.usable),
            sum(&|m| m.stranded),
            sum(&|m| m.fragment),
            sum(&|m| m.cpu_left)
        );
    }
    let failed: Vec<String> = CLASSES
        .iter()
        .enumerate()
        .map(|(c, name)| {
            let mean = |f: fn(&(u64, u64, u64)) -> u64| {
                r.runs
                    .iter()
                    .map(|x| f(&x.diagnosis.failed[c]) as f64)
                    .sum::<f64>()
                    / n
            };
            let pods = mean(|f| f.0);
            let gpus = mean(|f| f.1) / 1000.0;
            let blocked = mean(|f| f.2) / 1000.0;
            format!("{name} {pods:.1} pods / {gpus:.1} GPUs ({blocked:.1} by CPU/memory)")
        })
        .collect();
    println!("    failed by then: {}", failed.join(", "));
}
