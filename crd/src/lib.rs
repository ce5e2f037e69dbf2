//! The `GPUBudget` custom resource (`gpuledger.io/v1alpha1`): a namespace's GPU budget and quota
//! as a Kubernetes object, and its translation into the ledger's `BudgetSet`/`QuotaSet`.
//!
//! The allocator watches it; the CLI prints it (`gpuledger budget crd`) and reads `budget set`'s
//! flags through the same spec. The rules themselves are the ledger's ([`validate_budget`]), so
//! the object, the CLI and the RPC refuse the same budgets.

use gpuledger_ledger::pb;
use gpuledger_ledger::state::validate_budget;
use jiff::{Span, SpanRelativeTo};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The name a GPUBudget has in the allocator's namespace to be the cluster default.
pub const CLUSTER_DEFAULT_NAME: &str = "default";
/// The annotation the webhook puts on a pod it demoted (why, and when the budget recovers);
/// the allocator's pod watch turns it into an Event on the pod.
pub const ANN_DEMOTED: &str = "gpuledger.io/budget-demoted";
/// The prefix of a ledger budget's `source` when a GPUBudget wrote it: the watch owns those.
pub const SOURCE_PREFIX: &str = "GPUBudget ";

/// A namespace's GPU budget: an amount of GPU time per window and what admission does once
/// it is spent; optionally a hard cap on what the namespace holds at once.
// Each printcolumn(...) names its own `type_`; clippy takes the repeats for duplicates.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[kube(
    group = "gpuledger.io",
    version = "v1alpha1",
    kind = "GPUBudget",
    plural = "gpubudgets",
    shortname = "gpub",
    namespaced,
    status = "GPUBudgetStatus",
    derive = "PartialEq",
    label("app.kubernetes.io/part-of", "gpuledger"),
    doc = "A namespace's GPU budget, written into gpuledger's ledger by the allocator leader.",
    printcolumn(name = "Amount", type_ = "string", json_path = ".spec.amount"),
    printcolumn(name = "Unit", type_ = "string", json_path = ".spec.unit"),
    printcolumn(name = "Window", type_ = "string", json_path = ".spec.window"),
    printcolumn(name = "Policy", type_ = "string", json_path = ".spec.policy"),
    printcolumn(name = "State", type_ = "string", json_path = ".status.state"),
    printcolumn(name = "Seq", type_ = "integer", json_path = ".status.seq")
)]
#[serde(rename_all = "camelCase")]
pub struct GPUBudgetSpec {
    /// The amount per window, as a string: whole GPU-MiB-hours for unit mib-hours, GPU-hours
    /// with up to three decimals for unit gpu-hours (1 = one whole GPU for an hour).
    #[schemars(regex(pattern = r"^[0-9]{1,13}(\.[0-9]{1,3})?$"), length(max = 17))]
    pub amount: String,
    /// What is counted: GPU memory held (every pod holds some) or GPU compute held.
    #[serde(default)]
    pub unit: BudgetUnit,
    /// `day`, `week` (from Monday) or `month` (UTC calendar periods), or a rolling window of
    /// whole s/m/h/d, largest unit first, from 1m to 366d: `24h`, `7d`, `1h30m`.
    #[schemars(regex(pattern = r"^(day|week|month|[0-9]{1,6}[dhms]([0-9]{1,6}[hms]){0,3})$"))]
    pub window: String,
    /// What admission does with the namespace's new GPU pods once the budget is spent.
    pub policy: BudgetPolicy,
    /// The PriorityClass a demoted pod gets (policy demote only); it must exist.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub priority_class_name: Option<String>,
    /// A hard cap on what the namespace's live allocations hold together, checked at every
    /// grant. Absent: no cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota: Option<GPUQuota>,
}

/// What a budget counts.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum BudgetUnit {
    /// GPU memory held, MiB × hours.
    #[default]
    #[serde(rename = "mib-hours")]
    MibHours,
    /// GPU compute held, whole GPUs × hours.
    #[serde(rename = "gpu-hours")]
    GpuHours,
}

/// What admission does once a budget is spent.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum BudgetPolicy {
    /// Admit with `priorityClassName`, so in-budget pods may preempt the pod.
    Demote,
    /// Refuse new GPU pods, saying when the budget recovers.
    Deny,
    /// Admit with a warning.
    Warn,
}

/// A cap on GPU memory and compute held at once; 0 (or absent) leaves that resource uncapped.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GPUQuota {
    /// GPU memory in MiB, summed over the namespace's live allocations.
    #[serde(default, rename = "memMiB")]
    #[schemars(range(max = 1_000_000_000_000u64))]
    pub mem_mib: u64,
    /// GPU compute in percent of one GPU, summed (250 = two and a half GPUs).
    #[serde(default)]
    #[schemars(range(max = 1_000_000_000u64))]
    pub core_percent: u64,
}

/// What the allocator made of the object.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GPUBudgetStatus {
    /// The `metadata.generation` this status is about.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Applied` (the ledger holds this budget), `Refused` (nothing written; see message).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub state: String,
    /// The ledger seq at which the budget was written (or found already in force).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    /// Why the object was refused, or what it governs.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

/// The status state of an object the ledger holds.
pub const STATE_APPLIED: &str = "Applied";
/// The status state of an object the allocator refused.
pub const STATE_REFUSED: &str = "Refused";

impl GPUBudgetSpec {
    /// The ledger budget this spec asks for, for `namespace` ("" = the cluster default), or
    /// why it is refused. The same rules as `gpuledger budget set` and the SetBudget RPC.
    pub fn to_budget(&self, namespace: &str, source: &str) -> Result<pb::BudgetSet, String> {
        let (unit, amount) = match self.unit {
            BudgetUnit::MibHours => (
                pb::BudgetUnit::GpuMibHours,
                self.amount.parse::<u64>().map_err(|_| {
                    format!(
                        "amount {:?} is not a whole number of GPU-MiB-hours",
                        self.amount
                    )
                })?,
            ),
            BudgetUnit::GpuHours => (pb::BudgetUnit::GpuCoreHours, parse_milli(&self.amount)?),
        };
        let (window, rolling_ms) = match self.window.as_str() {
            "day" => (pb::BudgetWindow::Day, 0),
            "week" => (pb::BudgetWindow::Week, 0),
            "month" => (pb::BudgetWindow::Month, 0),
            d => (
                pb::BudgetWindow::Rolling,
                parse_duration_ms(d).map_err(|e| {
                    format!("window {d:?} is not day, week or month, nor a duration: {e}")
                })?,
            ),
        };
        let policy = match self.policy {
            BudgetPolicy::Demote => pb::BudgetPolicy::Demote,
            BudgetPolicy::Deny => pb::BudgetPolicy::Deny,
            BudgetPolicy::Warn => pb::BudgetPolicy::Warn,
        };
        let b = pb::BudgetSet {
            namespace: namespace.to_owned(),
            unit: unit as i32,
            amount,
            window: window as i32,
            rolling_ms,
            policy: policy as i32,
            priority_class: self.priority_class_name.clone().unwrap_or_default(),
            source: source.to_owned(),
        };
        match validate_budget(&b) {
            Some(why) => Err(why),
            None => Ok(b),
        }
    }

    /// The ledger quota this spec asks for `namespace` (both caps 0 when it has none).
    pub fn to_quota(&self, namespace: &str) -> Result<pb::QuotaSet, String> {
        let q = self.quota.unwrap_or_default();
        Ok(pb::QuotaSet {
            namespace: namespace.to_owned(),
            mem_mib: q.mem_mib,
            core_milli: q
                .core_percent
                .checked_mul(10)
                .ok_or_else(|| format!("quota corePercent {} is too large", q.core_percent))?,
        })
    }
}

/// The `source` a GPUBudget writes into the ledger: who set the budget, for the audit trail.
pub fn source_of(namespace: &str, name: &str) -> String {
    format!("{SOURCE_PREFIX}{namespace}/{name}")
}

/// A decimal with up to three places in thousandths: "2.5" → 2500.
pub fn parse_milli(s: &str) -> Result<u64, String> {
    let bad = || format!("amount {s:?} is not a number of GPU-hours with at most 3 decimals");
    let (i, f) = s.split_once('.').unwrap_or((s, ""));
    if f.len() > 3 || i.is_empty() || !f.chars().all(|c| c.is_ascii_digit()) {
        return Err(bad());
    }
    let i: u64 = i.parse().map_err(|_| bad())?;
    let f: u64 = format!("{f:0<3}").parse().map_err(|_| bad())?;
    i.checked_mul(1000)
        .and_then(|v| v.checked_add(f))
        .ok_or_else(bad)
}

/// A duration in milliseconds: whole numbers of s, m, h and d (24 hours), largest
/// unit first, such as `90s` or `1h30m`.
pub fn parse_duration_ms(s: &str) -> Result<i64, String> {
    // jiff's friendly format also takes `3 hours`, `1.5h` and `1h ago`; the accepted form is
    // the compact one, and the rest is jiff's.
    if let Some(c) = s
        .chars()
        .find(|c| !c.is_ascii_digit() && !"smhd".contains(*c))
    {
        return Err(format!("unknown unit {c:?} in duration {s:?}"));
    }
    let span: Span = s.parse().map_err(|e| format!("duration {s:?}: {e}"))?;
    let d = span
        .to_duration(SpanRelativeTo::days_are_24_hours())
        .map_err(|e| format!("duration {s:?}: {e}"))?;
    i64::try_from(d.as_millis()).map_err(|_| format!("duration {s:?} is too large"))
}

/// The CustomResourceDefinition as `deploy/` ships it: JSON, which is YAML too (kubectl,
/// kustomize and Helm read it as such), so that no YAML serializer is needed.
pub fn crd_yaml() -> Result<String, serde_json::Error> {
    use kube::CustomResourceExt;
    let mut out = serde_json::to_string_pretty(&GPUBudget::crd())?;
    out.push('\n');
    Ok(out)
}

#[cfg(test)]
mod tests;
