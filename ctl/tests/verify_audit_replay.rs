//! `gpuledger verify`, `audit`, `replay` and `inspect` against a live allocator on real etcd;
//! verify passes on an honest ledger and fails on a hand-corrupted log.

use std::process::Command;
use std::time::Duration;

use gpuledger_allocator::log::EtcdLog;
use gpuledger_auth::identity::Role;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::pki::credential_flags;
use gpuledger_testkit::workload::{inventory, pod};
use gpuledger_testkit::{Allocators, EtcdCluster};
use prost::Message;

use crate::kit;
use kit::ctl;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_audit_replay_inspect_and_a_corrupted_log() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = Allocators::start(dir.path(), &etcd, 2, "ctl", &[])?;
    let leader = allocs.wait_leader(Duration::from_secs(20)).await?;
    allocs
        .node_agent(leader, "node-a")?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("node-a", 2, 16_000, "NVIDIA A100")),
        })
        .await?;
    let mut c = allocs.extender(leader)?;
    for (uid, mem) in [("u1", 4_000), ("u2", 6_000), ("u3", 2_000)] {
        let req = api::ReserveRequest {
            request: Some(pod(uid, mem, 20)),
            node: "node-a".into(),
            ttl_ms: 0,
        };
        // u3 through the follower: the leader records the original caller, not the replica
        // that forwarded it.
        let mut via = if uid == "u3" {
            allocs.extender(1 - leader)?
        } else {
            c.clone()
        };
        via.reserve(req).await?;
    }
    c.confirm_bound(api::ConfirmBoundRequest {
        pod_uid: "u2".into(),
        node: "node-a".into(),
    })
    .await?;
    let mid_seq = allocs.status(leader).await.expect("leader").seq;
    c.release(api::ReleaseRequest {
        pod_uid: "u1".into(),
        reason: "pod deleted".into(),
        ..Default::default()
    })
    .await?;
    let head = allocs.status(leader).await.expect("leader").seq;
    allocs.wait_seq(head, Duration::from_secs(10)).await?;
    let target = format!("--allocator={}", allocs.addrs.join(","));
    let who = credential_flags(&allocs.ids.credentials(&Role::Viewer)?);

    let (ok, out) = ctl(&who, &["verify", &target]);
    assert!(ok, "verify of an honest ledger failed:\n{out}");
    assert!(out.contains("verify: OK"), "{out}");
    assert!(out.contains("compared 2 replica(s)"), "{out}");

    let (ok, out) = ctl(&who, &["audit", &target, "--pod", "default/pod-u1"]);
    assert!(ok, "{out}");
    assert!(
        out.contains("reserved for default/pod-u1:main on node-a"),
        "{out}"
    );
    assert!(out.contains("released (pod deleted)"), "{out}");
    assert!(!out.contains("pod-u2"), "audit shows only that pod:\n{out}");
    assert!(out.contains("ACTOR"), "{out}");
    for pod in ["pod-u1", "pod-u3"] {
        let (ok, out) = ctl(
            &who,
            &["audit", &target, "--pod", &format!("default/{pod}")],
        );
        assert!(ok, "{out}");
        let line = out
            .lines()
            .find(|l| l.contains("reserved for"))
            .unwrap_or_default();
        assert!(
            line.contains(" extender ") && !line.contains(" allocator "),
            "the reservation of {pod} names the extender as its actor:\n{out}"
        );
    }
    // At debug, the log read is a span, and its end names the seq it reached.
    let out = Command::new(env!("CARGO_BIN_EXE_gpuledger"))
        .args(["audit", &target, "--pod", "default/pod-u1"])
        .args(&who)
        .env("GPULEDGER_LOG", "gpuledger=debug")
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "read_log{{from_seq=1 to_seq=0}}: read to the end of the log seq={head}"
        )),
        "{err}"
    );

    // The state before the release has 3 allocations; at the end, 2.
    let (ok, out) = ctl(&who, &["replay", &target, "--at", &mid_seq.to_string()]);
    assert!(ok, "{out}");
    assert!(out.contains("allocations=3"), "{out}");
    let (ok, out) = ctl(&who, &["inspect", &target, "--details"]);
    assert!(ok, "{out}");
    assert!(out.contains("allocations=2"), "{out}");
    assert!(out.contains("default/pod-u2:main"), "{out}");
    assert!(
        out.contains("8000/16000") || out.contains("6000/16000"),
        "{out}"
    );

    // Corrupt the log by hand: the batch holding u2's reservation now says 16000 MiB.
    let client = etcd.client().await?;
    let log = EtcdLog::new(&client, "ctl", Duration::from_secs(5));
    let (batches, _) = log.read(1, 0).await?;
    let mut victim = batches
        .into_iter()
        .find(|b| {
            b.events.iter().any(|e| {
                matches!(&e.body, Some(pb::event::Body::Reserved(r))
                if r.pod.as_ref().is_some_and(|p| p.uid == "u2"))
            })
        })
        .expect("u2's batch");
    for e in &mut victim.events {
        if let Some(pb::event::Body::Reserved(r)) = &mut e.body {
            for s in &mut r.shares {
                s.mem_mib = 16_000;
            }
        }
    }
    let mut kv = client.kv_client();
    kv.put(log.log_key(victim.first_seq), victim.encode_to_vec(), None)
        .await?;
    let (ok, out) = ctl(&who, &["verify", &target]);
    assert!(!ok, "verify passed on a corrupted log:\n{out}");
    assert!(out.contains("DIFFERENCE"), "{out}");
    Ok(())
}
