//! `gpuledger simulate --trace`: published lists and generated variants side by side, each policy
//! against the first, with the cost of a decision measured in the same run.

use std::process::Command;

fn simulate(args: &[&str]) -> (bool, String, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let out = Command::new(env!("CARGO_BIN_EXE_gpuledger"))
        .current_dir(root)
        .arg("simulate")
        .arg("--plot")
        .arg(dir.path().join("plot.svg"))
        .args(args)
        .output()
        .expect("run gpuledger");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[test]
fn every_trace_gets_each_policy_with_ratio_and_cost() {
    let (ok, out, err) = simulate(&[
        "--trace",
        "default,multigpu-30,cpu-0",
        "--policy",
        "fgd,fgd-strand",
        "--seeds",
        "42",
        "--cost-stride",
        "2000",
    ]);
    assert!(ok, "{err}");
    for trace in ["default", "multigpu-30", "cpu-0"] {
        let lines: Vec<&str> = out
            .lines()
            .filter(|l| l.starts_with(&format!("trace={trace} ")))
            .collect();
        assert_eq!(lines.len(), 2, "{trace}: {out}");
        assert!(lines[0].contains("policy=fgd ") && lines[0].contains("ratio=1.000"));
        assert!(lines[1].contains("policy=fgd-strand "), "{out}");
        for l in lines {
            let us: f64 = l
                .split_whitespace()
                .find_map(|kv| kv.strip_prefix("us_per_decision="))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no cost in {l}"));
            assert!(us.is_finite() && us > 0.0, "{l}");
        }
    }
    assert!(out.contains("fgd-strand vs fgd:"), "{out}");
}

#[test]
fn an_unknown_trace_is_named() {
    let (ok, _, err) = simulate(&["--trace", "gpushare-120", "--seeds", "42"]);
    assert!(!ok);
    assert!(err.contains("gpushare-120"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
