//! Every request body captured from a real kube-scheduler and kube-apiserver v1.20.2
//! (`testdata/fixtures/kube-1.20/`) is sent to a real extender process over HTTP/HTTPS, backed by
//! a real allocator on etcd and the fake API server, and answered correctly in the shapes the
//! real components accepted.

use crate::kit;

use std::collections::BTreeSet;
use std::time::Duration;

use base64::Engine;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::kube::{KubeStack, StackOptions};
use gpuledger_testkit::workload::inventory;
use serde_json::Value;

fn keys(v: &Value) -> BTreeSet<String> {
    v.as_object()
        .map(|o| o.keys().cloned().collect())
        .unwrap_or_default()
}

fn same_type(a: &Value, b: &Value) -> bool {
    std::mem::discriminant(a) == std::mem::discriminant(b)
}

/// Every key of the accepted answer is in ours, with the same JSON type.
fn assert_shape(ours: &Value, accepted: &Value, what: &str) {
    match (ours, accepted) {
        (Value::Array(o), Value::Array(a)) => {
            if let (Some(o0), Some(a0)) = (o.first(), a.first()) {
                assert_shape(o0, a0, what);
            }
        }
        (Value::Object(_), Value::Object(a)) => {
            for (k, av) in a {
                let ov = ours
                    .get(k)
                    .unwrap_or_else(|| panic!("{what}: answer lacks {k:?}: {ours}"));
                assert!(
                    same_type(ov, av),
                    "{what}: {k:?} is {ov} but the scheduler accepted {av}"
                );
            }
        }
        _ => panic!("{what}: answer {ours} has not the shape of {accepted}"),
    }
}

async fn dump(stack: &KubeStack) -> anyhow::Result<Vec<pb::Allocation>> {
    kit::allocations(stack).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extender_answers_every_captured_request() -> anyhow::Result<()> {
    let fx = kit::fixtures();
    let stack = KubeStack::start(StackOptions {
        allocators: 1,
        extender_flags: Some(vec![]),
        ..Default::default()
    })
    .await?;
    for i in 1..=3 {
        let n = format!("gpu-node-{i}");
        stack
            .allocs
            .node_agent(0, &n)?
            .register_node(api::RegisterNodeRequest {
                inventory: Some(inventory(&n, 4, 81_920, "NVIDIA A100-SXM4-80GB")),
            })
            .await?;
        stack.api.add_node(&n, 256)?;
    }
    // A node without the requested GPU type, to see a per-node reason.
    stack
        .allocs
        .node_agent(0, "t4-node")?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("t4-node", 4, 16_000, "Tesla T4")),
        })
        .await?;
    let ext = kit::extender(&stack)?;

    // 001 filter: trainer-0 wants an A100, 3k MiB ("3k" is a quantity), 30% compute.
    let req = kit::read_json(&fx.join("extender/001-filter.json"))?;
    let mut with_t4 = req.clone();
    with_t4["NodeNames"] = serde_json::json!(["gpu-node-1", "t4-node", "ghost"]);
    let r = ext.post("filter", &with_t4).await?;
    assert_shape(
        &r,
        &kit::read_json(&fx.join("extender/001-filter.resp.json"))?,
        "001",
    );
    assert_eq!(r["NodeNames"], serde_json::json!(["gpu-node-1"]), "{r}");
    assert_eq!(r["Error"], "");
    let why = r["FailedAndUnresolvableNodes"]["t4-node"]
        .as_str()
        .unwrap_or("");
    assert!(!why.is_empty(), "the T4 node needs a reason: {r}");
    assert!(r["FailedAndUnresolvableNodes"]["ghost"].is_string(), "{r}");
    let r = ext.post("filter", &req).await?;
    assert_eq!(r["NodeNames"], serde_json::json!(["gpu-node-1"]), "{r}");

    // Pods exist in the API server as the scheduler saw them (same uid).
    for f in ["001-filter", "003-filter", "006-filter"] {
        let mut pod = kit::read_json(&fx.join(format!("extender/{f}.json")))?["Pod"].clone();
        pod["metadata"]
            .as_object_mut()
            .expect("metadata")
            .remove("resourceVersion");
        stack.api.add_pod(pod)?;
    }

    // 002 bind trainer-0 → gpu-node-1.
    let bind = kit::read_json(&fx.join("extender/002-bind.json"))?;
    let r = ext.post("bind", &bind).await?;
    assert_shape(
        &r,
        &kit::read_json(&fx.join("extender/002-bind.resp.json"))?,
        "002",
    );
    assert_eq!(r["Error"], "", "{r}");
    let pod = stack.api.pod("default", "trainer-0").expect("pod");
    assert_eq!(pod["spec"]["nodeName"], "gpu-node-1");
    // The Binding is made before bind answers; the confirm follows it.
    let uid = bind["PodUID"].as_str().expect("uid");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let bound = dump(&stack).await?.iter().any(|a| {
            a.pod.as_ref().is_some_and(|p| p.uid == uid)
                && a.state == pb::AllocationState::Bound as i32
        });
        if bound {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "not confirmed");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // The ledger is the record; the pod is left as the scheduler bound it.
    let pod = stack.api.pod("default", "trainer-0").expect("pod");
    assert!(
        pod["metadata"]["annotations"]["gpuledger.io/allocation"].is_null(),
        "annotated: {pod}"
    );
    let allocs = dump(&stack).await?;
    let mine: Vec<_> = allocs
        .iter()
        .filter(|a| a.pod.as_ref().is_some_and(|p| p.uid == uid))
        .collect();
    assert_eq!(mine.len(), 1, "{allocs:?}");
    assert_eq!(mine[0].node, "gpu-node-1");
    assert_eq!(mine[0].shares[0].mem_mib, 3000);
    assert_eq!(mine[0].shares[0].core_milli, 300);
    assert_eq!(mine[0].state, pb::AllocationState::Bound as i32);
    // The scheduler retrying the same bind is answered the same.
    assert_eq!(ext.post("bind", &bind).await?["Error"], "");
    // Another node for a bound pod: refused, and the grant stays.
    let mut other = bind.clone();
    other["Node"] = "gpu-node-2".into();
    let r = ext.post("bind", &other).await?;
    assert!(!r["Error"].as_str().unwrap_or("").is_empty(), "{r}");
    assert_eq!(dump(&stack).await?.len(), allocs.len());

    // 003 filter, 004 prioritize, 005 bind: infer-1, two GPU containers, NodeNames.
    let r = ext
        .post(
            "filter",
            &kit::read_json(&fx.join("extender/003-filter.json"))?,
        )
        .await?;
    assert_shape(
        &r,
        &kit::read_json(&fx.join("extender/003-filter.resp.json"))?,
        "003",
    );
    assert_eq!(
        r["NodeNames"],
        serde_json::json!(["gpu-node-1", "gpu-node-2", "gpu-node-3"]),
        "{r}"
    );
    let r = ext
        .post(
            "prioritize",
            &kit::read_json(&fx.join("extender/004-prioritize.json"))?,
        )
        .await?;
    assert_shape(
        &r,
        &kit::read_json(&fx.join("extender/004-prioritize.resp.json"))?,
        "004",
    );
    let hosts: Vec<&str> = r
        .as_array()
        .expect("list")
        .iter()
        .map(|h| h["Host"].as_str().expect("host"))
        .collect();
    assert_eq!(hosts, ["gpu-node-1", "gpu-node-2", "gpu-node-3"]);
    for h in r.as_array().expect("list") {
        assert!(
            (0..=10).contains(&h["Score"].as_i64().expect("score")),
            "{r}"
        );
    }
    let bind = kit::read_json(&fx.join("extender/005-bind.json"))?;
    assert_eq!(ext.post("bind", &bind).await?["Error"], "");
    let uid = bind["PodUID"].as_str().expect("uid");
    let mut infer: Vec<_> = dump(&stack)
        .await?
        .into_iter()
        .filter(|a| a.pod.as_ref().is_some_and(|p| p.uid == uid))
        .collect();
    infer.sort_by(|a, b| a.container.cmp(&b.container));
    assert_eq!(infer.len(), 2);
    assert_eq!(
        (infer[0].container.as_str(), infer[0].shares.len()),
        ("a", 2)
    );
    assert_eq!(infer[0].shares[0].mem_mib, 8192);
    assert_eq!(
        (infer[1].container.as_str(), infer[1].shares[0].core_milli),
        ("b", 500)
    );
    assert!(infer.iter().all(|a| a.node == "gpu-node-3"));

    // 006 filter, 007 prioritize, 008 bind: full Nodes instead of names.
    let req = kit::read_json(&fx.join("extender/006-filter.json"))?;
    let r = ext.post("filter", &req).await?;
    assert_shape(
        &r,
        &kit::read_json(&fx.join("extender/006-filter.resp.json"))?,
        "006",
    );
    assert!(r.get("NodeNames").is_none_or(Value::is_null), "{r}");
    assert_eq!(
        r["Nodes"]["items"], req["Nodes"]["items"],
        "full nodes come back untouched"
    );
    let r = ext
        .post(
            "prioritize",
            &kit::read_json(&fx.join("extender/007-prioritize.json"))?,
        )
        .await?;
    assert_shape(
        &r,
        &kit::read_json(&fx.join("extender/007-prioritize.resp.json"))?,
        "007",
    );
    assert_eq!(r.as_array().map(Vec::len), Some(3));
    let bind = kit::read_json(&fx.join("extender/008-bind.json"))?;
    let r = ext.post("bind", &bind).await?;
    assert_shape(
        &r,
        &kit::read_json(&fx.join("extender/008-bind.resp.json"))?,
        "008",
    );
    assert_eq!(r["Error"], "");
    assert_eq!(
        stack.api.pod("default", "hami-style-0").expect("pod")["spec"]["nodeName"],
        "gpu-node-1"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_answers_every_captured_review() -> anyhow::Result<()> {
    let fx = kit::fixtures();
    let port = gpuledger_testkit::free_port()?;
    let stack = KubeStack::start(StackOptions {
        allocators: 1,
        extender_flags: Some(vec![kit::webhook_flag(port)]),
        ..Default::default()
    })
    .await?;
    gpuledger_testkit::kube::stack::wait_http(port, Duration::from_secs(10)).await?;
    let hook = kit::webhook_client(&stack, port)?;

    for (file, allowed) in [
        ("001-mutate", true),
        ("002-validate", true),
        ("003-mutate", true),
        ("004-validate", false),
    ] {
        let req = kit::read_json(&fx.join(format!("webhook/{file}.json")))?;
        let accepted = kit::read_json(&fx.join(format!("webhook/{file}.resp.json")))?;
        let path = if file.contains("mutate") {
            "/mutate"
        } else {
            "/validate"
        };
        let (status, r) = hook.post(path, &req).await?;
        assert_eq!(status, 200, "{file}: {r}");
        assert_eq!(keys(&r), keys(&accepted), "{file}: {r}");
        // No field the accepted answer lacks (no empty status on an allowed answer), and the
        // patch a base64 string, as the API server writes a Go []byte.
        assert!(
            keys(&r["response"]).is_subset(&keys(&accepted["response"])),
            "{file}: {r}"
        );
        if let (Some(ours), Some(p)) = (
            r["response"].get("patch"),
            accepted["response"].get("patch"),
        ) {
            assert!(same_type(ours, p), "{file}: {r}");
        }
        assert_eq!(r["apiVersion"], "admission.k8s.io/v1");
        assert_eq!(r["kind"], "AdmissionReview");
        assert_eq!(r["response"]["uid"], req["request"]["uid"], "{file}");
        assert_eq!(r["response"]["allowed"], allowed, "{file}: {r}");
        if !allowed {
            assert_eq!(
                r["response"]["status"], accepted["response"]["status"],
                "{file}"
            );
        }
    }

    // The gpushare pod: the patch turns 3 GiB of aliyun.com/gpu-mem into gpuledger names.
    let req = kit::read_json(&fx.join("webhook/001-mutate.json"))?;
    let (_, r) = hook.post("/mutate", &req).await?;
    assert_eq!(r["response"]["patchType"], "JSONPatch");
    let patch: Value = serde_json::from_slice(
        &base64::engine::general_purpose::STANDARD
            .decode(r["response"]["patch"].as_str().expect("patch"))?,
    )?;
    let pod = kit::apply_patch(req["request"]["object"].clone(), &patch)?;
    let limits = &pod["spec"]["containers"][0]["resources"]["limits"];
    assert_eq!(limits["gpuledger.io/gpu"], "1", "{pod}");
    assert_eq!(limits["gpuledger.io/gpu-mem"], "3072", "{pod}");
    assert!(limits.get("aliyun.com/gpu-mem").is_none(), "{pod}");
    assert_eq!(
        pod["spec"]["containers"][0]["resources"]["requests"]["gpuledger.io/gpu-mem"],
        "3072"
    );
    // Not a pod at all / malformed: allowed, and a 400 that never panics.
    let mut cm = req.clone();
    cm["request"]["kind"]["kind"] = "ConfigMap".into();
    assert_eq!(
        hook.post("/validate", &cm).await?.1["response"]["allowed"],
        true
    );
    let (status, _) = hook.post_raw("/validate", b"{not json".to_vec()).await?;
    assert_eq!(status, 400);
    Ok(())
}
