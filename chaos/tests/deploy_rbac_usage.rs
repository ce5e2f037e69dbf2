//! Which Kubernetes API requests each gpuledger component really makes, for the RBAC check of
//! `make deploy-check`: the allocator and the extender run as processes against the fake
//! kube-apiserver, each with a kubeconfig whose bearer token is its ServiceAccount's user name,
//! through every code path that talks to the API server (watch, bind, pod deletion, reservation
//! expiry, node deletion, GPUBudgets, preemption). The fake server records (user, verb, group, resource, namespace);
//! with `GPULEDGER_RBAC_USAGE_OUT=<file>` the records are written there as JSON lines, and
//! deploy/test/deploy_check.py compares them with the ClusterRoles in deploy/.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpuledger_auth::identity::Role;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::kube::stack::{extender_tls_flags, scheduler_tls};
use gpuledger_testkit::kube::{ExtenderClient, ExtenderConfig, FakeApiServer};
use gpuledger_testkit::workload::{inventory, pod};
use gpuledger_testkit::{Allocators, EtcdCluster, Identities, Proc, bin_path, free_port};
use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::{Value, json};

const ALLOCATOR: &str = "system:serviceaccount:gpuledger-system:gpuledger-allocator";
const EXTENDER: &str = "system:serviceaccount:gpuledger-system:gpuledger-extender";

async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut f: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let t0 = Instant::now();
    while t0.elapsed() < timeout {
        if f().await? {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("{what}: not within {timeout:?}")
}

async fn live_pods(allocs: &Allocators) -> Result<Vec<String>> {
    let d = allocs
        .viewer(0)?
        .dump(api::DumpRequest {})
        .await?
        .into_inner();
    Ok(d.snapshot
        .map(|s| s.allocations)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|a| a.pod.map(|p| p.uid))
        .collect())
}

fn gpu_pod(name: &str) -> Value {
    json!({"metadata": {"name": name, "namespace": "team-a"},
           "spec": {"schedulerName": "gpuledger-scheduler", "containers": [{"name": "main", "image": "x",
               "resources": {"limits": {"gpuledger.io/gpu": "1", "gpuledger.io/gpu-mem": "2000"}}}]}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn components_api_requests() -> Result<()> {
    let tmp = tempfile::Builder::new()
        .prefix("gpuledger-rbac-")
        .tempdir()?;
    let dir = tmp.path();
    let etcd = EtcdCluster::start_in(&dir.join("etcd"), 1).await?;
    let apisrv = FakeApiServer::start(dir).await?;
    let alloc_kc = apisrv.kubeconfig_as(ALLOCATOR)?;
    let ext_kc = apisrv.kubeconfig_as(EXTENDER)?;
    // Callers of the allocator show ServiceAccount tokens, which it reviews with the API
    // server: that request is part of its RBAC too.
    let ids = Identities::tokens(apisrv.pki.clone(), apisrv.store.clone());
    let allocs = Allocators::start_each(
        dir,
        &etcd,
        &[etcd.endpoints_flag()],
        "rbac",
        &[
            &format!("--kubeconfig={}", alloc_kc.display()),
            "--reconcile-interval-ms=100",
        ],
        ids.clone(),
    )?;
    allocs.wait_leader(Duration::from_secs(30)).await?;
    let (port, http_port) = (free_port()?, free_port()?);
    let mut flags = vec![
        format!("--listen=127.0.0.1:{port}"),
        format!("--http-listen=127.0.0.1:{http_port}"),
        format!("--allocator={}", allocs.addrs.join(",")),
        format!("--kubeconfig={}", ext_kc.display()),
    ];
    flags.extend(extender_tls_flags(&ids.pki)?);
    flags.extend(ids.flags(&Role::Extender)?);
    let _extender = Proc::spawn(
        dir,
        "extender",
        &bin_path("gpuledger-extender")?,
        flags,
        vec![],
    )?;
    gpuledger_testkit::kube::stack::wait_http(port, Duration::from_secs(20)).await?;

    for n in ["n1", "n2"] {
        let mut c = allocs.node_agent(0, n)?;
        c.register_node(api::RegisterNodeRequest {
            inventory: Some(inventory(n, 2, 16_000, "T4")),
        })
        .await?;
        apisrv.add_node(n, 128)?;
    }

    // Path 1, the extender's bind: read the pod, annotate it, create its Binding.
    let ext = ExtenderClient::new(ExtenderConfig::gpuledger(
        &format!("https://127.0.0.1:{port}/gpuledger"),
        Some(scheduler_tls(&ids.pki)?),
    ))?;
    let a: Pod = serde_json::from_value(apisrv.add_pod(gpu_pod("a"))?)?;
    let nodes: Vec<Node> = ["n1", "n2"]
        .iter()
        .map(|n| serde_json::from_value(json!({"metadata": {"name": n}})))
        .collect::<Result<_, _>>()?;
    let f = ext.post("filter", &ext.args(&a, &nodes)?).await?;
    let node = f["NodeNames"][0]
        .as_str()
        .with_context(|| format!("filter placed nothing: {f}"))?
        .to_string();
    let b = ext
        .post(
            "bind",
            &json!({"PodName": "a", "PodNamespace": "team-a",
                    "PodUID": a.metadata.uid, "Node": node}),
        )
        .await?;
    if b["Error"].as_str().is_some_and(|e| !e.is_empty()) {
        bail!("bind failed: {b}");
    }
    let uid_a = a.metadata.uid.clone().unwrap_or_default();
    wait_until(
        "pod a bound in the ledger",
        Duration::from_secs(10),
        || async { Ok(live_pods(&allocs).await?.contains(&uid_a)) },
    )
    .await?;

    // Path 2, the allocator's pod watch: a deleted pod is released.
    apisrv.delete_pod("team-a", "a")?;
    wait_until("pod a released", Duration::from_secs(10), || async {
        Ok(!live_pods(&allocs).await?.contains(&uid_a))
    })
    .await?;

    // Path 3, the allocator's expiry: a reservation never bound, past its deadline, makes the
    // leader read the pod before it releases the reservation.
    let p = apisrv.add_pod(gpu_pod("b"))?;
    let uid_b = p["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    // What pod b asks for (the allocator reserves nothing else).
    let mut req = pod(&uid_b, 2_000, 0);
    if let Some(r) = req.pod.as_mut() {
        r.name = "b".into();
        r.namespace = "team-a".into();
    }
    allocs
        .extender(0)?
        .reserve(api::ReserveRequest {
            request: Some(req),
            node: "n1".into(),
            ttl_ms: 300,
        })
        .await?;
    wait_until(
        "reservation of b expired",
        Duration::from_secs(10),
        || async { Ok(!live_pods(&allocs).await?.contains(&uid_b)) },
    )
    .await?;

    // Path 4, the allocator's node watch: a deleted node leaves the ledger.
    apisrv.delete_node("n2")?;
    wait_until("node n2 removed", Duration::from_secs(10), || async {
        let d = allocs
            .viewer(0)?
            .dump(api::DumpRequest {})
            .await?
            .into_inner();
        Ok(!d
            .snapshot
            .is_some_and(|s| s.nodes.iter().any(|n| n.node == "n2")))
    })
    .await?;

    // Path 5, the GPUBudget watch: a demote budget's class is read, the budget written to the
    // ledger, the object's status patched and an Event created on it.
    apisrv
        .store
        .create(
            "scheduling.k8s.io/v1",
            "priorityclasses",
            "",
            json!({
            "metadata": {"name": "gpu-low"}, "value": -10}),
        )
        .map_err(|e| anyhow::anyhow!("{}", e.message()))?;
    apisrv
        .store
        .create(
            "gpuledger.io/v1alpha1",
            "gpubudgets",
            "team-a",
            json!({
            "apiVersion": "gpuledger.io/v1alpha1", "kind": "GPUBudget",
            "metadata": {"name": "gpu", "namespace": "team-a"},
            "spec": {"amount": "100", "window": "day", "policy": "demote",
                     "priorityClassName": "gpu-low"}}),
        )
        .map_err(|e| anyhow::anyhow!("{}", e.message()))?;
    wait_until("GPUBudget applied", Duration::from_secs(10), || async {
        let o = apisrv
            .store
            .get("gpuledger.io/v1alpha1", "gpubudgets", "team-a", "gpu");
        Ok(o.is_ok_and(|o| o["status"]["state"] == "Applied"))
    })
    .await?;

    // Path 6, preemption from filter: n1's two GPUs are full of lower-priority pods; a pending
    // pod's filter makes the leader read the PodDisruptionBudgets, evict one pod through the
    // Eviction API and tell both pods why.
    for name in ["low-0", "low-1"] {
        let mut p = gpu_pod(name);
        // What the reservation below asks for: the allocator checks it against the pod.
        let limits = &mut p["spec"]["containers"][0]["resources"]["limits"];
        limits["gpuledger.io/gpu-mem"] = json!("15000");
        limits["gpuledger.io/gpu-core"] = json!("10");
        p["spec"]["priority"] = json!(-5);
        p["spec"]["nodeName"] = json!("n1");
        p["status"] = json!({"phase": "Running"});
        let created = apisrv.add_pod(p)?;
        let uid = created["metadata"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let mut req = pod(&uid, 15_000, 10);
        if let Some(r) = req.pod.as_mut() {
            r.name = name.into();
            r.namespace = "team-a".into();
        }
        let c = allocs.extender(0)?;
        // Until the allocator's pod watch has the pod.
        wait_until(&format!("{name} reserved"), Duration::from_secs(10), || {
            let (mut c, req) = (c.clone(), req.clone());
            async move {
                Ok(c.reserve(api::ReserveRequest {
                    request: Some(req),
                    node: "n1".into(),
                    ttl_ms: 0,
                })
                .await
                .is_ok())
            }
        })
        .await?;
    }
    let mut high = gpu_pod("high");
    high["spec"]["priority"] = json!(100);
    high["spec"]["containers"][0]["resources"]["limits"]["gpuledger.io/gpu-mem"] = json!("10000");
    let high: Pod = serde_json::from_value(apisrv.add_pod(high)?)?;
    let n1: Vec<Node> = vec![serde_json::from_value(json!({"metadata": {"name": "n1"}}))?];
    wait_until("a low pod evicted", Duration::from_secs(20), || async {
        ext.post("filter", &ext.args(&high, &n1)?).await?;
        Ok(["low-0", "low-1"]
            .iter()
            .any(|n| apisrv.pod("team-a", n).is_none()))
    })
    .await?;

    let reqs = apisrv.store.requests();
    let mut lines = String::new();
    for r in &reqs {
        lines += &serde_json::to_string(&json!({"user": r.user, "verb": r.verb, "group": r.group,
            "resource": r.resource, "namespace": r.namespace}))?;
        lines.push('\n');
    }
    eprint!("{lines}");
    if let Some(out) = std::env::var_os("GPULEDGER_RBAC_USAGE_OUT") {
        std::fs::write(&out, &lines).with_context(|| format!("writing {out:?}"))?;
    }
    // The scenario must reach every path it claims to; a path no longer reached would make
    // the RBAC check report a grant as unused instead of saying that coverage was lost.
    let used = |user: &str, verb: &str, resource: &str| {
        reqs.iter()
            .any(|r| r.user == user && r.verb == verb && r.resource == resource)
    };
    for (user, verb, resource) in [
        (ALLOCATOR, "list", "pods"),
        (ALLOCATOR, "watch", "pods"),
        (ALLOCATOR, "get", "pods"),
        (ALLOCATOR, "list", "nodes"),
        (ALLOCATOR, "watch", "nodes"),
        (ALLOCATOR, "create", "tokenreviews"),
        (ALLOCATOR, "list", "gpubudgets"),
        (ALLOCATOR, "watch", "gpubudgets"),
        (ALLOCATOR, "patch", "gpubudgets/status"),
        (ALLOCATOR, "get", "priorityclasses"),
        (ALLOCATOR, "create", "pods/eviction"),
        (ALLOCATOR, "list", "poddisruptionbudgets"),
        (EXTENDER, "get", "pods"),
        (EXTENDER, "create", "pods/binding"),
    ] {
        assert!(
            used(user, verb, resource),
            "{user} never made {verb} {resource}: the scenario lost a code path"
        );
    }
    assert!(
        !used(EXTENDER, "patch", "pods"),
        "the extender changed a pod; the ledger is the record of a grant"
    );
    assert!(
        reqs.iter().all(|r| r.user != "anonymous"),
        "a request without the component's token: {reqs:?}"
    );
    Ok(())
}
