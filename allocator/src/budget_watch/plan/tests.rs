use gpuledger_crd::{BudgetPolicy, BudgetUnit, GPUBudgetSpec, GPUBudgetStatus, GPUQuota};

use super::*;

fn obj(ns: &str, name: &str) -> Arc<GPUBudget> {
    let mut o = GPUBudget::new(
        name,
        GPUBudgetSpec {
            amount: "10".into(),
            unit: BudgetUnit::MibHours,
            window: "day".into(),
            policy: BudgetPolicy::Deny,
            priority_class_name: None,
            quota: None,
        },
    );
    o.metadata.namespace = Some(ns.into());
    o.metadata.generation = Some(1);
    Arc::new(o)
}

/// `o` with the status the watch writes once the ledger holds it.
fn applied(o: &GPUBudget) -> Arc<GPUBudget> {
    let mut o = o.clone();
    o.status = Some(GPUBudgetStatus {
        observed_generation: o.metadata.generation,
        state: STATE_APPLIED.into(),
        seq: Some(3),
        message: "whatever".into(),
    });
    Arc::new(o)
}

fn ledger_budget(o: &GPUBudget, ns: &str) -> pb::BudgetSet {
    wanted(ns, o).expect("a valid object").budget
}

#[test]
fn one_object_governs_a_namespace_and_default_is_the_cluster_default() {
    let objs = [
        obj("team-a", "zeta"),
        obj("team-a", "alpha"),
        obj("gpuledger-system", "default"),
        obj("gpuledger-system", "own"),
        obj("team-b", "default"),
    ];
    let g = governing(&objs, "gpuledger-system");
    let names = |ns: &str| -> Vec<String> { g[ns].iter().map(|o| o.name_any()).collect() };
    assert_eq!(names("team-a"), ["alpha", "zeta"]);
    assert_eq!(names(""), ["default"]);
    assert_eq!(names("gpuledger-system"), ["own"]);
    assert_eq!(
        names("team-b"),
        ["default"],
        "default elsewhere is an ordinary budget"
    );
}

#[test]
fn the_cluster_default_takes_no_quota() {
    let mut o = (*obj("gpuledger-system", "default")).clone();
    assert!(wanted("", &o).is_ok_and(|w| w.quota.is_none()));
    o.spec.quota = Some(Default::default());
    assert!(wanted("", &o).is_err_and(|e| e.contains("no quota")));
    let w = wanted("team-a", &obj("team-a", "x"));
    assert!(w.is_ok_and(|w| w.budget.source == "GPUBudget team-a/x"
        && w.quota.is_some_and(|q| q.mem_mib == 0 && q.core_milli == 0)));
}

#[test]
fn an_object_the_ledger_holds_with_a_current_status_needs_nothing() {
    let o = applied(&obj("team-a", "a"));
    let groups = governing(std::slice::from_ref(&o), "gpuledger-system");
    let budgets = BTreeMap::from([("team-a".to_string(), ledger_budget(&o, "team-a"))]);
    assert_eq!(plan(&groups, &budgets, &BTreeMap::new()), []);
    // The object changed since (a new generation): only its status is written.
    let mut newer = (*o).clone();
    newer.metadata.generation = Some(2);
    let groups = governing(&[Arc::new(newer)], "gpuledger-system");
    assert!(matches!(
        plan(&groups, &budgets, &BTreeMap::new()).as_slice(),
        [Fix::Apply {
            write_budget: false,
            quota: None,
            ..
        }]
    ));
}

#[test]
fn what_differs_from_the_ledger_is_written() {
    let mut o = (*obj("team-a", "a")).clone();
    o.spec.quota = Some(GPUQuota {
        mem_mib: 4096,
        core_percent: 150,
    });
    let o = applied(&o);
    let groups = governing(std::slice::from_ref(&o), "gpuledger-system");
    let mut held = ledger_budget(&o, "team-a");
    held.amount = 5;
    let budgets = BTreeMap::from([("team-a".to_string(), held)]);
    let fixes = plan(&groups, &budgets, &BTreeMap::new());
    let [
        Fix::Apply {
            budget,
            write_budget: true,
            quota: Some(q),
            ..
        },
    ] = fixes.as_slice()
    else {
        panic!("budget and quota written, got {fixes:?}");
    };
    assert_eq!((budget.amount, q.mem_mib, q.core_milli), (10, 4096, 1500));
    let quotas = BTreeMap::from([(
        "team-a".to_string(),
        Quota {
            mem_mib: 4096,
            core_milli: 1500,
        },
    )]);
    assert!(matches!(
        plan(&groups, &budgets, &quotas).as_slice(),
        [Fix::Apply { quota: None, .. }]
    ));
}

#[test]
fn a_second_object_and_an_invalid_one_are_refused() {
    let mut bad = (*obj("team-b", "b")).clone();
    bad.spec.amount = "ten".into();
    let objs = [obj("team-a", "zeta"), obj("team-a", "alpha"), Arc::new(bad)];
    let groups = governing(&objs, "gpuledger-system");
    let fixes = plan(&groups, &BTreeMap::new(), &BTreeMap::new());
    let refused: Vec<(String, &str)> = fixes
        .iter()
        .filter_map(|f| match f {
            Fix::Refuse { object, why } => Some((object.name_any(), why.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(refused.len(), 2, "{fixes:?}");
    assert_eq!(refused[0].0, "zeta");
    assert!(refused[0].1.contains("already has GPUBudget alpha"));
    assert_eq!(refused[1].0, "b");
    assert!(
        refused[1].1.contains("not a whole number"),
        "{}",
        refused[1].1
    );
    assert!(already_refused(
        &{
            let mut o = (*objs[0]).clone();
            o.status = Some(GPUBudgetStatus {
                observed_generation: Some(1),
                state: STATE_REFUSED.into(),
                seq: None,
                message: refused[0].1.to_string(),
            });
            o
        },
        refused[0].1
    ));
}

#[test]
fn a_budget_whose_object_is_gone_is_removed_and_one_set_by_rpc_stays() {
    let gone = ledger_budget(&obj("team-a", "a"), "team-a");
    let mut by_rpc = gone.clone();
    by_rpc.namespace = "team-b".into();
    by_rpc.source = "gpuledger budget set".into();
    let budgets = BTreeMap::from([("team-a".to_string(), gone), ("team-b".to_string(), by_rpc)]);
    let quotas = BTreeMap::from([("team-a".to_string(), Quota::default())]);
    assert_eq!(
        plan(&BTreeMap::new(), &budgets, &quotas),
        [Fix::Remove {
            ns: "team-a".into(),
            source: "GPUBudget team-a/a".into(),
            clear_quota: true
        }]
    );
}
