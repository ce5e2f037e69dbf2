//! Pods as users write them, and what the cluster did with them.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::{Event, Namespace, Pod, ServiceAccount};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::{Value, json};

/// The image every test container runs (busybox, built and imported by [`crate::images`]).
pub const IMAGE: &str = "e2e.local/busybox:1";

/// A pod with one container `main` running `command` (default: sleep), with these resource
/// limits. Extended resources are written as limits, as users of gpushare and HAMi write them.
pub fn pod(name: &str, limits: &[(&str, &str)], command: Option<&[&str]>) -> Value {
    let limits: BTreeMap<&str, &str> = limits.iter().copied().collect();
    let command: Vec<&str> = command.map_or_else(|| vec!["sleep", "3600"], <[&str]>::to_vec);
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [{
                "name": "main",
                "image": IMAGE,
                "imagePullPolicy": "Never",
                "command": command,
                "resources": {"limits": limits},
            }],
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
        },
    })
}

/// Create namespace `ns` with `labels`; wait until kube-controller-manager made its `default`
/// ServiceAccount, without which the API server admits no pod there.
pub async fn namespace(client: &kube::Client, ns: &str, labels: &[(&str, &str)]) -> Result<()> {
    let labels: BTreeMap<&str, &str> = labels.iter().copied().collect();
    let o: Namespace = serde_json::from_value(json!({"metadata": {"name": ns, "labels": labels}}))?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &o)
        .await
        .with_context(|| format!("creating namespace {ns}"))?;
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    crate::until(
        &format!("ServiceAccount {ns}/default"),
        Duration::from_secs(30),
        || async { Ok(accounts.get_opt("default").await?.map(|_| ())) },
    )
    .await
}

/// Create `pod` in `ns`; the API server's answer (mutated by the webhook, if it ran).
pub async fn create(client: &kube::Client, ns: &str, pod: &Value) -> Result<Pod> {
    let p: Pod = serde_json::from_value(pod.clone())?;
    let name = p.metadata.name.clone().unwrap_or_default();
    Api::<Pod>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &p)
        .await
        .with_context(|| format!("creating pod {ns}/{name}"))
}

/// Wait until every pod of `names` in `ns` is bound; their nodes.
pub async fn wait_bound(
    client: &kube::Client,
    ns: &str,
    names: &[String],
    timeout: Duration,
) -> Result<BTreeMap<String, String>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let deadline = Instant::now() + timeout;
    loop {
        let list = pods.list(&ListParams::default()).await?;
        let bound: BTreeMap<String, String> = list
            .items
            .iter()
            .filter_map(|p| {
                let n = p.metadata.name.clone()?;
                let node = p.spec.as_ref()?.node_name.clone()?;
                names.contains(&n).then_some((n, node))
            })
            .collect();
        if bound.len() == names.len() {
            return Ok(bound);
        }
        if Instant::now() > deadline {
            let pending: Vec<&String> = names.iter().filter(|n| !bound.contains_key(*n)).collect();
            let mut why = String::new();
            for p in pending.iter().take(3) {
                why.push_str(&format!(
                    "\n{p}: {}",
                    events_text(client, ns, p).await.unwrap_or_default()
                ));
            }
            bail!(
                "{} of {} pods in {ns} not bound within {timeout:?}: {pending:?}{why}",
                pending.len(),
                names.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The pod's Events, oldest first.
pub async fn events(client: &kube::Client, ns: &str, pod: &str) -> Result<Vec<Event>> {
    let evs: Api<Event> = Api::namespaced(client.clone(), ns);
    let mut list = evs
        .list(&ListParams::default().fields(&format!("involvedObject.name={pod}")))
        .await?
        .items;
    list.sort_by_key(|e| e.metadata.creation_timestamp.clone());
    Ok(list)
}

/// The pod's Events as `reason: message` lines.
pub async fn events_text(client: &kube::Client, ns: &str, pod: &str) -> Result<String> {
    Ok(events(client, ns, pod)
        .await?
        .iter()
        .map(|e| {
            format!(
                "{}: {}",
                e.reason.as_deref().unwrap_or(""),
                e.message.as_deref().unwrap_or("")
            )
        })
        .collect::<Vec<_>>()
        .join("\n"))
}

/// Delete a pod at once (grace period 0: kubelet-less nodes have nobody to confirm it).
pub async fn force_delete(client: &kube::Client, ns: &str, name: &str) -> Result<()> {
    let dp = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    Api::<Pod>::namespaced(client.clone(), ns)
        .delete(name, &dp)
        .await
        .with_context(|| format!("deleting pod {ns}/{name}"))?;
    Ok(())
}

/// The live claim grants the pod `uid` consumes (the claim is reserved for it).
pub fn grants_consumed_by<'a>(
    l: &'a gpuledger_ledger::Ledger,
    uid: &str,
) -> Vec<&'a gpuledger_ledger::Alloc> {
    l.allocs()
        .values()
        .filter(|a| {
            a.claim
                .as_ref()
                .is_some_and(|c| c.consumers.iter().any(|p| p.uid == uid))
        })
        .collect()
}

/// The node of every pod with a live allocation in the ledger, by `namespace/name`.
pub fn ledger_nodes(l: &gpuledger_ledger::Ledger) -> BTreeMap<String, String> {
    l.allocs()
        .values()
        .map(|a| {
            (
                format!("{}/{}", a.pod.namespace, a.pod.name),
                a.node.clone(),
            )
        })
        .collect()
}
