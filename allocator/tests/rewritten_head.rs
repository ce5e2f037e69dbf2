//! Regression (issue 28): a replica elected over a `head` that does not match the log's last
//! batch (the store was changed) refuses to lead, rightly, but stepped down without a log line
//! or a count and campaigned again 100 ms later: about 150 elections in 30 s. Now each refusal
//! is logged and counted (`chain_breaks`, `failed_takeovers`) and the replica waits longer
//! before each new campaign.

use std::time::Duration;

use gpuledger_allocator::log::EtcdLog;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::workload::{inventory, pod};
use gpuledger_testkit::{Allocators, EtcdCluster};
use prost::Message;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewritten_head_is_logged_counted_and_backed_off() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let mut allocs = Allocators::start(dir.path(), &etcd, 1, "storm", &[])?;
    let leader = allocs.wait_leader(Duration::from_secs(20)).await?;
    allocs
        .node_agent(leader, "n1")?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("n1", 2, 16_000, "T4")),
        })
        .await?;

    // Someone with etcd's credentials rewrites head's hash.
    let client = etcd.client().await?;
    let log = EtcdLog::new(&client, "storm", Duration::from_secs(2));
    let mut kv = client.kv_client();
    let got = kv.get(log.head_key(), None).await?;
    let mut head = pb::Head::decode(got.kvs().first().map_or(&[][..], |k| k.value()))?;
    anyhow::ensure!(!head.hash.is_empty(), "head carries no hash");
    head.hash[0] ^= 0xff;
    kv.put(log.head_key(), head.encode_to_vec(), None).await?;
    // The leader's next write is fenced (head moved), it steps down, and every takeover after
    // meets the rewritten head.
    let _ = allocs
        .extender(leader)?
        .reserve(api::ReserveRequest {
            request: Some(pod("p1", 1_000, 0)),
            node: "n1".into(),
            ttl_ms: 0,
        })
        .await;
    tokio::time::sleep(Duration::from_secs(10)).await;

    let (_, metrics) =
        gpuledger_testkit::http::get(&format!("http://{}/metrics", allocs.http[leader])).await?;
    let count = |name: &str| gpuledger_testkit::promtext::total(&metrics, name);
    let failed = count("gpuledger_allocator_failed_takeovers_total");
    assert!(
        (2.0..=8.0).contains(&failed),
        "{failed} failed takeovers in 10 s (backing off from 200 ms to 30 s allows about 6)"
    );
    assert!(count("gpuledger_allocator_chain_breaks_total") >= failed);
    let log_text = std::fs::read_to_string(allocs.procs[leader].log_path())?;
    assert!(
        log_text.contains("elected but could not take over")
            && log_text.contains("head records hash"),
        "the refusal is not logged:\n{log_text}"
    );
    assert!(
        allocs.procs[leader].exited().is_none(),
        "the allocator exited"
    );
    Ok(())
}
