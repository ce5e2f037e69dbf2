//! kube-scheduler's `preempt` call to a real extender backed by a real allocator on etcd and the
//! fake API server, as a scheduler makes it when its own dry run found victims (a resource it
//! sees conflicts too; GPU memory alone never gets this far, see
//! `gpu_preemption_on_a_stock_scheduler.rs`): on a GPU full of lower-priority slices the
//! answer names the fewest pods whose slices free a fit (then the lowest priorities), keeps the
//! scheduler's own victims, drops the nodes where no eviction helps, and once the named pods
//! are gone the pod does fit there. The extender's own preemption from filter is off here
//! (`--preempt-retry-ms=0`), so that only the verb acts.

use crate::kit;

use std::time::{Duration, Instant};

use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::kube::{ExtenderClient, KubeStack, StackOptions};
use gpuledger_testkit::workload::inventory;
use serde_json::{Value, json};

const GIB: u64 = 1024;

/// A running pod on `node` asking for `mem_gib` of one GPU (none when 0), at `priority`.
fn pod(name: &str, node: Option<&str>, mem_gib: u64, priority: i32) -> Value {
    let limits = if mem_gib == 0 {
        json!({"cpu": "1"})
    } else {
        json!({"gpuledger.io/gpu": "1", "gpuledger.io/gpu-mem": (mem_gib * GIB).to_string()})
    };
    let mut p = json!({
        "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}")},
        "spec": {"schedulerName": "gpuledger-scheduler", "priority": priority,
                 "containers": [{"name": "c", "image": "x", "resources": {"limits": limits}}]},
        "status": {"phase": "Pending"},
    });
    if let Some(n) = node {
        p["spec"]["nodeName"] = json!(n);
        p["status"]["phase"] = json!("Running");
    }
    p
}

/// Create `p` in the API server, bound to its node, with its slice in the ledger when it asks
/// for one.
async fn running(stack: &KubeStack, p: &Value) -> anyhow::Result<()> {
    match p.pointer("/spec/nodeName").and_then(Value::as_str) {
        Some(node) if kit::request(p).is_ok() => {
            let r = kit::reserve(stack, p, node).await?;
            anyhow::ensure!(!r.allocations.is_empty(), "no allocation for {p}");
        }
        _ => {
            stack.api.add_pod(p.clone())?;
        }
    }
    Ok(())
}

/// `MetaVictims` UIDs per node of the answer.
fn victims(r: &Value) -> Vec<(String, Vec<String>)> {
    r["NodeNameToMetaVictims"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(n, v)| {
                    let uids = v["Pods"]
                        .as_array()
                        .map(|ps| {
                            ps.iter()
                                .filter_map(|p| p["UID"].as_str().map(String::from))
                                .collect()
                        })
                        .unwrap_or_default();
                    (n.clone(), uids)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The extender's preempt answer once its replica holds everything the allocator has: a
/// replica a few milliseconds behind would see a node with room to spare.
async fn preempt(stack: &KubeStack, ext: &ExtenderClient, args: &Value) -> anyhow::Result<Value> {
    kit::caught_up(stack).await?;
    ext.post("preempt", args).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preemption_frees_a_gpu_with_the_fewest_lowest_priority_victims() -> anyhow::Result<()> {
    let stack = KubeStack::start(StackOptions {
        allocators: 1,
        extender_flags: Some(vec![
            "--replica-stale-ms=3000".into(),
            "--preempt-retry-ms=0".into(),
        ]),
        ..Default::default()
    })
    .await?;
    for n in ["node-a", "node-b", "node-c", "node-d"] {
        stack
            .allocs
            .node_agent(0, n)?
            .register_node(api::RegisterNodeRequest {
                inventory: Some(inventory(n, 1, 80 * GIB, "NVIDIA A100-SXM4-80GB")),
            })
            .await?;
        stack.api.add_node(n, 64)?;
    }
    // node-a: one pod of 40 GiB, or two of 20 GiB at a lower priority, would free 40 GiB; a pod
    // with no GPU at the lowest priority of all frees nothing.
    // node-b: full with one pod that outranks the preemptor.
    // node-c: the scheduler evicts c-big anyway, which frees more than enough.
    // node-d: the scheduler evicts d-cpu (for its CPU), which frees no GPU memory.
    let pods = [
        pod("a-40", Some("node-a"), 40, 10),
        pod("a-20x", Some("node-a"), 20, 5),
        pod("a-20y", Some("node-a"), 20, 5),
        pod("a-cpu", Some("node-a"), 0, -100),
        pod("b-80", Some("node-b"), 80, 1000),
        pod("c-big", Some("node-c"), 60, 50),
        pod("c-small", Some("node-c"), 20, 1),
        pod("d-gpu", Some("node-d"), 80, 30),
        pod("d-cpu", Some("node-d"), 0, 1),
    ];
    for p in &pods {
        running(&stack, p).await?;
    }
    let preemptor = pod("in-budget", None, 40, 100);
    stack.api.add_pod(preemptor.clone())?;
    let ext = kit::extender(&stack)?;

    // Filter first, as the scheduler does: every node is full, none for good.
    let f = ext
        .post(
            "filter",
            &json!({"Pod": preemptor, "Nodes": null,
                                "NodeNames": ["node-a", "node-b", "node-c", "node-d"]}),
        )
        .await?;
    assert_eq!(f["NodeNames"], json!([]), "{f}");
    assert_eq!(f["FailedAndUnresolvableNodes"], json!({}), "{f}");

    // nodeCacheCapable: true, so victims come as UIDs; kube-scheduler's dry run does not see
    // GPU memory and reprieves every GPU pod, offering only what its CPU accounting needs.
    let meta = |uids: &[&str]| {
        json!({"Pods": uids.iter().map(|u| json!({"UID": u})).collect::<Vec<_>>(),
                                      "NumPDBViolations": 0})
    };
    let args = json!({
        "Pod": preemptor,
        "NodeNameToVictims": null,
        "NodeNameToMetaVictims": {
            "node-a": meta(&[]),
            "node-b": meta(&[]),
            "node-c": meta(&["uid-c-big"]),
            "node-d": meta(&["uid-d-cpu"]),
            "node-unknown": meta(&[]),
        },
    });
    let r = preempt(&stack, &ext, &args).await?;
    assert_eq!(
        victims(&r),
        [
            ("node-a".to_string(), vec!["uid-a-40".to_string()]),
            ("node-c".to_string(), vec!["uid-c-big".to_string()]),
            // Most important first, as the scheduler's own lists are.
            (
                "node-d".to_string(),
                vec!["uid-d-gpu".to_string(), "uid-d-cpu".to_string()],
            ),
        ],
        "{r}"
    );
    assert_eq!(
        r["NodeNameToMetaVictims"]["node-a"]["NumPDBViolations"], 0,
        "{r}"
    );

    // The same candidates as full pods (nodeCacheCapable: false) get the same answer.
    let full = |ps: &[&Value]| json!({"Pods": ps, "NumPDBViolations": 0});
    let args_full = json!({
        "Pod": preemptor,
        "NodeNameToVictims": {"node-a": full(&[]), "node-b": full(&[]), "node-c": full(&[&pods[5]]),
                              "node-d": full(&[&pods[8]])},
        "NodeNameToMetaVictims": null,
    });
    let r_full = preempt(&stack, &ext, &args_full).await?;
    assert_eq!(victims(&r_full), victims(&r), "{r_full}");

    // A preemptor of the victims' own priority may evict none of them.
    let mut peer = preemptor.clone();
    peer["spec"]["priority"] = json!(5);
    let mut args_peer = args.clone();
    args_peer["Pod"] = peer;
    let r_peer = preempt(&stack, &ext, &args_peer).await?;
    assert_eq!(
        victims(&r_peer),
        [("node-c".to_string(), vec!["uid-c-big".to_string()])],
        "{r_peer}"
    );

    // The scheduler deletes the victim; once the allocator has released its slice, the
    // preemptor fits on node-a.
    stack.api.delete_pod("default", "a-40")?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let f = ext
            .post(
                "filter",
                &json!({"Pod": preemptor, "Nodes": null, "NodeNames": ["node-a"]}),
            )
            .await?;
        if f["NodeNames"] == json!(["node-a"]) {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "node-a never fits: {f}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Nothing to evict there now: no answer for node-a (the filter offers it), and newer
    // schedulers refuse a node without victims.
    let r = preempt(&stack, &ext, &args).await?;
    assert!(r["NodeNameToMetaVictims"].get("node-a").is_none(), "{r}");
    assert!(r["NodeNameToMetaVictims"].get("node-c").is_some(), "{r}");
    Ok(())
}
