//! `gpuledger-bench versus` runs, every part of it, at the smallest sizes: HAMi's throughput
//! batch and gpuledger's, both churns (deletes in flight, kills, the room probe), and the DRA
//! twin against dra-example-driver. The bench needs this tier's binaries, so it has no smoke
//! run in `make test` (bench/tests/every_bench_runs.rs); without this a peer's or Kubernetes'
//! change could break it unseen, as 1.37's device-status rules broke the DRA twin. It asserts
//! the closing line and what must hold whatever the timing: gpuledger over-commits nothing,
//! strands nothing and loses no bound pod's grant through its churn, in which a real node
//! agent was restarted and registered again each time, and the DRA twin produced both
//! systems' figures. The
//! figures themselves are the bench's (docs/benchmarks.md), not this test's.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, ensure};
use gpuledger_testkit::bins::bin_path;

#[test]
#[ignore = "real Kubernetes and the peers (HAMi, dra-example-driver): make test-e2e"]
fn the_versus_bench_runs_every_part_at_the_smallest_sizes() -> Result<()> {
    let out = Command::new(bin_path("gpuledger-bench")?)
        .args([
            "versus",
            "--nodes",
            "1",
            "--gpus-per-node",
            "2",
            "--pods",
            "4",
            // HAMi's scheduler needs seconds to come back: kills much closer together than
            // its start keep it down for good.
            "--kill-every-s",
            "20",
            "--min-kills",
            "1",
            "--room-probes",
            "2",
        ])
        .stdin(Stdio::null())
        .output()
        .context("starting gpuledger-bench versus")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let tail = |s: &str| {
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    };
    ensure!(
        out.status.success(),
        "gpuledger-bench versus failed ({}):\n{}\n{}",
        out.status,
        tail(&stdout),
        tail(&stderr)
    );
    eprintln!("{}", tail(&stdout));
    let closing = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with("versus=hami "))
        .with_context(|| format!("no closing line:\n{}", tail(&stdout)))?;
    let fields: BTreeMap<&str, &str> = closing
        .split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .collect();
    for k in [
        "overcommit_gpuledger",
        "stranded_gpuledger",
        "lost_gpuledger",
    ] {
        ensure!(fields.get(k) == Some(&"0"), "{k} is not 0: {closing}");
    }
    for k in [
        "pods_per_s_ratio",
        "room_p99_ms",
        "dra_pods_per_s_ratio",
        "dra_start_p50_delta_ms",
    ] {
        ensure!(
            fields.get(k).is_some_and(|v| v.parse::<f64>().is_ok()),
            "{k} was not measured: {closing}"
        );
    }
    // "the node agent of gl-00000 SIGKILLed and restarted R times; its inventory registered N times"
    let agent = stdout
        .lines()
        .find(|l| l.contains("the node agent of"))
        .with_context(|| format!("no node agent restart reported:\n{}", tail(&stdout)))?;
    let counts: Vec<usize> = agent
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    ensure!(
        matches!(counts.as_slice(), [r, n] if *r >= 1 && n > r),
        "the agent was not restarted, or did not register again after each restart: {agent}"
    );
    Ok(())
}
