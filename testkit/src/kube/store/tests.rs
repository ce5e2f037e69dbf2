use serde_json::json;

use super::*;

fn with_pods(store: &Store) {
    for (name, app) in [("db-0", "db"), ("web-0", "web")] {
        store
            .create(
                "v1",
                "pods",
                "ns",
                json!({"metadata": {"name": name, "labels": {"app": app}}}),
            )
            .expect("pod");
    }
}

fn pdb(store: &Store, allowed: i64) {
    store
        .create(
            "policy/v1",
            "poddisruptionbudgets",
            "ns",
            json!({"metadata": {"name": "db"}, "spec": {"selector": {"matchLabels": {"app": "db"}}},
                   "status": {"disruptionsAllowed": allowed}}),
        )
        .expect("pdb");
}

#[test]
fn an_eviction_deletes_the_pod_unless_a_budget_forbids_it() {
    let store = Store::default();
    with_pods(&store);
    pdb(&store, 1);
    // The budget allows one: the pod goes and the budget allows no more.
    store.evict("ns", "db-0", &json!({})).expect("allowed");
    assert!(store.get("v1", "pods", "ns", "db-0").is_err());
    let b = store
        .get("policy/v1", "poddisruptionbudgets", "ns", "db")
        .expect("pdb");
    assert_eq!(b["status"]["disruptionsAllowed"], 0);
    store
        .create(
            "v1",
            "pods",
            "ns",
            json!({"metadata": {"name": "db-1", "labels": {"app": "db"}}}),
        )
        .expect("pod");
    let e = store
        .evict("ns", "db-1", &json!({}))
        .expect_err("the budget is spent");
    assert_eq!(e.code(), 429, "{}", e.message());
    assert!(store.get("v1", "pods", "ns", "db-1").is_ok());
    // A pod the budget does not select is not held back.
    store
        .evict("ns", "web-0", &json!({}))
        .expect("not selected");
}

#[test]
fn an_eviction_with_another_pods_uid_is_refused() {
    let store = Store::default();
    with_pods(&store);
    let e = store
        .evict(
            "ns",
            "web-0",
            &json!({"deleteOptions": {"preconditions": {"uid": "someone-else"}}}),
        )
        .expect_err("wrong uid");
    assert_eq!(e.code(), 409);
    assert!(store.get("v1", "pods", "ns", "web-0").is_ok());
    let e = store
        .evict("ns", "gone", &json!({}))
        .expect_err("no such pod");
    assert_eq!(e.code(), 404);
}
