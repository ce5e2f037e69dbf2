//! The agent's ledger subscription survives losing the allocator replica it follows: it resumes
//! from its last seq at another replica (after a leader failover when it was the leader), and
//! new reservations keep reaching it.

use crate::support;

use std::time::Duration;

use support::{Cluster, alloc_of};

/// The agent's log without terminal colour codes.
fn plain_log(c: &Cluster) -> anyhow::Result<String> {
    let raw = std::fs::read_to_string(c.agent.proc.log_path())?;
    let mut out = String::with_capacity(raw.len());
    let mut in_escape = false;
    for ch in raw.chars() {
        match (in_escape, ch) {
            (false, '\u{1b}') => in_escape = true,
            (true, 'm') => in_escape = false,
            (true, _) => {}
            (false, ch) => out.push(ch),
        }
    }
    Ok(out)
}

/// Which allocator replica the agent's (only) subscription is with, from its log.
fn followed_replica(c: &Cluster) -> anyhow::Result<usize> {
    let log = plain_log(c)?;
    let subscribed: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("subscribed to the ledger"))
        .collect();
    anyhow::ensure!(subscribed.len() == 1, "one subscription expected:\n{log}");
    c.allocs
        .addrs
        .iter()
        .position(|a| subscribed[0].contains(&format!("replica={a}")))
        .ok_or_else(|| anyhow::anyhow!("no known replica in {:?}", subscribed[0]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscription_resumes_at_another_replica() -> anyhow::Result<()> {
    let mut c = Cluster::start_with(2, 1, &[]).await?;
    c.reserve("uid-a", 1_000, None).await?;
    c.kubelet.admit("default", "pod-uid-a", "main", 1).await?;
    // Take away the replica the agent follows (the first it reached; not always replica 0).
    let followed = followed_replica(&c)?;
    c.allocs.procs[followed].kill();
    c.allocs
        .wait_leader_except(Duration::from_secs(20), Some(followed))
        .await?;
    let b = c.reserve("uid-b", 1_000, None).await?;
    let got = c
        .kubelet
        .admit("default", "pod-uid-b", "main", 1)
        .await
        .map_err(|e| anyhow::anyhow!("{e:#}\n{}", c.agent_log()))?;
    assert_eq!(
        got.response.envs["GPULEDGER_ALLOCATION_ID"],
        b.id.to_string()
    );
    let s = c.dump().await?;
    assert_eq!(
        alloc_of(&s, "uid-b").map(|x| x.device_ids.clone()),
        Some(got.device_ids)
    );
    assert!(
        plain_log(&c)?.matches("subscribed to the ledger").count() >= 2,
        "the agent subscribed again"
    );
    Ok(())
}
