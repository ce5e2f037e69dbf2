//! What a run prints at its end: pods and operations, throughput, admission latency, pods
//! done per phase between faults, every violation, and the closing `key=value` line.

use std::time::{Duration, Instant};

use gpuledger_testkit::cluster::LocalCluster;
use gpuledger_testkit::history::Outcome;

use super::check::Verdict;
use super::faults::Injected;
use super::{RunArgs, reproduce};

/// Print the report of a run whose check gave `v`.
pub(super) fn print(
    c: &LocalCluster,
    a: &RunArgs,
    v: &Verdict,
    injected: &[Injected],
    (started, workload, converged_s): (Instant, Duration, f64),
) {
    let Verdict {
        ops,
        history: hist_path,
        replay: r,
        violations,
        lost,
        double,
        replay_equal,
        succeeded,
        failed,
    } = v;
    let unknown = ops.iter().filter(|o| o.outcome == Outcome::Unknown).count();
    println!();
    println!(
        "seed {}: {} pods ({succeeded} succeeded, {} failed), {} client operations ({unknown} with unknown outcome), {} faults",
        a.seed,
        a.pods,
        failed.values().sum::<usize>(),
        ops.len(),
        injected.len()
    );
    for (why, n) in failed {
        println!("  failed: {n} x {why}");
    }
    println!(
        "workload {:.1}s ({:.1} pods/s); ledger seq {}, epochs up to {}",
        workload.as_secs_f64(),
        a.pods as f64 / workload.as_secs_f64(),
        r.ledger.seq(),
        r.ledger.epoch()
    );
    let mut admit: Vec<Duration> = c
        .runs
        .all()
        .iter()
        .filter_map(|r| r.started.map(|s| s.saturating_duration_since(r.seen)))
        .collect();
    admit.sort();
    if let (Some(p50), Some(max)) = (admit.get(admit.len() / 2), admit.last()) {
        println!(
            "admission on the node (bound to container started): p50 {:.2}s, max {:.2}s",
            p50.as_secs_f64(),
            max.as_secs_f64()
        );
    }
    print_phases(c, injected, started, workload);
    println!("history: {}", hist_path.display());
    for v in violations {
        println!("VIOLATION {v}");
    }
    if !violations.is_empty() {
        println!("{}", reproduce(a));
    }
    println!(
        "violations={} lost_grants={lost} double_grants={double} replay_equal={replay_equal} converged_s={converged_s:.1}",
        violations.len()
    );
}

/// Pods finished per second in each phase between faults.
fn print_phases(c: &LocalCluster, injected: &[Injected], started: Instant, workload: Duration) {
    let mut bounds: Vec<(Duration, String)> = vec![(Duration::ZERO, "start".into())];
    for (i, f) in injected.iter().enumerate() {
        bounds.push((f.at, format!("fault {}", i + 1)));
    }
    let ends: Vec<Duration> = c
        .runs
        .all()
        .iter()
        .filter_map(|r| r.ended.map(|e| e.saturating_duration_since(started)))
        .collect();
    println!("phase            from      to   pods done   pods/s");
    for (k, (from, label)) in bounds.iter().enumerate() {
        let to = bounds.get(k + 1).map_or(workload, |b| b.0);
        if to <= *from {
            continue;
        }
        let n = ends.iter().filter(|e| **e >= *from && **e < to).count();
        println!(
            "{label:<14} {:>6.1}s {:>6.1}s {n:>11} {:>8.1}",
            from.as_secs_f64(),
            to.as_secs_f64(),
            n as f64 / (to - *from).as_secs_f64()
        );
    }
    for (i, f) in injected.iter().enumerate() {
        println!(
            "fault {:>2} at {:>6.1}s, over at {:>6.1}s: {}",
            i + 1,
            f.at.as_secs_f64(),
            f.until.as_secs_f64(),
            f.what
        );
    }
}
