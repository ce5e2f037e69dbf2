//! `gpuledger adopt` against a live allocator on real etcd over TLS: pods that HAMi, gpushare and
//! gpu-manager placed (their annotations as each writes them) are planned without a write,
//! committed with --apply by an admin only, not twice on a second run; an over-committed GPU, a
//! GPU no node registers and partial annotations are shown; releasing an adopted grant frees
//! its room; `verify` and `audit` see the adopted grants like any other.

use std::time::Duration;

use gpuledger_auth::identity::Role;
use gpuledger_ledger::AllocState;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::pki::credential_flags;
use gpuledger_testkit::workload::inventory;
use gpuledger_testkit::{Allocators, EtcdCluster};
use serde_json::{Value, json};

use crate::kit::ctl;

fn pod(name: &str, node: &str, ann: Value, limits: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "team", "uid": format!("uid-{name}"),
                     "annotations": ann},
        "spec": {"nodeName": node, "containers": [
            {"name": "main", "image": "x", "resources": {"limits": limits}}]},
        "status": {"phase": "Running"}
    })
}

fn hami(name: &str, node: &str, devices: &str) -> Value {
    pod(
        name,
        node,
        json!({"hami.io/vgpu-node": node, "hami.io/bind-phase": "success",
               "hami.io/vgpu-devices-allocated": devices, "hami.io/vgpu-time": "1700000000"}),
        json!({"nvidia.com/gpu": "1"}),
    )
}

fn last_line(out: &str) -> &str {
    out.lines()
        .rev()
        .find(|l| l.starts_with("adopt nodes="))
        .unwrap_or("")
}

fn row<'a>(out: &'a str, pod: &str) -> &'a str {
    out.lines()
        .find(|l| l.contains(&format!("team/{pod} ")))
        .unwrap_or_else(|| panic!("no row for {pod}:\n{out}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adopt_plans_applies_once_and_shows_every_conflict() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = Allocators::start(dir.path(), &etcd, 1, "adopt", &[])?;
    let leader = allocs.wait_leader(Duration::from_secs(20)).await?;
    for (node, gpus) in [("node-a", 2), ("node-b", 1)] {
        allocs
            .node_agent(leader, node)?
            .register_node(api::RegisterNodeRequest {
                inventory: Some(inventory(node, gpus, 16_000, "NVIDIA A100")),
            })
            .await?;
    }
    let pods = json!({"apiVersion": "v1", "kind": "List", "items": [
        hami("h1", "node-a", "GPU-node-a-0,NVIDIA,4000,30:;"),
        // HAMi over-committed GPU-node-a-0: 4000 + 13000 MiB of 16000.
        hami("h2", "node-a", "GPU-node-a-0,NVIDIA,13000,20:;"),
        hami("ghost", "node-a", "GPU-gone,NVIDIA,1000,0:;"),
        pod("partial", "node-a",
            json!({"hami.io/vgpu-node": "node-a",
                   "hami.io/vgpu-devices-allocated": "GPU-node-a-1,NVIDIA,1000,0:;"}),
            json!({})),
        pod("s1", "node-a",
            json!({"ALIYUN_COM_GPU_MEM_IDX": "1", "ALIYUN_COM_GPU_MEM_POD": "8",
                   "ALIYUN_COM_GPU_MEM_DEV": "16", "ALIYUN_COM_GPU_MEM_ASSIGNED": "true",
                   "ALIYUN_COM_GPU_MEM_ASSUME_TIME": "1700000000000000000"}),
            json!({"aliyun.com/gpu-mem": "8"})),
        pod("m1", "node-b",
            json!({"tencent.com/predicate-node": "node-b", "tencent.com/gpu-assigned": "true",
                   "tencent.com/predicate-gpu-idx-0": "0",
                   "tencent.com/predicate-time": "1700000000000000000"}),
            json!({"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "8"})),
        pod("plain", "node-b", json!({}), json!({})),
    ]});
    let file = dir.path().join("pods.json");
    std::fs::write(&file, serde_json::to_vec(&pods)?)?;
    let file = file.to_string_lossy().into_owned();
    let target = format!("--allocator={}", allocs.addrs[leader]);
    let viewer = credential_flags(&allocs.ids.credentials(&Role::Viewer)?);
    let admin = credential_flags(&allocs.ids.credentials(&Role::Admin)?);
    let seq = |l: &gpuledger_ledger::Ledger| l.seq();
    let before = seq(&allocs.ledger(leader).await?);

    // Dry run: the plan per node, every conflict shown, nothing written.
    let (ok, out) = ctl(&viewer, &["adopt", &target, "--pods-file", &file]);
    assert!(ok, "{out}");
    assert_eq!(
        last_line(&out),
        "adopt nodes=2 adopt=3 held=0 cannot=3 applied=0",
        "{out}"
    );
    assert!(row(&out, "h1").ends_with("adopt"), "{out}");
    assert!(
        row(&out, "h1").contains("GPU-node-a-0 4000MiB 30%"),
        "{out}"
    );
    assert!(row(&out, "s1").contains("GPU-node-a-1 8000MiB 0%"), "{out}");
    assert!(
        row(&out, "m1").contains("GPU-node-b-0 2048MiB 50%"),
        "{out}"
    );
    assert!(
        row(&out, "h2").contains("GPU-node-a-0 holds team/h1"),
        "{out}"
    );
    assert!(
        row(&out, "ghost").contains("no node registers GPU GPU-gone"),
        "{out}"
    );
    assert!(
        row(&out, "partial").contains("hami.io/bind-phase is missing"),
        "{out}"
    );
    assert!(!out.contains("team/plain"), "{out}");
    assert_eq!(
        seq(&allocs.ledger(leader).await?),
        before,
        "a dry run writes nothing"
    );

    // A viewer cannot commit.
    let (ok, out) = ctl(
        &viewer,
        &["adopt", &target, "--pods-file", &file, "--apply"],
    );
    assert!(!ok, "{out}");
    assert!(
        out.contains("PERMISSION_DENIED") || out.contains("may not"),
        "{out}"
    );
    assert_eq!(seq(&allocs.ledger(leader).await?), before);

    // An admin commits; each adopted pod is bound at once, says who placed it.
    let (ok, out) = ctl(&admin, &["adopt", &target, "--pods-file", &file, "--apply"]);
    assert!(ok, "{out}");
    assert_eq!(
        last_line(&out),
        "adopt nodes=2 adopt=3 held=0 cannot=3 applied=3",
        "{out}"
    );
    let l = allocs.ledger(leader).await?;
    for (name, peer) in [("h1", "hami"), ("s1", "gpushare"), ("m1", "gpu-manager")] {
        let held = l.allocs_of_pod(&format!("uid-{name}"));
        assert_eq!(held.len(), 1, "{name}");
        assert_eq!(held[0].state, AllocState::Bound, "{name}");
        assert_eq!(held[0].policy, format!("adopted-from={peer}"), "{name}");
    }
    let gpu = |l: &gpuledger_ledger::Ledger, n: &str, g: &str| {
        l.node(n)
            .and_then(|x| x.gpu(g))
            .map(|g| (g.mem_used, g.core_used))
    };
    assert_eq!(gpu(&l, "node-a", "GPU-node-a-0"), Some((4000, 300)));
    let events = allocs.events(leader).await?;
    let adopted: Vec<&pb::Event> = events
        .iter()
        .filter(|e| matches!(&e.body, Some(pb::event::Body::Reserved(r)) if r.policy.starts_with("adopted-from=")))
        .collect();
    assert_eq!(adopted.len(), 3);
    for e in adopted {
        assert_eq!(
            e.actor.as_ref().map(|a| a.role.as_str()),
            Some("admin"),
            "{e:?}"
        );
    }

    // Again: nothing adopted twice.
    let after = seq(&l);
    let (ok, out) = ctl(&admin, &["adopt", &target, "--pods-file", &file, "--apply"]);
    assert!(ok, "{out}");
    assert_eq!(
        last_line(&out),
        "adopt nodes=2 adopt=0 held=3 cannot=3 applied=0",
        "{out}"
    );
    assert_eq!(
        seq(&allocs.ledger(leader).await?),
        after,
        "a second run writes nothing"
    );

    // verify and audit see the adopted grants as the ledger's own.
    let (ok, out) = ctl(&viewer, &["verify", &target]);
    assert!(ok, "{out}");
    let (ok, out) = ctl(&viewer, &["audit", &target, "--pod", "team/h1"]);
    assert!(ok && out.contains("adopted-from=hami"), "{out}");

    // The adopted pod goes (its grant released): its room is free, and the pod HAMi
    // over-committed onto that GPU now fits.
    allocs
        .admin(leader)?
        .release(api::ReleaseRequest {
            pod_uid: "uid-h1".into(),
            reason: "pod deleted".into(),
            ..Default::default()
        })
        .await?;
    let l = allocs.ledger(leader).await?;
    assert!(l.allocs_of_pod("uid-h1").is_empty());
    assert_eq!(gpu(&l, "node-a", "GPU-node-a-0"), Some((0, 0)));
    let mut pods = pods;
    pods["items"]
        .as_array_mut()
        .expect("items")
        .retain(|p| p["metadata"]["name"] != "h1");
    std::fs::write(&file, serde_json::to_vec(&pods)?)?;
    let (ok, out) = ctl(&admin, &["adopt", &target, "--pods-file", &file, "--apply"]);
    assert!(ok, "{out}");
    assert!(row(&out, "h2").contains("adopted as allocation"), "{out}");
    let l = allocs.ledger(leader).await?;
    assert_eq!(gpu(&l, "node-a", "GPU-node-a-0"), Some((13000, 200)));
    Ok(())
}

/// Without `--pods-file` the pods come from the API server; a deleted adopted pod releases its
/// grant through the allocator's pod watch, as gpuledger's own do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adopt_reads_the_api_server_and_a_deleted_pod_releases_its_grant() -> anyhow::Result<()> {
    use gpuledger_testkit::Identities;
    use gpuledger_testkit::kube::FakeApiServer;

    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let kube = FakeApiServer::start(&dir.path().join("kube")).await?;
    let ids = Identities::tokens(kube.pki.clone(), kube.store.clone());
    let kubeconfig = format!("--kubeconfig={}", kube.kubeconfig().display());
    let allocs = Allocators::start_each(
        &dir.path().join("alloc"),
        &etcd,
        &[etcd.endpoints_flag()],
        "adopt-kube",
        &[&kubeconfig],
        ids,
    )?;
    let leader = allocs.wait_leader(Duration::from_secs(20)).await?;
    kube.add_node("node-a", 8)?;
    allocs
        .node_agent(leader, "node-a")?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("node-a", 2, 16_000, "NVIDIA A100")),
        })
        .await?;
    let created = kube.add_pod(hami("h1", "node-a", "GPU-node-a-1,NVIDIA,6000,25:;"))?;
    let uid = created["metadata"]["uid"]
        .as_str()
        .expect("the API server sets a uid")
        .to_string();
    kube.set_pod_phase("team", "h1", "Running")?;
    let target = format!("--allocator={}", allocs.addrs[leader]);
    let admin = credential_flags(&allocs.ids.credentials(&Role::Admin)?);
    let (ok, out) = ctl(&admin, &["adopt", &target, &kubeconfig, "--apply"]);
    assert!(ok, "{out}");
    assert_eq!(
        last_line(&out),
        "adopt nodes=1 adopt=1 held=0 cannot=0 applied=1",
        "{out}"
    );
    let l = allocs.ledger(leader).await?;
    assert_eq!(l.allocs_of_pod(&uid).len(), 1, "{out}");

    kube.delete_pod("team", "h1")?;
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let l = allocs.ledger(leader).await?;
        if l.allocs_of_pod(&uid).is_empty() {
            let g = l.node("node-a").and_then(|n| n.gpu("GPU-node-a-1"));
            assert_eq!(g.map(|g| g.mem_used), Some(0));
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the deleted pod's adopted grant was not released"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}
