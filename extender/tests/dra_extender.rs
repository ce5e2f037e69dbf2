//! Filter, prioritize and bind of pods on the DRA path (the marker `gpuledger.io/dra`), against
//! DRA and device-plugin nodes registered in a real allocator on real etcd: the request is read
//! from the pod's ResourceClaimTemplate in the API server, only DRA nodes pass, a node whose
//! first-fit GPU the ledger would refuse does not, prioritize scores the first-fit GPU, and bind
//! posts the Binding without reserving; device-plugin pods never pass a DRA node.

use crate::kit;

use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::kube::{ExtenderClient, KubeStack, StackOptions};
use gpuledger_testkit::workload::inventory;
use serde_json::{Value, json};

/// A fake API server store result as an anyhow result.
fn ok<T, E: std::fmt::Debug>(r: Result<T, E>) -> anyhow::Result<T> {
    r.map_err(|e| anyhow::anyhow!("{e:?}"))
}

const NODES: [&str; 4] = ["dra-small", "dra-big", "dra-sick", "dp-1"];

fn marker_pod(name: &str, template: &str) -> Value {
    json!({"metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}")},
        "spec": {"schedulerName": "gpuledger-scheduler",
            "resourceClaims": [{"name": "gpuledger", "resourceClaimTemplateName": template}],
            "containers": [{"name": "c", "image": "x", "resources": {
                "claims": [{"name": "gpuledger", "request": "c0"}],
                "limits": {"gpuledger.io/dra": "1"}, "requests": {"gpuledger.io/dra": "1"}}}]}})
}

/// Store the template `name` in `default`: one request c0 of one GPU with this capacity.
fn put_template(stack: &KubeStack, name: &str, memory: &str, cores: &str) -> anyhow::Result<()> {
    let t = json!({"metadata": {"name": name, "labels": {"gpuledger.io/managed": "true"}},
        "spec": {"metadata": {"labels": {"gpuledger.io/managed": "true"}},
            "spec": {"devices": {"requests": [{"name": "c0", "exactly": {
                "deviceClassName": "gpu.gpuledger.io", "allocationMode": "ExactCount", "count": 1,
                "capacity": {"requests": {"memory": memory, "cores": cores}}}}]}}}});
    ok(stack
        .api
        .store
        .create("resource.k8s.io/v1", "resourceclaimtemplates", "default", t))?;
    Ok(())
}

async fn register(
    stack: &KubeStack,
    n: &str,
    gpus: u32,
    mem: u64,
    mode: pb::NodeMode,
) -> anyhow::Result<()> {
    let mut inv = inventory(n, gpus, mem, "NVIDIA A10");
    inv.mode = mode as i32;
    stack
        .allocs
        .node_agent(0, n)?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inv),
        })
        .await?;
    Ok(())
}

/// The extender's filter of `pod` on every node.
async fn filter(ext: &ExtenderClient, pod: &Value) -> anyhow::Result<Value> {
    ext.post(
        "filter",
        &json!({"Pod": pod, "Nodes": null, "NodeNames": NODES}),
    )
    .await
}

fn names(v: &Value) -> Vec<String> {
    v["NodeNames"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn marker_pods_fit_dra_nodes_where_first_fit_lands_on_a_gpu_the_ledger_accepts()
-> anyhow::Result<()> {
    let stack = KubeStack::start(StackOptions {
        allocators: 1,
        extender_flags: Some(vec![]),
        ..Default::default()
    })
    .await?;
    register(&stack, "dra-small", 2, 24_000, pb::NodeMode::Dra).await?;
    register(&stack, "dra-big", 2, 80_000, pb::NodeMode::Dra).await?;
    register(&stack, "dra-sick", 2, 24_000, pb::NodeMode::Dra).await?;
    register(&stack, "dp-1", 2, 24_000, pb::NodeMode::DevicePlugin).await?;
    // GPU 0 of dra-sick is unhealthy: its slice device carries the NoSchedule taint, so the
    // scheduler's first fit passes it by and takes GPU 1, which the ledger accepts.
    stack
        .allocs
        .node_agent(0, "dra-sick")?
        .set_device_health(api::SetDeviceHealthRequest {
            node: "dra-sick".into(),
            gpu_uuid: "GPU-dra-sick-0".into(),
            healthy: false,
            reason: "XID 79".into(),
            ..Default::default()
        })
        .await?;
    kit::caught_up(&stack).await?;
    put_template(&stack, "gpuledger-0123456789ab", "20000Mi", "800")?;
    let pod = marker_pod("dra-0", "gpuledger-0123456789ab");
    stack.api.add_pod(pod.clone())?;
    let ext = kit::extender(&stack)?;
    let args = json!({"Pod": pod, "Nodes": null, "NodeNames": NODES});

    let f = filter(&ext, &pod).await?;
    assert_eq!(names(&f), ["dra-small", "dra-big", "dra-sick"], "{f}");
    let failed = &f["FailedNodes"];
    let dp = failed["dp-1"].as_str().unwrap_or_default();
    assert!(dp.contains("device plugin, not DRA"), "{f}");
    assert_eq!(f["FailedAndUnresolvableNodes"]["dp-1"], failed["dp-1"]);
    assert!(failed.get("dra-sick").is_none(), "{f}");

    // Binpack (the default): the node of 24 GB GPUs is left fuller than the one of 80 GB; the
    // others do not fit.
    let p = ext.post("prioritize", &args).await?;
    let score = |n: &str| {
        p.as_array()
            .and_then(|a| a.iter().find(|h| h["Host"] == n))
            .and_then(|h| h["Score"].as_i64())
    };
    assert!(score("dra-small") > score("dra-big"), "{p}");
    assert_eq!(score("dp-1"), Some(0), "{p}");
    assert!(
        score("dra-sick") > Some(0),
        "GPU 1 of dra-sick takes the pod: {p}"
    );

    // Too much memory for any GPU of the small nodes: only the big one.
    put_template(&stack, "gpuledger-big", "40000Mi", "0")?;
    let big = marker_pod("dra-1", "gpuledger-big");
    let f = filter(&ext, &big).await?;
    assert_eq!(names(&f), ["dra-big"], "{f}");

    // A template that does not exist: the scheduler is told to retry, no node is judged.
    let lost = marker_pod("dra-2", "gpuledger-missing");
    let f = filter(&ext, &lost).await?;
    assert!(
        f["Error"]
            .as_str()
            .is_some_and(|e| e.contains("gpuledger-missing")),
        "{f}"
    );

    // A device-plugin GPU pod never passes a DRA node.
    let dp_pod = json!({"metadata": {"name": "dp-0", "namespace": "default", "uid": "uid-dp-0"},
        "spec": {"schedulerName": "gpuledger-scheduler", "containers": [{"name": "c", "image": "x",
            "resources": {"limits": {"gpuledger.io/gpu": "1", "gpuledger.io/gpu-mem": "3000"}}}]}});
    let f = filter(&ext, &dp_pod).await?;
    assert_eq!(names(&f), ["dp-1"], "{f}");
    assert!(
        f["FailedNodes"]["dra-small"]
            .as_str()
            .is_some_and(|w| w.contains("through DRA")),
        "{f}"
    );

    // Bind of the marker pod: the Binding only, nothing reserved in the ledger.
    let bind = json!({"PodName": "dra-0", "PodNamespace": "default", "PodUID": "uid-dra-0",
                      "Node": "dra-small"});
    let r = ext.post("bind", &bind).await?;
    assert_eq!(r["Error"], "", "{r}");
    assert_eq!(
        stack
            .api
            .pod("default", "dra-0")
            .map(|p| p["spec"]["nodeName"].clone()),
        Some(json!("dra-small"))
    );
    let allocations = kit::allocations(&stack).await?;
    assert!(
        allocations
            .iter()
            .all(|a| a.pod.as_ref().is_none_or(|p| p.uid != "uid-dra-0")),
        "a DRA pod was reserved at bind: {allocations:?}"
    );
    Ok(())
}
