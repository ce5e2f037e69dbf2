//! Budgets as people read them, and compared for what they mean.

use crate::pb;

/// A budget in one line for people: "10000 GPU-MiB-hours per day, deny".
pub fn budget_summary(b: &pb::BudgetSet) -> String {
    let unit = match pb::BudgetUnit::try_from(b.unit) {
        Ok(pb::BudgetUnit::GpuCoreHours) => {
            return format!("{} GPU-hours {}", fmt_milli(b.amount), summary_tail(b));
        }
        _ => "GPU-MiB-hours",
    };
    format!("{} {unit} {}", b.amount, summary_tail(b))
}

fn summary_tail(b: &pb::BudgetSet) -> String {
    let window = match pb::BudgetWindow::try_from(b.window) {
        Ok(pb::BudgetWindow::Rolling) => format!("per rolling {} s", b.rolling_ms / 1000),
        Ok(pb::BudgetWindow::Day) => "per day".into(),
        Ok(pb::BudgetWindow::Week) => "per week".into(),
        Ok(pb::BudgetWindow::Month) => "per month".into(),
        _ => "per ?".into(),
    };
    let policy = match pb::BudgetPolicy::try_from(b.policy) {
        Ok(pb::BudgetPolicy::Demote) => format!("demote to {}", b.priority_class),
        Ok(pb::BudgetPolicy::Deny) => "deny".into(),
        Ok(pb::BudgetPolicy::Warn) => "warn".into(),
        _ => "?".into(),
    };
    format!("{window}, {policy}")
}

/// Thousandths as a decimal: 2500 → "2.5".
fn fmt_milli(v: u64) -> String {
    let (i, f) = (v / 1000, v % 1000);
    if f == 0 {
        i.to_string()
    } else {
        format!("{i}.{f:03}").trim_end_matches('0').to_owned()
    }
}

/// The two budgets mean the same (where each came from aside).
pub fn same_budget(a: &pb::BudgetSet, b: &pb::BudgetSet) -> bool {
    pb::BudgetSet {
        source: String::new(),
        ..a.clone()
    } == pb::BudgetSet {
        source: String::new(),
        ..b.clone()
    }
}
