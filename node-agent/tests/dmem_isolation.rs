//! `--isolation=dmem` on a cgroup v2 tree in a test directory (these machines run cgroup v1):
//! the agent turns the dmem controller on down to the pod's cgroup, writes the pod's share of
//! its GPU's region into `dmem.max` as the kernel documents it (`<region> <bytes>`, one line
//! a write), again when it changes, and a pod whose cgroup appears later gets its limit then.
//! The tree's files are plain files: each keeps what the last write left. A DRA pod is held to
//! the sum of the claims reserved for it.

use crate::support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use gpuledger_proto::allocator::v1 as api;
use support::{Cluster, Options};

const UID_A: &str = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
const UID_B: &str = "1f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
/// The fake NVML puts GPU 0 at PCI 00000000:01:00.0; NVIDIA's driver names its region so.
const REGION: &str = "nvidia/0000:01:00.0/vidmem";

/// The root of a cgroup v2 mount with the dmem controller, and the systemd driver's
/// `kubepods.slice/kubepods-burstable.slice`; the kubelet enabled cpu and memory only.
pub(crate) fn tree(root: &Path) -> Result<PathBuf> {
    let qos = root.join("kubepods.slice/kubepods-burstable.slice");
    std::fs::create_dir_all(&qos)?;
    std::fs::write(root.join("cgroup.controllers"), "cpu memory pids dmem\n")?;
    // GPU 1 of a two-GPU node is at PCI 00000000:02:00.0.
    std::fs::write(
        root.join("dmem.capacity"),
        format!("{REGION} 42949672960\nnvidia/0000:02:00.0/vidmem 42949672960\n"),
    )?;
    for d in [root.to_path_buf(), root.join("kubepods.slice"), qos.clone()] {
        std::fs::write(d.join("cgroup.subtree_control"), "cpu memory\n")?;
    }
    Ok(qos)
}

/// The pod's cgroup as the kubelet makes it, with the `dmem.max` the kernel gives it.
fn pod_cgroup(qos: &Path, uid: &str) -> Result<PathBuf> {
    let d = qos.join(format!(
        "kubepods-burstable-pod{}.slice",
        uid.replace('-', "_")
    ));
    std::fs::create_dir_all(&d)?;
    std::fs::write(d.join("dmem.max"), "")?;
    Ok(d)
}

async fn wait_file(c: &Cluster, path: &Path, want: &str) -> Result<()> {
    wait_file_or(path, want, || c.agent_log()).await
}

/// Wait until `path` holds `want`; the failure says what it holds and `log()`.
async fn wait_file_or(path: &Path, want: &str, log: impl Fn() -> String) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let got = std::fs::read_to_string(path).unwrap_or_default();
        if got == want {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{} is {got:?}, not {want:?}\n{}", path.display(), log());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_pods_dmem_max_follows_its_share() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path().join("cgroup");
    let qos = tree(&root)?;
    let a = pod_cgroup(&qos, UID_A)?;
    let c = Cluster::start_opts(Options {
        flags: vec![
            "--isolation=dmem".into(),
            format!("--cgroup-root={}", root.display()),
        ],
        nvml: Some(Box::new(|cfg| cfg.driver_version = "615.20.01".into())),
        ..Options::default()
    })
    .await?;

    c.reserve(UID_A, 10_000, None).await?;
    wait_file(&c, &a.join("dmem.max"), &format!("{REGION} 10485760000\n")).await?;
    for d in [root.clone(), root.join("kubepods.slice"), qos.clone()] {
        assert_eq!(
            std::fs::read_to_string(d.join("cgroup.subtree_control"))?,
            "+dmem",
            "dmem not enabled in {}",
            d.display()
        );
    }

    // B's allocation comes before its cgroup: written when the kubelet makes it.
    c.reserve(UID_B, 2_048, None).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let b = pod_cgroup(&qos, UID_B)?;
    wait_file(&c, &b.join("dmem.max"), &format!("{REGION} 2147483648\n")).await?;

    // A's share ends while its cgroup stays: nothing of the GPU is left to it.
    c.admin()?
        .release(api::ReleaseRequest {
            pod_uid: UID_A.into(),
            reason: "pod succeeded".into(),
            ..Default::default()
        })
        .await?;
    wait_file(&c, &a.join("dmem.max"), &format!("{REGION} 0\n")).await?;
    assert_eq!(
        std::fs::read_to_string(b.join("dmem.max"))?,
        format!("{REGION} 2147483648\n"),
        "B's limit moved with A's release"
    );
    Ok(())
}

/// Regression: a DRA claim's grant names the claim, not the pod, and the pod that consumed it
/// got no `dmem.max`. Its pod is held to the sum of its claims on the GPU, written once its
/// cgroup is there and again when a claim is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dra_pods_dmem_max_is_the_sum_of_its_claims() -> Result<()> {
    use crate::dra_plugin::DraNode;
    use gpuledger_proto::ledger::v1 as pb;

    let tmp = tempfile::tempdir()?;
    let root = tmp.path().join("cgroup");
    let qos = tree(&root)?;
    let health = format!("127.0.0.1:{}", gpuledger_testkit::process::free_port()?);
    let n = DraNode::start_full(
        |_| {},
        &[
            "--isolation=dmem".into(),
            format!("--cgroup-root={}", root.display()),
            format!("--health-listen={health}"),
        ],
        Some(Box::new(|cfg| cfg.driver_version = "615.20.01".into())),
    )
    .await?;
    n.wait_slice(None).await?;

    // Two claims on GPU 0 (3000 MiB each), both reserved for pod A, granted and prepared as
    // the kubelet does before A's containers start.
    let mut claims = Vec::new();
    for (uid, name, share) in [
        ("claim-d1", "d1", "share-d1"),
        ("claim-d2", "d2", "share-d2"),
    ] {
        let c = n.add_claim(uid, name, 0, share)?;
        let mut g = n.grant(&c, 0, share);
        g.consumers = vec![pb::PodRef {
            uid: UID_A.into(),
            namespace: "team-a".into(),
            name: "a".into(),
        }];
        n.allocs
            .admin(0)?
            .grant_claim(api::GrantClaimRequest { grant: Some(g) })
            .await?;
        claims.push(c);
    }
    let r = n.dra.prepare(&claims).await?;
    for c in &claims {
        assert_eq!(r.claims[&c.uid].error, "", "{}", n.log());
    }
    let a = pod_cgroup(&qos, UID_A)?;
    let both = format!("{REGION} {}\n", 6000u64 << 20);
    wait_file_or(&a.join("dmem.max"), &both, || n.log()).await?;
    let (_, metrics) = gpuledger_testkit::http::get(&format!("http://{health}/metrics")).await?;
    let line = format!(
        "gpuledger_node_agent_isolation_limit_bytes{{mode=\"dmem\",target=\"{UID_A}/{REGION}\"}} {}",
        6000u64 << 20
    );
    assert!(metrics.contains(&line), "no {line:?} in\n{metrics}");

    // One claim released: A keeps the other's share.
    n.allocs
        .admin(0)?
        .release(api::ReleaseRequest {
            pod_uid: "claim-d1".into(),
            reason: "claim deleted".into(),
            ..Default::default()
        })
        .await?;
    let one = format!("{REGION} {}\n", 3000u64 << 20);
    wait_file_or(&a.join("dmem.max"), &one, || n.log()).await
}
