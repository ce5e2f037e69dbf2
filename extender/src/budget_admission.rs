//! Budgets at admission: a GPU pod of a namespace whose budget is spent is refused, demoted to
//! the budget's priority class, or admitted with a warning, as the budget says. The namespace's
//! standing is read from the extender's replica of the ledger, so admission costs no round trip;
//! without a fresh replica the pod is admitted unchanged (budgets are not worth an outage).

use gpuledger_ledger::state::BudgetStatus;
use gpuledger_ledger::{Ledger, pb};
use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, PatchOperation, RemoveOperation};
use k8s_openapi::api::core::v1::Pod;
use serde_json::Value;

use crate::replica::Replica;

/// The annotation a demoted pod gets: why, and when the budget recovers. The pod has no UID
/// at admission, so the allocator's pod watch turns it into the pod's Event once it exists.
pub const ANN_DEMOTED: &str = gpuledger_crd::ANN_DEMOTED;

/// What admission does with a GPU pod, given its namespace's budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// No budget, or within it: the pod is unchanged.
    Within,
    /// Refuse, with the reason.
    Deny(String),
    /// Admit with this priority class, with the reason.
    Demote {
        /// The budget's priority class.
        priority_class: String,
        /// Why, and when the budget recovers.
        why: String,
    },
    /// Admit unchanged, with this warning.
    Warn(String),
}

/// The verdict for a GPU pod of namespace `ns` at `now_ms`, from a state of the ledger.
pub fn verdict(l: &Ledger, ns: &str, now_ms: i64) -> Verdict {
    let Some(s) = l.budgets().status(ns, now_ms) else {
        return Verdict::Within;
    };
    if !s.exhausted() {
        return Verdict::Within;
    }
    let why = reason(ns, &s);
    match pb::BudgetPolicy::try_from(s.budget.policy) {
        Ok(pb::BudgetPolicy::Deny) => Verdict::Deny(why),
        Ok(pb::BudgetPolicy::Demote) => Verdict::Demote {
            priority_class: s.budget.priority_class.clone(),
            why,
        },
        _ => Verdict::Warn(why),
    }
}

/// "namespace team-a has spent its GPU budget (…): recovers at …".
fn reason(ns: &str, s: &BudgetStatus) -> String {
    let whose = if s.budget.namespace.is_empty() {
        "the cluster default GPU budget"
    } else {
        "its GPU budget"
    };
    let when = match s.recovers_at_ms {
        Some(t) => format!(
            "it recovers at {}",
            jiff::Timestamp::from_millisecond(t).map_or_else(|_| t.to_string(), |t| t.to_string())
        ),
        None => {
            "it recovers only after the namespace's running GPU pods release what they hold".into()
        }
    };
    format!(
        "namespace {ns} has spent {whose} ({}); {when}",
        gpuledger_ledger::state::budget_summary(&s.budget)
    )
}

/// The verdict from the replica for a GPU pod of `ns` (Within when the replica cannot answer).
pub async fn check(replica: Option<&Replica>, ns: &str, now_ms: i64) -> Verdict {
    let Some(r) = replica else {
        return Verdict::Within;
    };
    r.read("admission", |l, _| Some(verdict(l, ns, now_ms)))
        .await
        .unwrap_or(Verdict::Within)
}

/// The patch that demotes `pod` to `priority_class`: the class name set, the integer
/// priority removed so that the API server's Priority plugin derives it from the new class,
/// and [`ANN_DEMOTED`] saying `why` (after the `earlier` operations of the same patch).
pub fn demotion(
    pod: &Pod,
    earlier: &[PatchOperation],
    priority_class: &str,
    why: &str,
) -> Vec<PatchOperation> {
    let spec = |f: &str| PointerBuf::from_tokens(["spec", f]);
    let annotation = crate::webhook::patch::annotate(pod, earlier, ANN_DEMOTED, why.to_owned());
    let mut ops = vec![
        PatchOperation::Add(AddOperation {
            path: spec("priorityClassName"),
            value: Value::String(priority_class.to_owned()),
        }),
        annotation,
    ];
    if pod.spec.as_ref().is_some_and(|s| s.priority.is_some()) {
        ops.push(PatchOperation::Remove(RemoveOperation {
            path: spec("priority"),
        }));
    }
    ops
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuledger_ledger::Command;

    const H: i64 = 3_600_000;

    fn ledger(policy: pb::BudgetPolicy, class: &str) -> Ledger {
        let mut l = Ledger::new();
        l.execute(
            Command::SetBudget(pb::BudgetSet {
                namespace: "team-a".into(),
                unit: pb::BudgetUnit::GpuMibHours as i32,
                amount: 1000,
                window: pb::BudgetWindow::Day as i32,
                policy: policy as i32,
                priority_class: class.into(),
                ..Default::default()
            }),
            1,
            0,
        )
        .expect("budget");
        let inv = pb::NodeInventory {
            node: "n1".into(),
            gpus: vec![pb::Gpu {
                uuid: "GPU-0".into(),
                memory_mib: 16_000,
                healthy: true,
                ..Default::default()
            }],
            ..Default::default()
        };
        l.execute(Command::RegisterNode(inv), 1, 0).expect("node");
        let request = gpuledger_ledger::PodRequest {
            pod: pb::PodRef {
                uid: "u".into(),
                namespace: "team-a".into(),
                name: "p".into(),
            },
            containers: vec![gpuledger_ledger::ContainerRequest {
                name: "c".into(),
                slices: 1,
                mem_mib: 2000,
                ..Default::default()
            }],
            ..Default::default()
        };
        l.execute(
            Command::Reserve {
                request,
                node: "n1".into(),
                deadline_ms: H,
            },
            1,
            0,
        )
        .expect("reserve");
        l
    }

    #[test]
    fn each_policy_applies_once_the_budget_is_spent() {
        // 2000 MiB held from 0: 1000 MiB-hours are spent at half an hour.
        let l = ledger(pb::BudgetPolicy::Deny, "");
        assert_eq!(verdict(&l, "team-a", H / 4), Verdict::Within);
        assert_eq!(verdict(&l, "team-b", 10 * H), Verdict::Within, "no budget");
        match verdict(&l, "team-a", H) {
            Verdict::Deny(m) => {
                assert!(
                    m.contains("namespace team-a has spent its GPU budget"),
                    "{m}"
                );
                assert!(
                    m.contains("it recovers at 1970-01-02T00:00:00Z"),
                    "a day window recovers at midnight UTC: {m}"
                );
            }
            other => panic!("{other:?}"),
        }
        let l = ledger(pb::BudgetPolicy::Demote, "gpu-low");
        match verdict(&l, "team-a", H) {
            Verdict::Demote {
                priority_class,
                why,
            } => {
                assert_eq!(priority_class, "gpu-low");
                assert!(why.contains("1000 GPU-MiB-hours per day"), "{why}");
            }
            other => panic!("{other:?}"),
        }
        let l = ledger(pb::BudgetPolicy::Warn, "");
        assert!(matches!(verdict(&l, "team-a", H), Verdict::Warn(_)));
    }

    #[test]
    fn demotion_sets_the_class_says_why_and_drops_a_stale_priority() {
        let mut pod = Pod {
            spec: Some(Default::default()),
            ..Default::default()
        };
        let apply = |pod: &Pod, ops: Vec<PatchOperation>| {
            let mut v = serde_json::to_value(pod).expect("a pod serializes");
            json_patch::patch(&mut v, &json_patch::Patch(ops)).expect("the patch applies");
            v
        };
        let v = apply(&pod, demotion(&pod, &[], "gpu-low", "spent"));
        assert_eq!(v["spec"]["priorityClassName"], "gpu-low");
        assert_eq!(v["metadata"]["annotations"][ANN_DEMOTED], "spent");
        pod.metadata.annotations = Some([("keep".to_owned(), "me".to_owned())].into());
        pod.spec = Some(k8s_openapi::api::core::v1::PodSpec {
            priority: Some(1000),
            ..Default::default()
        });
        let v = apply(&pod, demotion(&pod, &[], "gpu-low", "spent"));
        assert_eq!(
            v["metadata"]["annotations"]["keep"], "me",
            "other annotations stay"
        );
        assert_eq!(v["metadata"]["annotations"][ANN_DEMOTED], "spent");
        assert!(v["spec"].get("priority").is_none(), "{v}");
    }
}
