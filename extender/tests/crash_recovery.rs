//! The extender dies at the two worst moments of a bind; the allocator's reconcile against
//! the API server repairs the ledger either way.

use crate::kit;

use std::time::Duration;

use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::eventually;
use gpuledger_testkit::kube::{KubeStack, SchedulerEmulator, StackOptions};
use gpuledger_testkit::workload::inventory;
use serde_json::{Value, json};

fn gpu_pod(name: &str) -> Value {
    json!({"metadata": {"name": name, "namespace": "default"},
           "spec": {"schedulerName": "gpuledger-scheduler", "containers": [{"name": "c", "image": "x",
              "resources": {"limits": {"gpuledger.io/gpu": "1", "gpuledger.io/gpu-mem": "4k"}}}]}})
}

async fn allocs_of(stack: &KubeStack, uid: &str) -> anyhow::Result<Vec<pb::Allocation>> {
    let d = stack
        .allocs
        .viewer(0)?
        .dump(api::DumpRequest {})
        .await?
        .into_inner();
    Ok(d.snapshot
        .map(|s| s.allocations)
        .unwrap_or_default()
        .into_iter()
        .filter(|a| a.pod.as_ref().is_some_and(|p| p.uid == uid))
        .collect())
}

/// The extender binary the stack starts must carry the `test-hooks` feature (this crate's
/// dev-dependency on itself turns it on for `cargo test`); without it `--crash-at` is unknown
/// and the test would only see an extender that never came up.
fn require_crash_hooks() -> anyhow::Result<()> {
    let bin = gpuledger_testkit::bin_path("gpuledger-extender")?;
    let out = std::process::Command::new(&bin)
        .args(["--crash-at=before-binding", "--version"])
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "{} has no --crash-at: it was built without the `test-hooks` feature. Run this test \
         through `cargo test` (which builds the binary with the feature), or build it with \
         `cargo build -p gpuledger-extender --features test-hooks`.\n{}",
        bin.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

async fn released_reasons(stack: &KubeStack) -> anyhow::Result<Vec<String>> {
    let events = stack.allocs.events(0).await?;
    Ok(events
        .into_iter()
        .filter_map(|e| match e.body {
            Some(pb::event::Body::Released(r)) => Some(r.reason),
            _ => None,
        })
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_binding_is_confirmed_and_before_binding_expires() -> anyhow::Result<()> {
    require_crash_hooks()?;
    let mut stack = KubeStack::start(StackOptions {
        allocators: 1,
        allocator_flags: vec![
            "--reserve-ttl=2".into(),
            "--reconcile-interval-ms=200".into(),
        ],
        extender_flags: Some(vec!["--crash-at=after-binding".into()]),
        ..Default::default()
    })
    .await?;
    stack
        .allocs
        .node_agent(0, "n1")?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("n1", 2, 16_000, "NVIDIA L4")),
        })
        .await?;
    stack.api.add_node("n1", 128)?;
    let ext = kit::extender(&stack)?;

    // 1. Killed between the Binding and the confirm.
    let p1 = stack.api.add_pod(gpu_pod("p1"))?;
    let uid1 = p1["metadata"]["uid"].as_str().expect("uid").to_string();
    let bind = json!({"PodName": "p1", "PodNamespace": "default", "PodUID": uid1, "Node": "n1"});
    let r = ext.post("bind", &bind).await;
    assert!(r.is_err(), "the extender should have died mid-bind: {r:?}");
    assert_eq!(
        stack.api.pod("default", "p1").expect("pod")["spec"]["nodeName"],
        "n1"
    );
    eventually(
        "reconcile records Bound",
        Duration::from_secs(10),
        || async {
            let a = allocs_of(&stack, &uid1).await?;
            Ok(a.len() == 1 && a[0].state == pb::AllocationState::Bound as i32)
        },
    )
    .await?;

    // 2. Killed after the reservation, before the Binding.
    stack
        .start_extender(&["--crash-at=before-binding".into()])
        .await?;
    let p2 = stack.api.add_pod(gpu_pod("p2"))?;
    let uid2 = p2["metadata"]["uid"].as_str().expect("uid").to_string();
    let bind = json!({"PodName": "p2", "PodNamespace": "default", "PodUID": uid2, "Node": "n1"});
    let r = ext.post("bind", &bind).await;
    assert!(r.is_err(), "the extender should have died mid-bind: {r:?}");
    let first = allocs_of(&stack, &uid2).await?;
    assert_eq!(first.len(), 1, "reserved before the crash");
    assert_eq!(first[0].state, pb::AllocationState::Reserved as i32);
    assert!(stack.api.pod("default", "p2").expect("pod")["spec"]["nodeName"].is_null());
    eventually(
        "the reservation expires",
        Duration::from_secs(10),
        || async { Ok(allocs_of(&stack, &uid2).await?.is_empty()) },
    )
    .await?;
    assert!(
        released_reasons(&stack)
            .await?
            .iter()
            .any(|r| r == "expired"),
        "released as expired"
    );
    // The pod's users see why it is back in the queue.
    eventually(
        "a GpuReservationExpired event on p2",
        Duration::from_secs(5),
        || async {
            Ok(stack.api.store.objects("v1", "events").iter().any(|e| {
                e["involvedObject"]["name"] == "p2"
                    && e["involvedObject"]["uid"] == uid2.as_str()
                    && e["reason"] == "GpuReservationExpired"
                    && e["type"] == "Warning"
                    && e["message"].as_str().is_some_and(|m| m.contains("n1"))
            }))
        },
    )
    .await?;
    // The pod is scheduled again, through a healthy extender.
    stack.start_extender(&[]).await?;
    let sched = SchedulerEmulator::start(
        stack.api.client().await?,
        "gpuledger-scheduler",
        stack.extender_config()?,
        4,
        Duration::from_millis(200),
    )?;
    eventually("p2 is bound again", Duration::from_secs(15), || async {
        Ok(stack.api.pod("default", "p2").expect("pod")["spec"]["nodeName"] == "n1")
    })
    .await?;
    // One grant, Bound. On a loaded machine the emulator may have timed out on a slow bind and
    // filtered p2 again (kube-scheduler does the same after its 5 s httpTimeout): that second
    // reservation is refused its Binding and expires after --reserve-ttl (2 s) like any other.
    eventually(
        "p2 holds exactly one grant, Bound",
        Duration::from_secs(10),
        || async {
            let a = allocs_of(&stack, &uid2).await?;
            Ok(a.len() == 1 && a[0].state == pb::AllocationState::Bound as i32)
        },
    )
    .await?;
    let again = allocs_of(&stack, &uid2).await?;
    assert_ne!(again[0].id, first[0].id, "a new grant after the expiry");
    drop(sched);
    Ok(())
}

/// The extender dies after the reservation, before the Binding, and the reservation outlives
/// the retry (a long TTL, or a leader failing over again and again, whose every new leader
/// starts the TTL afresh): the scheduler's next try is filtered to the node the pod holds GPUs
/// on, and bound there with the same grant, instead of being refused ("already holds
/// allocation … on node n1") on every other node until the reservation expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_whose_bind_died_after_its_reservation_is_bound_there_next_time() -> anyhow::Result<()>
{
    require_crash_hooks()?;
    let mut stack = KubeStack::start(StackOptions {
        allocators: 1,
        allocator_flags: vec!["--reserve-ttl=600".into()],
        extender_flags: Some(vec!["--crash-at=before-binding".into()]),
        ..Default::default()
    })
    .await?;
    kit::register_one_gpu_nodes(&stack, &["n1", "n2"], "NVIDIA L4").await?;
    for n in ["n1", "n2"] {
        stack.api.add_node(n, 128)?;
    }
    let ext = kit::extender(&stack)?;
    let p = stack.api.add_pod(gpu_pod("p"))?;
    let uid = p["metadata"]["uid"].as_str().expect("uid").to_string();
    let bind = json!({"PodName": "p", "PodNamespace": "default", "PodUID": uid, "Node": "n1"});
    let r = ext.post("bind", &bind).await;
    assert!(r.is_err(), "the extender should have died mid-bind: {r:?}");
    let first = allocs_of(&stack, &uid).await?;
    assert_eq!(first.len(), 1, "reserved before the crash");

    stack.start_extender(&[]).await?;
    let pod = stack.api.pod("default", "p").expect("pod");
    let r = ext
        .post("filter", &json!({"Pod": pod, "NodeNames": ["n2", "n1"]}))
        .await?;
    assert_eq!(r["NodeNames"], json!(["n1"]), "{r}");
    let why = r["FailedAndUnresolvableNodes"]["n2"].as_str().unwrap_or("");
    assert!(why.contains("already holds GPUs on node n1"), "{r}");
    let r = ext.post("bind", &bind).await?;
    assert!(r["Error"].as_str().unwrap_or("").is_empty(), "{r}");
    assert_eq!(
        stack.api.pod("default", "p").expect("pod")["spec"]["nodeName"],
        "n1"
    );
    eventually("p's grant Bound", Duration::from_secs(10), || async {
        let a = allocs_of(&stack, &uid).await?;
        Ok(a.len() == 1 && a[0].state == pb::AllocationState::Bound as i32)
    })
    .await?;
    assert_eq!(
        allocs_of(&stack, &uid).await?[0].id,
        first[0].id,
        "the same grant"
    );
    Ok(())
}
