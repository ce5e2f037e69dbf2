use super::validate::MAX_AMOUNT;
use super::*;
use crate::Ledger;
use crate::pb::event::Body;
use crate::placement::{ContainerRequest, Policy};
use crate::{Command, CommandError, PodRequest};

const H: i64 = 3_600_000;
/// 2026-11-24T00:00:00Z, a Tuesday.
const DAY0: i64 = 1_795_478_400_000;

fn ledger() -> Ledger {
    let mut l = Ledger::new();
    let inv = pb::NodeInventory {
        mode: Default::default(),
        node: "n1".into(),
        gpus: (0..2)
            .map(|i| pb::Gpu {
                uuid: format!("GPU-{i}"),
                index: i,
                model: "A100".into(),
                memory_mib: 40_000,
                healthy: true,
                compute_capability: String::new(),
            })
            .collect(),
        cpu_milli: 0,
        memory_mib: 0,
        isolation: String::new(),
        dra_cores: String::new(),
    };
    l.execute(Command::RegisterNode(inv), 1, DAY0)
        .expect("register");
    l
}

fn request(ns: &str, uid: &str, mem: u64, core: u32) -> PodRequest {
    PodRequest {
        pod: pb::PodRef {
            uid: uid.into(),
            namespace: ns.into(),
            name: uid.into(),
        },
        containers: vec![ContainerRequest {
            name: "main".into(),
            slices: 1,
            mem_mib: mem,
            core_milli: core,
            ..Default::default()
        }],
        policy: Policy::Binpack,
        ..Default::default()
    }
}

fn try_reserve(
    l: &mut Ledger,
    ns: &str,
    uid: &str,
    mem: u64,
    core: u32,
    t: i64,
) -> Result<u64, CommandError> {
    let (ev, _) = l.execute(
        Command::Reserve {
            request: request(ns, uid, mem, core),
            node: "n1".into(),
            deadline_ms: t + H,
        },
        1,
        t,
    )?;
    Ok(ev[0].seq)
}

fn reserve(l: &mut Ledger, ns: &str, uid: &str, mem: u64, core: u32, t: i64) -> u64 {
    try_reserve(l, ns, uid, mem, core, t).expect("reserve")
}

fn release(l: &mut Ledger, id: u64, t: i64) {
    l.execute(
        Command::Release {
            pod_uid: String::new(),
            container: String::new(),
            allocation_id: id,
            reason: "done".into(),
        },
        1,
        t,
    )
    .expect("release");
}

fn budget(ns: &str, amount: u64, window: pb::BudgetWindow, rolling_ms: i64) -> pb::BudgetSet {
    pb::BudgetSet {
        namespace: ns.into(),
        unit: pb::BudgetUnit::GpuMibHours as i32,
        amount,
        window: window as i32,
        rolling_ms,
        policy: pb::BudgetPolicy::Deny as i32,
        priority_class: String::new(),
        source: "test".into(),
    }
}

fn set(l: &mut Ledger, b: pb::BudgetSet, t: i64) {
    l.execute(Command::SetBudget(b), 1, t).expect("set budget");
}

#[test]
fn a_day_budget_against_hand_computed_consumption() {
    let mut l = ledger();
    set(&mut l, budget("a", 10_000, pb::BudgetWindow::Day, 0), DAY0);
    let p1 = reserve(&mut l, "a", "p1", 1000, 0, DAY0 + H);
    reserve(&mut l, "a", "p2", 3000, 0, DAY0 + 2 * H);
    release(&mut l, p1, DAY0 + 3 * H);
    // 1000 MiB for 2 h + 3000 MiB for 2 h (up to the question at 4 h) = 8000 MiB-hours.
    let s = l.budgets().status("a", DAY0 + 4 * H).expect("a budget");
    assert_eq!(s.used, 8000 * MS_PER_HOUR);
    assert_eq!(s.limit, 10_000 * MS_PER_HOUR);
    assert_eq!(s.rate, 3000);
    assert!(!s.exhausted());
    assert_eq!(s.window_start_ms, DAY0);
    // 2000 MiB-hours left at 3000 MiB: 40 minutes.
    assert_eq!(s.exhausts_at_ms, Some(DAY0 + 4 * H + 40 * 60_000));
    assert_eq!(s.recovers_at_ms, None);
    let s = l.budgets().status("a", DAY0 + 5 * H).expect("a budget");
    assert_eq!(s.used, 11_000 * MS_PER_HOUR);
    assert!(s.exhausted());
    assert_eq!(
        s.recovers_at_ms,
        Some(DAY0 + 24 * H),
        "a day window recovers at midnight"
    );
    // The next day only counts from midnight.
    let s = l.budgets().status("a", DAY0 + 25 * H).expect("a budget");
    assert_eq!(s.used, 3000 * MS_PER_HOUR);
    assert_eq!(s.window_start_ms, DAY0 + 24 * H);
    // Totals since the start are exact and independent of the window.
    let u = &l.budgets().usage()["a"];
    assert_eq!(u.mib_ms, (2000 + 3000) as u128 * MS_PER_HOUR);
    assert!(
        l.budgets().status("b", DAY0).is_none(),
        "no budget, no status"
    );
}

#[test]
fn a_rolling_window_forgets_what_left_it_within_one_bucket() {
    let mut l = ledger();
    set(
        &mut l,
        budget("a", 1000, pb::BudgetWindow::Rolling, H),
        DAY0,
    );
    let p = reserve(&mut l, "a", "p1", 1200, 0, DAY0);
    release(&mut l, p, DAY0 + H / 2);
    let s = l.budgets().status("a", DAY0 + H / 2).expect("budget");
    assert_eq!(s.used, 600 * MS_PER_HOUR, "1200 MiB for half an hour");
    // 45 min later the window starts at +15 min: 15 minutes of 1200 MiB are still inside.
    let s = l
        .budgets()
        .status("a", DAY0 + H / 2 + 3 * H / 4)
        .expect("budget");
    let exact = 300 * MS_PER_HOUR;
    let bucket = (H / ROLLING_BUCKETS) as u128 * 1200;
    assert!(
        s.used >= exact && s.used <= exact + bucket,
        "used {} not within one bucket above {exact}",
        s.used
    );
    let s = l.budgets().status("a", DAY0 + 2 * H).expect("budget");
    assert_eq!(s.used, 0, "everything left the window");
}

#[test]
fn a_spent_rolling_budget_says_when_it_recovers() {
    let mut l = ledger();
    set(&mut l, budget("a", 100, pb::BudgetWindow::Rolling, H), DAY0);
    let p = reserve(&mut l, "a", "p1", 1000, 0, DAY0);
    release(&mut l, p, DAY0 + H / 4);
    // 250 MiB-hours used, 100 allowed: within budget again once less than 100 is inside,
    // i.e. when the first 9 minutes (150 MiB-hours) have left the window, at +69 min.
    let s = l.budgets().status("a", DAY0 + H / 4).expect("budget");
    assert!(s.exhausted());
    let at = s.recovers_at_ms.expect("recovers");
    let exact = DAY0 + H + 9 * 60_000;
    assert!(
        at > exact - H / ROLLING_BUCKETS && at <= exact + H / ROLLING_BUCKETS,
        "recovers at {at}, about {exact}"
    );
    let later = l.budgets().status("a", at).expect("budget");
    assert!(!later.exhausted(), "within budget at the time it said");
}

#[test]
fn holding_more_than_the_amount_per_window_never_recovers_while_held() {
    let mut l = ledger();
    set(&mut l, budget("a", 100, pb::BudgetWindow::Rolling, H), DAY0);
    reserve(&mut l, "a", "p1", 1000, 0, DAY0);
    let s = l.budgets().status("a", DAY0 + H).expect("budget");
    assert!(s.exhausted());
    assert_eq!(s.recovers_at_ms, None);
}

#[test]
fn calendar_periods_are_utc_days_iso_weeks_and_months() {
    let t = DAY0 + 13 * H;
    assert_eq!(Window::Day.period_start(t), Some(DAY0));
    assert_eq!(
        Window::Week.period_start(t),
        Some(DAY0 - 24 * H),
        "Monday 23rd"
    );
    assert_eq!(Window::Week.next_period(t), DAY0 + 6 * 24 * H);
    // 2026-11-01T00:00Z and 2026-12-01T00:00Z.
    assert_eq!(Window::Month.period_start(t), Some(1_793_491_200_000));
    assert_eq!(Window::Month.next_period(t), 1_796_083_200_000);
    // February 2028 has 29 days.
    let feb = 1_834_185_600_000; // 2028-02-15T00:00Z
    assert_eq!(
        Window::Month.next_period(feb) - Window::Month.period_start(feb).expect("month"),
        29 * 24 * H
    );
}

#[test]
fn core_hour_budgets_count_compute_only() {
    let mut l = ledger();
    let mut b = budget("a", 1000, pb::BudgetWindow::Day, 0);
    b.unit = pb::BudgetUnit::GpuCoreHours as i32;
    set(&mut l, b, DAY0);
    reserve(&mut l, "a", "p1", 1000, 250, DAY0);
    reserve(&mut l, "a", "p2", 5000, 0, DAY0);
    // A quarter GPU for 4 h = one GPU-hour = the whole amount.
    let s = l.budgets().status("a", DAY0 + 4 * H).expect("budget");
    assert_eq!(s.used, 1000 * MS_PER_HOUR);
    assert_eq!(s.rate, 250);
    assert!(s.exhausted());
}

#[test]
fn the_cluster_default_applies_to_namespaces_without_their_own() {
    let mut l = ledger();
    reserve(&mut l, "a", "p1", 1000, 0, DAY0);
    reserve(&mut l, "b", "p2", 1000, 0, DAY0);
    set(&mut l, budget("", 500, pb::BudgetWindow::Day, 0), DAY0 + H);
    set(
        &mut l,
        budget("b", 5000, pb::BudgetWindow::Day, 0),
        DAY0 + H,
    );
    // Counting under the default starts when it is set: 1000 MiB for 1 h.
    let a = l.budgets().status("a", DAY0 + 2 * H).expect("default");
    assert_eq!(a.budget.namespace, "");
    assert_eq!(a.used, 1000 * MS_PER_HOUR);
    assert!(a.exhausted());
    let b = l.budgets().status("b", DAY0 + 2 * H).expect("own");
    assert_eq!(b.budget.namespace, "b");
    assert!(!b.exhausted());
    // An amount change keeps what was counted; a window change starts afresh.
    set(
        &mut l,
        budget("", 5000, pb::BudgetWindow::Day, 0),
        DAY0 + 2 * H,
    );
    let a = l.budgets().status("a", DAY0 + 3 * H).expect("default");
    assert_eq!(a.used, 2000 * MS_PER_HOUR);
    set(
        &mut l,
        budget("", 5000, pb::BudgetWindow::Week, 0),
        DAY0 + 3 * H,
    );
    let a = l.budgets().status("a", DAY0 + 4 * H).expect("default");
    assert_eq!(a.used, 1000 * MS_PER_HOUR);
    l.execute(
        Command::RemoveBudget(pb::BudgetRemoved {
            namespace: "b".into(),
            source: "test".into(),
        }),
        1,
        DAY0 + 4 * H,
    )
    .expect("remove");
    assert_eq!(
        l.budgets()
            .status("b", DAY0 + 4 * H)
            .expect("default")
            .budget
            .namespace,
        ""
    );
}

#[test]
fn setting_the_same_budget_again_writes_nothing() {
    let mut l = ledger();
    let (ev, _) = l
        .execute(
            Command::SetBudget(budget("a", 10, pb::BudgetWindow::Day, 0)),
            1,
            DAY0,
        )
        .expect("set");
    assert_eq!(ev.len(), 1);
    let mut again = budget("a", 10, pb::BudgetWindow::Day, 0);
    again.source = "GPUBudget a/x".into();
    let (ev, _) = l
        .execute(Command::SetBudget(again), 1, DAY0 + 1)
        .expect("set");
    assert!(ev.is_empty(), "only the source differs");
    let (ev, _) = l
        .execute(
            Command::RemoveBudget(pb::BudgetRemoved {
                namespace: "zzz".into(),
                source: String::new(),
            }),
            1,
            DAY0 + 2,
        )
        .expect("remove");
    assert!(ev.is_empty(), "removing what is not there writes nothing");
}

#[test]
fn bad_budgets_are_refused_and_write_nothing() {
    let mut l = ledger();
    let seq = l.seq();
    let ok = budget("a", 10, pb::BudgetWindow::Day, 0);
    let cases: Vec<(pb::BudgetSet, &str)> = vec![
        (
            pb::BudgetSet {
                amount: 0,
                ..ok.clone()
            },
            "out of range",
        ),
        (
            pb::BudgetSet {
                amount: MAX_AMOUNT + 1,
                ..ok.clone()
            },
            "out of range",
        ),
        (
            pb::BudgetSet {
                policy: 9,
                ..ok.clone()
            },
            "unknown budget policy",
        ),
        (
            pb::BudgetSet {
                unit: 0,
                ..ok.clone()
            },
            "unknown budget unit",
        ),
        (
            pb::BudgetSet {
                window: 0,
                ..ok.clone()
            },
            "unknown budget window",
        ),
        (
            pb::BudgetSet {
                window: pb::BudgetWindow::Rolling as i32,
                rolling_ms: 10,
                ..ok.clone()
            },
            "rolling window",
        ),
        (
            pb::BudgetSet {
                policy: pb::BudgetPolicy::Demote as i32,
                ..ok.clone()
            },
            "needs a priority class",
        ),
        (
            pb::BudgetSet {
                policy: pb::BudgetPolicy::Demote as i32,
                priority_class: "Low Priority".into(),
                ..ok.clone()
            },
            "not a DNS subdomain",
        ),
        (
            pb::BudgetSet {
                namespace: "Team_A".into(),
                ..ok.clone()
            },
            "not a DNS label",
        ),
    ];
    for (b, why) in cases {
        match l.execute(Command::SetBudget(b.clone()), 1, DAY0) {
            Err(CommandError::Invalid(m)) => assert!(m.contains(why), "{m:?} lacks {why:?}"),
            other => panic!("{b:?} was not refused: {other:?}"),
        }
    }
    assert_eq!(l.seq(), seq, "nothing written");
    // A follower meeting such an event reports it.
    let bad = pb::Event {
        seq: seq + 1,
        epoch: 1,
        time_ms: DAY0,
        body: Some(Body::BudgetSet(pb::BudgetSet { amount: 0, ..ok })),
        actor: None,
    };
    assert!(matches!(
        l.apply(&bad),
        Err(crate::ApplyError::Invariant { .. })
    ));
}

#[test]
fn the_quota_caps_what_a_namespace_holds_at_once() {
    let mut l = ledger();
    l.execute(
        Command::SetQuota(pb::QuotaSet {
            namespace: "a".into(),
            mem_mib: 5000,
            core_milli: 600,
        }),
        1,
        DAY0,
    )
    .expect("quota");
    let p1 = reserve(&mut l, "a", "p1", 3000, 300, DAY0);
    let seq = l.seq();
    let over =
        |l: &mut Ledger, uid: &str, mem: u64, core: u32| try_reserve(l, "a", uid, mem, core, DAY0);
    match over(&mut l, "p2", 2001, 0) {
        Err(CommandError::NoCapacity(m)) => assert!(m.contains("memory quota"), "{m}"),
        other => panic!("over the memory quota: {other:?}"),
    }
    match over(&mut l, "p2", 100, 301) {
        Err(CommandError::NoCapacity(m)) => assert!(m.contains("compute quota"), "{m}"),
        other => panic!("over the compute quota: {other:?}"),
    }
    assert_eq!(l.seq(), seq, "a refused grant writes nothing");
    // Exactly up to the cap fits; other namespaces are not capped.
    over(&mut l, "p2", 2000, 300).expect("up to the cap");
    reserve(&mut l, "b", "p3", 30_000, 0, DAY0);
    release(&mut l, p1, DAY0 + 1);
    over(&mut l, "p4", 3000, 0).expect("released memory is free again");
    // Clearing the quota (both 0) lifts the cap.
    l.execute(
        Command::SetQuota(pb::QuotaSet {
            namespace: "a".into(),
            mem_mib: 0,
            core_milli: 0,
        }),
        1,
        DAY0 + 2,
    )
    .expect("clear");
    assert!(l.quotas().is_empty());
}

#[test]
fn identity_corrections_move_consumption_between_namespaces() {
    let mut l = ledger();
    let a = reserve(&mut l, "a", "p1", 1000, 0, DAY0);
    let b = reserve(&mut l, "b", "p2", 3000, 0, DAY0);
    l.execute(
        Command::CorrectIdentity {
            node: "n1".into(),
            from_allocation_id: a,
            to_allocation_id: b,
            device_ids: vec!["d".into()],
        },
        1,
        DAY0 + H,
    )
    .expect("correct");
    // Pod p1 (namespace a) now holds allocation b's 3000 MiB, and p2 allocation a's 1000.
    assert_eq!(l.budgets().held("a"), (3000, 0));
    assert_eq!(l.budgets().held("b"), (1000, 0));
    let mut l2 = l.clone();
    l2.execute(
        Command::Release {
            pod_uid: "p1".into(),
            container: String::new(),
            allocation_id: 0,
            reason: "done".into(),
        },
        1,
        DAY0 + 2 * H,
    )
    .expect("release");
    l2.budgets.tick(DAY0 + 3 * H);
    let u = &l2.budgets().usage()["a"];
    assert_eq!(u.mib_ms, (1000 + 3000) as u128 * MS_PER_HOUR);
    assert_eq!(l2.budgets().held("a"), (0, 0));
}

#[test]
fn a_snapshot_keeps_budgets_quotas_and_consumption() {
    let mut l = ledger();
    set(&mut l, budget("a", 100, pb::BudgetWindow::Rolling, H), DAY0);
    set(&mut l, budget("", 100, pb::BudgetWindow::Month, 0), DAY0);
    l.execute(
        Command::SetQuota(pb::QuotaSet {
            namespace: "a".into(),
            mem_mib: 9000,
            core_milli: 0,
        }),
        1,
        DAY0,
    )
    .expect("quota");
    let p = reserve(&mut l, "a", "p1", 1000, 100, DAY0 + 1);
    reserve(&mut l, "c", "p2", 2000, 0, DAY0 + 2);
    release(&mut l, p, DAY0 + H / 3);
    reserve(&mut l, "a", "p3", 700, 0, DAY0 + H / 2);
    let back = Ledger::from_snapshot(&l.to_snapshot()).expect("restore");
    assert!(back.same_state(&l));
    assert_eq!(
        back.budgets().status("a", DAY0 + H),
        l.budgets().status("a", DAY0 + H)
    );
    let mut s = l.to_snapshot();
    s.usage[0].mib_ms = "x".into();
    assert!(
        Ledger::from_snapshot(&s).is_err(),
        "a corrupt integral is refused"
    );
}
