//! Preemption for GPU slices under the stock kube-scheduler with the shipped configuration: a
//! pod that does not fit a full GPU evicts exactly the pod whose slice frees room (the fewest
//! pods, then the lowest priorities, whose slices free a fit on one GPU) and binds there. The
//! second scenario is issue 19's budget story: a namespace that spends its budget has its next
//! pod demoted, an in-budget pod of another namespace preempts it, and once the rolling window
//! has passed the namespace's pods are admitted at default priority again.
//!
//! kube-scheduler's DefaultPreemption never calls an extender's `preempt` verb when only GPU
//! memory or compute (ignoredByScheduler) is short: its dry run reprieves every pod and drops
//! the node with "expected at least one victim pod" (kubernetes#139270). gpuledger preempts
//! itself: the extender's filter asks the allocator leader, which commits a `Nominated` event
//! naming the victims and evicts them through the Eviction API; the victims' deletion requeues
//! the pod. So these scenarios assert on the nomination and the evictions, not on the verb.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use gpuledger_e2e::gpuledger::{ADMIN_SA, counter, ctl};
use gpuledger_e2e::kubectl::Output;
use gpuledger_e2e::pods::{self, ledger_nodes};
use gpuledger_e2e::{E2e, Options, until};
use gpuledger_ledger::pb;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::{Api, PostParams};
use serde_json::json;

/// A pod asking for `mem` MiB of one GPU, at priority class `class` (None: the default).
fn gpu_pod(name: &str, mem: &str, class: Option<&str>) -> serde_json::Value {
    let mut p = pods::pod(name, &[("gpuledger.io/gpu-mem", mem)], None);
    if let Some(c) = class {
        p["spec"]["priorityClassName"] = json!(c);
    }
    p
}

/// The GPU the ledger granted to `ns/name`, if it holds one.
fn gpu_of(l: &gpuledger_ledger::Ledger, ns: &str, name: &str) -> Option<String> {
    l.allocs()
        .values()
        .find(|a| a.pod.namespace == ns && a.pod.name == name)
        .and_then(|a| a.shares.first().map(|s| s.gpu_uuid.clone()))
}

pub(crate) async fn terminating(api: &Api<Pod>, name: &str) -> Result<bool> {
    Ok(api.get(name).await?.metadata.deletion_timestamp.is_some())
}

pub(crate) async fn priority_classes(client: &kube::Client, classes: &[(&str, i32)]) -> Result<()> {
    let api: Api<PriorityClass> = Api::all(client.clone());
    for (name, value) in classes {
        let pc: PriorityClass = serde_json::from_value(json!({
            "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
            "metadata": {"name": name}, "value": value,
        }))?;
        api.create(&PostParams::default(), &pc).await?;
    }
    Ok(())
}

/// How many times kube-scheduler called the extender's `preempt` verb (printed: a scheduler
/// with kubernetes#139270 fixed may call it too; the nomination is what decides).
async fn preempt_calls(e: &E2e) -> Result<f64> {
    let m = e.gl.extender_metrics().await?;
    Ok(counter(
        &m,
        "gpuledger_extender_requests_total",
        &[("verb", "preempt")],
    ))
}

/// Every nomination the ledger recorded for `ns/name`: node, victims (`ns/name`), actor role.
pub(crate) async fn nominations(
    e: &E2e,
    ns: &str,
    name: &str,
) -> Result<Vec<(String, Vec<String>, String)>> {
    let leader = e.gl.allocs.wait_leader(Duration::from_secs(20)).await?;
    let log = e.gl.allocs.events(leader).await?;
    Ok(log
        .into_iter()
        .filter_map(|ev| match ev.body {
            Some(pb::event::Body::Nominated(n))
                if n.pod
                    .as_ref()
                    .is_some_and(|p| p.namespace == ns && p.name == name) =>
            {
                let victims = n
                    .victims
                    .iter()
                    .filter_map(|v| v.pod.as_ref())
                    .map(|p| format!("{}/{}", p.namespace, p.name))
                    .collect();
                Some((
                    n.node,
                    victims,
                    ev.actor.map(|a| a.role).unwrap_or_default(),
                ))
            }
            _ => None,
        })
        .collect())
}

/// Require that `ns/name` was nominated on `node` by the extender, evicting exactly `victims`.
async fn nominated_evicting(
    e: &E2e,
    ns: &str,
    name: &str,
    node: &str,
    victims: &[String],
) -> Result<()> {
    let n = nominations(e, ns, name).await?;
    ensure!(
        n.iter()
            .any(|(at, v, who)| at == node && v == victims && who == "extender"),
        "{ns}/{name} was not nominated on {node} evicting {victims:?} at the extender's request: {n:?}"
    );
    eprintln!(
        "{ns}/{name}: nominated on {node} evicting {victims:?}; the scheduler called the preempt verb {} time(s)",
        preempt_calls(e).await?
    );
    Ok(())
}

/// Wait until `victim` of `ns` is evicted (deletion requested), then delete it as the kubelet a
/// kubelet-less node lacks would.
async fn evicted(e: &E2e, ns: &str, victim: &str) -> Result<()> {
    let api: Api<Pod> = Api::namespaced(e.client.clone(), ns);
    until(
        &format!("{ns}/{victim} evicted"),
        Duration::from_secs(60),
        || async { Ok(terminating(&api, victim).await?.then_some(())) },
    )
    .await
    .map_err(|err| anyhow::anyhow!("{err}\n{}", e.log_tails(30)))?;
    pods::force_delete(&e.client, ns, victim).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes (kube-apiserver, kube-scheduler): make test-e2e"]
async fn a_higher_priority_pod_on_a_full_gpu() -> Result<()> {
    const NS: &str = "team-p";
    // One node, one 16 GiB GPU.
    let (e, nodes) = E2e::with_gpu_nodes(Options::default(), 1, 1, NS).await?;
    priority_classes(
        &e.client,
        &[("e2e-lowest", 10), ("e2e-low", 20), ("e2e-in-budget", 1000)],
    )
    .await?;
    let big = "big-low";
    let small = "small-lowest";
    pods::create(&e.client, NS, &gpu_pod(big, "12000", Some("e2e-low"))).await?;
    pods::create(&e.client, NS, &gpu_pod(small, "4000", Some("e2e-lowest"))).await?;
    let names = [big.to_string(), small.to_string()];
    pods::wait_bound(&e.client, NS, &names, Duration::from_secs(60)).await?;
    let gpu = gpu_of(&e.gl.ledger().await?, NS, big);
    ensure!(gpu.is_some(), "{big} holds no GPU in the ledger");

    // 8000 MiB: 384 free; evicting small-lowest frees 4000 (too little), big-low 12000. The
    // scheduler's own dry run, blind to GPU memory, evicts nothing; gpuledger evicts big-low
    // though small-lowest has the lower priority.
    let pre = "in-budget";
    pods::create(&e.client, NS, &gpu_pod(pre, "8000", Some("e2e-in-budget"))).await?;
    let api: Api<Pod> = Api::namespaced(e.client.clone(), NS);
    evicted(&e, NS, big).await?;
    nominated_evicting(&e, NS, pre, &nodes[0], &[format!("{NS}/{big}")]).await?;
    ensure!(
        !terminating(&api, small).await?,
        "{small} was evicted too, though its slice frees too little"
    );
    let bound =
        pods::wait_bound(&e.client, NS, &[pre.to_string()], Duration::from_secs(60)).await?;
    ensure!(
        bound.get(pre) == Some(&nodes[0]),
        "{pre} bound to {bound:?}"
    );
    let l = e.gl.ledger().await?;
    ensure!(
        gpu_of(&l, NS, pre) == gpu,
        "{pre} is on {:?}, the GPU {big} left is {gpu:?}",
        gpu_of(&l, NS, pre)
    );
    let held = ledger_nodes(&l);
    ensure!(
        held.contains_key(&format!("{NS}/{small}")) && !held.contains_key(&format!("{NS}/{big}")),
        "the ledger holds {held:?}"
    );
    ensure!(
        !terminating(&api, small).await?,
        "{small} was evicted after all"
    );
    Ok(())
}

/// Namespace with a budget.
const A: &str = "team-a";
/// Namespace without one.
const B: &str = "team-b";
/// The priority class A's pods are demoted to once A's budget is spent.
const DEMOTED: &str = "e2e-over-budget";
const DEMOTED_VALUE: i32 = -10;
/// A's budget: 10 GPU-MiB-hours, which 12000 MiB held spends in 3 s, per rolling minute (the
/// shortest window the ledger takes).
const AMOUNT: &str = "10";
const WINDOW: &str = "1m";

/// `kubectl create` of `pod` in `ns`, as a user runs it (the webhook's warnings on stderr).
fn kubectl_create(e: &E2e, ns: &str, pod: &serde_json::Value) -> Result<Output> {
    e.kubectl()
        .run_with_input(&["-n", ns, "create", "-f", "-"], Some(&pod.to_string()))
}

/// `(priorityClassName, priority)` of `ns/name` as stored.
async fn priority_of(e: &E2e, ns: &str, name: &str) -> Result<(Option<String>, Option<i32>)> {
    let spec = Api::<Pod>::namespaced(e.client.clone(), ns)
        .get(name)
        .await?
        .spec
        .context("a pod without a spec")?;
    Ok((spec.priority_class_name, spec.priority))
}

/// Create A's pod `name` as a user would and require that admission left it as written: no
/// warning, the default priority.
async fn admitted_unchanged(e: &E2e, name: &str, mem: &str, when: &str) -> Result<()> {
    let out = kubectl_create(e, A, &gpu_pod(name, mem, None))?;
    ensure!(
        out.ok && !out.stderr.contains("Warning"),
        "{name}, {when}: {out:?}"
    );
    let p = priority_of(e, A, name).await?;
    ensure!(
        p == (None, Some(0)),
        "{name}, {when}, was not admitted at the default priority: {p:?}"
    );
    Ok(())
}

/// Whether A's budget is spent now, as the leader's ledger folds it.
async fn a_spent(e: &E2e) -> Result<bool> {
    let now = i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis(),
    )?;
    let l = e.gl.ledger().await?;
    let s = l
        .budgets()
        .status(A, now)
        .context("team-a has no budget in the ledger")?;
    Ok(s.exhausted())
}

/// Wait until the extender's ledger replica, which answers admission, has folded all the
/// leader has.
async fn replica_caught_up(e: &E2e) -> Result<()> {
    let seq = e.gl.ledger().await?.seq() as f64;
    until(
        "the extender's replica caught up",
        Duration::from_secs(20),
        || async {
            let m = e.gl.extender_metrics().await?;
            Ok((counter(&m, "gpuledger_extender_replica_seq", &[]) >= seq).then_some(()))
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes (kube-apiserver, kube-scheduler): make test-e2e"]
async fn a_namespace_over_budget_is_demoted_preempted_and_recovers() -> Result<()> {
    let (e, nodes) = E2e::with_gpu_nodes(Options::default(), 1, 1, A).await?;
    e.namespace(B).await?;
    priority_classes(&e.client, &[(DEMOTED, DEMOTED_VALUE)]).await?;
    let admin = e
        .certs
        .token_flags(&e.cp.pki.request_token(&e.client, ADMIN_SA).await?);
    let addrs = &e.gl.allocs.addrs;
    let set = |policy: &str| {
        let mut args = vec![
            "budget", "set", A, "--amount", AMOUNT, "--window", WINDOW, "--policy", policy,
        ];
        if policy == "demote" {
            args.extend(["--priority-class", DEMOTED]);
        }
        ctl(addrs, &admin, &args)
    };
    set("demote")?;

    // Within budget.
    admitted_unchanged(&e, "a-1", "12000", "within budget").await?;
    pods::wait_bound(&e.client, A, &["a-1".into()], Duration::from_secs(60)).await?;
    let spent_from = Instant::now();
    until("team-a's budget spent", Duration::from_secs(30), || async {
        Ok(a_spent(&e).await?.then_some(()))
    })
    .await?;
    replica_caught_up(&e).await?;

    // Spent: a-2 is demoted, says so at admission, and fills the GPU (16000 of 16384 MiB).
    let out = kubectl_create(&e, A, &gpu_pod("a-2", "4000", None))?;
    ensure!(
        out.ok
            && out.stderr.contains(&format!("demoted to {DEMOTED}"))
            && out
                .stderr
                .contains(&format!("namespace {A} has spent its GPU budget"))
            && out.stderr.contains("recovers"),
        "a-2's admission did not say it was demoted and why: {out:?}"
    );
    ensure!(
        priority_of(&e, A, "a-2").await? == (Some(DEMOTED.into()), Some(DEMOTED_VALUE)),
        "a-2 is not demoted: {:?}",
        priority_of(&e, A, "a-2").await?
    );
    // The leader's pod watch tells the demoted pod why, in an Event of its own.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let events = e.kubectl().ok(&[
            "-n",
            A,
            "get",
            "events",
            "--field-selector=involvedObject.name=a-2,reason=GpuBudgetDemoted",
        ])?;
        if events.contains(&format!("admitted at priority class {DEMOTED}"))
            && events.contains("recovers")
        {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "a-2 has no GpuBudgetDemoted Event saying why after 20 s:\n{events}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    pods::wait_bound(&e.client, A, &["a-2".into()], Duration::from_secs(60)).await?;

    // B is within budget (it has none) at the default priority, and fits only where a-2 is:
    // a-1 has B's priority and cannot be preempted.
    pods::create(&e.client, B, &gpu_pod("b-1", "4000", None)).await?;
    evicted(&e, A, "a-2").await?;
    nominated_evicting(&e, B, "b-1", &nodes[0], &[format!("{A}/a-2")]).await?;
    let bound = pods::wait_bound(&e.client, B, &["b-1".into()], Duration::from_secs(60)).await?;
    ensure!(
        bound.get("b-1") == Some(&nodes[0]),
        "b-1 bound to {bound:?}"
    );
    let events = e.kubectl().ok(&[
        "-n",
        A,
        "get",
        "events",
        "--field-selector=involvedObject.name=a-2",
    ])?;
    ensure!(
        events.contains("Preempted") && events.contains(&format!("Preempted by {B}/b-1 on node")),
        "kubectl get events does not say why a-2 went:\n{events}"
    );
    let held = ledger_nodes(&e.gl.ledger().await?);
    ensure!(
        held.contains_key(&format!("{A}/a-1")) && !held.contains_key(&format!("{A}/a-2")),
        "the ledger holds {held:?}"
    );

    // The deny policy, while A is still spent: refused, with the reason and the recovery.
    set("deny")?;
    replica_caught_up(&e).await?;
    let out = kubectl_create(&e, A, &gpu_pod("a-denied", "1000", None))?;
    ensure!(
        !out.ok
            && out
                .stderr
                .contains(&format!("namespace {A} has spent its GPU budget"))
            && out.stderr.contains("recovers"),
        "a spent budget with policy deny admitted a pod, or did not say why: {out:?}"
    );
    set("demote")?;
    ensure!(
        a_spent(&e).await?,
        "changing the policy lost what team-a had spent"
    );

    // A releases everything; once its consumption has left the rolling minute, its pods are
    // admitted unchanged again.
    pods::force_delete(&e.client, A, "a-1").await?;
    let released = Instant::now();
    until(
        "team-a's budget recovered",
        Duration::from_secs(90),
        || async { Ok((!a_spent(&e).await?).then_some(())) },
    )
    .await?;
    let waited = released.elapsed();
    ensure!(
        waited >= Duration::from_secs(45),
        "team-a recovered {waited:?} after a-1's release: sooner than a-1's last seconds of \
         12000 MiB can leave a rolling minute"
    );
    replica_caught_up(&e).await?;
    admitted_unchanged(&e, "a-3", "1000", "after the window rolled over").await?;
    eprintln!(
        "budget story: spent to recovered in {:?}",
        spent_from.elapsed()
    );
    Ok(())
}
