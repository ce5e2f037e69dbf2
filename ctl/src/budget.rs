//! `gpuledger budget`: namespaces' GPU budgets and quotas — show where each stands, set them.

use std::collections::BTreeSet;

use anyhow::{Context, Result};
use gpuledger_ledger::state::{BudgetStatus, MS_PER_HOUR, budget_summary};
use gpuledger_ledger::{Ledger, pb};
use gpuledger_proto::allocator::v1 as api;

use crate::client::{Target, connect, dump_of};
use crate::table::Table;
use crate::when::{fmt_time, now_ms};

/// The namespace name that stands for the cluster default budget on the command line.
const CLUSTER_DEFAULT: &str = "*";

/// Arguments of `gpuledger budget`.
#[derive(clap::Args, Debug)]
pub struct BudgetArgs {
    #[command(subcommand)]
    action: Option<Action>,
    #[command(flatten)]
    target: Target,
    /// Show as a table or as one JSON document.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

/// Output format of `gpuledger budget`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Aligned columns.
    Table,
    /// One JSON document with exact integers.
    Json,
}

#[derive(clap::Subcommand, Debug)]
enum Action {
    /// Per namespace: budget, used, remaining, burn rate, projected exhaustion (the default).
    Show,
    /// Set or replace a namespace's budget (needs an admin credential).
    Set(SetArgs),
    /// Remove a namespace's budget; it falls back to the cluster default, if any.
    Remove {
        /// The namespace, or `*` for the cluster default.
        namespace: String,
        #[command(flatten)]
        target: Target,
    },
    /// Cap what a namespace may hold at once; checked by the leader at every grant. Both caps
    /// 0 clears it.
    Quota {
        /// The namespace.
        namespace: String,
        /// GPU memory in MiB, summed over the namespace's live allocations (0 = no cap).
        #[arg(long, default_value_t = 0)]
        mem_mib: u64,
        /// GPU compute in percent of one GPU, summed (250 = two and a half GPUs; 0 = no cap).
        #[arg(long, default_value_t = 0)]
        core_percent: u64,
        #[command(flatten)]
        target: Target,
    },
    /// Print the GPUBudget CustomResourceDefinition (`deploy/` ships this output).
    Crd,
}

#[derive(clap::Args, Debug)]
struct SetArgs {
    #[command(flatten)]
    target: Target,
    /// The namespace, or `*` for the cluster default (namespaces without their own budget).
    namespace: String,
    /// The amount per window: GPU-MiB-hours (an integer) with --unit mib-hours, GPU-hours
    /// (up to three decimals, 1 = one whole GPU for an hour) with --unit gpu-hours.
    #[arg(long, allow_hyphen_values = true)]
    amount: String,
    /// What is counted: GPU memory held (every pod holds some) or compute held (only pods
    /// with a compute share count).
    #[arg(long, value_enum, default_value_t = Unit::MibHours)]
    unit: Unit,
    /// `day`, `week` (from Monday) or `month`, all UTC calendar periods; or a rolling window
    /// such as `24h`, `7d`, `90m`.
    #[arg(long)]
    window: String,
    /// What admission does once the budget is spent.
    #[arg(long, value_enum)]
    policy: Policy,
    /// The priority class a demoted pod gets (policy demote only).
    #[arg(long)]
    priority_class: Option<String>,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy)]
enum Unit {
    /// GPU memory, MiB × hours.
    MibHours,
    /// GPU compute, whole GPUs × hours.
    GpuHours,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy)]
enum Policy {
    /// Admit with a lower priority class, so in-budget pods may preempt the pod.
    Demote,
    /// Refuse new GPU pods, saying when the budget recovers.
    Deny,
    /// Admit with a warning.
    Warn,
}

/// `gpuledger budget`.
pub async fn budget(a: BudgetArgs) -> Result<()> {
    match a.action.unwrap_or(Action::Show) {
        Action::Show => {
            let mut c = connect(&a.target).await?;
            let (_, snap) = dump_of(&mut c).await?;
            let l = Ledger::from_snapshot(&snap)
                .map_err(|e| anyhow::anyhow!("the dump does not load: {e}"))?;
            let out = match a.format {
                Format::Table => render_budgets(&l, now_ms()),
                Format::Json => json(&l, now_ms()),
            };
            print!("{out}");
            Ok(())
        }
        Action::Crd => {
            print!("{}", gpuledger_crd::crd_yaml()?);
            Ok(())
        }
        Action::Set(s) => {
            let b = budget_of(&s)?;
            write(
                &s.target,
                api::SetBudgetRequest {
                    budget: Some(b),
                    remove: false,
                },
            )
            .await
        }
        Action::Remove { namespace, target } => {
            write(
                &target,
                api::SetBudgetRequest {
                    budget: Some(pb::BudgetSet {
                        namespace: ns_arg(&namespace),
                        source: "gpuledger budget remove".into(),
                        ..Default::default()
                    }),
                    remove: true,
                },
            )
            .await
        }
        Action::Quota {
            namespace,
            mem_mib,
            core_percent,
            target,
        } => {
            let core_milli = core_percent
                .checked_mul(10)
                .context("--core-percent is too large")?;
            let mut c = connect(&target).await?;
            let r = c
                .set_quota(api::SetQuotaRequest {
                    quota: Some(pb::QuotaSet {
                        namespace,
                        mem_mib,
                        core_milli,
                    }),
                })
                .await
                .map_err(|s| anyhow::anyhow!("quota refused: {}", s.message()))?
                .into_inner();
            println!("{} at seq {}", changed(r.changed), r.seq);
            Ok(())
        }
    }
}

async fn write(t: &Target, req: api::SetBudgetRequest) -> Result<()> {
    let mut c = connect(t).await?;
    let r = c
        .set_budget(req)
        .await
        .map_err(|s| anyhow::anyhow!("budget refused: {}", s.message()))?
        .into_inner();
    println!("{} at seq {}", changed(r.changed), r.seq);
    Ok(())
}

fn changed(c: bool) -> &'static str {
    if c { "written" } else { "unchanged" }
}

fn ns_arg(ns: &str) -> String {
    if ns == CLUSTER_DEFAULT {
        String::new()
    } else {
        ns.to_owned()
    }
}

/// The budget `gpuledger budget set` asks for, read through the GPUBudget spec so that the
/// flags and the object are refused for the same reasons (the allocator checks again).
fn budget_of(s: &SetArgs) -> Result<pb::BudgetSet> {
    let spec = gpuledger_crd::GPUBudgetSpec {
        amount: s.amount.clone(),
        unit: match s.unit {
            Unit::MibHours => gpuledger_crd::BudgetUnit::MibHours,
            Unit::GpuHours => gpuledger_crd::BudgetUnit::GpuHours,
        },
        window: s.window.clone(),
        policy: match s.policy {
            Policy::Demote => gpuledger_crd::BudgetPolicy::Demote,
            Policy::Deny => gpuledger_crd::BudgetPolicy::Deny,
            Policy::Warn => gpuledger_crd::BudgetPolicy::Warn,
        },
        priority_class_name: s.priority_class.clone(),
        quota: None,
    };
    spec.to_budget(&ns_arg(&s.namespace), "gpuledger budget set")
        .map_err(|e| {
            // The spec's field names are this command's flags.
            let flag = if e.starts_with("amount ") || e.starts_with("window ") {
                "--"
            } else {
                ""
            };
            anyhow::anyhow!("budget refused: {flag}{e}")
        })
}

/// The namespaces a report covers: every one with a budget of its own or any consumption.
fn namespaces(l: &Ledger) -> BTreeSet<&str> {
    let b = l.budgets();
    b.budgets()
        .keys()
        .chain(b.usage().keys())
        .map(String::as_str)
        .filter(|ns| !ns.is_empty())
        .collect()
}

/// Amounts in the budget's unit, as hours: MiB-hours, or GPU-hours from core_milli.
fn hours(b: &pb::BudgetSet, unit_ms: u128) -> String {
    let per = if b.unit == pb::BudgetUnit::GpuCoreHours as i32 {
        MS_PER_HOUR as f64 * 1000.0
    } else {
        MS_PER_HOUR as f64
    };
    format!("{:.3}", unit_ms as f64 / per)
}

/// The budgets table at `now`: one row per namespace, then the cluster default and quotas.
pub fn render_budgets(l: &Ledger, now: i64) -> String {
    let b = l.budgets();
    let mut t = Table::new(&[
        "NAMESPACE",
        "BUDGET",
        "USED",
        "REMAINING",
        "BURN/H",
        "EXHAUSTED AT",
        "RECOVERS AT",
        "QUOTA",
    ]);
    let mut rows = 0;
    for ns in namespaces(l) {
        let quota = b.quotas().get(ns).map_or("-".to_owned(), |q| {
            format!("{} MiB, {}% GPU", q.mem_mib, q.core_milli / 10)
        });
        let Some(s) = b.status(ns, now) else {
            t.row(vec![
                ns.into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                quota,
            ]);
            rows += 1;
            continue;
        };
        let inherited = if s.budget.namespace.is_empty() {
            " (default)"
        } else {
            ""
        };
        let rate_h = hours(&s.budget, u128::from(s.rate) * MS_PER_HOUR);
        t.row(vec![
            ns.into(),
            format!("{}{inherited}", budget_summary(&s.budget)),
            hours(&s.budget, s.used),
            hours(&s.budget, s.remaining()),
            rate_h,
            exhaust_cell(&s),
            recover_cell(&s),
            quota,
        ]);
        rows += 1;
    }
    let mut out = if rows > 0 {
        t.render()
    } else {
        "no namespace has a budget or has held a GPU\n".to_owned()
    };
    if let Some(d) = b.budgets().get("") {
        out.push_str(&format!("\ncluster default: {}\n", budget_summary(d)));
    }
    out.push_str(&format!("as of {} (seq {})\n", fmt_time(now), l.seq()));
    out
}

/// When the budget runs out at the current rate, or that it has.
fn exhaust_cell(s: &BudgetStatus) -> String {
    if s.exhausted() {
        return "SPENT".into();
    }
    s.exhausts_at_ms.map_or_else(|| "-".into(), fmt_time)
}

/// When a spent budget recovers.
fn recover_cell(s: &BudgetStatus) -> String {
    match s.recovers_at_ms {
        Some(t) => fmt_time(t),
        None if s.exhausted() => "when pods end".into(),
        None => "-".into(),
    }
}

/// The same as one JSON document, integrals exact (unit × ms).
fn json(l: &Ledger, now: i64) -> String {
    let b = l.budgets();
    let rows: Vec<serde_json::Value> = namespaces(l)
        .into_iter()
        .map(|ns| {
            let s = b.status(ns, now);
            serde_json::json!({
                "namespace": ns,
                "budget": s.as_ref().map(|s| budget_summary(&s.budget)),
                "inherited": s.as_ref().map(|s| s.budget.namespace.is_empty()),
                "window_start_ms": s.as_ref().map(|s| s.window_start_ms),
                "used_unit_ms": s.as_ref().map(|s| s.used.to_string()),
                "limit_unit_ms": s.as_ref().map(|s| s.limit.to_string()),
                "rate": s.as_ref().map(|s| s.rate),
                "exhausted": s.as_ref().map(BudgetStatus::exhausted),
                "exhausts_at_ms": s.as_ref().and_then(|s| s.exhausts_at_ms),
                "recovers_at_ms": s.as_ref().and_then(|s| s.recovers_at_ms),
                "held_mib": b.held(ns).0,
                "held_core_milli": b.held(ns).1,
                "quota": b.quotas().get(ns).map(|q| serde_json::json!({
                    "mem_mib": q.mem_mib, "core_milli": q.core_milli,
                })),
            })
        })
        .collect();
    let doc = serde_json::json!({ "now_ms": now, "seq": l.seq(), "namespaces": rows });
    format!("{doc}\n")
}
