//! The webhook's DRA path against the fake kube-apiserver: pods written for gpushare, HAMi and
//! gpu-manager, on the DRA path by namespace label or annotation, are answered with the exact
//! JSON Patch that claims a content-addressed ResourceClaimTemplate and records its requests.
//! The webhook writes nothing, whoever sends the review; the allocator's leader makes the
//! template with the right requests once the admitted pod exists, reuses it for an identical
//! pod, makes none for a pod whose requests do not make the template it names or whose stored
//! template differs (one the API server stored without `capacity.requests`: feature gate off),
//! and collects the templates no pod claims. A pod on the device-plugin path is answered as
//! before.

use crate::kit;

use std::time::Duration;

use base64::Engine;
use gpuledger_testkit::free_port;
use gpuledger_testkit::kube::{KubeStack, StackOptions};
use serde_json::{Value, json};

/// A fake API server store result as an anyhow result.
fn ok<T, E: std::fmt::Debug>(r: Result<T, E>) -> anyhow::Result<T> {
    r.map_err(|e| anyhow::anyhow!("{e:?}"))
}

const RV1: &str = "resource.k8s.io/v1";

/// An AdmissionReview of creating `pod` in `ns`, as the API server sends it.
fn review(pod: &Value, ns: &str, uid: &str, dry_run: bool) -> Value {
    json!({"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1",
           "request": {"uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
                       "resource": {"group": "", "version": "v1", "resource": "pods"},
                       "namespace": ns, "operation": "CREATE", "dryRun": dry_run,
                       "userInfo": {"username": "system:admin"}, "object": pod}})
}

/// The mutate answer: allowed, and the decoded patch (Null when none) or the denial message.
async fn mutate(hook: &kit::Https, review: &Value) -> anyhow::Result<Result<Value, String>> {
    let (s, v) = hook.post("/mutate", review).await?;
    anyhow::ensure!(s == 200, "mutate answered {s}: {v}");
    let r = &v["response"];
    assert_eq!(r["uid"], review["request"]["uid"], "{v}");
    if r["allowed"] != true {
        return Ok(Err(r["status"]["message"]
            .as_str()
            .unwrap_or("")
            .to_string()));
    }
    Ok(Ok(match r["patch"].as_str() {
        None => Value::Null,
        Some(p) => {
            assert_eq!(r["patchType"], "JSONPatch");
            serde_json::from_slice(&base64::engine::general_purpose::STANDARD.decode(p)?)?
        }
    }))
}

/// The namespace `team-dra`, labelled for the DRA path.
fn dra_namespace(stack: &KubeStack) -> anyhow::Result<()> {
    ok(stack.api.store.create(
        "v1",
        "namespaces",
        "",
        json!({"metadata": {"name": "team-dra", "labels": {"gpuledger.io/path": "dra"}}}),
    ))?;
    Ok(())
}

fn templates(stack: &KubeStack) -> Vec<Value> {
    stack.api.store.objects(RV1, "resourceclaimtemplates")
}

/// The template the patch names, and the patch expected for a one-GPU-container pod asking
/// `mib` (None: the whole GPU) and `cores`.
fn expected_patch(template: &str, with_scheduler: bool, mib: Option<u64>, cores: u32) -> Value {
    let mut ops = vec![
        json!({"op": "add", "path": "/spec/resourceClaims",
               "value": [{"name": "gpuledger", "resourceClaimTemplateName": template}]}),
        json!({"op": "add", "path": "/spec/containers/0/resources",
               "value": {"claims": [{"name": "gpuledger", "request": "c0"}],
                         "limits": {"gpuledger.io/dra": "1"},
                         "requests": {"gpuledger.io/dra": "1"}}}),
    ];
    ops.push(requests_op(&[(0, 1, mib, cores)]));
    if with_scheduler {
        ops.push(
            json!({"op": "add", "path": "/spec/schedulerName", "value": "gpuledger-scheduler"}),
        );
    }
    Value::Array(ops)
}

/// The operation recording the claim requests `reqs` (container, count, MiB or null, core
/// milli) on a pod without annotations, its value decoded as [`decoded`] decodes it.
fn requests_op(reqs: &[(u32, u32, Option<u64>, u32)]) -> Value {
    let reqs: Vec<Value> = reqs
        .iter()
        .map(|(c, n, mib, cores)| {
            json!({"container": c, "name": format!("c{c}"), "count": n, "memMib": mib,
                   "coreMilli": cores})
        })
        .collect();
    json!({"op": "add", "path": "/metadata/annotations",
           "value": {"gpuledger.io/claim-requests": reqs}})
}

/// `patch` with the recorded requests' JSON text decoded, to compare as JSON.
fn decoded(mut patch: Value) -> Value {
    for op in patch.as_array_mut().into_iter().flatten() {
        let pointer = if op["path"] == "/metadata/annotations/gpuledger.io~1claim-requests" {
            "/value"
        } else {
            "/value/gpuledger.io~1claim-requests"
        };
        let Some(v) = op.pointer_mut(pointer) else {
            continue;
        };
        if let Some(text) = v.as_str() {
            *v = serde_json::from_str(text).unwrap_or(Value::Null);
        }
    }
    patch
}

/// The API server stores the admitted pod (`pod` with `patch` applied) in `ns`.
fn store_admitted(stack: &KubeStack, ns: &str, pod: &Value, patch: &Value) -> anyhow::Result<()> {
    let admitted = kit::apply_patch(pod.clone(), patch)?;
    ok(stack.api.store.create("v1", "pods", ns, admitted))?;
    Ok(())
}

/// The template `name` of `ns` once the allocator has made it.
async fn made(stack: &KubeStack, ns: &str, name: &str) -> anyhow::Result<Value> {
    let t0 = std::time::Instant::now();
    loop {
        if let Ok(t) = stack.api.store.get(RV1, "resourceclaimtemplates", ns, name) {
            return Ok(t);
        }
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(15),
            "the allocator made no template {ns}/{name} within 15 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The messages of the Events with `reason`, once there is one.
async fn events(stack: &KubeStack, reason: &str) -> anyhow::Result<Vec<String>> {
    let t0 = std::time::Instant::now();
    loop {
        let found: Vec<String> = stack
            .api
            .store
            .objects("v1", "events")
            .into_iter()
            .filter(|e| e["reason"] == reason)
            .map(|e| e["message"].as_str().unwrap_or_default().to_string())
            .collect();
        if !found.is_empty() {
            return Ok(found);
        }
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(15),
            "no {reason} Event within 15 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The template's name as the patch gives it.
fn named(patch: &Value) -> String {
    patch[0]["value"][0]["resourceClaimTemplateName"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn is_content_name(n: &str) -> bool {
    n.strip_prefix("gpuledger-").is_some_and(|h| {
        h.len() == 12
            && h.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    })
}

async fn stack_with_webhook(extra: &[&str]) -> anyhow::Result<(KubeStack, kit::Https)> {
    let port = free_port()?;
    let mut flags = vec![
        kit::webhook_flag(port),
        "--scheduler-name=gpuledger-scheduler".to_string(),
    ];
    flags.extend(extra.iter().map(|s| s.to_string()));
    let stack = KubeStack::start(StackOptions {
        allocators: 1,
        allocator_flags: vec![
            "--claim-watch".into(),
            "--claim-reconcile-interval=1".into(),
            "--claim-template-collect-after=2".into(),
        ],
        extender_flags: Some(flags),
        ..Default::default()
    })
    .await?;
    gpuledger_testkit::kube::stack::wait_http(port, Duration::from_secs(10)).await?;
    let hook = kit::webhook_client(&stack, port)?;
    Ok((stack, hook))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_pods_become_claims_of_a_content_addressed_template() -> anyhow::Result<()> {
    let (stack, hook) = stack_with_webhook(&["--dra-namespace-label"]).await?;
    dra_namespace(&stack)?;

    // gpushare, on the DRA path by its namespace's label: 3 GiB, no compute asked.
    let gpushare = json!({"metadata": {"name": "gpushare-0", "namespace": "team-dra"},
        "spec": {"containers": [{"name": "c", "image": "x",
            "resources": {"limits": {"aliyun.com/gpu-mem": "3", "cpu": "1"}}}]}});
    let patch = mutate(&hook, &review(&gpushare, "team-dra", "r-1", false))
        .await?
        .map_err(anyhow::Error::msg)?;
    let t = named(&patch);
    assert!(is_content_name(&t), "template name {t:?}");
    // The peer name is gone, cpu stays, the marker is in requests and limits, the requests
    // are recorded.
    let mut want = expected_patch(&t, true, Some(3072), 0);
    want[1]["value"]["limits"]["cpu"] = json!("1");
    assert_eq!(decoded(patch.clone()), want);
    // The review (sent here without any credentials, as anyone in the cluster could) made
    // nothing: the template is the allocator's to make, for a pod that exists.
    assert!(templates(&stack).is_empty(), "the webhook wrote a template");
    store_admitted(&stack, "team-dra", &gpushare, &patch)?;
    let stored = made(&stack, "team-dra", &t).await?;
    assert_eq!(
        stored["metadata"]["labels"],
        json!({"gpuledger.io/managed": "true"})
    );
    assert_eq!(
        stored["spec"],
        json!({"metadata": {"labels": {"gpuledger.io/managed": "true"}},
               "spec": {"devices": {"requests": [{"name": "c0", "exactly": {
                   "deviceClassName": "gpu.gpuledger.io", "allocationMode": "ExactCount",
                   "count": 1, "capacity": {"requests": {"memory": "3072Mi", "cores": "0"}}}}]}}})
    );

    // A second identical pod names the same template, which stays the one.
    let mut again = gpushare.clone();
    again["metadata"]["name"] = json!("gpushare-1");
    let patch2 = mutate(&hook, &review(&again, "team-dra", "r-2", false))
        .await?
        .map_err(anyhow::Error::msg)?;
    assert_eq!(named(&patch2), t);
    store_admitted(&stack, "team-dra", &again, &patch2)?;

    // HAMi, on the DRA path by annotation in a namespace without the label: two GPUs of
    // 3000 MiB and 30% each, which must be distinct GPUs. The pod's own annotations stay.
    let hami = json!({"metadata": {"name": "hami-0", "namespace": "default",
            "annotations": {"gpuledger.io/path": "dra"}},
        "spec": {"containers": [
            {"name": "side", "image": "x", "resources": {"limits": {"cpu": "1"}}},
            {"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "2",
                "nvidia.com/gpumem": "3000", "nvidia.com/gpucores": "30"}}}]}});
    let patch = mutate(&hook, &review(&hami, "default", "r-3", false))
        .await?
        .map_err(anyhow::Error::msg)?;
    let th = named(&patch);
    assert!(is_content_name(&th) && th != t, "{th} vs {t}");
    let reqs =
        json!([{"container": 1, "name": "c1", "count": 2, "memMib": 3000, "coreMilli": 300}]);
    assert_eq!(
        decoded(patch.clone()),
        json!([
            {"op": "add", "path": "/spec/resourceClaims",
             "value": [{"name": "gpuledger", "resourceClaimTemplateName": th}]},
            {"op": "add", "path": "/spec/containers/1/resources",
             "value": {"claims": [{"name": "gpuledger", "request": "c1"}],
                       "limits": {"gpuledger.io/dra": "1"}, "requests": {"gpuledger.io/dra": "1"}}},
            {"op": "add", "path": "/metadata/annotations/gpuledger.io~1claim-requests",
             "value": reqs},
            {"op": "add", "path": "/spec/schedulerName", "value": "gpuledger-scheduler"}
        ])
    );
    store_admitted(&stack, "default", &hami, &patch)?;
    let stored = made(&stack, "default", &th).await?;
    assert_eq!(
        stored["spec"]["spec"]["devices"],
        json!({"requests": [{"name": "c1", "exactly": {
                   "deviceClassName": "gpu.gpuledger.io", "allocationMode": "ExactCount",
                   "count": 2, "capacity": {"requests": {"memory": "3000Mi", "cores": "300"}}}}],
               "constraints": [{"requests": ["c1"], "distinctAttribute": "gpu.gpuledger.io/uuid"}]})
    );

    // gpu-manager: half a GPU's compute, 15 × 256 MiB, in requests and limits; and a
    // whole-GPU container beside it (vcuda-core 100): memory left to the device's default.
    let vcuda = json!({"metadata": {"name": "vcuda-0", "namespace": "team-dra"},
        "spec": {"schedulerName": "my-scheduler", "containers": [
            {"name": "c", "image": "x", "resources": {
                "requests": {"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "15"},
                "limits": {"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "15"}}},
            {"name": "w", "image": "x", "resources": {"limits": {"tencent.com/vcuda-core": "100"}}}]}});
    let patch = mutate(&hook, &review(&vcuda, "team-dra", "r-4", false))
        .await?
        .map_err(anyhow::Error::msg)?;
    let tv = named(&patch);
    // A pod of another scheduler keeps it.
    assert_eq!(patch.as_array().map(Vec::len), Some(4), "{patch}");
    assert_eq!(patch[1]["path"], "/spec/containers/0/resources");
    assert_eq!(
        patch[1]["value"],
        json!({"claims": [{"name": "gpuledger", "request": "c0"}],
               "limits": {"gpuledger.io/dra": "1"}, "requests": {"gpuledger.io/dra": "1"}})
    );
    assert_eq!(patch[2]["path"], "/spec/containers/1/resources");
    assert_eq!(
        patch[2]["value"]["claims"],
        json!([{"name": "gpuledger", "request": "c1"}])
    );
    store_admitted(&stack, "team-dra", &vcuda, &patch)?;
    let stored = made(&stack, "team-dra", &tv).await?;
    let reqs = &stored["spec"]["spec"]["devices"]["requests"];
    assert_eq!(
        reqs[0]["exactly"]["capacity"]["requests"],
        json!({"memory": "3840Mi", "cores": "500"})
    );
    assert_eq!(
        reqs[1]["exactly"]["capacity"]["requests"],
        json!({"cores": "1000"})
    );
    assert_eq!(reqs[1]["exactly"]["count"], 1);
    assert_eq!(templates(&stack).len(), 3);

    // A dry run answers the same kind of patch.
    let mut dry = gpushare.clone();
    dry["spec"]["containers"][0]["resources"]["limits"]["aliyun.com/gpu-mem"] = json!("5");
    let patch = mutate(&hook, &review(&dry, "team-dra", "r-5", true))
        .await?
        .map_err(anyhow::Error::msg)?;
    let td = named(&patch);
    assert!(is_content_name(&td) && td != t);

    // A percentage of GPU memory cannot be a claim's capacity: refused, saying what to do.
    let pct = json!({"metadata": {"name": "pct", "namespace": "team-dra"},
        "spec": {"containers": [{"name": "c", "image": "x", "resources": {"limits": {
            "nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "50"}}}]}});
    let why = mutate(&hook, &review(&pct, "team-dra", "r-6", false))
        .await?
        .expect_err("percent of memory on the DRA path");
    assert!(
        why.contains("50% of a GPU's memory") && why.contains("MiB"),
        "{why}"
    );
    // An unknown path value is refused too.
    let mut odd = gpushare.clone();
    odd["metadata"]["annotations"] = json!({"gpuledger.io/path": "claims"});
    let why = mutate(&hook, &review(&odd, "default", "r-7", false))
        .await?
        .expect_err("unknown path");
    assert!(
        why.contains("gpuledger.io/path") && why.contains("\"claims\""),
        "{why}"
    );
    // Reviews alone never made a template: three pods exist, three templates.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(templates(&stack).len(), 3);
    Ok(())
}

/// Store (replacing any) the template `name` in `default` as an API server would have it: one
/// request c0 of one GPU, with `capacity` as its capacity requests (None: none).
fn put_template(stack: &KubeStack, name: &str, capacity: Option<Value>) -> anyhow::Result<()> {
    let _ = stack
        .api
        .store
        .delete(RV1, "resourceclaimtemplates", "default", name);
    let mut exactly = json!({"deviceClassName": "gpu.gpuledger.io",
                             "allocationMode": "ExactCount", "count": 1});
    if let Some(c) = capacity {
        exactly["capacity"] = json!({"requests": c});
    }
    let managed = json!({"gpuledger.io/managed": "true"});
    ok(stack.api.store.create(
        RV1,
        "resourceclaimtemplates",
        "default",
        json!({"metadata": {"name": name, "labels": managed},
               "spec": {"metadata": {"labels": managed},
                        "spec": {"devices": {"requests": [{"name": "c0", "exactly": exactly}]}}}}),
    ))?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_template_is_made_that_the_pod_does_not_ask_and_unclaimed_ones_are_collected()
-> anyhow::Result<()> {
    let (stack, hook) = stack_with_webhook(&["--pod-path=dra"]).await?;
    let pod = json!({"metadata": {"name": "p", "namespace": "default"},
        "spec": {"containers": [{"name": "c", "image": "x",
            "resources": {"limits": {"gpuledger.io/gpu-mem": "2000", "gpuledger.io/gpu-core": "20"}}}]}});
    let patch = mutate(&hook, &review(&pod, "default", "r-1", false))
        .await?
        .map_err(anyhow::Error::msg)?;
    let t = named(&patch);
    // An API server whose DRAConsumableCapacity gate is off stored it without capacity: the
    // allocator does not take it, and the pod is told why.
    put_template(&stack, &t, None)?;
    store_admitted(&stack, "default", &pod, &patch)?;
    let why = events(&stack, "GpuClaimTemplateRefused").await?;
    assert!(
        why[0].contains("dropped capacity.requests") && why[0].contains("DRAConsumableCapacity"),
        "{why:?}"
    );

    // A pod that names one template and records requests of another gets neither.
    let mut forged = kit::apply_patch(pod.clone(), &patch)?;
    forged["metadata"]["name"] = json!("forged");
    forged["metadata"]["namespace"] = json!("other");
    forged["metadata"]["annotations"]["gpuledger.io/claim-requests"] =
        json!(r#"[{"container":0,"name":"c0","count":1,"memMib":16000,"coreMilli":1000}]"#);
    ok(stack.api.store.create("v1", "pods", "other", forged))?;
    let t0 = std::time::Instant::now();
    while events(&stack, "GpuClaimTemplateRefused").await?.len() < 2 {
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(15),
            "the forged pod was not told"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let why = events(&stack, "GpuClaimTemplateRefused").await?;
    assert!(
        why.iter().any(|w| w.contains("makes gpuledger-")),
        "{why:?}"
    );
    assert!(
        stack
            .api
            .store
            .get(RV1, "resourceclaimtemplates", "other", &t)
            .is_err(),
        "a template was made for a pod whose requests do not make it"
    );

    // Collection: a managed template no pod claims goes (after 2 s here); the one pod p
    // claims stays, whatever it holds.
    put_template(
        &stack,
        "gpuledger-000000000000",
        Some(json!({"cores": "1"})),
    )?;
    let t0 = std::time::Instant::now();
    while stack
        .api
        .store
        .get(
            RV1,
            "resourceclaimtemplates",
            "default",
            "gpuledger-000000000000",
        )
        .is_ok()
    {
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(20),
            "an unclaimed template was not collected within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        ok(stack
            .api
            .store
            .get(RV1, "resourceclaimtemplates", "default", &t))
        .is_ok(),
        "the template a pod claims was collected"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_plugin_pod_is_answered_as_before() -> anyhow::Result<()> {
    let (stack, hook) = stack_with_webhook(&["--dra-namespace-label"]).await?;
    let gpushare = json!({"metadata": {"name": "gpushare-0", "namespace": "default"},
        "spec": {"containers": [{"name": "c", "image": "x",
            "resources": {"limits": {"aliyun.com/gpu-mem": "3"}}}]}});
    let patch = mutate(&hook, &review(&gpushare, "default", "r-1", false))
        .await?
        .map_err(anyhow::Error::msg)?;
    // The device-plugin translation: gpuledger names only, no claim, no marker.
    assert_eq!(
        patch,
        json!([
            {"op": "add", "path": "/spec/containers/0/resources",
             "value": {"limits": {"gpuledger.io/gpu": "1", "gpuledger.io/gpu-mem": "3072"}}},
            {"op": "add", "path": "/spec/schedulerName", "value": "gpuledger-scheduler"}
        ])
    );
    // The same pod annotated for the device-plugin path in a DRA namespace: the same answer.
    dra_namespace(&stack)?;
    let mut annotated = gpushare.clone();
    annotated["metadata"]["namespace"] = json!("team-dra");
    annotated["metadata"]["annotations"] = json!({"gpuledger.io/path": "device-plugin"});
    let patch2 = mutate(&hook, &review(&annotated, "team-dra", "r-2", false))
        .await?
        .map_err(anyhow::Error::msg)?;
    assert_eq!(patch2, patch);
    assert!(templates(&stack).is_empty());
    // A pod asking for no GPU: no patch at all, on either path.
    let plain = json!({"metadata": {"name": "p", "namespace": "team-dra"},
        "spec": {"containers": [{"name": "c", "image": "x", "resources": {"limits": {"cpu": "1"}}}]}});
    assert_eq!(
        mutate(&hook, &review(&plain, "team-dra", "r-3", false)).await?,
        Ok(Value::Null)
    );
    assert!(templates(&stack).is_empty());
    Ok(())
}

/// A namespace that spent its GPU budget (policy deny): its next pod on the DRA path is denied
/// as a device-plugin pod is, by validate, which sees the converted pod (only the marker left).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_over_budget_namespace_is_denied_its_dra_pods() -> anyhow::Result<()> {
    use gpuledger_proto::allocator::v1 as api;
    use gpuledger_proto::ledger::v1 as pb;
    let (stack, hook) = stack_with_webhook(&["--pod-path=dra"]).await?;
    stack
        .allocs
        .node_agent(0, "n1")?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(gpuledger_testkit::workload::inventory(
                "n1", 1, 16_000, "T4",
            )),
        })
        .await?;
    stack
        .allocs
        .admin(0)?
        .set_budget(api::SetBudgetRequest {
            budget: Some(pb::BudgetSet {
                namespace: "team-a".into(),
                unit: pb::BudgetUnit::GpuMibHours as i32,
                amount: 1,
                window: pb::BudgetWindow::Day as i32,
                policy: pb::BudgetPolicy::Deny as i32,
                source: "test".into(),
                ..Default::default()
            }),
            remove: false,
        })
        .await?;
    let pod = |name: &str| {
        json!({"metadata": {"name": name, "namespace": "team-a"},
            "spec": {"containers": [{"name": "c", "image": "x",
                "resources": {"limits": {"aliyun.com/gpu-mem": "1"}}}]}})
    };
    // Within budget: admitted, converted.
    let early = kit::admit(&hook, pod("early"))
        .await?
        .map_err(anyhow::Error::msg)?;
    assert_eq!(
        early["spec"]["resourceClaims"][0]["name"], "gpuledger",
        "{early}"
    );
    // A device-plugin pod of the namespace holds 16,000 MiB: 1 GPU-MiB-hour lasts 225 ms.
    let hog = json!({"metadata": {"name": "hog", "namespace": "team-a", "uid": "uid-hog"},
        "spec": {"schedulerName": "gpuledger-scheduler", "containers": [{"name": "c", "image": "x",
            "resources": {"limits": {"gpuledger.io/gpu": "1", "gpuledger.io/gpu-mem": "16000"}}}]}});
    kit::reserve(&stack, &hog, "n1").await?;
    let t0 = std::time::Instant::now();
    let why = loop {
        match kit::admit(&hook, pod("late")).await? {
            Err(why) => break why,
            Ok(p) if t0.elapsed() > Duration::from_secs(10) => {
                anyhow::bail!("an over-budget DRA pod was admitted: {p}")
            }
            Ok(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    assert!(
        why.contains("namespace team-a has spent its GPU budget"),
        "{why}"
    );
    Ok(())
}

/// Reviews are not authenticated: however many arrive, the namespace label comes from the
/// watch, never from one read of the API server per review. A namespace labelled a moment
/// before its pod is still seen, and a namespace nobody created takes the default path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespace_labels_cost_the_api_server_no_read_per_review() -> anyhow::Result<()> {
    let (stack, hook) = stack_with_webhook(&["--dra-namespace-label"]).await?;
    dra_namespace(&stack)?;
    let namespace_reads = || {
        stack
            .api
            .store
            .requests()
            .iter()
            .filter(|r| r.resource == "namespaces")
            .count()
    };
    let pod = |ns: &str| {
        json!({"metadata": {"name": "p", "namespace": ns},
               "spec": {"containers": [{"name": "c", "image": "x",
                   "resources": {"limits": {"aliyun.com/gpu-mem": "3"}}}]}})
    };
    // The first review waits for the watch's list, if it has not come yet.
    let first = mutate(&hook, &review(&pod("team-dra"), "team-dra", "r-0", false)).await?;
    assert!(is_content_name(&named(&first.map_err(anyhow::Error::msg)?)));
    let before = namespace_reads();
    for i in 1..=200 {
        let patch = mutate(
            &hook,
            &review(&pod("team-dra"), "team-dra", &format!("r-{i}"), false),
        )
        .await?
        .map_err(anyhow::Error::msg)?;
        assert!(is_content_name(&named(&patch)), "review {i}: {patch}");
    }
    assert_eq!(
        namespace_reads() - before,
        0,
        "200 reviews read the namespace from the API server"
    );
    // Labelled just now: the watch brings it.
    ok(stack.api.store.create(
        "v1",
        "namespaces",
        "",
        json!({"metadata": {"name": "team-new", "labels": {"gpuledger.io/path": "dra"}}}),
    ))?;
    let fresh = mutate(&hook, &review(&pod("team-new"), "team-new", "r-new", false)).await?;
    assert!(is_content_name(&named(&fresh.map_err(anyhow::Error::msg)?)));
    // No such namespace (a review no API server sent): the default path, device plugin.
    let none = mutate(&hook, &review(&pod("nowhere"), "nowhere", "r-none", false))
        .await?
        .map_err(anyhow::Error::msg)?;
    assert!(named(&none).is_empty(), "{none}");
    Ok(())
}
