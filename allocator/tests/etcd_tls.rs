//! etcd over TLS with client certificates (`--etcd-ca`, `--etcd-cert`, `--etcd-key`): the
//! allocator leads and grants against an etcd that accepts only clients its CA signed, and
//! without a client certificate it cannot.

use crate::support;

use std::time::{Duration, Instant};

use gpuledger_auth::identity::Role;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::allocators::connect;
use gpuledger_testkit::workload::{inventory, pod};
use gpuledger_testkit::{Allocators, EtcdCluster, Identities, Pki};
use support::spawn_allocator;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_allocator_grants_through_an_etcd_that_demands_client_certificates()
-> anyhow::Result<()> {
    // The test kit's etcd serves TLS on both ports and demands client certificates.
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;

    // With the CA and a client certificate: it leads and grants.
    let allocs = Allocators::start(&dir.path().join("ok"), &etcd, 1, "tls", &["--no-kube"])?;
    allocs.wait_leader(Duration::from_secs(30)).await?;
    allocs
        .node_agent(0, "n1")?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("n1", 2, 16_000, "NVIDIA A10")),
        })
        .await?;
    let r = allocs
        .extender(0)?
        .reserve(api::ReserveRequest {
            request: Some(pod("u1", 4_000, 20)),
            node: "n1".into(),
            ttl_ms: 60_000,
        })
        .await?
        .into_inner();
    assert_eq!(r.allocations.len(), 1);

    // Trusting the CA but without a client certificate: etcd refuses, so no leader, no grants.
    let ids = Identities::certs(Pki::new(&dir.path().join("anon"))?);
    let ca_only = vec![
        format!("--etcd-endpoints={}", etcd.endpoints_flag()),
        format!("--etcd-ca={}", etcd.ca_file().display()),
        "--no-kube".into(),
    ];
    let (_anon, addr) = spawn_allocator(dir.path(), &ids, "tls-anon", ca_only, "info")?;
    let viewer = ids.credentials(&Role::Viewer)?;
    let deadline = Instant::now() + Duration::from_secs(4);
    let mut answered = 0;
    while Instant::now() < deadline {
        let st = connect(&addr, &viewer)?.status(api::StatusRequest {}).await;
        if let Ok(s) = st {
            let s = s.into_inner();
            assert!(!s.ready, "ready without a client certificate: {s:?}");
            answered += 1;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        answered > 0,
        "the replica without a certificate never answered Status"
    );

    // A plain http:// endpoint with TLS flags is refused at start with a clear error.
    let plain_flags = vec![
        format!(
            "--etcd-endpoints={}",
            etcd.endpoints_flag().replace("https://", "http://")
        ),
        format!("--etcd-ca={}", etcd.ca_file().display()),
        "--no-kube".into(),
    ];
    let (mut plain, _) = spawn_allocator(dir.path(), &ids, "tls-plain", plain_flags, "info")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while plain.exited().is_none() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "still running with an http:// endpoint"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = plain.log_tail(20);
    assert!(log.contains("use https://"), "{log}");
    Ok(())
}
