//! Regression (e2e `binds_in_flight`, 1 of 61 binds refused under load): kube-scheduler binds
//! asynchronously, so the next pod's filter can reach the extender before the previous pod's
//! bind does. A pod the extender found feasible holds that capacity, on every node it was
//! feasible on, until its bind says where it goes, or fails. Each filtered pod is checked
//! against the API server: a made-up one (fake filters once made a node refuse real pods) holds
//! nothing once its check fails, milliseconds later.

use crate::kit;

use gpuledger_testkit::kube::{ExtenderClient, KubeStack, StackOptions};
use serde_json::{Value, json};

fn pod(name: &str) -> Value {
    json!({"metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}")},
           "spec": {"schedulerName": "gpuledger-scheduler", "containers": [{"name": "c", "image": "x",
              "resources": {"limits": {"gpuledger.io/gpu": "1", "gpuledger.io/gpu-mem": "10000"}}}]}})
}

async fn fits(ext: &ExtenderClient, p: &Value) -> anyhow::Result<(Value, Value)> {
    let r = ext
        .post(
            "filter",
            &json!({"Pod": p, "Nodes": null, "NodeNames": ["n1", "n2"]}),
        )
        .await?;
    Ok((r["NodeNames"].clone(), r["FailedNodes"].clone()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filtered_pod_holds_its_capacity_until_its_bind() -> anyhow::Result<()> {
    let stack = KubeStack::start(StackOptions {
        allocators: 1,
        extender_flags: Some(Vec::new()),
        ..Default::default()
    })
    .await?;
    kit::register_one_gpu_nodes(&stack, &["n1", "n2"], "NVIDIA A10").await?;
    let ext = kit::extender(&stack)?;
    let (a, b) = (pod("a"), pod("b"));
    // A made-up pod (the API server has no such pod) holds nothing once it is checked.
    let (names, _) = fits(&ext, &pod("ghost")).await?;
    assert_eq!(names, json!(["n1", "n2"]));
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let (names, failed) = fits(&ext, &b).await?;
    assert_eq!(
        names,
        json!(["n1", "n2"]),
        "a made-up pod held room: {failed}"
    );
    // b is not in the API server either: let its check fail before a is filtered.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    stack.api.add_pod(a.clone())?;
    let (names, _) = fits(&ext, &a).await?;
    assert_eq!(names, json!(["n1", "n2"]));
    // a's bind has not arrived: b cannot have the room a may take on either node, at once
    // (the scheduler filters the next pod before a's check answers).
    let (names, failed) = fits(&ext, &b).await?;
    assert_eq!(names, json!([]), "{failed}");
    assert!(
        failed["n1"]
            .as_str()
            .is_some_and(|w| w.contains("counting binds in flight")),
        "{failed}"
    );
    // a's bind fails (a is gone from the API server): a is forgotten, b fits again.
    stack.api.delete_pod("default", "a")?;
    let bind = json!({"PodName": "a", "PodNamespace": "default", "PodUID": "uid-a", "Node": "n1"});
    let r = ext.post("bind", &bind).await?;
    assert!(r["Error"].as_str().is_some_and(|e| !e.is_empty()), "{r}");
    let (names, failed) = fits(&ext, &b).await?;
    assert_eq!(names, json!(["n1", "n2"]), "{failed}");
    Ok(())
}
