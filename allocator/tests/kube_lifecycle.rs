//! The allocator watches Kubernetes: a deleted or finished pod frees its GPUs within 2 s, a
//! deleted node frees everything on it.

use crate::support;

use std::time::Duration;

use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::cluster::SCHEDULER_NAME;
use gpuledger_testkit::kube::{KubeStack, StackOptions};
use gpuledger_testkit::workload::{inventory, pod};
use k8s_openapi::serde_json::json;
use support::{reserve_admitted, wait_until};

async fn live(stack: &KubeStack) -> anyhow::Result<Vec<pb::Allocation>> {
    let d = stack
        .allocs
        .viewer(0)?
        .dump(api::DumpRequest {})
        .await?
        .into_inner();
    Ok(d.snapshot.map(|s| s.allocations).unwrap_or_default())
}

/// Whether replica `i`'s ledger holds GPUs for pod `uid`.
async fn holds(
    allocs: &gpuledger_testkit::Allocators,
    i: usize,
    uid: &str,
) -> anyhow::Result<bool> {
    let d = allocs
        .viewer(i)?
        .dump(api::DumpRequest {})
        .await?
        .into_inner();
    let l = d.snapshot.map(|s| s.allocations).unwrap_or_default();
    Ok(l.iter()
        .any(|x| x.pod.as_ref().is_some_and(|p| p.uid == uid)))
}

/// Create the pod in the API server, reserve and bind it like the extender does.
async fn place(stack: &KubeStack, name: &str, node: &str) -> anyhow::Result<String> {
    let mut req = pod("", 2_000, 10);
    let p = stack
        .api
        .add_pod(json!({"metadata": {"name": name, "namespace": "default"},
        "spec": gpuledger_testkit::workload::pod_spec(&req, SCHEDULER_NAME)}))?;
    let uid = p["metadata"]["uid"].as_str().expect("uid").to_string();
    if let Some(r) = req.pod.as_mut() {
        r.name = name.into();
        r.uid.clone_from(&uid);
    }
    reserve_admitted(
        &mut stack.allocs.extender(0)?,
        api::ReserveRequest {
            request: Some(req),
            node: node.into(),
            ttl_ms: 0,
        },
    )
    .await?;
    stack
        .api
        .store
        .bind("default", name, &json!({"target": {"name": node}}))
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    Ok(uid)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_pods_and_nodes_release() -> anyhow::Result<()> {
    let stack = KubeStack::start(StackOptions {
        allocators: 2,
        allocator_flags: vec!["--reconcile-interval-ms=200".into()],
        ..Default::default()
    })
    .await?;
    for n in ["n1", "n2"] {
        stack
            .allocs
            .node_agent(0, n)?
            .register_node(api::RegisterNodeRequest {
                inventory: Some(inventory(n, 2, 16_000, "T4")),
            })
            .await?;
        stack.api.add_node(n, 128)?;
    }
    let a = place(&stack, "a", "n1").await?;
    let b = place(&stack, "b", "n1").await?;
    let d = place(&stack, "d", "n2").await?;
    let e = place(&stack, "e", "n2").await?;
    // Bound pods are confirmed from the watch.
    wait_until("pods confirmed bound", Duration::from_secs(5), || async {
        let l = live(&stack).await?;
        Ok(l.len() == 4
            && l.iter()
                .all(|x| x.state == pb::AllocationState::Bound as i32))
    })
    .await?;

    stack.api.delete_pod("default", "a")?;
    let took = wait_until("pod a released", Duration::from_secs(2), || async {
        Ok(!live(&stack)
            .await?
            .iter()
            .any(|x| x.pod.as_ref().is_some_and(|p| p.uid == a)))
    })
    .await?;
    eprintln!("pod deletion released in {took:?}");

    stack.api.set_pod_phase("default", "b", "Succeeded")?;
    wait_until(
        "finished pod b released",
        Duration::from_secs(2),
        || async {
            Ok(!live(&stack)
                .await?
                .iter()
                .any(|x| x.pod.as_ref().is_some_and(|p| p.uid == b)))
        },
    )
    .await?;

    stack.api.delete_node("n2")?;
    wait_until(
        "node n2 removed with its allocations",
        Duration::from_secs(2),
        || async {
            let l = live(&stack).await?;
            let snap = stack
                .allocs
                .viewer(0)?
                .dump(api::DumpRequest {})
                .await?
                .into_inner()
                .snapshot
                .expect("snapshot");
            Ok(l.is_empty() && snap.nodes.iter().all(|n| n.node != "n2"))
        },
    )
    .await?;
    let _ = (d, e);
    Ok(())
}

/// A pod deleted while its leader lies dead: the replica that leads next saw the deletion in
/// its own watch (not leading, it wrote nothing then) and releases the pod's GPUs in its first
/// pass, not after the [`YOUNG`](gpuledger_allocator::expiry::YOUNG) wait its reconcile gives
/// a grant it has just met and whose pod its cache lacks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_deleted_while_the_leader_is_dead_is_released_as_the_next_one_leads()
-> anyhow::Result<()> {
    let mut stack = KubeStack::start(StackOptions {
        allocators: 2,
        // Time enough to delete the pod while nobody leads.
        allocator_flags: vec!["--reconcile-interval-ms=200".into(), "--lease-ttl=4".into()],
        ..Default::default()
    })
    .await?;
    let leader = stack.allocs.wait_leader(Duration::from_secs(20)).await?;
    stack
        .allocs
        .node_agent(leader, "n1")?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("n1", 2, 16_000, "T4")),
        })
        .await?;
    stack.api.add_node("n1", 128)?;
    let a = place(&stack, "a", "n1").await?;
    let other = 1 - leader;
    wait_until(
        "pod a held on the other replica",
        Duration::from_secs(5),
        || holds(&stack.allocs, other, &a),
    )
    .await?;

    stack.allocs.procs[leader].kill();
    stack.api.delete_pod("default", "a")?;
    // The lease runs out 4 s after the kill at most; the release follows in the new leader's
    // first pass. Waiting out YOUNG (5 s) on top would take 9 s.
    let took = wait_until(
        "pod a released by the next leader",
        Duration::from_secs(7),
        || async { Ok(!holds(&stack.allocs, other, &a).await?) },
    )
    .await?;
    let new = stack
        .allocs
        .wait_leader_except(Duration::from_secs(1), Some(leader))
        .await?;
    assert_eq!(new, other);
    eprintln!("released {took:?} after the delete, the leader dead");
    Ok(())
}

/// A pending GPU pod kube-scheduler found unschedulable gets the status condition
/// `gpuledger.io/RoomFreed` once the ledger releases the GPUs of a deleted pod, so that kube-scheduler retries it then,
/// not at its next unrelated event or its 5-minute flush. A pending pod kube-scheduler has not
/// given up on, and a bound one, are left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_gpu_pod_is_requeued_when_the_ledger_frees_room() -> anyhow::Result<()> {
    let stack = KubeStack::start(StackOptions {
        allocators: 1,
        allocator_flags: vec!["--reconcile-interval-ms=200".into()],
        ..Default::default()
    })
    .await?;
    stack
        .allocs
        .node_agent(0, "n1")?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("n1", 1, 2_000, "T4")),
        })
        .await?;
    stack.api.add_node("n1", 128)?;
    place(&stack, "holder", "n1").await?;
    // The node's CPU and memory reach the ledger (a NodeRegistered, which can free room too).
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Two pending GPU pods: one kube-scheduler found no room for, one it has not tried yet.
    let spec = gpuledger_testkit::workload::pod_spec(&pod("", 2_000, 10), SCHEDULER_NAME);
    for name in ["waiting", "untried"] {
        stack
            .api
            .add_pod(json!({"metadata": {"name": name, "namespace": "default"}, "spec": spec}))?;
    }
    stack
        .api
        .store
        .update("v1", "pods", "default", "waiting", |p| {
            p["status"]["conditions"] = json!([{"type": "PodScheduled", "status": "False",
                "reason": "Unschedulable", "lastTransitionTime": "2026-01-01T00:00:00Z",
                "message": "0/1 nodes are available: 1 no GPU has room."}]);
            Ok(())
        })
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    // The seq in the condition's message, when the pod has the condition.
    let annotation = |name: &str| {
        let p = stack.api.pod("default", name)?;
        let c = p["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "gpuledger.io/RoomFreed")?
            .clone();
        let m = c["message"].as_str()?;
        Some(m.split("(seq ").nth(1)?.split(')').next()?.to_string())
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(annotation("waiting"), None, "nothing was freed yet");

    stack.api.delete_pod("default", "holder")?;
    let took = wait_until(
        "the waiting pod requeued",
        Duration::from_secs(3),
        || async { Ok(annotation("waiting").is_some()) },
    )
    .await?;
    eprintln!("requeued {took:?} after the deletion");
    assert_eq!(
        annotation("untried"),
        None,
        "a pod kube-scheduler has not tried"
    );
    // The seq it names is the release's, which the ledger holds.
    let seq: u64 = annotation("waiting").unwrap_or_default().parse()?;
    assert!(seq >= 1 && seq <= stack.allocs.status(0).await.map(|s| s.seq).unwrap_or(0));
    Ok(())
}
