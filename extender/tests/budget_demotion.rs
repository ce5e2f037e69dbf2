//! A namespace that spent its budget (policy demote): the webhook, over real HTTPS, admits its
//! next GPU pod at the budget's priority class with an annotation saying why and when the
//! budget recovers; once the pod exists, the allocator leader gives it one Event saying so.
//! Real etcd, real gRPC, the fake API server.

use crate::kit;

use std::time::{Duration, Instant};

use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::free_port;
use gpuledger_testkit::kube::{KubeStack, StackOptions};
use gpuledger_testkit::workload::inventory;
use serde_json::{Value, json};

const ANN: &str = "gpuledger.io/budget-demoted";

fn gpu_pod(name: &str, mem: &str) -> Value {
    json!({"metadata": {"name": name, "namespace": "team-a"},
        "spec": {"schedulerName": "gpuledger-scheduler", "containers": [{"name": "c", "image": "x",
            "resources": {"limits": {"gpuledger.io/gpu": "1", "gpuledger.io/gpu-mem": mem}}}]}})
}

/// The Events on the pod with `uid`: (reason, message).
fn events_on(stack: &KubeStack, uid: &str) -> Vec<(String, String)> {
    stack
        .api
        .store
        .objects("v1", "events")
        .into_iter()
        .filter(|e| e["involvedObject"]["uid"] == uid)
        .map(|e| {
            (
                e["reason"].as_str().unwrap_or_default().to_owned(),
                e["message"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_pod_says_why_and_gets_one_event() -> anyhow::Result<()> {
    let port = free_port()?;
    let stack = KubeStack::start(StackOptions {
        allocators: 1,
        extender_flags: Some(vec![
            kit::webhook_flag(port),
            "--scheduler-name=gpuledger-scheduler".into(),
        ]),
        ..Default::default()
    })
    .await?;
    gpuledger_testkit::kube::stack::wait_http(port, Duration::from_secs(10)).await?;
    let hook = kit::webhook_client(&stack, port)?;
    stack
        .allocs
        .node_agent(0, "n1")?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("n1", 1, 16_000, "T4")),
        })
        .await?;
    stack.api.add_node("n1", 128)?;
    // 1 GPU-MiB-hour a day, spent in 225 ms by a pod holding 16,000 MiB.
    stack.demote_budget("team-a", "gpu-low", "test").await?;

    // Within budget: admitted unchanged.
    let early = kit::admit(&hook, gpu_pod("early", "1000"))
        .await?
        .map_err(anyhow::Error::msg)?;
    assert!(early["spec"].get("priorityClassName").is_none(), "{early}");
    assert!(early["metadata"].get("annotations").is_none(), "{early}");
    let early = stack.api.add_pod(early)?;

    let hog = stack.api.add_pod(gpu_pod("hog", "16000"))?;
    let mut req = kit::request(&hog)?;
    if let Some(p) = req.pod.as_mut() {
        p.uid = hog["metadata"]["uid"].as_str().unwrap_or_default().into();
    }
    kit::reserve_admitted(
        &mut stack.allocs.extender(0)?,
        api::ReserveRequest {
            request: Some(req),
            node: "n1".into(),
            ttl_ms: 0,
        },
    )
    .await?;

    // Spent: the next pod is demoted, and says why and when the budget recovers.
    let t0 = Instant::now();
    let late = loop {
        let p = kit::admit(&hook, gpu_pod("late", "1000"))
            .await?
            .map_err(anyhow::Error::msg)?;
        if p["spec"]["priorityClassName"] == "gpu-low" || t0.elapsed() > Duration::from_secs(10) {
            break p;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(late["spec"]["priorityClassName"], "gpu-low", "{late}");
    let why = late["metadata"]["annotations"][ANN]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        why.contains("namespace team-a has spent its GPU budget") && why.contains("recovers at"),
        "{why:?}"
    );

    // The pod as the API server stores it: the leader's pod watch gives it one Event.
    let late = stack.api.add_pod(late)?;
    let uid = late["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let t0 = Instant::now();
    while events_on(&stack, &uid).is_empty() && t0.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stack
        .api
        .store
        .update("v1", "pods", "team-a", "late", |p| {
            p["metadata"]["labels"] = json!({"touched": "yes"});
            Ok(())
        })
        .map_err(|e| anyhow::anyhow!("{}", e.message()))?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let evs = events_on(&stack, &uid);
    assert_eq!(evs.len(), 1, "one Event, not one per change: {evs:?}");
    let (reason, message) = &evs[0];
    assert_eq!(reason, "GpuBudgetDemoted");
    assert!(
        message.contains("priority class gpu-low") && message.contains(&why),
        "{message}"
    );
    let early_uid = early["metadata"]["uid"].as_str().unwrap_or_default();
    assert!(
        events_on(&stack, early_uid).is_empty(),
        "the pod admitted within budget gets no such Event"
    );
    Ok(())
}
