//! What the agent tells people: Kubernetes Events on the pod (limit exceeded, identity
//! corrected), created through an ordinary kubeconfig against the test kit's API server, and
//! its `/metrics` (Allocate latency, NVML-measured memory, violations, health).

use crate::support;

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use gpuledger_testkit::free_port;
use gpuledger_testkit::kube::FakeApiServer;
use serde_json::Value;
use support::Cluster;

struct Observed {
    api: FakeApiServer,
    _dir: tempfile::TempDir,
    port: u16,
    flags: Vec<String>,
}

async fn observed() -> anyhow::Result<Observed> {
    let dir = tempfile::tempdir()?;
    let api = FakeApiServer::start(dir.path()).await?;
    let port = free_port()?;
    let flags = vec![
        format!("--kubeconfig={}", api.kubeconfig().display()),
        format!("--health-listen=127.0.0.1:{port}"),
    ];
    Ok(Observed {
        api,
        _dir: dir,
        port,
        flags,
    })
}

async fn wait_event(api: &FakeApiServer, pod: &str, reason: &str) -> anyhow::Result<Value> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let events = api.store.objects("v1", "events");
        if let Some(e) = events
            .iter()
            .find(|e| e["involvedObject"]["name"] == pod && e["reason"] == reason)
        {
            return Ok(e.clone());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "no {reason} event for {pod}; events: {events:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The value of the series whose line starts with `series` (name and labels).
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

async fn scrape(port: u16) -> anyhow::Result<String> {
    let (code, text) =
        gpuledger_testkit::http::get(&format!("http://127.0.0.1:{port}/metrics")).await?;
    anyhow::ensure!(code == 200, "/metrics answered {code}: {text}");
    Ok(text)
}

fn sleeper(allocation_id: u64) -> anyhow::Result<Child> {
    Ok(Command::new("sleep")
        .arg("60")
        .env("GPULEDGER_ALLOCATION_ID", allocation_id.to_string())
        .spawn()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_container_gets_an_event_and_the_metrics_follow_nvml() -> anyhow::Result<()> {
    let o = observed().await?;
    let flags: Vec<&str> = o.flags.iter().map(String::as_str).collect();
    let mut c = Cluster::start(1, &flags).await?;
    let gpu = c.gpu(0);
    let a = c.reserve("uid-a", 10_000, None).await?;
    let b = c.reserve("uid-b", 6_000, None).await?;
    c.kubelet.admit("default", "pod-uid-a", "main", 1).await?;
    c.kubelet.admit("default", "pod-uid-b", "main", 1).await?;

    let hog = sleeper(a.id)?;
    let fine = sleeper(b.id)?;
    c.nvml.set_process(hog.id(), 12_000, &gpu)?;
    c.nvml.set_process(fine.id(), 5_000, &gpu)?;

    let e = wait_event(&o.api, "pod-uid-a", "GpuLimitExceeded").await?;
    assert_eq!(e["type"], "Warning");
    assert_eq!(e["metadata"]["namespace"], "default");
    assert_eq!(e["source"]["host"], support::NODE);
    let msg = e["message"].as_str().unwrap_or_default();
    for want in [
        "12000 MiB",
        "10000 MiB",
        gpu.as_str(),
        "killed",
        "This node's isolation is nvml",
    ] {
        assert!(msg.contains(want), "{want:?} missing from {msg:?}");
    }
    assert!(
        o.api
            .store
            .objects("v1", "events")
            .iter()
            .all(|e| e["involvedObject"]["name"] != "pod-uid-b"),
        "the pod within its limit gets no event"
    );

    // After the kill only the process within its limit uses memory, as NVML measures it.
    let used = format!("gpuledger_node_agent_gpu_memory_used_bytes{{gpu=\"{gpu}\"}}");
    let deadline = Instant::now() + Duration::from_secs(5);
    let text = loop {
        let text = scrape(o.port).await?;
        if value(&text, &used) == Some(5_000.0 * 1048576.0) {
            break text;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{used} never became 5000 MiB:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let allocated = format!("gpuledger_node_agent_gpu_memory_allocated_bytes{{gpu=\"{gpu}\"}}");
    assert_eq!(
        value(&text, &allocated),
        Some(16_000.0 * 1048576.0),
        "{text}"
    );
    // pod() asks 10 % compute for each of the two pods on the one GPU.
    let core = format!("gpuledger_node_agent_gpu_core_allocated_permille{{gpu=\"{gpu}\"}}");
    assert_eq!(value(&text, &core), Some(200.0), "{text}");
    let kills = r#"gpuledger_node_agent_violations_total{action="kill"}"#;
    assert_eq!(value(&text, kills), Some(1.0), "{text}");
    let allocates = r#"gpuledger_node_agent_allocate_duration_seconds_count{outcome="ok"}"#;
    assert_eq!(value(&text, allocates), Some(2.0), "{text}");
    let healthy = format!("gpuledger_node_agent_gpu_healthy{{gpu=\"{gpu}\"}}");
    assert_eq!(value(&text, &healthy), Some(1.0), "{text}");
    assert_eq!(
        value(&text, "gpuledger_node_agent_kubelet_registered"),
        Some(1.0)
    );
    assert_eq!(value(&text, "gpuledger_node_agent_enforcing"), Some(1.0));
    assert_eq!(
        value(&text, r#"gpuledger_node_agent_isolation{mode="nvml"}"#),
        Some(1.0),
        "{text}"
    );
    assert_eq!(value(&text, "gpuledger_node_agent_allocations"), Some(2.0));
    assert!(value(&text, "gpuledger_node_agent_ledger_seq").is_some_and(|s| s > 0.0));
    let (code, _) =
        gpuledger_testkit::http::get(&format!("http://127.0.0.1:{}/readyz", o.port)).await?;
    assert_eq!(code, 200);
    for mut ch in [hog, fine] {
        let _ = ch.kill();
        let _ = ch.wait();
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrected_identity_is_told_to_the_pod() -> anyhow::Result<()> {
    let o = observed().await?;
    let flags: Vec<&str> = o.flags.iter().map(String::as_str).collect();
    let c = Cluster::start(2, &flags).await?;
    let (g0, g1) = (c.gpu(0), c.gpu(1));
    let a = c.reserve("uid-a", 10_000, Some(&g0)).await?;
    c.reserve("uid-b", 10_000, Some(&g1)).await?;
    // B is admitted first and gets A's (older) reservation on GPU 0; PreStart corrects it.
    // (The kubelet knows A already, so both reservations could be B's.)
    c.kubelet.add_pod("default", "pod-uid-a", "main");
    c.kubelet.admit("default", "pod-uid-b", "main", 1).await?;
    let e = wait_event(&o.api, "pod-uid-b", "GpuIdentityCorrected").await?;
    let msg = e["message"].as_str().unwrap_or_default();
    assert!(msg.contains(&g0), "{msg}");
    assert!(msg.contains("default/pod-uid-a"), "{msg}");
    assert!(msg.contains(&format!("allocation {}", a.id)), "{msg}");
    Ok(())
}

/// Regression (hostile load II): the agent's port of probes and metrics accepted every
/// connection, in the same process as the device plugin. Now it holds
/// `--http-max-connections`, closes what sends no request in time, and the probe still gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_cannot_take_the_health_port() -> anyhow::Result<()> {
    use gpuledger_testkit::attacker::{ensure_closed_within, idle_flood_past};
    let port = free_port()?;
    let health = format!("--health-listen=127.0.0.1:{port}");
    let c = Cluster::start(
        1,
        &[
            &health,
            "--http-max-connections=64",
            "--http-max-connections-per-peer=8",
            "--http-header-read-timeout-ms=1500",
        ],
    )
    .await?;
    let url = |path: &str| format!("http://127.0.0.1:{port}{path}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while gpuledger_testkit::http::get(&url("/healthz"))
        .await
        .is_err()
    {
        anyhow::ensure!(Instant::now() < deadline, "the health port never answered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut flood = idle_flood_past(([127, 0, 0, 1], port).into(), 64).await?;
    let (code, _) = gpuledger_testkit::http::get(&url("/healthz")).await?;
    assert_eq!(code, 200, "the liveness probe during the flood");
    ensure_closed_within(&mut flood, Duration::from_millis(1600)).await?;
    let text = scrape(port).await?;
    for limit in ["http_connections_per_peer", "http_connections_evicted"] {
        let series =
            format!("gpuledger_node_agent_limited_total{{listener=\"http\",limit=\"{limit}\"}}");
        assert!(value(&text, &series).is_some_and(|n| n >= 1.0), "{text}");
    }
    drop(c);
    Ok(())
}

/// Defence in depth: on a node whose first layer is MPS or dmem, a process that got past it
/// (here: one the fake NVML shows using more than its share) is still killed by the NVML
/// backstop, and the pod's Event names the layer it escaped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_escape_from_mps_or_dmem_is_killed_and_the_event_names_the_layer() -> anyhow::Result<()>
{
    use gpuledger_testkit::kubelet::node::{MpsReaper, mps_stand_in};
    for mode in ["mps", "dmem"] {
        let o = observed().await?;
        let tmp = tempfile::tempdir()?;
        let mut flags = o.flags.clone();
        flags.push(format!("--isolation={mode}"));
        let mut nvml: Option<support::NvmlEdit> = None;
        let _reaper = if mode == "mps" {
            let control = mps_stand_in(&tmp.path().join("bin"))?;
            let dir = tmp.path().join("mps");
            flags.push(format!("--mps-control={}", control.display()));
            flags.push(format!("--mps-dir={}", dir.display()));
            Some(MpsReaper(dir))
        } else {
            let root = tmp.path().join("cgroup");
            crate::dmem_isolation::tree(&root)?;
            flags.push(format!("--cgroup-root={}", root.display()));
            nvml = Some(Box::new(|cfg| cfg.driver_version = "615.20.01".into()));
            None
        };
        let mut c = Cluster::start_opts(support::Options {
            flags,
            nvml,
            ..support::Options::default()
        })
        .await?;
        let gpu = c.gpu(0);
        let a = c.reserve("uid-a", 10_000, None).await?;
        c.kubelet.admit("default", "pod-uid-a", "main", 1).await?;
        let mut hog = sleeper(a.id)?;
        c.nvml.set_process(hog.id(), 12_000, &gpu)?;

        let e = wait_event(&o.api, "pod-uid-a", "GpuLimitExceeded").await?;
        let msg = e["message"].as_str().unwrap_or_default();
        let layer = format!(
            "escaped this node's first isolation layer, {mode}, and the NVML backstop caught it"
        );
        for want in ["12000 MiB", "10000 MiB", "killed", layer.as_str()] {
            assert!(msg.contains(want), "{mode}: {want:?} missing from {msg:?}");
        }
        let status = hog.wait()?;
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(9), "{mode}: killed with SIGKILL");
    }
    Ok(())
}
