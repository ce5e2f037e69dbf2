//! NVML reports pids in the host's pid namespace. An agent that can see it is not there (a
//! DaemonSet without `hostPID: true`) would map those pids to other processes or none, so it
//! refuses to enforce, says so in `/readyz`, its log and a metric, and touches nothing.

use crate::support;

use std::process::Command;
use std::time::Duration;

use support::{AgentIn, Cluster, Options};

async fn get(port: u16, path: &str) -> anyhow::Result<(u16, String)> {
    gpuledger_testkit::http::get(&format!("http://127.0.0.1:{port}{path}")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outside_the_host_pid_namespace_the_agent_refuses_to_enforce_and_says_why()
-> anyhow::Result<()> {
    let port = gpuledger_testkit::free_port()?;
    let mut c = Cluster::start_opts(Options {
        flags: vec![format!("--health-listen=127.0.0.1:{port}")],
        agent_in: AgentIn::OwnPidNamespace,
        ..Options::default()
    })
    .await?;
    let gpu = c.gpu(0);
    let a = c.reserve("uid-a", 1_000, None).await?;
    c.kubelet.admit("default", "pod-uid-a", "main", 1).await?;
    // Far over its limit: an enforcing agent kills it within a pass (200 ms).
    let mut hog = Command::new("sleep")
        .arg("60")
        .env("GPULEDGER_ALLOCATION_ID", a.id.to_string())
        .spawn()?;
    c.nvml.set_process(hog.id(), 30_000, &gpu)?;
    tokio::time::sleep(Duration::from_secs(2)).await;

    let (code, body) = get(port, "/readyz").await?;
    assert_eq!(code, 503, "{body}");
    assert!(
        body.contains("enforcement refused") && body.contains("hostPID: true"),
        "{body}"
    );
    let (_, metrics) = get(port, "/metrics").await?;
    assert!(
        metrics
            .lines()
            .any(|l| l == "gpuledger_node_agent_enforcing 0"),
        "{metrics}"
    );
    assert!(
        c.agent.proc.log_tail(200).contains("ENFORCEMENT REFUSED"),
        "{}",
        c.agent_log()
    );
    assert!(hog.try_wait()?.is_none(), "nothing is killed");
    assert!(
        c.violations().await?.is_empty(),
        "nothing is attributed or reported"
    );
    // It still measures what NVML sees, and still serves the kubelet.
    let used = format!("gpuledger_node_agent_gpu_memory_used_bytes{{gpu=\"{gpu}\"}} ");
    assert!(
        metrics
            .lines()
            .any(|l| l.strip_prefix(&used) == Some(&(30_000u64 << 20).to_string())),
        "{metrics}"
    );
    let _ = hog.kill();
    let _ = hog.wait();
    Ok(())
}
