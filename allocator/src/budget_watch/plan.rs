//! What a pass of the GPUBudget watch decides, as pure functions: the objects and the ledger's
//! budgets and quotas in, the fixes out. The watch gathers the inputs and applies the fixes.

use std::collections::BTreeMap;
use std::sync::Arc;

use gpuledger_crd::{
    CLUSTER_DEFAULT_NAME, GPUBudget, SOURCE_PREFIX, STATE_APPLIED, STATE_REFUSED, source_of,
};
use gpuledger_ledger::pb;
use gpuledger_ledger::state::{Quota, same_budget};
use kube::ResourceExt;

/// A write (or a refusal) a pass asks of the watch.
#[derive(Debug, Clone, PartialEq)]
pub enum Fix {
    /// Bring the ledger to what `object` asks, then mark the object applied (with an Event
    /// when something was written).
    Apply {
        /// The object.
        object: Arc<GPUBudget>,
        /// The budget it asks for (its namespace: the ledger namespace it speaks for).
        budget: pb::BudgetSet,
        /// Whether the ledger's budget differs from it (and so is written).
        write_budget: bool,
        /// The quota to write, when the ledger's differs.
        quota: Option<pb::QuotaSet>,
    },
    /// Refuse the object: nothing is written; its status and an Event say why.
    Refuse {
        /// The object.
        object: Arc<GPUBudget>,
        /// Why.
        why: String,
    },
    /// Remove the budget of `ns` that a GPUBudget no longer there wrote (and, when the ledger
    /// took that, clear the namespace's quota if `clear_quota`).
    Remove {
        /// The ledger namespace.
        ns: String,
        /// The budget's source (the object that wrote it).
        source: String,
        /// The namespace has a quota to clear.
        clear_quota: bool,
    },
}

/// What one object asks of the ledger, once checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Wanted {
    /// The budget.
    pub budget: pb::BudgetSet,
    /// The quota (None for the cluster default, which takes none).
    pub quota: Option<pb::QuotaSet>,
}

/// The objects by the ledger namespace they speak for, each list by name: the first governs.
pub fn governing(
    objs: &[Arc<GPUBudget>],
    default_ns: &str,
) -> BTreeMap<String, Vec<Arc<GPUBudget>>> {
    let mut m: BTreeMap<String, Vec<Arc<GPUBudget>>> = BTreeMap::new();
    for o in objs {
        if o.metadata.deletion_timestamp.is_some() {
            continue;
        }
        m.entry(ledger_namespace(o, default_ns))
            .or_default()
            .push(o.clone());
    }
    for l in m.values_mut() {
        l.sort_by_key(|o| o.name_any());
    }
    m
}

/// The ledger namespace an object speaks for: "" for the cluster default.
fn ledger_namespace(o: &GPUBudget, default_ns: &str) -> String {
    let ns = o.namespace().unwrap_or_default();
    if ns == default_ns && o.name_any() == CLUSTER_DEFAULT_NAME {
        String::new()
    } else {
        ns
    }
}

/// What `o` asks for ledger namespace `ns`, or why it is refused.
pub fn wanted(ns: &str, o: &GPUBudget) -> Result<Wanted, String> {
    let source = source_of(&o.namespace().unwrap_or_default(), &o.name_any());
    let budget = o.spec.to_budget(ns, &source)?;
    let quota = if ns.is_empty() {
        if o.spec.quota.is_some() {
            return Err("the cluster default takes no quota: a quota caps one namespace".into());
        }
        None
    } else {
        Some(o.spec.to_quota(ns)?)
    };
    Ok(Wanted { budget, quota })
}

/// Compare every governing object (`groups`, from [`governing`]) with the ledger's `budgets`
/// and `quotas`: what to write, whom to refuse, which budgets to remove.
pub fn plan(
    groups: &BTreeMap<String, Vec<Arc<GPUBudget>>>,
    budgets: &BTreeMap<String, pb::BudgetSet>,
    quotas: &BTreeMap<String, Quota>,
) -> Vec<Fix> {
    let mut fixes = Vec::new();
    for (ns, objs) in groups {
        let Some((first, rest)) = objs.split_first() else {
            continue;
        };
        fixes.extend(apply(ns, first, budgets.get(ns), quotas.get(ns).copied()));
        for o in rest {
            let why = format!(
                "{} already has GPUBudget {}: one object per namespace, the first by name",
                if ns.is_empty() {
                    "the cluster default".to_owned()
                } else {
                    format!("namespace {ns}")
                },
                first.name_any()
            );
            fixes.push(Fix::Refuse {
                object: o.clone(),
                why,
            });
        }
    }
    for (ns, b) in budgets {
        if !b.source.starts_with(SOURCE_PREFIX) || groups.contains_key(ns) {
            continue;
        }
        fixes.push(Fix::Remove {
            ns: ns.clone(),
            source: b.source.clone(),
            clear_quota: !ns.is_empty() && quotas.contains_key(ns),
        });
    }
    fixes
}

/// What bringing the ledger (budget `cur`, quota `q`) to what `o` asks for `ns` takes; None
/// when the ledger and the object's status are both up to date.
fn apply(
    ns: &str,
    o: &Arc<GPUBudget>,
    cur: Option<&pb::BudgetSet>,
    q: Option<Quota>,
) -> Option<Fix> {
    let w = match wanted(ns, o) {
        Ok(w) => w,
        Err(why) => {
            return Some(Fix::Refuse {
                object: o.clone(),
                why,
            });
        }
    };
    let budget_same = cur.is_some_and(|c| same_budget(c, &w.budget));
    let quota = w.quota.filter(|x| {
        q.unwrap_or_default()
            != Quota {
                mem_mib: x.mem_mib,
                core_milli: x.core_milli,
            }
    });
    let status = o.status.clone().unwrap_or_default();
    let current =
        status.state == STATE_APPLIED && status.observed_generation == o.metadata.generation;
    if budget_same && quota.is_none() && current {
        return None;
    }
    Some(Fix::Apply {
        object: o.clone(),
        budget: w.budget,
        write_budget: !budget_same,
        quota,
    })
}

/// Whether `o`'s status says it is refused already, for `why`, at its generation.
pub fn already_refused(o: &GPUBudget, why: &str) -> bool {
    let st = o.status.clone().unwrap_or_default();
    st.state == STATE_REFUSED
        && st.message == why
        && st.observed_generation == o.metadata.generation
}

/// Why a budget naming priority class `name` is refused while the class does not exist.
pub fn no_class(name: &str) -> String {
    format!(
        "priority class {name:?} does not exist in the cluster: create the PriorityClass first \
         (the API server would refuse every pod demoted to it)"
    )
}

#[cfg(test)]
mod tests;
