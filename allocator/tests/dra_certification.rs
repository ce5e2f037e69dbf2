//! DRA claims certified by the ledger (docs/dra.md): the scheduler's allocation of a share of
//! one of our devices gets `gpuledger.io/Granted` only once the ledger committed its grant,
//! also across a leader killed in between (never granted twice); an allocation that over-commits
//! the GPU or under-declares its share gets `gpuledger.io/Refused` with a readable reason and no
//! grant; a deallocated claim's grant is released, and a claim deleted while no allocator ran is
//! released at the next election (one deleted while it runs, at once); a Granted the ledger did
//! not write is rewritten to the ledger's decision; one deleted while its grant is in flight
//! is released at once, not at the next pass. Real etcd, the real allocator binary, the fake
//! API server.

use std::time::Duration;

use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::kube::store::ApiError;
use gpuledger_testkit::kube::{KubeStack, StackOptions};
use gpuledger_testkit::workload::inventory;
use k8s_openapi::serde_json::json;
use nix::sys::signal::Signal;

/// Poll `f` every 50 ms until it finds something; that, or an error naming `what`.
async fn poll<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Option<T>>>,
{
    let t0 = std::time::Instant::now();
    while t0.elapsed() < timeout {
        if let Some(v) = f().await? {
            return Ok(v);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("{what}: not within {timeout:?}")
}

const GV: &str = "resource.k8s.io/v1";
const NS: &str = "default";
const DRIVER: &str = "gpu.gpuledger.io";
const GRANTED: &str = "gpuledger.io/Granted";
const REFUSED: &str = "gpuledger.io/Refused";

/// The end of every allocator's log, for a failure's message.
fn logs(stack: &KubeStack) -> String {
    stack
        .allocs
        .procs
        .iter()
        .map(|p| format!("--- {}:\n{}", p.name, p.log_tail(30)))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `allocators` allocators watching claims, their full pass every `pass_s` seconds.
async fn claim_stack(allocators: usize, pass_s: u64) -> anyhow::Result<KubeStack> {
    KubeStack::start(StackOptions {
        allocators,
        allocator_flags: vec![
            "--claim-watch".into(),
            format!("--claim-reconcile-interval={pass_s}"),
        ],
        ..Default::default()
    })
    .await
}

/// Register `node` as a DRA node with one 16000 MiB GPU (`GPU-<node>-0`, device `gpu-<node>-0`).
async fn dra_node(stack: &KubeStack, node: &str) -> anyhow::Result<()> {
    let mut inv = inventory(node, 1, 16_000, "A100");
    inv.mode = pb::NodeMode::Dra as i32;
    stack
        .allocs
        .node_agent(0, node)?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inv),
        })
        .await?;
    Ok(())
}

/// Create claim `name` asking `mem` MiB and `cores` thousandths in request c0, then allocate
/// it as the scheduler does (one UpdateStatus): share `share` of `node`'s GPU, declaring
/// `consumed` (MiB, cores), reserved for pod `<name>-pod`. Its uid.
fn allocated_claim(
    stack: &KubeStack,
    name: &str,
    asked: (u64, u64),
    node: &str,
    share: &str,
    consumed: (u64, u64),
) -> anyhow::Result<String> {
    allocated_claim_marked(stack, name, asked, node, share, consumed, None)
}

/// [`allocated_claim`], its result's `status.devices` entry carrying `Granted=True` with
/// `message` in the same write, as a forger with status rights would (or one from before the
/// allocation changed).
fn allocated_claim_marked(
    stack: &KubeStack,
    name: &str,
    (mem, cores): (u64, u64),
    node: &str,
    share: &str,
    consumed: (u64, u64),
    granted: Option<&str>,
) -> anyhow::Result<String> {
    let store = &stack.api.store;
    let made = store
        .create(
            GV,
            "resourceclaims",
            NS,
            json!({"apiVersion": GV, "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": NS},
                "spec": {"devices": {"requests": [{"name": "c0", "exactly": {
                    "deviceClassName": DRIVER,
                    "capacity": {"requests": {"memory": format!("{mem}Mi"), "cores": cores.to_string()}}}}]}}}),
        )
        .map_err(|e| anyhow::anyhow!("{}", e.message()))?;
    let uid = made["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    store
        .update(GV, "resourceclaims", NS, name, |o| {
            o["status"] = json!({
                "allocation": {
                    "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                        {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
                    "devices": {"results": [{
                        "request": "c0", "driver": DRIVER, "pool": node,
                        "device": format!("gpu-{node}-0"), "shareID": share,
                        "consumedCapacity": {"memory": format!("{}Mi", consumed.0), "cores": consumed.1.to_string()},
                        "bindingConditions": [GRANTED], "bindingFailureConditions": [REFUSED]}]}},
                "reservedFor": [{"resource": "pods", "name": format!("{name}-pod"), "uid": format!("{name}-pod-uid")}],
            });
            if let Some(message) = granted {
                o["status"]["devices"] = json!([{
                    "driver": DRIVER, "pool": node, "device": format!("gpu-{node}-0"), "shareID": share,
                    "conditions": [{"type": GRANTED, "status": "True", "observedGeneration": 1,
                        "lastTransitionTime": "2026-01-01T00:00:00Z", "reason": "LedgerGrant",
                        "message": message}]}]);
            }
            Ok(())
        })
        .map_err(|e| anyhow::anyhow!("{}", e.message()))?;
    Ok(uid)
}

/// The gpuledger condition on claim `name` (type, reason, message), if any.
fn condition(stack: &KubeStack, name: &str) -> Option<(String, String, String)> {
    let c = stack.api.store.get(GV, "resourceclaims", NS, name).ok()?;
    let entry = c
        .pointer("/status/devices")?
        .as_array()?
        .iter()
        .find(|e| e["driver"] == DRIVER)?
        .clone();
    let cond = entry["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["status"] == "True")?
        .clone();
    let s = |k: &str| cond[k].as_str().unwrap_or_default().to_owned();
    Some((s("type"), s("reason"), s("message")))
}

/// Every condition with status True on claim `name`'s gpuledger entry: (type, reason, message).
fn true_conditions(stack: &KubeStack, name: &str) -> Vec<(String, String, String)> {
    let Ok(c) = stack.api.store.get(GV, "resourceclaims", NS, name) else {
        return Vec::new();
    };
    let conds = c
        .pointer("/status/devices")
        .and_then(|d| d.as_array())
        .and_then(|d| d.iter().find(|e| e["driver"] == DRIVER))
        .and_then(|e| e["conditions"].as_array())
        .cloned()
        .unwrap_or_default();
    let s =
        |c: &k8s_openapi::serde_json::Value, k: &str| c[k].as_str().unwrap_or_default().to_owned();
    conds
        .iter()
        .filter(|c| c["status"] == "True")
        .map(|c| (s(c, "type"), s(c, "reason"), s(c, "message")))
        .collect()
}

/// Wait until claim `name`'s True conditions satisfy `ok` (`what` names it); them.
async fn wait_true(
    stack: &KubeStack,
    name: &str,
    what: &str,
    ok: impl Fn(&[(String, String, String)]) -> bool,
) -> anyhow::Result<Vec<(String, String, String)>> {
    poll(what, Duration::from_secs(20), || async {
        let t = true_conditions(stack, name);
        Ok(ok(&t).then_some(t))
    })
    .await
    .map_err(|e| {
        e.context(format!(
            "conditions: {:?}\n{}",
            true_conditions(stack, name),
            logs(stack)
        ))
    })
}

async fn wait_condition(stack: &KubeStack, name: &str) -> anyhow::Result<(String, String, String)> {
    poll(
        &format!("a gpuledger condition on claim {name}"),
        Duration::from_secs(20),
        || async { Ok(condition(stack, name)) },
    )
    .await
    .map_err(|e| e.context(logs(stack)))
}

/// The claim grant and refusal events of the log, as replica `i` reads it.
async fn claim_events(stack: &KubeStack, i: usize) -> anyhow::Result<Vec<pb::event::Body>> {
    Ok(stack
        .allocs
        .events(i)
        .await?
        .into_iter()
        .filter_map(|e| e.body)
        .filter(|b| {
            matches!(
                b,
                pb::event::Body::ClaimGranted(_)
                    | pb::event::Body::ClaimRefused(_)
                    | pb::event::Body::Released(_)
            )
        })
        .collect())
}

fn grants_of(events: &[pb::event::Body], uid: &str) -> Vec<pb::ClaimGranted> {
    events
        .iter()
        .filter_map(|b| match b {
            pb::event::Body::ClaimGranted(g) if g.claim.as_ref().is_some_and(|c| c.uid == uid) => {
                Some(g.clone())
            }
            _ => None,
        })
        .collect()
}

fn released(events: &[pb::event::Body], id: u64) -> Option<String> {
    events.iter().find_map(|b| match b {
        pb::event::Body::Released(r) if r.allocation_id == id => Some(r.reason.clone()),
        _ => None,
    })
}

/// The seq of ClaimGranted for `uid` in the log (its allocation id).
async fn grant_seq(stack: &KubeStack, i: usize, uid: &str) -> anyhow::Result<Option<u64>> {
    for e in stack.allocs.events(i).await? {
        if let Some(pb::event::Body::ClaimGranted(g)) = &e.body
            && g.claim.as_ref().is_some_and(|c| c.uid == uid)
        {
            return Ok(Some(e.seq));
        }
    }
    Ok(None)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_are_granted_before_their_condition_and_over_commits_refused() -> anyhow::Result<()>
{
    let mut stack = claim_stack(2, 1).await?;
    dra_node(&stack, "n1").await?;

    // The API server takes no status write: the leader commits the grant, cannot mark it.
    stack
        .api
        .store
        .fail_writes("resource.k8s.io", "resourceclaims/status");
    let leader = stack.allocs.wait_leader(Duration::from_secs(20)).await?;
    let a = allocated_claim(&stack, "a", (8_000, 300), "n1", "share-a", (8_000, 300))?;
    let seq_a = poll("claim a's grant committed", Duration::from_secs(20), || {
        grant_seq(&stack, leader, &a)
    })
    .await
    .map_err(|e| e.context(logs(&stack)))?;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        condition(&stack, "a"),
        None,
        "no condition while writes fail"
    );

    // The leader dies between the grant and its condition; the next one certifies claim a
    // from the grant it finds, without granting again.
    stack.allocs.procs[leader].kill();
    stack.api.store.heal_writes();
    let leader = stack
        .allocs
        .wait_leader_except(Duration::from_secs(30), Some(leader))
        .await?;
    let (kind, reason, message) = wait_condition(&stack, "a").await?;
    assert_eq!((kind.as_str(), reason.as_str()), (GRANTED, "LedgerGrant"));
    assert!(
        message.contains(&format!("allocation {seq_a} (seq {seq_a}")),
        "the condition names the grant committed before the failover: {message}"
    );
    let events = claim_events(&stack, leader).await?;
    let grants = grants_of(&events, &a);
    assert_eq!(grants.len(), 1, "claim a granted once: {grants:?}");
    let consumers: Vec<&str> = grants[0].consumers.iter().map(|p| p.uid.as_str()).collect();
    assert_eq!(consumers, ["a-pod-uid"], "the claim's reservedFor");

    // A second pod shares claim a (the scheduler adds it to reservedFor): the grant's
    // consumers follow, so the node agent charges that pod's processes to the grant.
    stack
        .api
        .store
        .update(GV, "resourceclaims", NS, "a", |o| {
            o["status"]["reservedFor"]
                .as_array_mut()
                .ok_or_else(|| ApiError::new(500, "InternalError", "no reservedFor"))?
                .push(json!({"resource": "pods", "name": "a-pod-2", "uid": "a-pod-2-uid"}));
            Ok(())
        })
        .map_err(|e| anyhow::anyhow!("{}", e.message()))?;
    let consumers_of_a = || async {
        let l = stack.allocs.ledger(leader).await?;
        Ok::<_, anyhow::Error>(
            l.allocs_of_pod(&a)
                .first()
                .and_then(|x| x.claim.as_ref())
                .map(|c| {
                    c.consumers
                        .iter()
                        .map(|p| p.uid.clone())
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default(),
        )
    };
    poll(
        "claim a's grant names both pods",
        Duration::from_secs(20),
        || async {
            let c = consumers_of_a().await?;
            Ok((c == ["a-pod-uid", "a-pod-2-uid"]).then_some(()))
        },
    )
    .await
    .map_err(|e| e.context(logs(&stack)))?;

    // Two more 8000 MiB shares of the same 16000 MiB GPU, as a scheduler that over-counts
    // would write them: the first fits, the second is refused.
    let b = allocated_claim(&stack, "b", (8_000, 300), "n1", "share-b", (8_000, 300))?;
    let (kind, _, _) = wait_condition(&stack, "b").await?;
    assert_eq!(kind, GRANTED);
    let c = allocated_claim(&stack, "c", (8_000, 300), "n1", "share-c", (8_000, 300))?;
    let (kind, reason, message) = wait_condition(&stack, "c").await?;
    assert_eq!(
        (kind.as_str(), reason.as_str()),
        (REFUSED, "LedgerNoCapacity")
    );
    assert!(
        message.contains("GPU-n1-0 has 0 MiB") && message.contains("request c0"),
        "a readable refusal: {message}"
    );
    // A share declared smaller than the request consumes.
    allocated_claim(&stack, "d", (4_000, 300), "n1", "share-d", (1_000, 300))?;
    let (kind, reason, message) = wait_condition(&stack, "d").await?;
    assert_eq!(
        (kind.as_str(), reason.as_str()),
        (REFUSED, "LedgerShareMismatch")
    );
    assert!(message.contains("memory=4000Mi"), "{message}");

    let l = stack.allocs.ledger(leader).await?;
    let gpu = &l.node("n1").expect("n1").gpus[0];
    assert_eq!(gpu.mem_used, 16_000, "a and b hold the GPU");
    assert!(gpu.mem_used <= gpu.memory_mib, "no over-commit");
    assert!(
        l.allocs_of_pod(&c).is_empty(),
        "no grant for the refused claim"
    );
    let events = claim_events(&stack, leader).await?;
    assert!(events.iter().any(|b| matches!(b,
        pb::event::Body::ClaimRefused(r) if r.claim.as_ref().is_some_and(|x| x.uid == c))));

    // The scheduler clears b's allocation: its grant is released.
    let b_id = grants_of(&events, &b)[0].allocation_id;
    stack
        .api
        .store
        .update(GV, "resourceclaims", NS, "b", |o| {
            o["status"] = json!({});
            Ok(())
        })
        .map_err(|e| anyhow::anyhow!("{}", e.message()))?;
    let why = poll(
        "claim b's grant released",
        Duration::from_secs(10),
        || async { Ok(released(&claim_events(&stack, leader).await?, b_id)) },
    )
    .await?;
    assert_eq!(why, "claim-deallocated");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_deleted_while_no_allocator_runs_is_released_at_the_next_election()
-> anyhow::Result<()> {
    // Passes only at elections: the release below can come from nothing else.
    let mut stack = claim_stack(1, 3600).await?;
    dra_node(&stack, "n1").await?;
    let e = allocated_claim(&stack, "e", (2_000, 100), "n1", "share-e", (2_000, 100))?;
    let (kind, _, _) = wait_condition(&stack, "e").await?;
    assert_eq!(kind, GRANTED);
    let id = grants_of(&claim_events(&stack, 0).await?, &e)[0].allocation_id;

    // Deleted while the allocator watches: the watch releases it (no pass comes for an hour).
    let f = allocated_claim(&stack, "f", (2_000, 100), "n1", "share-f", (2_000, 100))?;
    wait_condition(&stack, "f").await?;
    let f_id = grants_of(&claim_events(&stack, 0).await?, &f)[0].allocation_id;
    stack
        .api
        .store
        .delete(GV, "resourceclaims", NS, "f")
        .map_err(|e| anyhow::anyhow!("{}", e.message()))?;
    let why = poll(
        "claim f's grant released",
        Duration::from_secs(10),
        || async { Ok(released(&claim_events(&stack, 0).await?, f_id)) },
    )
    .await?;
    assert_eq!(why, "claim-deleted");

    stack.allocs.procs[0].kill();
    stack
        .api
        .store
        .delete(GV, "resourceclaims", NS, "e")
        .map_err(|e| anyhow::anyhow!("{}", e.message()))?;
    stack.allocs.procs[0].start()?;
    stack.allocs.wait_leader(Duration::from_secs(30)).await?;
    let why = poll(
        "claim e's grant released",
        Duration::from_secs(15),
        || async { Ok(released(&claim_events(&stack, 0).await?, id)) },
    )
    .await?;
    assert_eq!(why, "claim-deleted");
    let l = stack.allocs.ledger(0).await?;
    assert!(l.allocs_of_pod(&e).is_empty());
    assert_eq!(l.node("n1").expect("n1").gpus[0].mem_used, 0);
    Ok(())
}

/// Regression: a `Granted=True` the allocator did not write stayed. Under-declared, the ledger
/// refused the result but the claim kept saying granted; with the right share, the allocator
/// granted it but left a message naming an allocation that does not exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_granted_condition_the_ledger_did_not_write_is_rewritten() -> anyhow::Result<()> {
    // No pass for an hour: the claims' own watch events must put it right.
    let stack = claim_stack(1, 3600).await?;
    dra_node(&stack, "n1").await?;
    stack.allocs.wait_leader(Duration::from_secs(20)).await?;
    let forged = "granted by the GPU ledger as allocation 999 (seq 999, epoch 1): 1000 MiB and \
                  300/1000 of GPU GPU-n1-0 on node n1";

    // Under-declared (asks 4000 MiB, declares 1000) and marked Granted: Refused, not Granted.
    let u = allocated_claim_marked(
        &stack,
        "u",
        (4_000, 300),
        "n1",
        "share-u",
        (1_000, 300),
        Some(forged),
    )?;
    let refused = wait_true(&stack, "u", "claim u marked Refused", |t| {
        t.iter().any(|(k, _, _)| k == REFUSED)
    })
    .await?;
    assert_eq!(
        refused.len(),
        1,
        "only the ledger's decision stands: {refused:?}"
    );
    assert_eq!(refused[0].1, "LedgerShareMismatch");
    assert!(stack.allocs.ledger(0).await?.allocs_of_pod(&u).is_empty());

    // The right share, marked Granted with another allocation's text: granted, and the
    // condition names the grant the ledger committed.
    let g = allocated_claim_marked(
        &stack,
        "g",
        (4_000, 300),
        "n1",
        "share-g",
        (4_000, 300),
        Some(forged),
    )?;
    let seq = poll("claim g's grant committed", Duration::from_secs(20), || {
        grant_seq(&stack, 0, &g)
    })
    .await
    .map_err(|e| e.context(logs(&stack)))?;
    let named = format!("allocation {seq} (seq {seq}");
    let conds = wait_true(&stack, "g", "claim g's condition names its grant", |t| {
        t.iter().any(|(_, _, m)| m.contains(&named))
    })
    .await?;
    assert_eq!(conds.len(), 1, "{conds:?}");
    assert_eq!(
        (conds[0].0.as_str(), conds[0].1.as_str()),
        (GRANTED, "LedgerGrant")
    );
    Ok(())
}

/// Regression: a claim's change and its deletion were different keys of the certification
/// queue, so the deletion's release could run beside the certification, before its grant
/// committed, and the grant held the room until the next full pass (here an hour away).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_deleted_while_its_grant_is_in_flight_is_released_at_once() -> anyhow::Result<()> {
    let mut stack = claim_stack(1, 3600).await?;
    dra_node(&stack, "n1").await?;
    stack.allocs.wait_leader(Duration::from_secs(20)).await?;

    // etcd stops answering (for less than the lease): claim i's grant waits in flight while
    // the claim is deleted and the deletion handed to the workers.
    let signal = |s: &mut KubeStack, sig| -> anyhow::Result<()> {
        s.etcd()
            .member(0)
            .ok_or_else(|| anyhow::anyhow!("no etcd member"))?
            .signal(sig)
    };
    signal(&mut stack, Signal::SIGSTOP)?;
    let made = allocated_claim(&stack, "i", (2_000, 100), "n1", "share-i", (2_000, 100));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let deleted = stack.api.store.delete(GV, "resourceclaims", NS, "i");
    tokio::time::sleep(Duration::from_millis(300)).await;
    signal(&mut stack, Signal::SIGCONT)?;
    let i = made?;
    deleted.map_err(|e| anyhow::anyhow!("{}", e.message()))?;

    // The race happened: the grant committed after the deletion.
    let id = poll("claim i's grant committed", Duration::from_secs(20), || {
        grant_seq(&stack, 0, &i)
    })
    .await
    .map_err(|e| e.context(logs(&stack)))?;
    let why = poll(
        "claim i's grant released at once, not at the next pass",
        Duration::from_secs(10),
        || async { Ok(released(&claim_events(&stack, 0).await?, id)) },
    )
    .await
    .map_err(|e| e.context(logs(&stack)))?;
    assert_eq!(why, "claim-deleted");
    let l = stack.allocs.ledger(0).await?;
    assert_eq!(l.node("n1").expect("n1").gpus[0].mem_used, 0);
    Ok(())
}
