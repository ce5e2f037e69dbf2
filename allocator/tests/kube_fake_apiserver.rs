//! The test kit's fake kube-apiserver behaves like the real one for what gpuledger and
//! kube-rs use, reached through an ordinary kubeconfig: create/get/list with field selectors,
//! watch from a resourceVersion, merge patch (resourceVersion as a precondition, status only on
//! `status`), bindings with 409 on a second bind, events,
//! leases.

use std::time::Duration;

use futures::StreamExt;
use gpuledger_testkit::kube::FakeApiServer;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::serde_json::{Value, json};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_rs_works_against_the_fake_apiserver() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let server = FakeApiServer::start(dir.path()).await?;
    let client = server.client().await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    for (name, sched) in [("a", "gpuledger-scheduler"), ("b", "default-scheduler")] {
        let p: Pod = k8s_openapi::serde_json::from_value(json!({"metadata": {"name": name},
            "spec": {"schedulerName": sched, "containers": [{"name": "c", "image": "x"}]}}))?;
        pods.create(&PostParams::default(), &p).await?;
    }
    let dup: Pod = k8s_openapi::serde_json::from_value(json!({"metadata": {"name": "a"},
        "spec": {"containers": [{"name": "c", "image": "x"}]}}))?;
    match pods.create(&PostParams::default(), &dup).await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 409),
        other => panic!("duplicate create: {other:?}"),
    }
    let pending = pods
        .list(
            &ListParams::default().fields("spec.schedulerName=gpuledger-scheduler,spec.nodeName="),
        )
        .await?;
    assert_eq!(pending.items.len(), 1);
    let rv = pending.metadata.resource_version.clone().expect("list rv");

    // Watch from the list's resourceVersion, then bind: the pod leaves the selector.
    let mut w = pods
        .watch(
            &WatchParams::default().fields("spec.schedulerName=gpuledger-scheduler,spec.nodeName="),
            &rv,
        )
        .await?
        .boxed();
    let binding = json!({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "a"},
                         "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"}});
    let _: Value = pods
        .create_subresource("binding", "a", &PostParams::default(), &binding)
        .await?;
    let again: Result<Value, _> = pods
        .create_subresource("binding", "a", &PostParams::default(), &binding)
        .await;
    match again {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 409);
            assert!(s.message.contains("already assigned"), "{}", s.message);
        }
        other => panic!("second bind: {other:?}"),
    }
    let ev = tokio::time::timeout(Duration::from_secs(5), w.next())
        .await?
        .expect("event")?;
    assert!(
        matches!(ev, WatchEvent::Deleted(_)),
        "bound pod leaves the pending selector: {ev:?}"
    );
    let on_n1 = pods
        .list(&ListParams::default().fields("spec.nodeName=n1"))
        .await?;
    assert_eq!(on_n1.items.len(), 1);

    // Merge patch.
    let patched = pods
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"x": "1"}}})),
        )
        .await?;
    assert_eq!(
        patched
            .metadata
            .annotations
            .unwrap_or_default()
            .get("x")
            .map(String::as_str),
        Some("1")
    );
    assert!(
        patched.spec.and_then(|s| s.node_name).is_some(),
        "patch keeps the rest"
    );

    // A resourceVersion in a merge patch is a precondition; a status patch changes only
    // the status.
    let stale = json!({"metadata": {"resourceVersion": "1", "labels": {"y": "1"}}});
    match pods
        .patch("a", &PatchParams::default(), &Patch::Merge(&stale))
        .await
    {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 409),
        other => panic!("stale patch: {other:?}"),
    }
    let rv = patched.metadata.resource_version.clone().expect("rv");
    let st = pods
        .patch_status(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"resourceVersion": rv},
                "spec": {"nodeName": "elsewhere"}, "status": {"phase": "Running"}})),
        )
        .await?;
    assert_eq!(st.status.and_then(|s| s.phase).as_deref(), Some("Running"));
    assert_eq!(
        st.spec.and_then(|s| s.node_name).as_deref(),
        Some("n1"),
        "a status patch leaves the spec"
    );

    // Events and leases are stored like anything else.
    let events: Api<Event> = Api::namespaced(client.clone(), "default");
    let e: Event = k8s_openapi::serde_json::from_value(json!({"metadata": {"generateName": "a."},
        "involvedObject": {"kind": "Pod", "name": "a", "namespace": "default"}, "reason": "Bound"}))?;
    let made = events.create(&PostParams::default(), &e).await?;
    assert!(made.metadata.name.is_some_and(|n| n.starts_with("a.")));
    let leases: Api<Lease> = Api::namespaced(client, "kube-system");
    let l: Lease = k8s_openapi::serde_json::from_value(
        json!({"metadata": {"name": "gpuledger"}, "spec": {"holderIdentity": "x"}}),
    )?;
    leases.create(&PostParams::default(), &l).await?;
    assert_eq!(
        leases
            .get("gpuledger")
            .await?
            .spec
            .and_then(|s| s.holder_identity)
            .as_deref(),
        Some("x")
    );
    Ok(())
}
