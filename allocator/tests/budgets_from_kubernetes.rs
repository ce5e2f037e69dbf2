//! GPUBudget objects become ledger budgets: written by the leader once (not again after a
//! failover), refused with a status, a log line and an Event when their priority class does
//! not exist (nothing written), removed with the object; the CLI's RPCs refuse what an object
//! governs. Real etcd, real gRPC, the fake API server over HTTPS.

use crate::support;

use std::time::Duration;

use gpuledger_crd::{
    BudgetPolicy, BudgetUnit, GPUBudget, GPUBudgetSpec, GPUQuota, STATE_APPLIED, STATE_REFUSED,
};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::kube::{KubeStack, StackOptions};
use k8s_openapi::api::scheduling::v1::PriorityClass;
use k8s_openapi::serde_json::json;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use support::wait_until;
use tonic::Code;

/// The budget events in the whole log: (namespace, what).
async fn budget_events(stack: &KubeStack, i: usize) -> anyhow::Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for e in stack.allocs.events(i).await? {
        match e.body {
            Some(pb::event::Body::BudgetSet(b)) => out.push((b.namespace, b.source)),
            Some(pb::event::Body::BudgetRemoved(b)) => {
                out.push((b.namespace, format!("removed by {}", b.source)))
            }
            Some(pb::event::Body::QuotaSet(q)) => {
                out.push((q.namespace, format!("quota {} {}", q.mem_mib, q.core_milli)))
            }
            _ => {}
        }
    }
    Ok(out)
}

fn spec(amount: &str, policy: BudgetPolicy, class: Option<&str>) -> GPUBudgetSpec {
    GPUBudgetSpec {
        amount: amount.into(),
        unit: BudgetUnit::MibHours,
        window: "day".into(),
        policy,
        priority_class_name: class.map(str::to_owned),
        quota: None,
    }
}

async fn status_of(api: &Api<GPUBudget>, name: &str) -> anyhow::Result<(String, String, u64)> {
    let s = api.get(name).await?.status.unwrap_or_default();
    Ok((s.state, s.message, s.seq.unwrap_or(0)))
}

/// The Events on GPUBudget `name`: (reason, message).
fn events_on(stack: &KubeStack, name: &str) -> Vec<(String, String)> {
    stack
        .api
        .store
        .objects("v1", "events")
        .into_iter()
        .filter(|e| {
            e["involvedObject"]["kind"] == "GPUBudget" && e["involvedObject"]["name"] == name
        })
        .map(|e| {
            (
                e["reason"].as_str().unwrap_or_default().to_owned(),
                e["message"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpubudgets_are_written_once_refused_with_a_reason_and_removed() -> anyhow::Result<()> {
    let mut stack = KubeStack::start(StackOptions {
        allocators: 2,
        ..Default::default()
    })
    .await?;
    let client = stack.api.client().await?;
    let team_a: Api<GPUBudget> = Api::namespaced(client.clone(), "team-a");
    let classes: Api<PriorityClass> = Api::all(client.clone());
    let leader = stack.allocs.wait_leader(Duration::from_secs(30)).await?;

    // A demote budget whose class does not exist: refused, nothing written.
    team_a
        .create(
            &PostParams::default(),
            &GPUBudget::new("gpu", spec("500", BudgetPolicy::Demote, Some("gpu-low"))),
        )
        .await?;
    wait_until("gpu refused", Duration::from_secs(10), || async {
        Ok(status_of(&team_a, "gpu").await?.0 == STATE_REFUSED)
    })
    .await?;
    let (_, why, _) = status_of(&team_a, "gpu").await?;
    assert!(why.contains("\"gpu-low\" does not exist"), "{why}");
    assert!(
        events_on(&stack, "gpu")
            .iter()
            .any(|(r, m)| r == "BudgetRefused" && m.contains("does not exist")),
        "a Warning Event says why: {:?}",
        events_on(&stack, "gpu")
    );
    assert!(
        budget_events(&stack, leader).await?.is_empty(),
        "nothing written"
    );

    // Once the class exists, the next pass writes the budget, named after its object.
    classes
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"apiVersion": "scheduling.k8s.io/v1",
                "kind": "PriorityClass", "metadata": {"name": "gpu-low"}, "value": -10}))?,
        )
        .await?;
    wait_until("gpu applied", Duration::from_secs(10), || async {
        Ok(status_of(&team_a, "gpu").await?.0 == STATE_APPLIED)
    })
    .await?;
    let (_, summary, seq) = status_of(&team_a, "gpu").await?;
    assert!(
        summary.contains("500 GPU-MiB-hours per day, demote to gpu-low"),
        "{summary}"
    );
    let l = stack.allocs.ledger(leader).await?;
    let b = &l.budgets().budgets()["team-a"];
    assert_eq!((b.amount, b.source.as_str()), (500, "GPUBudget team-a/gpu"));
    assert!(
        seq > 0 && seq <= l.seq(),
        "status seq {seq}, ledger {}",
        l.seq()
    );

    // A second object for the same namespace is refused; the first still governs.
    team_a
        .create(
            &PostParams::default(),
            &GPUBudget::new("other", spec("1", BudgetPolicy::Deny, None)),
        )
        .await?;
    wait_until("other refused", Duration::from_secs(10), || async {
        Ok(status_of(&team_a, "other").await?.0 == STATE_REFUSED)
    })
    .await?;
    assert!(
        status_of(&team_a, "other")
            .await?
            .1
            .contains("already has GPUBudget gpu")
    );

    // The CLI's RPCs: the object governs team-a; a class that does not exist is refused.
    let mut admin = stack.allocs.admin(leader)?;
    let head = stack.allocs.ledger(leader).await?.seq();
    let cli = |ns: &str, policy: pb::BudgetPolicy, class: &str| api::SetBudgetRequest {
        budget: Some(pb::BudgetSet {
            namespace: ns.into(),
            unit: pb::BudgetUnit::GpuMibHours as i32,
            amount: 7,
            window: pb::BudgetWindow::Day as i32,
            policy: policy as i32,
            priority_class: class.into(),
            source: "cli".into(),
            ..Default::default()
        }),
        remove: false,
    };
    let e = admin
        .set_budget(cli("team-a", pb::BudgetPolicy::Deny, ""))
        .await
        .expect_err("team-a is governed by its GPUBudget");
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(
        e.message().contains("GPUBudget team-a/gpu"),
        "{}",
        e.message()
    );
    let e = admin
        .set_quota(api::SetQuotaRequest {
            quota: Some(pb::QuotaSet {
                namespace: "team-a".into(),
                mem_mib: 1,
                core_milli: 0,
            }),
        })
        .await
        .expect_err("team-a's quota is its GPUBudget's");
    assert!(
        e.message().contains("GPUBudget team-a/gpu"),
        "{}",
        e.message()
    );
    let e = admin
        .set_budget(cli("team-b", pb::BudgetPolicy::Demote, "no-such-class"))
        .await
        .expect_err("the class does not exist");
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(
        e.message().contains("\"no-such-class\" does not exist"),
        "{}",
        e.message()
    );
    admin
        .set_budget(cli("team-b", pb::BudgetPolicy::Demote, "gpu-low"))
        .await?;
    assert_eq!(
        stack.allocs.ledger(leader).await?.seq(),
        head + 1,
        "only the valid CLI budget was written"
    );

    // A change of the object (a quota added) is written; a failover writes nothing again.
    team_a
        .patch(
            "gpu",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"quota": GPUQuota { mem_mib: 4096, core_percent: 150 }}}),
            ),
        )
        .await?;
    wait_until("quota set", Duration::from_secs(10), || async {
        let l = stack.allocs.ledger(leader).await?;
        Ok(l.quotas()
            .get("team-a")
            .is_some_and(|q| q.mem_mib == 4096 && q.core_milli == 1500))
    })
    .await?;
    let before = budget_events(&stack, leader).await?;
    assert_eq!(
        before,
        [
            ("team-a".into(), "GPUBudget team-a/gpu".into()),
            ("team-b".into(), "cli".into()),
            ("team-a".into(), "quota 4096 1500".into()),
        ]
    );
    stack.allocs.procs[leader].kill();
    let next = stack
        .allocs
        .wait_leader_except(Duration::from_secs(30), Some(leader))
        .await?;
    // Two resync periods of the new leader.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        budget_events(&stack, next).await?,
        before,
        "nothing written twice"
    );

    // Deleting the object removes its budget and its quota; the CLI's budget stays.
    team_a.delete("other", &DeleteParams::default()).await?;
    team_a.delete("gpu", &DeleteParams::default()).await?;
    wait_until("budget removed", Duration::from_secs(10), || async {
        let l = stack.allocs.ledger(next).await?;
        Ok(!l.budgets().budgets().contains_key("team-a") && !l.quotas().contains_key("team-a"))
    })
    .await?;
    let l = stack.allocs.ledger(next).await?;
    assert_eq!(l.budgets().budgets()["team-b"].source, "cli");

    // The cluster default: `default` in the allocator's namespace.
    let system: Api<GPUBudget> = Api::namespaced(client, "gpuledger-system");
    system
        .create(
            &PostParams::default(),
            &GPUBudget::new("default", spec("9", BudgetPolicy::Warn, None)),
        )
        .await?;
    wait_until("cluster default set", Duration::from_secs(10), || async {
        let l = stack.allocs.ledger(next).await?;
        Ok(l.budgets()
            .budgets()
            .get("")
            .is_some_and(|b| b.amount == 9 && b.source == "GPUBudget gpuledger-system/default"))
    })
    .await?;
    Ok(())
}
