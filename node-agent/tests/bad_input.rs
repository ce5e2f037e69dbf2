//! Bad input: no NVML library, and Allocate for devices this agent does not advertise.

use crate::support;

use std::process::Command;
use std::time::Duration;

use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::bin_path;
use gpuledger_testkit::kubelet::node::fake_nvml_lib;
use support::{Cluster, alloc_of};
use tonic::Code;

#[test]
fn a_missing_nvml_library_is_a_clear_error_and_a_failing_exit() -> anyhow::Result<()> {
    let bin = bin_path("gpuledger-node-agent")?;
    let out = Command::new(&bin)
        .args([
            "--node-name=n1",
            "--nvml-lib=/nonexistent/libnvidia-ml.so.1",
        ])
        .output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("/nonexistent/libnvidia-ml.so.1") && err.contains("does not exist"),
        "{err}"
    );
    // A library that loads but finds no driver (the fake without its state file).
    let out = Command::new(&bin)
        .args([
            "--node-name=n1",
            &format!("--nvml-lib={}", fake_nvml_lib()?.display()),
        ])
        .env_remove("FAKE_NVML_CONFIG")
        .output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot load or initialise NVML"), "{err}");
    // An isolation the node cannot serve stops the agent with what is missing; it never runs
    // a weaker one (the fake NVML answers driver 550, and this machine runs cgroup v1 or has
    // no dmem controller).
    let dir = tempfile::tempdir()?;
    let fake_state = dir.path().join("nvml.json");
    std::fs::write(&fake_state, r#"{"gpus":[]}"#)?;
    for (flags, want) in [
        (
            vec![
                "--isolation=hami-core".to_string(),
                "--hami-core-lib=/nonexistent/libvgpu.so".into(),
                format!("--hami-core-dir={}", dir.path().join("hami").display()),
            ],
            "no HAMi-core library at --hami-core-lib /nonexistent/libvgpu.so",
        ),
        (
            vec![
                "--isolation=dmem".to_string(),
                format!("--cgroup-root={}", dir.path().display()),
            ],
            "is not a cgroup v2 mount",
        ),
        (
            vec![
                "--isolation=mps".to_string(),
                "--mps-control=/nonexistent/nvidia-cuda-mps-control".into(),
            ],
            "no MPS control daemon at /nonexistent/nvidia-cuda-mps-control",
        ),
    ] {
        let out = Command::new(&bin)
            .args([
                "--node-name=n1",
                &format!("--nvml-lib={}", fake_nvml_lib()?.display()),
            ])
            .args(&flags)
            .env("FAKE_NVML_CONFIG", &fake_state)
            .output()?;
        assert!(!out.status.success(), "{flags:?} started");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("isolation refused") && err.contains(want),
            "{flags:?}: {err}"
        );
    }
    // --help explains the flags.
    let out = Command::new(&bin).arg("--help").output()?;
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--node-name",
        "--allocator",
        "--nvml-lib",
        "--kubelet-dir",
        "--pod-resources-socket",
        "--slots-per-gpu",
        "--enforce-interval",
        "--grace",
        "--on-violation",
        "--mps",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_for_unknown_devices_is_refused_and_claims_nothing() -> anyhow::Result<()> {
    let c = Cluster::start(1, &[]).await?;
    let gpu = c.gpu(0);
    c.reserve("uid-a", 1_000, None).await?;
    let seq = c.dump().await?.seq;
    for (ids, code) in [
        (vec!["GPU-elsewhere::0".to_string()], Code::NotFound),
        (vec![format!("{gpu}::999")], Code::NotFound),
        (vec!["garbage".to_string()], Code::InvalidArgument),
        (
            vec![format!("{gpu}::0"), "GPU-elsewhere::1".to_string()],
            Code::NotFound,
        ),
        (vec![], Code::InvalidArgument),
    ] {
        let e = c
            .kubelet
            .raw_allocate(ids.clone())
            .await
            .expect_err("refused");
        assert_eq!(e.code(), code, "{ids:?}: {e}");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let s = c.dump().await?;
    assert_eq!(s.seq, seq, "nothing was written");
    let a = alloc_of(&s, "uid-a").expect("reservation");
    assert_ne!(a.state, pb::AllocationState::Assigned as i32);
    // The reservation is still there to claim with valid devices.
    let got = c.kubelet.admit("default", "pod-uid-a", "main", 1).await?;
    assert_eq!(
        got.response.envs["GPULEDGER_ALLOCATION_ID"],
        a.id.to_string()
    );
    Ok(())
}
