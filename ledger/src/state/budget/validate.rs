//! Which budgets are acceptable: the allocator, the fold, the CLI and the GPUBudget object
//! share these rules.

use crate::pb;

/// Shortest rolling window: one minute.
pub const MIN_ROLLING_MS: i64 = 60_000;
/// Longest rolling window: 366 days.
pub const MAX_ROLLING_MS: i64 = 366 * 86_400_000;
/// Largest amount a budget may have (unit-hours): 10^12 GPU-MiB-hours is ~1.4 million
/// 80 GiB GPUs for a year; anything larger is a typo.
pub const MAX_AMOUNT: u64 = 1_000_000_000_000;

/// Why a budget is not acceptable, or None. The allocator and the fold share it.
pub fn validate_budget(b: &pb::BudgetSet) -> Option<String> {
    if !b.namespace.is_empty() && !is_dns_label(&b.namespace) {
        return Some(format!("namespace {:?} is not a DNS label", b.namespace));
    }
    if !matches!(
        pb::BudgetUnit::try_from(b.unit),
        Ok(pb::BudgetUnit::GpuMibHours | pb::BudgetUnit::GpuCoreHours)
    ) {
        return Some(format!("unknown budget unit {}", b.unit));
    }
    if b.amount == 0 || b.amount > MAX_AMOUNT {
        return Some(format!(
            "amount {} is out of range (1 to {MAX_AMOUNT})",
            b.amount
        ));
    }
    match pb::BudgetWindow::try_from(b.window) {
        Ok(pb::BudgetWindow::Rolling) => {
            if !(MIN_ROLLING_MS..=MAX_ROLLING_MS).contains(&b.rolling_ms) {
                return Some(format!(
                    "a rolling window of {} ms is out of range (1 minute to 366 days)",
                    b.rolling_ms
                ));
            }
        }
        Ok(pb::BudgetWindow::Day | pb::BudgetWindow::Week | pb::BudgetWindow::Month) => {
            if b.rolling_ms != 0 {
                return Some("a calendar window has no rolling length".into());
            }
        }
        _ => return Some(format!("unknown budget window {}", b.window)),
    }
    match pb::BudgetPolicy::try_from(b.policy) {
        Ok(pb::BudgetPolicy::Demote) => {
            if b.priority_class.is_empty() || b.priority_class.len() > 253 {
                return Some("policy demote needs a priority class name".into());
            }
            if !b.priority_class.split('.').all(is_dns_label) {
                return Some(format!(
                    "priority class {:?} is not a DNS subdomain",
                    b.priority_class
                ));
            }
        }
        Ok(pb::BudgetPolicy::Deny | pb::BudgetPolicy::Warn) => {
            if !b.priority_class.is_empty() {
                return Some("only policy demote takes a priority class".into());
            }
        }
        _ => return Some(format!("unknown budget policy {}", b.policy)),
    }
    None
}

/// A Kubernetes DNS-1123 label: 1–63 of `[a-z0-9-]`, alphanumeric at both ends.
pub fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}
