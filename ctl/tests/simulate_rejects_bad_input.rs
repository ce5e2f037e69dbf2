//! `gpuledger simulate` refuses malformed trace rows with the file and line, without panicking.

use std::process::Command;

fn run(nodes: &str, pods: &str) -> (bool, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("nodes.csv"), nodes).expect("write");
    std::fs::write(dir.path().join("pods.csv"), pods).expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_gpuledger"))
        .arg("simulate")
        .arg("--nodes")
        .arg(dir.path().join("nodes.csv"))
        .arg("--pods")
        .arg(dir.path().join("pods.csv"))
        .arg("--plot")
        .arg(dir.path().join("plot.svg"))
        .args(["--seeds", "1"])
        .output()
        .expect("run gpuledger");
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!stderr.contains("panicked"), "{stderr}");
    (out.status.success(), stderr)
}

const NODES: &str = "sn,cpu_milli,memory_mib,gpu,model\nn0,8000,8192,1,T4\n";
const HEADER: &str = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n";

#[test]
fn a_bad_number_names_file_line_and_column() {
    let (ok, err) = run(
        NODES,
        &format!("{HEADER}a,1000,1024,1,500,\nb,lots,1024,1,500,\n"),
    );
    assert!(!ok);
    assert!(
        err.contains("pods.csv:3") && err.contains("cpu_milli"),
        "{err}"
    );
}

#[test]
fn a_short_row_is_refused() {
    let (ok, err) = run(NODES, &format!("{HEADER}a,1000,1024,1\n"));
    assert!(!ok);
    assert!(
        err.contains("pods.csv:2") && err.contains("fields"),
        "{err}"
    );
}

#[test]
fn an_impossible_gpu_share_is_refused() {
    let (ok, err) = run(NODES, &format!("{HEADER}a,1000,1024,1,1500,\n"));
    assert!(!ok);
    assert!(
        err.contains("pods.csv:2") && err.contains("gpu_milli"),
        "{err}"
    );
    let (ok, err) = run(NODES, &format!("{HEADER}a,1000,1024,2,500,\n"));
    assert!(!ok);
    assert!(err.contains("whole GPUs"), "{err}");
}

#[test]
fn a_missing_column_is_named() {
    let (ok, err) = run(
        "sn,cpu_milli,gpu,model\nn0,8000,1,T4\n",
        &format!("{HEADER}a,1,1,1,500,\n"),
    );
    assert!(!ok);
    assert!(
        err.contains("nodes.csv") && err.contains("memory_mib"),
        "{err}"
    );
}
