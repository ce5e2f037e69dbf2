use gpuledger_ledger::placement::{ContainerRequest, PodRequest};
use serde_json::json;

use super::*;

fn ledger(pods: &[(&str, &str)]) -> Ledger {
    let mut l = Ledger::new();
    for n in ["n1", "n2"] {
        let inv = pb::NodeInventory {
            mode: Default::default(),
            isolation: String::new(),
            dra_cores: String::new(),
            node: n.into(),
            gpus: vec![pb::Gpu {
                uuid: format!("GPU-{n}"),
                index: 0,
                model: "A100".into(),
                memory_mib: 80_000,
                healthy: true,
                compute_capability: String::new(),
            }],
            cpu_milli: 0,
            memory_mib: 0,
        };
        l.execute(Command::RegisterNode(inv), 1, 0)
            .expect("register");
    }
    for (uid, node) in pods {
        let req = PodRequest {
            pod: pb::PodRef {
                uid: (*uid).into(),
                namespace: "ns".into(),
                name: (*uid).into(),
            },
            containers: vec![ContainerRequest {
                name: "c".into(),
                slices: 1,
                mem_mib: 10_000,
                ..Default::default()
            }],
            ..Default::default()
        };
        l.execute(
            Command::Reserve {
                request: req,
                node: (*node).into(),
                deadline_ms: 0,
            },
            1,
            0,
        )
        .expect("reserve");
    }
    l
}

fn pod(uid: &str, node: &str, priority: i32, labels: serde_json::Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": uid, "namespace": "ns", "uid": uid, "labels": labels},
        "spec": {"nodeName": node, "priority": priority, "containers": []},
        "status": {"phase": "Running"},
    }))
    .expect("a pod")
}

fn pdb(name: &str, ns: &str, selector: serde_json::Value, allowed: i32) -> PodDisruptionBudget {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": ns},
        "spec": {"selector": selector, "minAvailable": 1},
        "status": {"disruptionsAllowed": allowed, "currentHealthy": 1, "desiredHealthy": 1,
                   "expectedPods": 1},
    }))
    .expect("a PDB")
}

#[test]
fn only_lower_priority_unprotected_gpu_pods_are_evictable_and_terminating_ones_leave() {
    let l = ledger(&[
        ("low", "n1"),
        ("high", "n1"),
        ("guarded", "n1"),
        ("going", "n1"),
        ("other", "n2"),
    ]);
    let mut going = pod("going", "n1", 1, json!({}));
    going.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
    ));
    let pods = [
        pod("low", "n1", 1, json!({})),
        pod("high", "n1", 500, json!({})),
        pod("guarded", "n1", 1, json!({"app": "db"})),
        going,
        pod("no-gpu", "n1", 1, json!({})),
        pod("me", "n1", 1, json!({})),
        pod("other", "n2", 1, json!({})),
    ];
    let pdbs = [pdb("db", "ns", json!({"matchLabels": {"app": "db"}}), 0)];
    let out = node_pods(pods.iter(), &pdbs, &l, &["n1".to_string()], 100, "me");
    assert_eq!(out.len(), 1);
    let uids: Vec<&str> = out[0]
        .evictable
        .iter()
        .map(|e| e.pod_uid.as_str())
        .collect();
    assert_eq!(uids, ["low"], "{out:?}");
    assert_eq!(out[0].leaving.iter().collect::<Vec<_>>(), ["going"]);
}

#[test]
fn a_budget_protects_only_what_it_selects_in_its_namespace_while_it_allows_nothing() {
    let db = pod("db-0", "n1", 1, json!({"app": "db", "tier": "x"}));
    let web = pod("web-0", "n1", 1, json!({"app": "web"}));
    let zero = pdb("db", "ns", json!({"matchLabels": {"app": "db"}}), 0);
    assert_eq!(
        protected_by(&db, std::slice::from_ref(&zero)).as_deref(),
        Some("ns/db")
    );
    assert_eq!(protected_by(&web, std::slice::from_ref(&zero)), None);
    // One disruption allowed: the Eviction API takes one, so the pod is not left out.
    assert_eq!(
        protected_by(
            &db,
            &[pdb("db", "ns", json!({"matchLabels": {"app": "db"}}), 1)]
        ),
        None
    );
    // Another namespace's budget does not apply.
    assert_eq!(
        protected_by(
            &db,
            &[pdb("db", "other", json!({"matchLabels": {"app": "db"}}), 0)]
        ),
        None
    );
    // policy/v1: an empty selector selects every pod of the namespace.
    assert_eq!(
        protected_by(&web, &[pdb("all", "ns", json!({}), 0)]).as_deref(),
        Some("ns/all")
    );
    let expr = json!({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["x"]}]});
    assert!(protected_by(&db, &[pdb("t", "ns", expr, 0)]).is_some());
}
