//! `gpuledger simulate` on the real openb trace: one seed, so that it stays quick in debug builds.

use std::path::PathBuf;
use std::process::Command;

fn trace(file: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/traces/openb")
        .join(file);
    assert!(
        p.exists(),
        "{} is missing: the openb trace (Alibaba cluster-trace-gpu-v2023) must be in \
         ../shared/traces/openb next to the workspace",
        p.display()
    );
    p
}

fn unallocated(seed: &str) -> Vec<String> {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(env!("CARGO_BIN_EXE_gpuledger"))
        .arg("simulate")
        .arg("--nodes")
        .arg(trace("openb_node_list_gpu_node.csv"))
        .arg("--pods")
        .arg(trace("openb_pod_list_default.csv"))
        .arg("--plot")
        .arg(dir.path().join("plot.svg"))
        .args(["--policy", "bestfit,fgd", "--seeds", seed])
        .output()
        .expect("run gpuledger");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with("policy="))
        .map(String::from)
        .collect()
}

#[test]
fn one_seed_is_deterministic_and_fgd_beats_best_fit() {
    let a = unallocated("42");
    assert_eq!(a, unallocated("42"), "same seed, same result");
    let pct = |l: &str| -> f64 {
        l.rsplit('=')
            .next()
            .and_then(|x| x.parse().ok())
            .expect("number")
    };
    let (bestfit, fgd) = (pct(&a[0]), pct(&a[1]));
    // Published means over 10 seeds: best-fit 7.14 %, FGD 4.77 %; one seed lands near them.
    assert!((6.0..8.5).contains(&bestfit), "{a:?}");
    assert!((3.5..6.0).contains(&fgd), "{a:?}");
    assert!(fgd < bestfit, "{a:?}");
}
