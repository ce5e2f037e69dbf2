//! ServiceAccount tokens against real allocators that review them with the (fake) API server's
//! TokenReview: an expired token, a token for another audience, a token of an account with no
//! gpuledger role and a node agent's token bound to no pod are all refused for every RPC, and
//! the ledger does not change; a valid token of the right account is served.

use std::time::Duration;

use gpuledger_auth::CredentialArgs;
use gpuledger_auth::token::AUDIENCE;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::allocators::connect;
use gpuledger_testkit::kube::{KubeStack, StackOptions};
use gpuledger_testkit::pki::NAMESPACE;
use tonic::Code;

/// One allocator that reviews tokens with the fake API server (no extender).
async fn stack() -> anyhow::Result<KubeStack> {
    KubeStack::start(StackOptions {
        etcd_members: 1,
        allocators: 1,
        allocator_flags: vec![],
        extender_flags: None,
    })
    .await
}

/// A client of replica 0 of `stack` that sends `token`.
pub(crate) fn with_token(
    stack: &KubeStack,
    dir: &std::path::Path,
    name: &str,
    token: &str,
) -> anyhow::Result<gpuledger_testkit::allocators::Client> {
    let file = dir.join(name);
    std::fs::write(&file, token)?;
    connect(
        &stack.allocs.addrs[0],
        &CredentialArgs {
            ca: Some(stack.allocs.ids.pki.ca_file().to_path_buf()),
            token_file: Some(file),
            client_cert: None,
            client_key: None,
            server_name: None,
        },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_foreign_roleless_and_unbound_tokens_are_refused() -> anyhow::Result<()> {
    let stack = stack().await?;
    let dir = tempfile::tempdir()?;
    let store = &stack.api.store;
    let issue = |account: &str, audience: &str, ttl: u64| {
        store
            .issue_token(NAMESPACE, account, &[audience], ttl, None)
            .map_err(|e| anyhow::anyhow!("{}", e.message()))
    };
    let expired = issue("gpuledger-admin", AUDIENCE, 1)?;
    let foreign = issue("gpuledger-admin", "https://kubernetes.default.svc", 3600)?;
    let roleless = issue("default", AUDIENCE, 3600)?;
    let unbound = issue("gpuledger-node-agent", AUDIENCE, 3600)?;
    let good = issue("gpuledger-viewer", AUDIENCE, 3600)?;
    // Past its expiry (a second of lifetime, and never used before).
    tokio::time::sleep(Duration::from_millis(2100)).await;

    let mut viewer = with_token(&stack, dir.path(), "good", &good)?;
    let before = viewer.status(api::StatusRequest {}).await?.into_inner().seq;

    let cases = [
        ("expired", expired, Code::Unauthenticated),
        ("another audience", foreign, Code::Unauthenticated),
        ("no gpuledger role", roleless, Code::PermissionDenied),
        (
            "a node agent's token bound to no pod",
            unbound,
            Code::Unauthenticated,
        ),
    ];
    for (what, token, code) in cases {
        let mut c = with_token(&stack, dir.path(), what, &token)?;
        let status = c.status(api::StatusRequest {}).await;
        assert_eq!(
            status.as_ref().map_err(tonic::Status::code).err(),
            Some(code),
            "{what}: Status answered {status:?}"
        );
        let write = c
            .remove_node(api::RemoveNodeRequest {
                node: "any".into(),
                reason: "hostile".into(),
            })
            .await;
        assert_eq!(
            write.as_ref().map_err(tonic::Status::code).err(),
            Some(code),
            "{what}: RemoveNode answered {write:?}"
        );
        let dump = c.dump(api::DumpRequest {}).await;
        assert!(dump.is_err(), "{what}: Dump answered");
    }
    let after = viewer.status(api::StatusRequest {}).await?.into_inner().seq;
    assert_eq!(after, before, "refused tokens changed the ledger");
    // The valid viewer token reads.
    viewer.dump(api::DumpRequest {}).await?;
    Ok(())
}

/// The extender reserves only for a pod the API server has, that a gpuledger scheduler
/// schedules, and that is pending or bound to the node it names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_extender_reserves_only_for_admissible_pods() -> anyhow::Result<()> {
    let stack = stack().await?;
    for n in ["n1", "n2"] {
        stack
            .allocs
            .node_agent(0, n)?
            .register_node(api::RegisterNodeRequest {
                inventory: Some(gpuledger_testkit::workload::inventory(n, 2, 16_000, "T4")),
            })
            .await?;
    }
    let pod_of = |name: &str, scheduler: &str, node: Option<&str>| -> anyhow::Result<String> {
        let asks = gpuledger_testkit::workload::pod("", 1_000, 10);
        let mut spec = gpuledger_testkit::workload::pod_spec(&asks, scheduler);
        if let Some(n) = node {
            spec["nodeName"] = serde_json::json!(n);
        }
        let p = stack.api.add_pod(serde_json::json!({
            "metadata": {"name": name, "namespace": "default"}, "spec": spec}))?;
        Ok(p["metadata"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_string())
    };
    let request = |name: &str, uid: &str, node: &str| {
        let mut r = gpuledger_testkit::workload::pod(uid, 1_000, 10);
        if let Some(p) = r.pod.as_mut() {
            p.name = name.into();
        }
        api::ReserveRequest {
            request: Some(r),
            node: node.into(),
            ttl_ms: 0,
        }
    };
    let mut ext = stack.allocs.extender(0)?;
    let before = stack.allocs.status(0).await.map(|s| s.seq);

    let other = pod_of("other", "some-other-scheduler", None)?;
    let bound_elsewhere = pod_of("elsewhere", "gpuledger-scheduler", Some("n2"))?;
    let refused = [
        (
            "a pod the API server does not have",
            request("ghost", "no-such-uid", "n1"),
        ),
        ("a pod of another scheduler", request("other", &other, "n1")),
        (
            "a pod bound to another node",
            request("elsewhere", &bound_elsewhere, "n1"),
        ),
    ];
    for (what, req) in refused {
        let r = ext.reserve(req).await;
        assert_eq!(
            r.as_ref().map_err(tonic::Status::code).err(),
            Some(Code::PermissionDenied),
            "{what}: {r:?}"
        );
    }
    assert_eq!(
        stack.allocs.status(0).await.map(|s| s.seq),
        before,
        "refused reservations changed the ledger"
    );
    // A pending pod of a gpuledger scheduler, created just now (the pod watch may not have
    // delivered it yet: the allocator asks the API server).
    let fine = pod_of("fine", "gpuledger-scheduler", None)?;
    ext.reserve(request("fine", &fine, "n1")).await?;
    Ok(())
}

/// Fail unless `r` is PERMISSION_DENIED naming `rule`.
fn denied<T: std::fmt::Debug>(
    r: Result<tonic::Response<T>, tonic::Status>,
    rule: &str,
    what: &str,
) {
    match r {
        Err(s) => {
            assert_eq!(s.code(), Code::PermissionDenied, "{what}: {s:?}");
            assert!(s.message().contains(rule), "{what}: {}", s.message());
        }
        Ok(v) => panic!("{what} was allowed: {v:?}"),
    }
}

/// A compromised extender can reserve only what a pod itself asks for, and confirm only a pod
/// the API server has bound to that node: it can no longer hold a whole GPU for a pod that asked
/// for a slice, or for a pod that asked for no GPU, nor mark a pending pod bound so that its
/// reservation never expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_extender_reserves_only_what_the_pod_asks_and_confirms_only_bound_pods()
-> anyhow::Result<()> {
    use gpuledger_testkit::workload::{inventory, pod, pod_spec};
    let stack = stack().await?;
    for n in ["n1", "n2"] {
        stack
            .allocs
            .node_agent(0, n)?
            .register_node(api::RegisterNodeRequest {
                inventory: Some(inventory(n, 2, 16_000, "T4")),
            })
            .await?;
    }
    // What the pod asks for: 1000 MiB and 10 % of one GPU.
    let asks = pod("", 1_000, 10);
    let add = |name: &str, spec: serde_json::Value| -> anyhow::Result<String> {
        let p = stack.api.add_pod(serde_json::json!({
            "metadata": {"name": name, "namespace": "default"}, "spec": spec}))?;
        Ok(p["metadata"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_string())
    };
    let request = |name: &str, uid: &str, mem: u64, core: u32| {
        let mut r = pod(uid, mem, core);
        if let Some(p) = r.pod.as_mut() {
            p.name = name.into();
        }
        api::ReserveRequest {
            request: Some(r),
            node: "n1".into(),
            ttl_ms: 0,
        }
    };
    let small = add("small", pod_spec(&asks, "gpuledger-scheduler"))?;
    let nginx = add(
        "nginx",
        serde_json::json!({"schedulerName": "gpuledger-scheduler",
            "containers": [{"name": "main", "image": "nginx"}]}),
    )?;
    let mut ext = stack.allocs.extender(0)?;
    let before = stack.allocs.status(0).await.map(|s| s.seq);
    // A whole GPU for the pod that asked for a slice; any GPU for a pod that asked for none.
    // (The allocator's pod watch may not have the pods yet: it asks the API server.)
    denied(
        ext.reserve(request("small", &small, 16_000, 100)).await,
        "extender-reserve-pod-request",
        "a whole GPU for a 1000 MiB pod",
    );
    denied(
        ext.reserve(request("nginx", &nginx, 16_000, 100)).await,
        "extender-reserve-pod-request",
        "a GPU for a pod that asks for none",
    );
    assert_eq!(
        stack.allocs.status(0).await.map(|s| s.seq),
        before,
        "refused reservations changed the ledger"
    );
    // Exactly what it asks for is reserved.
    ext.reserve(request("small", &small, 1_000, 10)).await?;
    let confirm = |node: &str| api::ConfirmBoundRequest {
        pod_uid: small.clone(),
        node: node.into(),
    };
    // Pending: it is not bound anywhere, so it is not confirmed.
    let seq = stack.allocs.status(0).await.map(|s| s.seq);
    denied(
        ext.confirm_bound(confirm("n1")).await,
        "extender-confirm-bound-pod",
        "a confirm of a pending pod",
    );
    assert_eq!(stack.allocs.status(0).await.map(|s| s.seq), seq);
    // Bound in the API server: confirmed at once (read again when the watch lags), but only
    // to that node.
    stack
        .api
        .store
        .bind(
            "default",
            "small",
            &serde_json::json!({"target": {"name": "n1"}}),
        )
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    denied(
        ext.confirm_bound(confirm("n2")).await,
        "rule extender-",
        "a confirm to another node",
    );
    ext.confirm_bound(confirm("n1")).await?;
    let bound = stack
        .allocs
        .viewer(0)?
        .dump(api::DumpRequest {})
        .await?
        .into_inner()
        .snapshot
        .map(|s| s.allocations)
        .unwrap_or_default();
    assert!(
        bound
            .iter()
            .any(|a| a.pod.as_ref().is_some_and(|p| p.uid == small)
                && a.state == gpuledger_proto::ledger::v1::AllocationState::Bound as i32),
        "the bound pod's allocation is not Bound: {bound:?}"
    );
    Ok(())
}
