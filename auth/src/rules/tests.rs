use super::*;

fn caller(role: Role) -> Caller {
    Caller {
        subject: format!("test:{}", role.kind()),
        role,
    }
}

fn agent(node: &str) -> Caller {
    caller(Role::NodeAgent { node: node.into() })
}

fn on(nodes: &[&str]) -> Facts {
    Facts {
        nodes: nodes.iter().map(|n| n.to_string()).collect(),
        ..Facts::default()
    }
}

fn pod(scheduler: bool, node: Option<&str>, ended: bool) -> Facts {
    Facts {
        pod: Some(PodFacts::Found {
            gpuledger_scheduler: scheduler,
            node: node.map(String::from),
            ended,
        }),
        ..Facts::default()
    }
}

/// The roles' rights with no condition in the way: the table, row by row.
#[test]
fn which_role_may_make_which_call() {
    use Call::*;
    let allowed = |role: &Role| -> Vec<Call> {
        Call::ALL
            .into_iter()
            .filter(|c| rule_for(role, *c).is_some())
            .collect()
    };
    assert_eq!(
        allowed(&Role::Allocator),
        vec![Filter, Score, Status, Dump, ReadLog, Replicate]
    );
    assert_eq!(
        allowed(&Role::Extender),
        vec![
            Filter,
            Score,
            Reserve,
            ConfirmBound,
            Release,
            Status,
            Replicate,
            Preempt
        ]
    );
    assert_eq!(
        allowed(&Role::NodeAgent { node: "a".into() }),
        vec![
            RegisterNode,
            SetDeviceHealth,
            Assign,
            CorrectIdentity,
            ReportViolation,
            Subscribe,
            Status,
            PrepareClaim,
            UnprepareClaim
        ]
    );
    assert_eq!(
        allowed(&Role::Viewer),
        vec![
            Filter,
            Score,
            Subscribe,
            Status,
            Dump,
            ReadLog,
            ReadSnapshots,
            HttpState
        ]
    );
    assert_eq!(
        allowed(&Role::Admin),
        vec![
            RegisterNode,
            RemoveNode,
            SetDeviceHealth,
            Filter,
            Score,
            Release,
            Subscribe,
            Status,
            Dump,
            ReadLog,
            ReadSnapshots,
            HttpState,
            SetBudget,
            SetQuota,
            GrantClaim,
            RefuseClaim,
            Adopt
        ]
    );
}

#[test]
fn a_call_no_rule_allows_names_the_role_and_the_call() {
    let e = authorize(
        &caller(Role::Extender),
        Call::RegisterNode,
        &on(&["a"]),
        None,
    )
    .unwrap_err();
    assert_eq!(e.rule, "no-rule");
    assert_eq!(e.why, "an extender may not call RegisterNode");
    let e = authorize(
        &caller(Role::Viewer),
        Call::Release,
        &Facts::default(),
        None,
    )
    .unwrap_err();
    assert_eq!(e.rule, "no-rule");
}

#[test]
fn a_node_agent_touches_only_its_own_node() {
    for call in [
        Call::RegisterNode,
        Call::SetDeviceHealth,
        Call::Assign,
        Call::CorrectIdentity,
        Call::ReportViolation,
        Call::Subscribe,
        Call::PrepareClaim,
        Call::UnprepareClaim,
    ] {
        assert!(
            authorize(&agent("a"), call, &on(&["a"]), None).is_ok(),
            "{call:?}"
        );
        let e = authorize(&agent("a"), call, &on(&["b"]), None).unwrap_err();
        assert!(
            e.why.contains("node b, not the caller's node a"),
            "{call:?}: {e}"
        );
        // A correction that moves devices from an allocation on A to one on B.
        assert!(authorize(&agent("a"), call, &on(&["a", "b"]), None).is_err());
        assert!(
            authorize(&agent("a"), call, &on(&[]), None).is_err(),
            "no node named"
        );
        let unknown = Facts {
            unknown_allocation: true,
            ..on(&["a"])
        };
        assert!(authorize(&agent("a"), call, &unknown, None).is_err());
    }
    for call in [
        Call::Release,
        Call::Reserve,
        Call::RemoveNode,
        Call::Dump,
        Call::ReadLog,
        Call::GrantClaim,
        Call::RefuseClaim,
        Call::Adopt,
    ] {
        assert!(
            authorize(&agent("a"), call, &on(&["a"]), None).is_err(),
            "{call:?}"
        );
    }
}

#[test]
fn the_extender_reserves_only_for_admissible_pods() {
    let ext = caller(Role::Extender);
    for call in [Call::Reserve, Call::ConfirmBound] {
        assert!(authorize(&ext, call, &pod(true, None, false), Some("n1")).is_ok());
        assert!(authorize(&ext, call, &pod(true, Some("n1"), false), Some("n1")).is_ok());
        let cases = [
            (
                pod(false, None, false),
                "not scheduled by a gpuledger scheduler",
            ),
            (pod(true, Some("n2"), false), "bound to node n2, not n1"),
            (pod(true, None, true), "ended"),
            (
                Facts {
                    pod: Some(PodFacts::Missing),
                    ..Facts::default()
                },
                "no pod with this UID",
            ),
            (Facts::default(), "no pod with this UID"),
        ];
        for (facts, why) in cases {
            let e = authorize(&ext, call, &facts, Some("n1")).unwrap_err();
            assert!(e.why.contains(why), "{call:?}: {e} (want {why})");
            assert!(e.rule.starts_with("extender-"), "{}", e.rule);
        }
    }
    let no_api = Facts {
        pod: Some(PodFacts::NoApiServer),
        ..Facts::default()
    };
    assert!(authorize(&ext, Call::Reserve, &no_api, Some("n1")).is_ok());
}

#[test]
fn the_extender_preempts_only_for_pending_admissible_pods() {
    let ext = caller(Role::Extender);
    // Preempt names no node: a pod bound anywhere may not evict others.
    assert!(authorize(&ext, Call::Preempt, &pod(true, None, false), None).is_ok());
    for (facts, why) in [
        (pod(true, Some("n1"), false), "bound to node n1"),
        (
            pod(false, None, false),
            "not scheduled by a gpuledger scheduler",
        ),
        (pod(true, None, true), "ended"),
        (Facts::default(), "no pod with this UID"),
    ] {
        let e = authorize(&ext, Call::Preempt, &facts, None).unwrap_err();
        assert!(e.why.contains(why), "{e} (want {why})");
        assert_eq!(e.rule, "extender-preempt-admissible-pod");
    }
    for role in [Role::Viewer, Role::Admin, Role::Allocator] {
        assert!(rule_for(&role, Call::Preempt).is_none(), "{role:?}");
    }
    assert!(rule_for(&Role::NodeAgent { node: "a".into() }, Call::Preempt).is_none());
}

#[test]
fn the_extender_releases_only_reservations() {
    let ext = caller(Role::Extender);
    let reserved = Facts {
        only_reservations: true,
        ..Facts::default()
    };
    assert!(authorize(&ext, Call::Release, &reserved, None).is_ok());
    let e = authorize(&ext, Call::Release, &Facts::default(), None).unwrap_err();
    assert_eq!(e.rule, "extender-release-own-reservations");
    let unknown = Facts {
        unknown_allocation: true,
        only_reservations: true,
        ..Facts::default()
    };
    assert!(authorize(&ext, Call::Release, &unknown, None).is_err());
    // An admin may release anything.
    assert!(authorize(&caller(Role::Admin), Call::Release, &Facts::default(), None).is_ok());
}

#[test]
fn grpc_paths_name_their_calls() {
    assert_eq!(
        Call::from_grpc_path("/gpuledger.allocator.v1.Allocator/Reserve"),
        Some(Call::Reserve)
    );
    assert_eq!(
        Call::from_grpc_path("/gpuledger.allocator.v1.Allocator/HttpState"),
        None
    );
    assert_eq!(Call::from_grpc_path("/other.Service/Reserve"), None);
    for c in Call::ALL.into_iter().filter(|c| *c != Call::HttpState) {
        let path = format!("/gpuledger.allocator.v1.Allocator/{}", c.name());
        assert_eq!(Call::from_grpc_path(&path), Some(c));
    }
}
