//! The agent's ledger subscription survives losing the allocator replica it follows: it resumes
//! from its last seq at another replica (after a leader failover when it was the leader), and
//! new reservations keep reaching it.

mod support;

use std::time::Duration;

use support::{Cluster, alloc_of};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscription_resumes_at_another_replica() -> anyhow::Result<()> {
    let mut c = Cluster::start_with(2, 1, &[]).await?;
    c.reserve("uid-a", 1_000, None).await?;
    c.kubelet.admit("default", "pod-uid-a", "main", 1).await?;
    // The agent follows replica 0 first; take it away.
    c.allocs.procs[0].kill();
    c.allocs
        .wait_leader_except(Duration::from_secs(20), Some(0))
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
        std::fs::read_to_string(c.agent.proc.log_path())?
            .matches("subscribed to the ledger")
            .count()
            >= 2,
        "the agent subscribed again"
    );
    Ok(())
}
