//! The Grafana dashboard in deploy/ queries only series the binaries export: every `gpuledger_*`
//! name in its expressions is scraped from a running allocator, extender and node agent.

use std::collections::BTreeSet;
use std::time::Duration;

use gpuledger_testkit::kube::stack::wait_http;
use gpuledger_testkit::kube::{KubeStack, StackOptions};
use gpuledger_testkit::kubelet::Kubelet;
use gpuledger_testkit::kubelet::node::{FakeNvml, NodeAgent};
use gpuledger_testkit::promtext::{dashboard_exprs, exported_names, names_in_expr};
use gpuledger_testkit::{free_port, http};

async fn scrape(url: &str) -> anyhow::Result<BTreeSet<String>> {
    let (code, text) = http::get(url).await?;
    anyhow::ensure!(code == 200, "{url}: HTTP {code}: {text}");
    Ok(exported_names(&text))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_expression_names_an_exported_metric() -> anyhow::Result<()> {
    let stack = KubeStack::start(StackOptions {
        etcd_members: 1,
        allocators: 1,
        allocator_flags: vec![],
        extender_flags: Some(vec![]),
    })
    .await?;
    let dir = tempfile::tempdir()?;
    let kubelet = Kubelet::start(&dir.path().join("kubelet")).await?;
    let nvml = FakeNvml::new(dir.path(), "n1", 2, 16_000)?;
    let port = free_port()?;
    let health = format!("--health-listen=127.0.0.1:{port}");
    let _agent = NodeAgent::start(
        dir.path(),
        "n1",
        &stack.allocs.addrs,
        &nvml,
        &kubelet,
        &[health.as_str()],
    )?;
    wait_http(port, Duration::from_secs(20)).await?;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while http::get(&format!("http://127.0.0.1:{port}/readyz"))
        .await?
        .0
        != 200
    {
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the node agent never got ready"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let mut exported = scrape(&format!("http://{}/metrics", stack.allocs.http[0])).await?;
    let ext = stack.extender_url.trim_end_matches("/gpuledger");
    exported.extend(scrape(&format!("{ext}/metrics")).await?);
    exported.extend(scrape(&format!("http://127.0.0.1:{port}/metrics")).await?);
    for component in ["allocator", "extender", "node_agent"] {
        assert!(
            exported
                .iter()
                .any(|n| n.starts_with(&format!("gpuledger_{component}_"))),
            "nothing exported by the {component}: {exported:?}"
        );
    }

    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/grafana/gpuledger-dashboard.json");
    let dashboard: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    let exprs = dashboard_exprs(&dashboard);
    assert!(
        exprs.len() >= 10,
        "only {} expressions in {path:?}",
        exprs.len()
    );
    let mut missing = Vec::new();
    for e in &exprs {
        let names = names_in_expr(e);
        assert!(
            !names.is_empty(),
            "an expression names no gpuledger metric: {e}"
        );
        missing.extend(names.into_iter().filter(|n| !exported.contains(n)));
    }
    assert!(
        missing.is_empty(),
        "the dashboard queries series no binary exports: {missing:?}\nexported: {exported:?}"
    );
    Ok(())
}
