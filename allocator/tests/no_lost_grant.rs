//! Every reservation acked before a leader kill is in the ledger after failover; retrying it
//! returns the same grant; the replayed log equals every replica's live state.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpuledger_allocator::log::EtcdLog;
use gpuledger_auth::identity::Role;
use gpuledger_ledger::Ledger;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::workload::{inventory, pod, reserve_retry, reserve_retry_via};
use gpuledger_testkit::{Allocators, EtcdCluster};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acked_grants_survive_leader_kills_and_replay_equals_live() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(3).await?;
    let dir = tempfile::tempdir()?;
    // A small snapshot interval so snapshots may be written while leaders change.
    let mut allocs = Allocators::start(dir.path(), &etcd, 3, "nlg", &["--snapshot-every=50"])?;
    let leader = allocs.wait_leader(Duration::from_secs(20)).await?;
    for n in 0..4 {
        let node = format!("n{n}");
        allocs
            .node_agent(leader, &node)?
            .register_node(api::RegisterNodeRequest {
                inventory: Some(inventory(&node, 4, 80_000, "A100")),
            })
            .await?;
    }
    let acked: Arc<Mutex<BTreeMap<String, Vec<pb::Allocation>>>> = Arc::default();
    // Reserving as the extender does: through the one client, failing over between replicas.
    let clients = allocs.pool_as(&Role::Extender)?;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..8 {
        let (acked, clients, stop) = (acked.clone(), clients.clone(), stop.clone());
        workers.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let uid = format!("w{w}-{i}");
                let req = api::ReserveRequest {
                    request: Some(pod(&uid, 500, 1)),
                    node: format!("n{}", i % 4),
                    ttl_ms: 0,
                };
                if let Ok((r, _)) = reserve_retry_via(
                    &clients,
                    w + i,
                    req,
                    Instant::now() + Duration::from_secs(10),
                )
                .await
                {
                    acked.lock().expect("lock").insert(uid, r.allocations);
                }
                i += 1;
            }
        }));
    }
    // Two leader kills while the workers reserve.
    let mut killed = Vec::new();
    for _ in 0..2 {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let l = allocs.wait_leader(Duration::from_secs(15)).await?;
        allocs.procs[l].kill();
        killed.push(l);
        allocs
            .wait_leader_except(Duration::from_secs(15), Some(l))
            .await?;
        allocs.procs[l].start()?;
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in workers {
        w.await?;
    }
    let acked = acked.lock().expect("lock").clone();
    assert!(
        acked.len() > 50,
        "too few grants to mean anything: {}",
        acked.len()
    );
    let leader = allocs.wait_leader(Duration::from_secs(15)).await?;
    let head = allocs.status(leader).await.expect("leader").seq;
    allocs.wait_seq(head, Duration::from_secs(20)).await?;

    // Every acked grant is in the ledger, exactly as acked; a retry returns it unchanged.
    let dump = allocs
        .viewer(leader)?
        .dump(api::DumpRequest {})
        .await?
        .into_inner();
    let live =
        Ledger::from_snapshot(&dump.snapshot.expect("snapshot")).map_err(anyhow::Error::msg)?;
    for (uid, allocations) in &acked {
        for a in allocations {
            let got = live
                .alloc(a.id)
                .unwrap_or_else(|| panic!("acked allocation {} of {uid} lost", a.id));
            assert_eq!(&got.pod.uid, uid);
            assert_eq!(got.shares, a.shares);
        }
    }
    for (uid, allocations) in acked.iter().take(20) {
        let req = api::ReserveRequest {
            request: Some(pod(uid, 500, 1)),
            node: allocations[0].node.clone(),
            ttl_ms: 0,
        };
        let (r, _) =
            reserve_retry(&allocs, 0, req, Instant::now() + Duration::from_secs(10)).await?;
        assert!(!r.created, "retry of {uid} made a second grant");
        assert_eq!(
            r.allocations.iter().map(|a| a.id).collect::<Vec<_>>(),
            allocations.iter().map(|a| a.id).collect::<Vec<_>>()
        );
    }
    // One live allocation per pod container.
    let mut per_pod = BTreeMap::new();
    for a in live.allocs().values() {
        *per_pod
            .entry((a.pod.uid.clone(), a.container.clone()))
            .or_insert(0) += 1;
    }
    assert!(per_pod.values().all(|n| *n == 1));

    // Replay the log from empty: equal to every replica's state.
    let client = etcd.client().await?;
    let log = EtcdLog::new(&client, "nlg", Duration::from_secs(10));
    let (batches, _) = log.read(1, 0).await?;
    let mut replayed = Ledger::new();
    for b in &batches {
        replayed
            .apply_all(&b.events)
            .map_err(|e| anyhow::anyhow!("replay: {e}"))?;
    }
    replayed.check().map_err(anyhow::Error::msg)?;
    for i in 0..allocs.addrs.len() {
        let d = allocs
            .viewer(i)?
            .dump(api::DumpRequest {})
            .await?
            .into_inner();
        let l =
            Ledger::from_snapshot(&d.snapshot.expect("snapshot")).map_err(anyhow::Error::msg)?;
        assert_eq!(l.seq(), replayed.seq(), "replica {i} is at another seq");
        assert!(
            l.same_state(&replayed),
            "replica {i} differs from the replayed log"
        );
    }
    // Epochs only grow along the log, and the log has at least three of them.
    let epochs: Vec<u64> = batches.iter().map(|b| b.epoch).collect();
    assert!(epochs.windows(2).all(|w| w[0] <= w[1]));
    let mut distinct = epochs.clone();
    distinct.dedup();
    assert!(distinct.len() >= 3, "expected 3 epochs, got {distinct:?}");
    Ok(())
}
