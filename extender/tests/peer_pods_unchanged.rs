//! Pods written for gpushare (`aliyun.com/gpu-mem`, GiB), for HAMi (`nvidia.com/gpumem`,
//! `nvidia.com/gpucores`) and for gpu-manager (`tencent.com/vcuda-core`, `vcuda-memory`) are
//! admitted by the webhook, placed by the scheduler emulator through the extender, and bound,
//! without a change to their YAML.

use crate::kit;

use std::time::{Duration, Instant};

use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::free_port;
use gpuledger_testkit::kube::{KubeStack, SchedulerEmulator, StackOptions};
use gpuledger_testkit::workload::inventory;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpushare_and_hami_pods_run_as_written() -> anyhow::Result<()> {
    let port = free_port()?;
    let flags = vec![
        kit::webhook_flag(port),
        "--scheduler-name=gpuledger-scheduler".into(),
    ];
    let stack = KubeStack::start(StackOptions {
        allocators: 1,
        extender_flags: Some(flags),
        ..Default::default()
    })
    .await?;
    gpuledger_testkit::kube::stack::wait_http(port, Duration::from_secs(10)).await?;
    let hook = kit::webhook_client(&stack, port)?;
    for n in ["n1", "n2"] {
        stack
            .allocs
            .node_agent(0, n)?
            .register_node(api::RegisterNodeRequest {
                inventory: Some(inventory(n, 2, 24_000, "NVIDIA A10")),
            })
            .await?;
        stack.api.add_node(n, 128)?;
    }
    // As their users wrote them: no gpuledger names, default scheduler.
    let gpushare = json!({"metadata": {"name": "gpushare-0", "namespace": "default"},
        "spec": {"containers": [{"name": "c", "image": "x",
            "resources": {"limits": {"aliyun.com/gpu-mem": "3"}}}]}});
    let hami = json!({"metadata": {"name": "hami-0", "namespace": "default"},
        "spec": {"containers": [{"name": "c", "image": "x",
            "resources": {"limits": {"nvidia.com/gpumem": "3000", "nvidia.com/gpucores": "30"}}}]}});
    // The example pod of kubernetes-gpusharing (gpu-manager's names): half a GPU's compute,
    // 15 × 256 MiB.
    let gpumanager = json!({"metadata": {"name": "vcuda-0", "namespace": "default"},
        "spec": {"containers": [{"name": "c", "image": "x",
            "resources": {"requests": {"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "15"},
                "limits": {"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "15"}}}]}});
    let bad = json!({"metadata": {"name": "bad-0", "namespace": "default"},
        "spec": {"containers": [{"name": "c", "image": "x",
            "resources": {"limits": {"gpuledger.io/gpu": "3", "gpuledger.io/gpu-mem": "1000"}}}]}});
    for p in [gpushare, hami, gpumanager] {
        let admitted = kit::admit(&hook, p).await?.map_err(anyhow::Error::msg)?;
        assert_eq!(admitted["spec"]["schedulerName"], "gpuledger-scheduler");
        let limits = &admitted["spec"]["containers"][0]["resources"]["limits"];
        assert!(
            limits
                .as_object()
                .is_some_and(|l| l.keys().all(|k| k.starts_with("gpuledger.io/"))),
            "a name no node advertises is left: {limits}"
        );
        stack.api.add_pod(admitted)?;
    }
    // gpu-manager's rule: 1-99 or whole GPUs in hundreds.
    let vcuda_150 = json!({"metadata": {"name": "vcuda-bad", "namespace": "default"},
        "spec": {"containers": [{"name": "c", "image": "x",
            "resources": {"limits": {"tencent.com/vcuda-core": "150", "tencent.com/vcuda-memory": "4"}}}]}});
    let why = kit::admit(&hook, vcuda_150)
        .await?
        .expect_err("150 is neither a share nor whole GPUs");
    assert!(
        why.contains("tencent.com/vcuda-core must be 1-99") && why.contains("got 150"),
        "{why}"
    );
    // Three slices on distinct GPUs where no node has three GPUs: refused at admission.
    let why = kit::admit(&hook, bad)
        .await?
        .expect_err("no node has 3 GPUs");
    assert!(why.contains("3 GPU"), "{why}");
    let bad_policy = json!({"metadata": {"name": "bp", "namespace": "default",
        "annotations": {"gpuledger.io/policy": "fastest"}},
        "spec": {"containers": [{"name": "c", "image": "x",
            "resources": {"limits": {"gpuledger.io/gpu-mem": "1000"}}}]}});
    let why = kit::admit(&hook, bad_policy)
        .await?
        .expect_err("unknown policy");
    assert!(why.contains("unknown placement policy"), "{why}");
    let both = json!({"metadata": {"name": "both", "namespace": "default"},
        "spec": {"containers": [{"name": "c", "image": "x",
            "resources": {"limits": {"gpuledger.io/gpu-mem": "1000", "gpuledger.io/gpu-mem-percent": "10"}}}]}});
    let why = kit::admit(&hook, both).await?.expect_err("MiB and percent");
    assert!(why.contains("set one of them"), "{why}");

    let sched = SchedulerEmulator::start(
        stack.api.client().await?,
        "gpuledger-scheduler",
        stack.extender_config()?,
        4,
        Duration::from_millis(200),
    )?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let bound = ["gpushare-0", "hami-0", "vcuda-0"].iter().all(|n| {
            stack
                .api
                .pod("default", n)
                .is_some_and(|p| p["spec"]["nodeName"].is_string())
        });
        if bound {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not bound; scheduler errors: {:?}",
            sched.stats.last_error.lock().map(|m| m.clone())
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let snap = stack
        .allocs
        .viewer(0)?
        .dump(api::DumpRequest {})
        .await?
        .into_inner()
        .snapshot
        .expect("snapshot");
    let by_name = |n: &str| {
        snap.allocations
            .iter()
            .find(|a| a.pod.as_ref().is_some_and(|p| p.name == n))
            .unwrap_or_else(|| panic!("no allocation for {n}: {:?}", snap.allocations))
            .clone()
    };
    let g = by_name("gpushare-0");
    assert_eq!((g.shares.len(), g.shares[0].mem_mib), (1, 3 * 1024));
    let h = by_name("hami-0");
    assert_eq!((h.shares[0].mem_mib, h.shares[0].core_milli), (3000, 300));
    let v = by_name("vcuda-0");
    assert_eq!(
        (v.shares.len(), v.shares[0].mem_mib, v.shares[0].core_milli),
        (1, 15 * 256, 500),
        "50 % compute and 3,840 MiB"
    );
    for a in [&g, &h, &v] {
        let pod = stack
            .api
            .pod("default", &a.pod.as_ref().expect("pod").name)
            .expect("pod");
        assert_eq!(pod["spec"]["nodeName"], a.node.as_str());
    }

    // Each user sees where the pod landed in `kubectl describe pod`: a GpuPlaced Event that
    // names the node and the GPU the ledger holds.
    for a in [&g, &h] {
        let name = &a.pod.as_ref().expect("pod").name;
        let gpu = &a.shares[0].gpu_uuid;
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let events = stack.api.store.objects("v1", "events");
            let found = events.iter().any(|e| {
                e["involvedObject"]["name"] == name.as_str()
                    && e["reason"] == "GpuPlaced"
                    && e["type"] == "Normal"
                    && e["message"]
                        .as_str()
                        .is_some_and(|m| m.contains(a.node.as_str()) && m.contains(gpu.as_str()))
            });
            if found {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "no GpuPlaced event for {name} on {gpu}: {events:#?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // The extender's own metrics count the binds and time every verb.
    let (code, text) =
        gpuledger_testkit::http::get(&format!("{}/metrics", stack.extender_http_url)).await?;
    assert_eq!(code, 200);
    let (ready, why) =
        gpuledger_testkit::http::get(&format!("{}/readyz", stack.extender_http_url)).await?;
    assert_eq!(ready, 200, "{why}");
    let binds_ok = text
        .lines()
        .find(|l| l.starts_with(r#"gpuledger_extender_requests_total{verb="bind",outcome="ok"}"#))
        .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no bind counter in:\n{text}"));
    assert!(binds_ok >= 2, "{binds_ok} binds counted:\n{text}");
    assert!(
        text.contains(r#"gpuledger_extender_request_duration_seconds_count{verb="filter"}"#),
        "{text}"
    );
    Ok(())
}
