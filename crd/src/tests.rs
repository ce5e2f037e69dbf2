use super::*;

fn spec(amount: &str, unit: BudgetUnit, window: &str, policy: BudgetPolicy) -> GPUBudgetSpec {
    GPUBudgetSpec {
        amount: amount.into(),
        unit,
        window: window.into(),
        policy,
        priority_class_name: None,
        quota: None,
    }
}

#[test]
fn a_spec_becomes_the_budget_the_cli_would_write() {
    let b = spec("10000", BudgetUnit::MibHours, "day", BudgetPolicy::Deny)
        .to_budget("team-a", "GPUBudget team-a/gpu")
        .unwrap();
    assert_eq!(b.amount, 10_000);
    assert_eq!(b.window, pb::BudgetWindow::Day as i32);
    assert_eq!(b.policy, pb::BudgetPolicy::Deny as i32);
    assert_eq!(b.source, "GPUBudget team-a/gpu");
    let r = spec("2.5", BudgetUnit::GpuHours, "1h30m", BudgetPolicy::Warn)
        .to_budget("", "x")
        .unwrap();
    assert_eq!((r.amount, r.rolling_ms), (2500, 5_400_000));
    assert_eq!(r.window, pb::BudgetWindow::Rolling as i32);
}

#[test]
fn bad_specs_are_refused_with_the_ledgers_reasons() {
    let cases = [
        (
            spec("0", BudgetUnit::MibHours, "day", BudgetPolicy::Deny),
            "out of range",
        ),
        (
            spec(
                "1000000000001",
                BudgetUnit::MibHours,
                "day",
                BudgetPolicy::Deny,
            ),
            "out of range",
        ),
        (
            spec("-5", BudgetUnit::MibHours, "day", BudgetPolicy::Deny),
            "whole number",
        ),
        (
            spec("1.5", BudgetUnit::MibHours, "day", BudgetPolicy::Deny),
            "whole number",
        ),
        (
            spec("1.2345", BudgetUnit::GpuHours, "day", BudgetPolicy::Deny),
            "3 decimals",
        ),
        (
            spec("5", BudgetUnit::MibHours, "30s", BudgetPolicy::Deny),
            "1 minute to 366 days",
        ),
        (
            spec("5", BudgetUnit::MibHours, "367d", BudgetPolicy::Deny),
            "1 minute to 366 days",
        ),
        (
            spec("5", BudgetUnit::MibHours, "fortnight", BudgetPolicy::Deny),
            "not day, week",
        ),
        (
            spec("5", BudgetUnit::MibHours, "day", BudgetPolicy::Demote),
            "needs a priority class",
        ),
    ];
    for (s, want) in cases {
        let e = s.to_budget("team-a", "t").unwrap_err();
        assert!(e.contains(want), "{s:?}: {e}");
    }
    let mut s = spec("5", BudgetUnit::MibHours, "day", BudgetPolicy::Deny);
    s.priority_class_name = Some("low".into());
    assert!(
        s.to_budget("team-a", "t")
            .unwrap_err()
            .contains("only policy demote")
    );
    assert!(
        spec("5", BudgetUnit::MibHours, "day", BudgetPolicy::Deny)
            .to_budget("Team_A", "t")
            .unwrap_err()
            .contains("DNS label")
    );
}

#[test]
fn quota_is_in_the_ledgers_units() {
    let mut s = spec("5", BudgetUnit::MibHours, "day", BudgetPolicy::Deny);
    assert_eq!(s.to_quota("a").unwrap().mem_mib, 0);
    s.quota = Some(GPUQuota {
        mem_mib: 4096,
        core_percent: 250,
    });
    let q = s.to_quota("a").unwrap();
    assert_eq!((q.mem_mib, q.core_milli), (4096, 2500));
    s.quota = Some(GPUQuota {
        mem_mib: 0,
        core_percent: u64::MAX,
    });
    assert!(s.to_quota("a").is_err());
}

#[test]
fn gpu_hours_parse_to_thousandths() {
    assert_eq!(parse_milli("2.5").ok(), Some(2500));
    assert_eq!(parse_milli("3").ok(), Some(3000));
    assert_eq!(parse_milli("0.125").ok(), Some(125));
    for bad in ["", ".5", "1.2345", "-1", "x", "1.x", "99999999999999999999"] {
        assert!(parse_milli(bad).is_err(), "{bad:?} parsed");
    }
}

/// The schema refuses statically what it can: the API server applies these before any
/// gpuledger code sees the object.
#[test]
fn the_schema_constrains_amount_window_policy_and_unit() {
    let crd = serde_json::to_value(<GPUBudget as kube::CustomResourceExt>::crd()).unwrap();
    let v = &crd["spec"]["versions"][0];
    assert_eq!(v["name"], "v1alpha1");
    assert_eq!(v["subresources"]["status"], serde_json::json!({}));
    let spec = &v["schema"]["openAPIV3Schema"]["properties"]["spec"];
    let amount = spec["properties"]["amount"]["pattern"].as_str().unwrap();
    let window = spec["properties"]["window"]["pattern"].as_str().unwrap();
    // The patterns use only what ECMA-262 (the API server) and the regex crate read alike.
    let re = |p: &str, s: &str| regex::Regex::new(p).unwrap().is_match(s);
    for ok in ["1", "10000", "2.5", "1000000000000"] {
        assert!(re(amount, ok), "amount {ok} refused");
    }
    for bad in ["-1", "1e9", "", "1.2345", "12345678901234", " 1"] {
        assert!(!re(amount, bad), "amount {bad:?} accepted");
    }
    for ok in ["day", "week", "month", "24h", "7d", "1h30m", "90s"] {
        assert!(re(window, ok), "window {ok} refused");
    }
    for bad in ["daily", "1.5h", "-1h", "", "24 h", "1w"] {
        assert!(!re(window, bad), "window {bad:?} accepted");
    }
    let policies = &spec["properties"]["policy"]["enum"];
    assert_eq!(policies, &serde_json::json!(["demote", "deny", "warn"]));
    let units = &spec["properties"]["unit"]["enum"];
    assert_eq!(units, &serde_json::json!(["mib-hours", "gpu-hours"]));
    let required = spec["required"].as_array().unwrap();
    for f in ["amount", "window", "policy"] {
        assert!(required.contains(&f.into()), "{f} not required");
    }
}

/// `deploy/` ships what the code generates: regenerate both files with
/// `gpuledger budget crd > deploy/kustomize/base/crd-gpubudget.yaml` (and the chart's copy).
#[test]
fn the_shipped_crd_is_the_generated_one() {
    let want = crd_yaml().unwrap();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for f in [
        "deploy/kustomize/base/crd-gpubudget.yaml",
        "deploy/helm/gpuledger/crds/gpubudget.yaml",
    ] {
        let got = std::fs::read_to_string(root.join(f)).unwrap_or_default();
        assert!(
            got == want,
            "{f} differs from the generated CRD: run `gpuledger budget crd > {f}`"
        );
    }
}
