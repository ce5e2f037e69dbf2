//! The demo's faults: the allocator leader and a node agent SIGKILLed midway, each measured
//! until the cluster serves again and checked for what it must not lose.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use anyhow::Result;
use gpuledger_testkit::cluster::{LocalCluster, RunOutcome};
use indicatif::ProgressBar;

/// One fault and how the cluster came back from it.
pub(super) struct Failover {
    /// What was killed.
    pub what: String,
    /// How long the cluster took to recover, in words.
    pub detail: String,
}

/// SIGKILL the allocator leader; measure until a new leader is elected and until a bind sent
/// after the kill succeeds; restart the old one.
pub(super) async fn kill_leader(c: &mut LocalCluster, leader: usize) -> Result<Failover> {
    let kill_at = Instant::now();
    c.allocs.procs[leader].kill();
    let new = c
        .allocs
        .wait_leader_except(Duration::from_secs(30), Some(leader))
        .await?;
    let elected_ms = kill_at.elapsed().as_millis();
    let wait_until = Instant::now() + Duration::from_secs(30);
    let mut flowed = None;
    while Instant::now() < wait_until {
        let binds = c
            .scheduler
            .stats
            .binds
            .lock()
            .map(|b| b.clone())
            .unwrap_or_default();
        if let Some(d) = binds
            .iter()
            .filter(|(sent, _)| *sent >= kill_at)
            .map(|(_, done)| done.saturating_duration_since(kill_at))
            .min()
        {
            flowed = Some(d);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    c.allocs.procs[leader].start()?;
    let detail = match flowed {
        Some(d) => format!(
            "alloc{leader} killed -> alloc{new} seen leading after {elected_ms} ms; binds flowed again after {} ms (alloc{leader} restarted as a follower)",
            d.as_millis()
        ),
        None => format!(
            "alloc{leader} killed -> alloc{new} seen leading after {elected_ms} ms; no bind was attempted in the next 30 s"
        ),
    };
    Ok(Failover {
        what: "allocator leader".into(),
        detail,
    })
}

/// SIGKILL the node agent of the busiest node, restart it, and check that the pods running
/// there kept their allocation (same id in the ledger, same node) and that the agent's view
/// equals the ledger again.
pub(super) async fn kill_agent(
    c: &mut LocalCluster,
    bar: &ProgressBar,
) -> Result<(Failover, String)> {
    let running = c.runs.running();
    let mut per_node: BTreeMap<String, usize> = BTreeMap::new();
    for r in &running {
        *per_node.entry(r.node.clone()).or_default() += 1;
    }
    let i = c
        .nodes
        .iter()
        .enumerate()
        .max_by_key(|(_, n)| per_node.get(&n.name).copied().unwrap_or(0))
        .map_or(0, |(i, _)| i);
    let name = c.nodes[i].name.clone();
    let before: Vec<_> = running.into_iter().filter(|r| r.node == name).collect();
    bar.println(format!(
        "SIGKILL node agent of {name} ({} pods running there), restart after 1 s",
        before.len()
    ));
    let back_ms = c
        .restart_agent(i, Duration::from_secs(1))
        .await?
        .as_millis();
    // The pods that were running: still running with the same allocation, or ended normally.
    let snap = c.dump().await?;
    let now: HashMap<(String, String), _> = c
        .runs
        .all()
        .into_iter()
        .map(|r| ((r.namespace.clone(), r.name.clone()), r))
        .collect();
    let (mut kept, mut ended, mut lost) = (0, 0, Vec::new());
    for b in &before {
        let r = now.get(&(b.namespace.clone(), b.name.clone()));
        if r.is_some_and(|r| r.outcome != RunOutcome::Running) {
            ended += 1;
            continue;
        }
        let held = snap.allocations.iter().any(|x| {
            x.node == name
                && x.pod
                    .as_ref()
                    .is_some_and(|p| p.name == b.name && p.namespace == b.namespace)
                && Some(x.id) == b.allocation_id
        });
        if held {
            kept += 1;
        } else {
            lost.push(b.name.clone());
        }
    }
    let view = c
        .check_agent_views(Duration::from_secs(10))
        .await
        .into_iter()
        .find(|v| v.node == name);
    let view_s = match view {
        Some(v) if v.agree => "its view equals the ledger".to_string(),
        Some(v) => format!("its view DIFFERS from the ledger: {}", v.detail),
        None => "no view".into(),
    };
    let check = if lost.is_empty() {
        format!(
            "{name}: {kept} pods kept running on their GPUs across the agent restart ({ended} ended normally meanwhile); {view_s}"
        )
    } else {
        format!("{name}: pods LOST their allocation across the agent restart: {lost:?}; {view_s}")
    };
    Ok((
        Failover {
            what: "node agent".into(),
            detail: format!(
                "agent on {name} killed -> restarted, re-registered with the kubelet and ready after {back_ms} ms"
            ),
        },
        check,
    ))
}
