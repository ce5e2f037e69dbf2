//! NVML charges a process's CUDA context to the process: on an H100 80GB HBM3 (driver 580) a
//! process that allocated a 4096 MiB tensor showed 4614 MiB. The fake NVML reproduces that
//! (a 518 MiB context per process); a pod given 4096 MiB that fills them is left alone by
//! default (--context-allowance-mib), and killed when the allowance is 0.

use crate::support;

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use support::cgroups::Sleeper;
use support::{Cluster, Options};

/// A cluster whose GPU charges a 518 MiB context to each process, and a process of a pod
/// given 4096 MiB that allocated 4096 MiB.
async fn full_share(flags: &[&str]) -> anyhow::Result<(Cluster, Sleeper, u64)> {
    let c = Cluster::start_opts(Options {
        flags: flags.iter().map(|f| f.to_string()).collect(),
        nvml: Some(Box::new(|cfg| cfg.gpus[0].context_mib = 518)),
        ..Options::default()
    })
    .await?;
    let a = c.reserve("uid-a", 4_096, None).await?;
    c.kubelet.admit("default", "pod-uid-a", "main", 1).await?;
    let p = Sleeper::outside_pods(Some(a.id))?;
    let gpu = c.gpu(0);
    c.edit_nvml(|cfg| {
        cfg.processes.push(nvidia_ml::FakeProcess {
            pid: p.pid(),
            used_mib: 4_096,
            gpu,
        })
    })?;
    Ok((c, p, a.id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_fills_its_share_is_not_killed_for_its_cuda_context() -> anyhow::Result<()> {
    let (c, mut p, _) = full_share(&[]).await?;
    // NVML shows what the real driver showed: 4096 + 518.
    let text = std::fs::read_to_string(c.nvml.path())?;
    assert!(text.contains("\"context_mib\": 518"), "{text}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(p.alive(), "killed for its context\n{}", c.agent_log());
    assert!(c.violations().await?.is_empty());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_context_allowance_the_context_counts_against_the_share() -> anyhow::Result<()> {
    let (c, mut p, id) = full_share(&["--context-allowance-mib=0"]).await?;
    let st = p.ended(Duration::from_secs(10)).await;
    assert_eq!(st.and_then(|s| s.signal()), Some(9), "{}", c.agent_log());
    let v = c
        .wait_violations(&[p.pid()], Duration::from_secs(5))
        .await?;
    assert_eq!(
        (v[0].allocation_id, v[0].used_mib, v[0].limit_mib),
        (id, 4_614, 4_096)
    );
    Ok(())
}
