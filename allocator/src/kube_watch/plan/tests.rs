use super::*;

fn held(node: &str, reserved: bool, reserved_ms: i64, deadline_ms: i64) -> Held {
    Held {
        id: 7,
        ns: "ns".into(),
        name: "pod".into(),
        node: node.into(),
        reserved,
        deadline_ms,
        reserved_ms,
    }
}

fn pod(uid: &str, finished: Option<&str>, node: Option<&str>) -> PodFacts {
    PodFacts {
        uid: uid.into(),
        finished: finished.map(str::to_string),
        node: node.map(str::to_string),
    }
}

/// The reconcile at `ms` milliseconds after the first look, on one replica's monotonic clock.
struct Clocked {
    expiry: Expiry,
    t0: tokio::time::Instant,
    /// The UIDs the watch saw deleted.
    deleted: HashSet<String>,
}

impl Clocked {
    fn new() -> Clocked {
        Clocked {
            expiry: Expiry::default(),
            t0: tokio::time::Instant::now(),
            deleted: HashSet::new(),
        }
    }

    fn plan(
        &mut self,
        h: &BTreeMap<String, Vec<Held>>,
        cached: impl Fn(&str, &str) -> Option<PodFacts>,
        ms: u64,
    ) -> Vec<Fix> {
        plan_pods(
            h,
            cached,
            |uid| self.deleted.contains(uid),
            &mut self.expiry,
            self.t0 + Duration::from_millis(ms),
        )
    }
}

fn one(uid: &str, h: Held) -> BTreeMap<String, Vec<Held>> {
    BTreeMap::from([(uid.to_string(), vec![h])])
}

#[test]
fn a_finished_pod_is_released_and_a_bound_one_confirmed() {
    let list = [held("n1", true, 0, 10_000)];
    assert_eq!(
        on_pod(&pod("u", Some("succeeded"), Some("n1")), &list),
        Some(Fix::Release {
            uid: "u".into(),
            reason: "pod succeeded".into()
        })
    );
    assert!(matches!(
        on_pod(&pod("u", None, Some("n1")), &list),
        Some(Fix::Confirm { node, .. }) if node == "n1"
    ));
    assert_eq!(
        on_pod(&pod("u", None, Some("n2")), &list),
        None,
        "bound elsewhere"
    );
    assert_eq!(on_pod(&pod("u", None, None), &list), None, "not bound yet");
    let bound = [held("n1", false, 0, 0)];
    assert_eq!(
        on_pod(&pod("u", None, Some("n1")), &bound),
        None,
        "confirmed already"
    );
}

#[test]
fn a_cached_pod_past_its_deadline_and_bound_nowhere_is_checked_with_the_api_server() {
    let h = one("u", held("n1", true, 0, 10_000));
    let cached = |_: &str, _: &str| Some(pod("u", None, None));
    let mut c = Clocked::new();
    assert!(c.plan(&h, cached, 0).is_empty(), "first seen");
    assert!(c.plan(&h, cached, 9_999).is_empty(), "before its TTL");
    assert_eq!(
        c.plan(&h, cached, 10_000),
        [Fix::CheckExpired {
            uid: "u".into(),
            held: held("n1", true, 0, 10_000)
        }]
    );
    // Bound there after all: confirmed from the cache, whatever the deadline.
    let bound = |_: &str, _: &str| Some(pod("u", None, Some("n1")));
    assert!(matches!(
        c.plan(&h, bound, 20_000).as_slice(),
        [Fix::Confirm { .. }]
    ));
}

/// A new leader's first pass after a failover: the pod was deleted while the old leader was
/// dying, this replica's watch saw it go, and its grant (young here: first seen now) is
/// released at once instead of after [`crate::expiry::YOUNG`].
#[test]
fn a_grant_of_a_pod_the_watch_saw_deleted_is_released_at_once_however_young() {
    let h = one("u", held("n1", false, 1_000, 0));
    let nothing = |_: &str, _: &str| None;
    let mut c = Clocked::new();
    assert!(c.plan(&h, nothing, 0).is_empty(), "not seen deleted: waits");
    c.deleted.insert("u".into());
    assert_eq!(
        c.plan(&h, nothing, 1),
        [Fix::Release {
            uid: "u".into(),
            reason: "pod deleted".into()
        }]
    );
    // A pod of that name and another UID in the cache changes nothing.
    let other = |_: &str, _: &str| Some(pod("v", None, Some("n1")));
    assert!(matches!(
        c.plan(&h, other, 2).as_slice(),
        [Fix::Release { .. }]
    ));
    // Another pod's deletion is not this one's.
    let mut c = Clocked::new();
    c.deleted.insert("v".into());
    assert!(c.plan(&h, nothing, 0).is_empty());
}

#[test]
fn a_young_reservation_missing_from_the_cache_is_left_alone_an_older_one_is_read() {
    let h = one("u", held("n1", true, 1_000, 60_000));
    let nothing = |_: &str, _: &str| None;
    let mut c = Clocked::new();
    let young = crate::expiry::YOUNG.as_millis() as u64;
    assert!(c.plan(&h, nothing, 0).is_empty());
    assert!(c.plan(&h, nothing, young - 1).is_empty());
    assert_eq!(
        c.plan(&h, nothing, young),
        [Fix::Read {
            uid: "u".into(),
            held: vec![held("n1", true, 1_000, 60_000)],
            expired: false
        }]
    );
    // Another pod under the same name is not this one.
    let other = |_: &str, _: &str| Some(pod("v", None, Some("n1")));
    assert!(matches!(
        c.plan(&h, other, 59_000).as_slice(),
        [Fix::Read { expired: true, .. }]
    ));
}

#[test]
fn what_the_api_server_says_decides_a_read_pod() {
    let list = vec![held("n1", true, 0, 10_000)];
    assert_eq!(
        after_read("u", &list, false, None),
        [Fix::Release {
            uid: "u".into(),
            reason: "pod deleted".into()
        }]
    );
    assert_eq!(
        after_read("u", &list, false, Some(&pod("v", None, None))),
        [Fix::Release {
            uid: "u".into(),
            reason: "pod deleted".into()
        }],
        "a pod of the same name but another UID"
    );
    assert!(after_read("u", &list, false, Some(&pod("u", None, None))).is_empty());
    assert!(matches!(
        after_read("u", &list, true, Some(&pod("u", None, None))).as_slice(),
        [Fix::CheckExpired { .. }]
    ));
    assert!(matches!(
        after_read("u", &list, true, Some(&pod("u", None, Some("n1")))).as_slice(),
        [Fix::Confirm { .. }]
    ));
}

#[test]
fn an_expired_reservation_is_confirmed_if_bound_else_released_and_its_pod_told() {
    let h = held("n1", true, 0, 10_000);
    assert!(matches!(
        after_expiry_read("u", &h, Some(&pod("u", None, Some("n1")))),
        Fix::Confirm { .. }
    ));
    assert_eq!(
        after_expiry_read("u", &h, Some(&pod("u", None, Some("n2")))),
        Fix::ReleaseExpired {
            uid: "u".into(),
            held: h.clone()
        }
    );
    assert_eq!(
        after_expiry_read("u", &h, None),
        Fix::Release {
            uid: "u".into(),
            reason: "expired".into()
        },
        "gone: nobody to tell"
    );
}

#[test]
fn a_node_missing_from_kubernetes_is_removed_after_the_grace_and_capacities_sync() {
    let grace = Duration::from_secs(30);
    let t0 = Instant::now();
    let nodes = vec![
        ("gone".to_string(), (0, 0)),
        ("kept".to_string(), (4000, 16_000)),
        ("grown".to_string(), (4000, 16_000)),
    ];
    let kube = |n: &str| match n {
        "kept" => Some(Some((4000, 16_000))),
        "grown" => Some(Some((8000, 32_000))),
        _ => None,
    };
    let mut missing = Missing::default();
    assert_eq!(
        plan_nodes(&nodes, kube, &mut missing, t0, grace),
        [Fix::SyncCapacity {
            node: "grown".into(),
            cpu_milli: 8000,
            memory_mib: 32_000
        }]
    );
    let later = t0 + grace - Duration::from_millis(1);
    assert_eq!(
        plan_nodes(&nodes[..1], kube, &mut missing, later, grace),
        []
    );
    assert_eq!(
        plan_nodes(&nodes[..1], kube, &mut missing, t0 + grace, grace),
        [Fix::RemoveNode {
            node: "gone".into(),
            reason: "node is not in Kubernetes"
        }]
    );
    // Back in Kubernetes before the grace ran out: its clock starts over when it goes again.
    let mut missing = Missing::default();
    let _ = plan_nodes(&nodes[..1], kube, &mut missing, t0, grace);
    let back = |_: &str| Some(None);
    assert_eq!(
        plan_nodes(&nodes[..1], back, &mut missing, t0 + grace, grace),
        []
    );
    assert_eq!(
        plan_nodes(&nodes[..1], kube, &mut missing, t0 + grace, grace),
        []
    );
}

#[test]
fn claim_grants_are_not_reconciled_as_pods() {
    use gpuledger_ledger::{Command, pb};
    let mut l = Ledger::new();
    for (node, mode) in [
        ("dra", pb::NodeMode::Dra),
        ("dp", pb::NodeMode::DevicePlugin),
    ] {
        let inv = pb::NodeInventory {
            node: node.into(),
            gpus: vec![pb::Gpu {
                uuid: format!("GPU-{node}"),
                index: 0,
                model: "A100".into(),
                memory_mib: 16_000,
                healthy: true,
                compute_capability: String::new(),
            }],
            mode: mode as i32,
            ..Default::default()
        };
        l.execute(Command::RegisterNode(inv), 1, 0)
            .expect("register");
    }
    let grant = pb::ClaimGranted {
        claim: Some(pb::ClaimRef {
            uid: "claim-uid".into(),
            namespace: "ns".into(),
            name: "gpu".into(),
        }),
        request: "c0".into(),
        node: "dra".into(),
        pool: "dra".into(),
        device: gpuledger_ledger::state::dra_device_name("GPU-dra"),
        share_id: "s".into(),
        share: Some(pb::GpuShare {
            gpu_uuid: "GPU-dra".into(),
            mem_mib: 1000,
            core_milli: 0,
        }),
        source: "claim".into(),
        ..Default::default()
    };
    l.execute(Command::GrantClaim(grant), 1, 1).expect("grant");
    let request = gpuledger_ledger::PodRequest {
        pod: pb::PodRef {
            uid: "pod-uid".into(),
            namespace: "ns".into(),
            name: "p".into(),
        },
        containers: vec![gpuledger_ledger::ContainerRequest {
            name: "main".into(),
            slices: 1,
            mem_mib: 1000,
            ..Default::default()
        }],
        ..Default::default()
    };
    l.execute(
        Command::Reserve {
            request,
            node: "dp".into(),
            deadline_ms: 1000,
        },
        1,
        2,
    )
    .expect("reserve");
    assert_eq!(l.allocs().len(), 2);
    let held = held_by_pod(&l);
    assert_eq!(held.keys().collect::<Vec<_>>(), ["pod-uid"]);
}
