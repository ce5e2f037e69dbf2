//! Preemption of GPU slices under a scheduler that never calls the extender's `preempt` verb
//! for them, as every kube-scheduler since 1.22 does (kubernetes#139270): the test kit's
//! scheduler emulator runs DefaultPreemption's dry run on the resources the scheduler sees,
//! finds no victim, and calls nothing. The extender's filter asks the allocator leader instead;
//! the leader (real processes on real etcd, the fake API server) evicts exactly the pod whose
//! slice frees room, nominates the preemptor, and the preemptor binds to that GPU. The room is
//! kept from pods that do not outrank it, through a leader failover, until the deadline; a pod
//! with `preemptionPolicy: Never` and a victim a PodDisruptionBudget protects are left alone.

use std::time::Duration;

use anyhow::Context;
use gpuledger_ledger::pb;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::eventually;
use gpuledger_testkit::kube::{KubeStack, Preemption, SchedulerEmulator, StackOptions};
use gpuledger_testkit::workload::inventory;
use serde_json::{Value, json};

use crate::kit;

const NODE: &str = "gpu-0";
const UUID: &str = "GPU-gpu-0-0";

/// A pod of `default` asking for `mem` MiB of one GPU at `priority`; bound to `node` and
/// running when one is given.
fn pod(name: &str, mem: u64, priority: i32, node: Option<&str>) -> Value {
    let mut p = json!({
        "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}"),
                     "labels": {"app": name}},
        "spec": {"schedulerName": "gpuledger-scheduler", "priority": priority,
                 "containers": [{"name": "c", "image": "x", "resources": {"limits": {
                     "gpuledger.io/gpu": "1", "gpuledger.io/gpu-mem": mem.to_string()}}}]},
        "status": {"phase": "Pending"},
    });
    if let Some(n) = node {
        p["spec"]["nodeName"] = json!(n);
        p["status"]["phase"] = json!("Running");
    }
    p
}

/// One node with one 16 GiB GPU (16384 MiB), full: `big-low` (12000 MiB, priority 20) and
/// `small-lowest` (4000 MiB, priority 10), as in the real-Kubernetes tier.
async fn full_gpu(allocators: usize, ttl_ms: u64) -> anyhow::Result<KubeStack> {
    let stack = KubeStack::start(StackOptions {
        allocators,
        allocator_flags: vec![
            "--reconcile-interval-ms=100".into(),
            format!("--nomination-ttl-ms={ttl_ms}"),
        ],
        extender_flags: Some(vec![
            "--replica-stale-ms=3000".into(),
            "--preempt-retry-ms=300".into(),
        ]),
        ..Default::default()
    })
    .await?;
    stack
        .allocs
        .node_agent(0, NODE)?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory(NODE, 1, 16_384, "Tesla T4")),
        })
        .await?;
    stack.api.add_node(NODE, 64)?;
    for p in [
        pod("big-low", 12_000, 20, Some(NODE)),
        pod("small-lowest", 4_000, 10, Some(NODE)),
    ] {
        kit::reserve(&stack, &p, NODE).await?;
    }
    Ok(stack)
}

/// The scheduler emulator on the stack's extender, retrying a failed pod after 200 ms.
async fn scheduler(stack: &KubeStack) -> anyhow::Result<SchedulerEmulator> {
    SchedulerEmulator::start(
        stack.api.client().await?,
        "gpuledger-scheduler",
        stack.extender_config()?,
        4,
        Duration::from_millis(200),
    )
}

fn exists(stack: &KubeStack, name: &str) -> bool {
    stack.api.pod("default", name).is_some()
}

fn bound_to(stack: &KubeStack, name: &str) -> Option<String> {
    stack.api.pod("default", name)?["spec"]["nodeName"]
        .as_str()
        .map(String::from)
}

/// The Events of pod `name` with `reason`: their messages.
fn events(stack: &KubeStack, name: &str, reason: &str) -> Vec<String> {
    stack
        .api
        .store
        .objects("v1", "events")
        .into_iter()
        .filter(|e| e["involvedObject"]["name"] == name && e["reason"] == reason)
        .filter_map(|e| e["message"].as_str().map(String::from))
        .collect()
}

/// The pods holding GPU memory in the ledger (by name) and the live nominations (by name).
async fn ledger(stack: &KubeStack, i: usize) -> anyhow::Result<(Vec<String>, Vec<pb::Nominated>)> {
    let l = stack.allocs.ledger(i).await?;
    let mut held: Vec<String> = l.allocs().values().map(|a| a.pod.name.clone()).collect();
    held.sort();
    Ok((held, l.nominations().iter().cloned().collect()))
}

/// How many times the extender's `preempt` verb was called (any outcome).
async fn preempt_verb_calls(stack: &KubeStack) -> anyhow::Result<f64> {
    let (_, text) =
        gpuledger_testkit::http::get(&format!("{}/metrics", stack.extender_http_url)).await?;
    Ok(text
        .lines()
        .filter(|l| l.starts_with("gpuledger_extender_requests_total{verb=\"preempt\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

/// The extender's filter of `p` on the node, as the scheduler sends it.
async fn filter(stack: &KubeStack, p: &Value) -> anyhow::Result<Value> {
    kit::caught_up(stack).await?;
    kit::extender(stack)?
        .post(
            "filter",
            &json!({"Pod": p, "Nodes": null, "NodeNames": [NODE]}),
        )
        .await
}

/// `big-low` evicted for `in-budget` (8000 MiB, priority 1000), asked by one filter of it (no
/// scheduler running): the nomination is live and the victim's slice released.
async fn nominated(stack: &KubeStack, preemptor: &Value) -> anyhow::Result<pb::Nominated> {
    stack.api.add_pod(preemptor.clone())?;
    let f = filter(stack, preemptor).await?;
    anyhow::ensure!(
        f["NodeNames"] == json!([]),
        "it fits before any eviction: {f}"
    );
    eventually(
        "big-low evicted and released",
        Duration::from_secs(20),
        || async {
            let (held, _) = ledger(stack, 0).await?;
            Ok(!exists(stack, "big-low") && !held.contains(&"big-low".to_string()))
        },
    )
    .await?;
    let (_, noms) = ledger(stack, 0).await?;
    noms.into_iter()
        .next()
        .context("no nomination after the eviction")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pod_whose_slice_frees_room_is_evicted_and_the_preemptor_binds_there()
-> anyhow::Result<()> {
    let stack = full_gpu(1, 60_000).await?;
    let sched = scheduler(&stack).await?;
    // 8000 MiB: 384 are free; evicting small-lowest frees 4000 (too little), big-low 12000.
    stack.api.add_pod(pod("in-budget", 8_000, 1_000, None))?;
    eventually("in-budget bound", Duration::from_secs(30), || async {
        Ok(bound_to(&stack, "in-budget").is_some())
    })
    .await
    .map_err(|e| {
        anyhow::anyhow!(
            "{e}; scheduler: {:?}",
            sched.stats.last_error.lock().unwrap()
        )
    })?;
    assert_eq!(bound_to(&stack, "in-budget").as_deref(), Some(NODE));
    assert!(!exists(&stack, "big-low"), "big-low was not evicted");
    assert!(
        exists(&stack, "small-lowest"),
        "small-lowest was evicted though its slice frees too little"
    );

    // The scheduler's own preemption found no victim and never called the verb.
    assert_eq!(
        sched
            .stats
            .preempt_calls
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    assert_eq!(preempt_verb_calls(&stack).await?, 0.0);
    assert!(sched.stats.preempted.lock().unwrap().is_empty());
    let tried = sched.stats.preemptions.lock().unwrap().clone();
    assert!(
        tried.iter().any(|(k, r)| k == "default/in-budget"
            && matches!(r, Preemption::NoCandidate(w)
                if w.iter().any(|(n, why)| n == NODE && why.contains("expected at least one victim pod")))),
        "{tried:?}"
    );

    // The ledger: the preemptor on the GPU big-low left, small-lowest still there; the
    // nomination (by the extender, naming its victim) ended with the reservation.
    eventually(
        "the ledger holds in-budget",
        Duration::from_secs(10),
        || async { Ok(ledger(&stack, 0).await?.0 == ["in-budget", "small-lowest"]) },
    )
    .await?;
    let l = stack.allocs.ledger(0).await?;
    let mine = l
        .allocs()
        .values()
        .find(|a| a.pod.name == "in-budget")
        .context("in-budget holds nothing")?;
    assert_eq!(mine.shares[0].gpu_uuid, UUID);
    assert!(l.nominations().is_empty());
    let log = stack.allocs.events(0).await?;
    let nom = log
        .iter()
        .find_map(|e| match &e.body {
            Some(pb::event::Body::Nominated(n)) => Some((n.clone(), e.actor.clone())),
            _ => None,
        })
        .context("no Nominated event")?;
    let victims: Vec<&str> = nom
        .0
        .victims
        .iter()
        .filter_map(|v| v.pod.as_ref())
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(victims, ["big-low"]);
    assert_eq!((nom.0.node.as_str(), nom.0.priority), (NODE, 1_000));
    assert_eq!(nom.1.map(|a| a.role).as_deref(), Some("extender"));
    assert!(log.iter().any(|e| matches!(&e.body,
        Some(pb::event::Body::NominationEnded(x)) if x.reason.starts_with("reserved on node gpu-0"))));

    // What users see.
    let preempted = events(&stack, "big-low", "Preempted");
    assert!(
        preempted
            .iter()
            .any(|m| m.contains("Preempted by default/in-budget on node gpu-0")),
        "{preempted:?}"
    );
    let preempting = events(&stack, "in-budget", "GpuPreempting");
    assert!(
        preempting
            .iter()
            .any(|m| m.contains("default/big-low (priority 20)") && m.contains(NODE)),
        "{preempting:?}"
    );
    assert!(events(&stack, "small-lowest", "Preempted").is_empty());
    drop(sched);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_freed_room_is_kept_from_a_lower_priority_pod_created_meanwhile() -> anyhow::Result<()>
{
    let stack = full_gpu(1, 60_000).await?;
    let pre = pod("in-budget", 8_000, 1_000, None);
    let n = nominated(&stack, &pre).await?;
    assert_eq!(n.node, NODE);
    // 12384 MiB are free now; a pod of lower priority that fits there is not offered it
    // (9000 MiB: beside the nominee's 8000 it would not fit even if small-lowest went).
    let later = pod("later", 9_000, 500, None);
    stack.api.add_pod(later.clone())?;
    let f = filter(&stack, &later).await?;
    assert_eq!(f["NodeNames"], json!([]), "{f}");
    let why = f["FailedNodes"][NODE].as_str().unwrap_or_default();
    assert!(why.contains("kept for default/in-budget"), "{why}");
    let refused = kit::reserve_admitted(
        &mut stack.allocs.extender(0)?,
        api::ReserveRequest {
            request: Some(kit::request(&later)?),
            node: NODE.into(),
            ttl_ms: 0,
        },
    )
    .await
    .expect_err("later reserved the kept room");
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    // The nominee's own filter says why it waits no more: the room is there for it.
    let f = filter(&stack, &pre).await?;
    assert_eq!(f["NodeNames"], json!([NODE]), "{f}");

    let sched = scheduler(&stack).await?;
    eventually("in-budget bound", Duration::from_secs(20), || async {
        Ok(bound_to(&stack, "in-budget").as_deref() == Some(NODE))
    })
    .await?;
    // `later` evicts nothing for itself: small-lowest, the only pod below it, frees too little.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(bound_to(&stack, "later"), None);
    assert!(exists(&stack, "small-lowest"));
    assert_eq!(ledger(&stack, 0).await?.0, ["in-budget", "small-lowest"]);
    drop(sched);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nomination_expires_and_the_room_is_offered_again() -> anyhow::Result<()> {
    let stack = full_gpu(1, 2_000).await?;
    let pre = pod("in-budget", 8_000, 1_000, None);
    nominated(&stack, &pre).await?;
    let later = pod("later", 9_000, 500, None);
    stack.api.add_pod(later.clone())?;
    assert_eq!(filter(&stack, &later).await?["NodeNames"], json!([]));
    // Nobody schedules in-budget: its nomination ends at the deadline.
    eventually(
        "the nomination expired",
        Duration::from_secs(10),
        || async { Ok(ledger(&stack, 0).await?.1.is_empty()) },
    )
    .await?;
    let log = stack.allocs.events(0).await?;
    let ended = log
        .iter()
        .find_map(|e| match &e.body {
            Some(pb::event::Body::NominationEnded(x)) => Some((x.reason.clone(), e.actor.clone())),
            _ => None,
        })
        .context("no NominationEnded")?;
    assert!(ended.0.starts_with("expired"), "{ended:?}");
    assert_eq!(ended.1.map(|a| a.role).as_deref(), Some("allocator"));
    assert_eq!(filter(&stack, &later).await?["NodeNames"], json!([NODE]));
    eventually("in-budget told", Duration::from_secs(5), || async {
        Ok(!events(&stack, "in-budget", "GpuNominationExpired").is_empty())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nomination_is_ledger_state_and_survives_a_leader_failover() -> anyhow::Result<()> {
    let mut stack = full_gpu(2, 60_000).await?;
    let pre = pod("in-budget", 8_000, 1_000, None);
    let n = nominated(&stack, &pre).await?;
    let old = stack.allocs.wait_leader(Duration::from_secs(10)).await?;
    stack.allocs.procs[old].kill();
    let new = stack
        .allocs
        .wait_leader_except(Duration::from_secs(20), Some(old))
        .await?;
    // The new leader folded the nomination from the log.
    let (_, noms) = ledger(&stack, new).await?;
    assert_eq!(noms, [n]);
    let later = pod("later", 9_000, 500, None);
    stack.api.add_pod(later.clone())?;
    let refused = kit::reserve_admitted(
        &mut stack.allocs.extender(new)?,
        api::ReserveRequest {
            request: Some(kit::request(&later)?),
            node: NODE.into(),
            ttl_ms: 0,
        },
    )
    .await
    .expect_err("the new leader gave the kept room away");
    assert!(
        refused.message().contains("kept for default/in-budget"),
        "{refused:?}"
    );
    let sched = scheduler(&stack).await?;
    eventually("in-budget bound", Duration::from_secs(30), || async {
        Ok(bound_to(&stack, "in-budget").as_deref() == Some(NODE))
    })
    .await?;
    assert_eq!(bound_to(&stack, "later"), None);
    drop(sched);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_preempting_pods_and_protected_victims_evict_nothing() -> anyhow::Result<()> {
    let stack = full_gpu(1, 60_000).await?;
    let sched = scheduler(&stack).await?;
    let mut never = pod("never", 8_000, 1_000, None);
    never["spec"]["preemptionPolicy"] = json!("Never");
    stack.api.add_pod(never.clone())?;
    eventually(
        "the scheduler tried never",
        Duration::from_secs(10),
        || async {
            Ok(sched
                .stats
                .preemptions
                .lock()
                .unwrap()
                .iter()
                .any(|(k, r)| k == "default/never" && *r == Preemption::NotEligible))
        },
    )
    .await?;
    // Asked directly, the allocator refuses too: the policy is the API server's word.
    let e = stack
        .allocs
        .extender(0)?
        .preempt(api::PreemptRequest {
            request: Some(kit::request(&never)?),
            nodes: vec![NODE.into()],
        })
        .await
        .expect_err("a Never pod preempted");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("preemptionPolicy Never"), "{e:?}");

    // big-low, the only pod whose slice would make room, is protected by a budget that
    // allows no disruption: an eager pod evicts nothing either.
    stack
        .api
        .store
        .create(
            "policy/v1",
            "poddisruptionbudgets",
            "default",
            json!({"metadata": {"name": "big"}, "spec": {"selector": {"matchLabels": {"app": "big-low"}}},
                   "status": {"disruptionsAllowed": 0}}),
        )
        .map_err(|e| anyhow::anyhow!("{}", e.message()))?;
    stack.api.add_pod(pod("eager", 8_000, 1_000, None))?;
    let r = stack
        .allocs
        .extender(0)?
        .preempt(api::PreemptRequest {
            request: Some(kit::request(&pod("eager", 8_000, 1_000, None))?),
            nodes: vec![NODE.into()],
        })
        .await?
        .into_inner();
    assert!(r.nomination.is_none(), "{r:?}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(exists(&stack, "big-low") && exists(&stack, "small-lowest"));
    assert_eq!(bound_to(&stack, "never"), None);
    assert_eq!(bound_to(&stack, "eager"), None);
    let (held, noms) = ledger(&stack, 0).await?;
    assert_eq!(held, ["big-low", "small-lowest"]);
    assert!(noms.is_empty(), "{noms:?}");
    drop(sched);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_extender_preempts_and_only_for_a_pending_gpuledger_pod() -> anyhow::Result<()> {
    let stack = full_gpu(1, 60_000).await?;
    let pre = pod("in-budget", 8_000, 1_000, None);
    let req = |p: &Value| -> anyhow::Result<api::PreemptRequest> {
        Ok(api::PreemptRequest {
            request: Some(kit::request(p)?),
            nodes: vec![NODE.into()],
        })
    };
    for (who, mut c) in [
        ("viewer", stack.allocs.viewer(0)?),
        ("admin", stack.allocs.admin(0)?),
        ("node agent", stack.allocs.node_agent(0, NODE)?),
    ] {
        let e = c.preempt(req(&pre)?).await.expect_err(who);
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{who}: {e:?}");
        assert!(e.message().contains("no-rule"), "{who}: {e:?}");
    }
    let mut ext = stack.allocs.extender(0)?;
    // Not in the API server.
    let e = ext
        .preempt(req(&pre)?)
        .await
        .expect_err("a pod nobody created");
    assert!(
        e.message().contains("extender-preempt-admissible-pod"),
        "{e:?}"
    );
    // Bound already (small-lowest, which exists).
    let e = ext
        .preempt(req(&pod("small-lowest", 4_000, 10, None))?)
        .await
        .expect_err("a bound pod");
    assert!(e.message().contains("bound to node"), "{e:?}");
    // Another scheduler's pod.
    let mut other = pre.clone();
    other["spec"]["schedulerName"] = json!("someone-else");
    stack.api.add_pod(other.clone())?;
    let e = ext
        .preempt(req(&other)?)
        .await
        .expect_err("another scheduler's pod");
    assert!(
        e.message()
            .contains("not scheduled by a gpuledger scheduler"),
        "{e:?}"
    );
    assert!(exists(&stack, "big-low") && exists(&stack, "small-lowest"));
    assert!(ledger(&stack, 0).await?.1.is_empty());
    Ok(())
}
