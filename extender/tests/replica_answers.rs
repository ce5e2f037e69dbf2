//! The extender answers filter and prioritize from its replica of the ledger: the answers equal
//! the allocator's gRPC answers for the same state (default policy and learned FGD workload
//! included), follow the ledger as it changes, survive the allocators for the staleness bound,
//! and past it fall back to the allocator, which names the dead ledger.

use crate::kit;

use std::time::{Duration, Instant};

use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::kube::{ExtenderClient, KubeStack, StackOptions};
use gpuledger_testkit::workload::inventory;
use serde_json::{Value, json};

fn pod(name: &str, mem: &str, core: &str, policy: Option<&str>) -> Value {
    let mut p = json!({"metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}")},
           "spec": {"schedulerName": "gpuledger-scheduler", "containers": [{"name": "c", "image": "x",
              "resources": {"limits": {"gpuledger.io/gpu": "1", "gpuledger.io/gpu-mem": mem,
                                       "gpuledger.io/gpu-core": core}}}]}});
    if let Some(pol) = policy {
        p["metadata"]["annotations"] = json!({"gpuledger.io/policy": pol});
    }
    p
}

const NODES: [&str; 3] = ["n-big", "n-small", "n-t4"];

/// The allocator's Filter and Score, shaped as the extender answers.
async fn allocator_answer(stack: &KubeStack, p: &Value) -> anyhow::Result<(Value, Value)> {
    let mut c = stack.allocs.extender(0)?;
    let nodes: Vec<String> = NODES.map(String::from).to_vec();
    let f = c
        .filter(api::FilterRequest {
            request: Some(kit::request(p)?),
            nodes: nodes.clone(),
        })
        .await?
        .into_inner();
    let s = c
        .score(api::ScoreRequest {
            request: Some(kit::request(p)?),
            nodes,
        })
        .await?
        .into_inner();
    // Every failed node is in FailedNodes (what kube-scheduler 1.20 reads), and no text the
    // scheduler sees has a `%`.
    let text = |m: std::collections::HashMap<String, String>| -> std::collections::BTreeMap<String, String> {
        let no_pct = gpuledger_extender::scheduler_text::without_percent;
        m.into_iter().map(|(n, why)| (n, no_pct(&why).into_owned())).collect()
    };
    let failed = text(f.failed.into_iter().chain(f.unresolvable.clone()).collect());
    let filter = json!({"NodeNames": f.nodes, "FailedNodes": failed,
                        "FailedAndUnresolvableNodes": text(f.unresolvable), "Error": ""});
    let scores: Vec<Value> = s
        .scores
        .iter()
        .map(|s| json!({"Host": s.node, "Score": s.score}))
        .collect();
    Ok((filter, Value::Array(scores)))
}

/// The extender's filter and prioritize for `p`, then its bind, which fails (the probe is not in
/// the API server): the extender assumes a filtered pod until its bind, and a failed bind is
/// forgotten, so no probe counts against the next one's answers.
async fn extender_answer(ext: &ExtenderClient, p: &Value) -> anyhow::Result<(Value, Value)> {
    let args = json!({"Pod": p, "Nodes": null, "NodeNames": NODES});
    let answer = (
        ext.post("filter", &args).await?,
        ext.post("prioritize", &args).await?,
    );
    let m = &p["metadata"];
    let bind = json!({"PodName": m["name"], "PodNamespace": m["namespace"], "PodUID": m["uid"],
                      "Node": NODES[0]});
    let r = ext.post("bind", &bind).await?;
    anyhow::ensure!(
        r["Error"]
            .as_str()
            .is_some_and(|e| e.contains("reading pod")),
        "the probe's bind: {r}"
    );
    Ok(answer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filter_and_prioritize_come_from_the_replica_and_equal_the_allocator() -> anyhow::Result<()>
{
    let mut stack = KubeStack::start(StackOptions {
        allocators: 1,
        allocator_flags: vec!["--default-policy=fgd".into(), "--fgd-min-samples=2".into()],
        extender_flags: Some(vec!["--replica-stale-ms=3000".into()]),
        ..Default::default()
    })
    .await?;
    for (n, gpus, mem, model) in [
        ("n-big", 4, 81_920, "NVIDIA A100-SXM4-80GB"),
        ("n-small", 2, 24_000, "NVIDIA A10"),
        ("n-t4", 1, 16_000, "Tesla T4"),
    ] {
        stack
            .allocs
            .node_agent(0, n)?
            .register_node(api::RegisterNodeRequest {
                inventory: Some(inventory(n, gpus, mem, model)),
            })
            .await?;
    }
    let ext = kit::extender(&stack)?;
    let probes = [
        pod("probe-fgd", "10000", "30", None),
        pod("probe-binpack", "20000", "50", Some("binpack")),
        pod("probe-spread", "4000", "10", Some("spread")),
    ];
    let mut last = Vec::new();
    // Equal answers while the state moves: three reservations (FGD learns from two).
    for (i, node) in ["", "n-big", "n-small", "n-big"].iter().enumerate() {
        if !node.is_empty() {
            kit::reserve(&stack, &pod(&format!("r{i}"), "16000", "40", None), node).await?;
        }
        kit::caught_up(&stack).await?;
        last.clear();
        for p in &probes {
            let want = allocator_answer(&stack, p).await?;
            let got = extender_answer(&ext, p).await?;
            assert_eq!(
                got, want,
                "{} after {i} reservations",
                p["metadata"]["name"]
            );
            last.push(got);
        }
    }
    let from_replica = kit::metric(
        &stack,
        r#"gpuledger_extender_answers_total{verb="filter",source="replica"} "#,
    )
    .await?;
    assert!(
        from_replica >= 12.0,
        "filter answered by the replica {from_replica} times"
    );

    // The replica follows the ledger: fill n-small and filter says so.
    kit::reserve(&stack, &pod("fill-a", "20000", "50", None), "n-small").await?;
    kit::reserve(&stack, &pod("fill-b", "8000", "50", None), "n-small").await?;
    kit::caught_up(&stack).await?;
    let (f, _) = extender_answer(&ext, &probes[1]).await?;
    assert!(f["FailedNodes"]["n-small"].is_string(), "{f}");
    assert_eq!(f, allocator_answer(&stack, &probes[1]).await?.0);
    // Every batch the allocator handed on chained onto the one before, hashed by the extender.
    assert_eq!(
        kit::metric(&stack, "gpuledger_extender_replica_chain_breaks_total ").await?,
        0.0
    );

    // The allocator dies: within the staleness bound the replica still answers, the same.
    let before = extender_answer(&ext, &probes[0]).await?;
    stack.allocs.procs[0].kill();
    let t = Instant::now();
    let after = extender_answer(&ext, &probes[0]).await?;
    if t.elapsed() < Duration::from_secs(2) {
        assert_eq!(after, before, "answered from the replica");
    }
    // Past the bound the extender asks the allocator, and says the ledger is unavailable.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let args = json!({"Pod": probes[0], "Nodes": null, "NodeNames": NODES});
    let f = ext.post("filter", &args).await?;
    let err = f["Error"].as_str().unwrap_or("");
    assert!(err.contains("ledger unavailable"), "{f}");
    assert_eq!(
        kit::metric(&stack, "gpuledger_extender_replica_synced ").await?,
        0.0
    );
    Ok(())
}
