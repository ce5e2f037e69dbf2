//! `gpuledger simulate` on tiny traces whose outcome is computable by hand.

use std::path::Path;
use std::process::{Command, Output};

fn simulate(dir: &Path, nodes: &str, pods: &str, extra: &[&str]) -> Output {
    std::fs::write(dir.join("nodes.csv"), nodes).expect("write nodes");
    std::fs::write(dir.join("pods.csv"), pods).expect("write pods");
    Command::new(env!("CARGO_BIN_EXE_gpuledger"))
        .arg("simulate")
        .arg("--nodes")
        .arg(dir.join("nodes.csv"))
        .arg("--pods")
        .arg(dir.join("pods.csv"))
        .arg("--plot")
        .arg(dir.join("plot.svg"))
        .args(extra)
        .output()
        .expect("run gpuledger")
}

fn last_lines(out: &Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with("policy="))
        .map(String::from)
        .collect()
}

const NODES: &str = "sn,cpu_milli,memory_mib,gpu,model\nn0,8000,8192,1,T4\nn1,8000,8192,1,T4\n";

#[test]
fn two_halves_and_a_whole_fill_two_gpus() {
    // Columns in another order and an extra column: read by header name.
    let pods = "qos,gpu_milli,name,num_gpu,cpu_milli,memory_mib,gpu_spec\n\
                LS,500,a,1,1000,1024,\nLS,500,b,1,1000,1024,\nLS,1000,c,1,1000,1024,\n";
    let dir = tempfile::tempdir().expect("tempdir");
    // Whatever the order, best-fit and FGD put both halves on one GPU: nothing is left over.
    let out = simulate(
        dir.path(),
        NODES,
        pods,
        &[
            "--policy",
            "bestfit,fgd,fgd-pack",
            "--seeds",
            "1..4",
            "--tune",
            "1.0",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        last_lines(&out),
        [
            "policy=bestfit unallocated_pct_at_100=0.00",
            "policy=fgd unallocated_pct_at_100=0.00",
            "policy=fgd-pack unallocated_pct_at_100=0.00",
        ]
    );
    let svg = std::fs::read_to_string(dir.path().join("plot.svg")).expect("plot written");
    assert!(svg.starts_with("<svg") && svg.contains("fgd-pack"));
}

#[test]
fn gpu_spec_must_match_the_model_exactly() {
    // The only pod wants a T4X (not a T4): it fits nowhere and the whole capacity stays free.
    let pods = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n\
                a,1000,1024,2,1000,T4X|A10\n";
    let dir = tempfile::tempdir().expect("tempdir");
    let out = simulate(
        dir.path(),
        NODES,
        pods,
        &["--policy", "binpack", "--seeds", "7", "--tune", "1.0"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        last_lines(&out),
        ["policy=binpack unallocated_pct_at_100=100.00"]
    );
}

#[test]
fn host_cpu_is_a_real_constraint() {
    // Each node has 8 cores. If the 7-core CPU-only pod `a` lands before both GPU pods are placed,
    // the node it takes has too little CPU left for a 2-core GPU pod: one GPU stays unused (50 %).
    // If it comes last, both GPUs are used and `a` itself fails (0 %).
    let pods = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n\
                a,7000,1024,0,0,\nb,2000,1024,1,1000,\nc,2000,1024,1,1000,\n";
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("runs.json");
    std::fs::write(dir.path().join("nodes.csv"), NODES).expect("write nodes");
    std::fs::write(dir.path().join("pods.csv"), pods).expect("write pods");
    let out = Command::new(env!("CARGO_BIN_EXE_gpuledger"))
        .arg("simulate")
        .arg("--nodes")
        .arg(dir.path().join("nodes.csv"))
        .arg("--pods")
        .arg(dir.path().join("pods.csv"))
        .arg("--plot")
        .arg(dir.path().join("plot.svg"))
        .args([
            "--policy", "bestfit", "--seeds", "1..12", "--tune", "1.0", "--json",
        ])
        .arg(&json)
        .output()
        .expect("run gpuledger");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json")).expect("valid json");
    let at_100: Vec<f64> = v[0]["runs"]
        .as_array()
        .expect("runs")
        .iter()
        .map(|r| r["alloc_at"][3].as_f64().expect("number"))
        .collect();
    assert!(at_100.iter().all(|&x| x == 0.5 || x == 1.0), "{at_100:?}");
    assert!(
        at_100.contains(&0.5),
        "the CPU pod never blocked a GPU: {at_100:?}"
    );
    assert!(
        at_100.contains(&1.0),
        "the CPU pod always blocked a GPU: {at_100:?}"
    );
    let failed: Vec<u64> = v[0]["runs"]
        .as_array()
        .expect("runs")
        .iter()
        .map(|r| r["failed"].as_u64().expect("number"))
        .collect();
    assert!(
        failed.iter().all(|&f| f == 1),
        "exactly one pod fails each run: {failed:?}"
    );
}
