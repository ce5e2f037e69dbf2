//! `--isolation=mps` against a stand-in `nvidia-cuda-mps-control` that speaks the control
//! protocol (`-d` writes the daemon's PID where the real one does; commands on stdin) and
//! records what it was told in `control.log`: one daemon per GPU, the GPUs put in
//! EXCLUSIVE_PROCESS through the fake NVML, each daemon's limits equal to the largest share
//! on its GPU after grants, a release, an agent restart and a daemon crash, a container given
//! only its GPU's pipe directory, and at exit the idle GPU's daemon quit and its GPU back in
//! DEFAULT compute mode.

use crate::support;

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::kubelet::node::{MpsReaper, mps_stand_in};
use support::Cluster;

fn daemon_pid(gpu_dir: &Path) -> Option<u32> {
    std::fs::read_to_string(gpu_dir.join("pipe/nvidia-cuda-mps-control.pid"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn control_log(mps_dir: &Path, gpu: &str) -> Vec<String> {
    std::fs::read_to_string(mps_dir.join(gpu).join("log/control.log"))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// The memory limit the daemon of `gpu` was last told as its default, and how many times any
/// default was set.
fn last_default(log: &[String]) -> (Option<String>, usize) {
    let sets: Vec<&String> = log
        .iter()
        .filter(|l| l.starts_with("set_default_device_pinned_mem_limit "))
        .collect();
    (sets.last().map(|l| l.to_string()), sets.len())
}

async fn wait_log(
    c: &Cluster,
    mps_dir: &Path,
    gpu: &str,
    what: &str,
    pred: impl Fn(&[String]) -> bool,
) -> Result<Vec<String>> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let log = control_log(mps_dir, gpu);
        if pred(&log) {
            return Ok(log);
        }
        if Instant::now() > deadline {
            bail!(
                "{gpu}'s daemon never got {what}; control.log:\n{}\n{}",
                log.join("\n"),
                c.agent_log()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn starts(log: &[String]) -> usize {
    log.iter().filter(|l| l.starts_with("start ")).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mps_daemons_per_gpu_hold_clients_to_the_ledger_through_restarts_and_crashes() -> Result<()>
{
    let tmp = tempfile::tempdir()?;
    let control = mps_stand_in(&tmp.path().join("bin"))?;
    let mps_dir = tmp.path().join("mps");
    let _reaper = MpsReaper(mps_dir.clone());
    let flags = [
        "--isolation=mps".to_string(),
        format!("--mps-control={}", control.display()),
        format!("--mps-dir={}", mps_dir.display()),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut c = Cluster::start(2, &flags).await?;
    let (g0, g1) = (c.gpu(0), c.gpu(1));

    let modes = nvidia_ml::compute_modes(c.nvml.path());
    for g in [&g0, &g1] {
        assert_eq!(
            modes.get(g),
            Some(&nvidia_ml::COMPUTE_MODE_EXCLUSIVE_PROCESS),
            "{g} not in EXCLUSIVE_PROCESS: {modes:?}"
        );
    }
    for g in [&g0, &g1] {
        let want = format!("start CUDA_VISIBLE_DEVICES={g}");
        wait_log(&c, &mps_dir, g, "started for its GPU alone", |l| {
            l.iter().filter(|x| **x == want).count() == 1 && starts(l) == 1
        })
        .await?;
    }

    // No server runs yet: the defaults are set for the first one.
    c.reserve("uid-a", 10_000, Some(&g0)).await?;
    wait_log(&c, &mps_dir, &g0, "A's share", |l| {
        last_default(l).0.as_deref() == Some("set_default_device_pinned_mem_limit 0 10000M")
    })
    .await?;
    // A server runs now: it is told too, not only the next one.
    std::fs::write(mps_dir.join(&g0).join("pipe/servers"), "4242\n")?;
    c.reserve("uid-b", 30_000, Some(&g0)).await?;
    let log = wait_log(&c, &mps_dir, &g0, "the larger share", |l| {
        last_default(l).0.as_deref() == Some("set_default_device_pinned_mem_limit 0 30000M")
    })
    .await?;
    for line in [
        "set_default_active_thread_percentage 10",
        "set_device_pinned_mem_limit 4242 0 30000M",
        "set_active_thread_percentage 4242 10",
    ] {
        assert!(log.iter().any(|l| l == line), "no {line:?} in {log:?}");
    }
    assert!(
        !control_log(&mps_dir, &g1)
            .iter()
            .any(|l| l.starts_with("set_")),
        "the idle GPU's daemon was given a limit"
    );

    // The container gets its GPU's pipe directory and nothing else of the daemon's.
    let a = c.kubelet.admit("default", "pod-uid-a", "main", 1).await?;
    let pipe = mps_dir.join(&g0).join("pipe").display().to_string();
    let mps_mounts: Vec<_> = a
        .response
        .mounts
        .iter()
        .filter(|m| m.host_path.starts_with(&mps_dir.display().to_string()))
        .collect();
    assert_eq!(mps_mounts.len(), 1, "{:?}", a.response.mounts);
    assert_eq!(mps_mounts[0].host_path, pipe);
    assert_eq!(mps_mounts[0].container_path, "/tmp/nvidia-mps");
    assert_eq!(
        a.response.envs["CUDA_MPS_PIPE_DIRECTORY"],
        "/tmp/nvidia-mps"
    );
    assert_eq!(
        a.response.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"],
        "0=10000M"
    );

    // B leaves: the daemon comes down to A's share.
    c.admin()?
        .release(api::ReleaseRequest {
            pod_uid: "uid-b".into(),
            reason: "pod succeeded".into(),
            ..Default::default()
        })
        .await?;
    let log = wait_log(&c, &mps_dir, &g0, "the remaining share", |l| {
        last_default(l).0.as_deref() == Some("set_default_device_pinned_mem_limit 0 10000M")
    })
    .await?;
    assert!(
        log.iter()
            .any(|l| l == "set_device_pinned_mem_limit 4242 0 10000M")
    );

    // The agent dies: the next one adopts the running daemon and tells it the limits again.
    let (_, sets_before) = last_default(&log);
    c.agent.restart()?;
    let log = wait_log(&c, &mps_dir, &g0, "its limits from the next agent", |l| {
        last_default(l).1 > sets_before
    })
    .await?;
    assert_eq!(starts(&log), 1, "the daemon was started again: {log:?}");
    assert_eq!(
        last_default(&log).0.as_deref(),
        Some("set_default_device_pinned_mem_limit 0 10000M")
    );

    // The daemon crashes, and someone put its GPU back in DEFAULT: the mode is set again,
    // the daemon started again and told its limits.
    let mode_file = nvidia_ml::compute_mode_path(c.nvml.path());
    std::fs::write(&mode_file, format!(r#"{{"{g0}":0,"{g1}":3}}"#))?;
    let pid = daemon_pid(&mps_dir.join(&g0)).context("no daemon PID on GPU 0")?;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    let log = wait_log(&c, &mps_dir, &g0, "a restart and its limits", |l| {
        starts(l) == 2
            && l.iter()
                .rposition(|x| x.starts_with("start "))
                .is_some_and(|s| {
                    l[s..]
                        .iter()
                        .any(|x| x == "set_default_device_pinned_mem_limit 0 10000M")
                })
    })
    .await?;
    assert!(
        log.iter()
            .any(|l| l.starts_with("set_active_thread_percentage 4242"))
    );
    assert_eq!(
        nvidia_ml::compute_modes(c.nvml.path()).get(&g0),
        Some(&nvidia_ml::COMPUTE_MODE_EXCLUSIVE_PROCESS),
        "the restarted daemon's GPU is not in EXCLUSIVE_PROCESS"
    );

    // SIGTERM: the idle GPU's daemon is quit and its GPU back in DEFAULT; GPU 0's stays for A.
    c.agent.proc.terminate(Duration::from_secs(10));
    assert!(
        !mps_dir.join(&g1).exists(),
        "the idle GPU's daemon directory stayed\n{}",
        c.agent_log()
    );
    let modes = nvidia_ml::compute_modes(c.nvml.path());
    assert_eq!(modes.get(&g1), Some(&nvidia_ml::COMPUTE_MODE_DEFAULT));
    assert_eq!(
        modes.get(&g0),
        Some(&nvidia_ml::COMPUTE_MODE_EXCLUSIVE_PROCESS)
    );
    let pid = daemon_pid(&mps_dir.join(&g0)).context("GPU 0's daemon was stopped")?;
    assert!(
        Path::new(&format!("/proc/{pid}")).exists(),
        "GPU 0's daemon, with a client, was stopped"
    );
    Ok(())
}
