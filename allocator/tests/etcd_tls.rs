//! etcd over TLS with client certificates (`--etcd-ca`, `--etcd-cert`, `--etcd-key`): the
//! allocator leads and grants against an etcd that accepts only clients its CA signed, and
//! without a client certificate it cannot.

use std::time::{Duration, Instant};

use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::workload::{inventory, pod};
use gpuledger_testkit::{Allocators, Proc, free_port};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa, KeyPair,
};

struct Pki {
    ca: std::path::PathBuf,
    server: (std::path::PathBuf, std::path::PathBuf),
    client: (std::path::PathBuf, std::path::PathBuf),
}

fn pki(dir: &std::path::Path) -> anyhow::Result<Pki> {
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;
    let write = |name: &str, text: String| -> anyhow::Result<std::path::PathBuf> {
        let p = dir.join(name);
        std::fs::write(&p, text)?;
        Ok(p)
    };
    let leaf = |name: &str, usage: ExtendedKeyUsagePurpose| -> anyhow::Result<_> {
        let mut p = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".into()])?;
        p.extended_key_usages = vec![usage];
        let key = KeyPair::generate()?;
        let cert = p.signed_by(&key, &ca)?;
        Ok((
            write(&format!("{name}.crt"), cert.pem())?,
            write(&format!("{name}.key"), key.serialize_pem())?,
        ))
    };
    Ok(Pki {
        ca: write("ca.crt", ca.pem())?,
        server: leaf("server", ExtendedKeyUsagePurpose::ServerAuth)?,
        client: leaf("client", ExtendedKeyUsagePurpose::ClientAuth)?,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_allocator_grants_through_an_etcd_that_demands_client_certificates()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let p = pki(dir.path())?;
    let (client_port, peer_port) = (free_port()?, free_port()?);
    let url = format!("https://127.0.0.1:{client_port}");
    let etcd_bin = gpuledger_testkit::etcd::find_etcd()?;
    let _etcd = Proc::spawn(
        dir.path(),
        "etcd",
        &etcd_bin,
        vec![
            "--name=tls0".into(),
            format!("--data-dir={}", dir.path().join("etcd.data").display()),
            format!("--listen-client-urls={url}"),
            format!("--advertise-client-urls={url}"),
            format!("--listen-peer-urls=http://127.0.0.1:{peer_port}"),
            format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}"),
            format!("--initial-cluster=tls0=http://127.0.0.1:{peer_port}"),
            format!("--cert-file={}", p.server.0.display()),
            format!("--key-file={}", p.server.1.display()),
            format!("--trusted-ca-file={}", p.ca.display()),
            "--client-cert-auth".into(),
            "--log-level=warn".into(),
        ],
        vec![],
    )?;

    // With the CA and a client certificate: it leads and grants.
    let flags = [
        format!("--etcd-ca={}", p.ca.display()),
        format!("--etcd-cert={}", p.client.0.display()),
        format!("--etcd-key={}", p.client.1.display()),
        "--no-kube".into(),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let allocs = Allocators::start(&dir.path().join("ok"), &url, 1, "tls", &flags)?;
    allocs.wait_leader(Duration::from_secs(30)).await?;
    let mut c = allocs.client(0)?;
    c.register_node(api::RegisterNodeRequest {
        inventory: Some(inventory("n1", 2, 16_000, "NVIDIA A10")),
    })
    .await?;
    let r = c
        .reserve(api::ReserveRequest {
            request: Some(pod("u1", 4_000, 20)),
            node: "n1".into(),
            ttl_ms: 60_000,
        })
        .await?
        .into_inner();
    assert_eq!(r.allocations.len(), 1);

    // Trusting the CA but without a client certificate: etcd refuses, so no leader, no grants.
    let flags = [format!("--etcd-ca={}", p.ca.display()), "--no-kube".into()];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let anon = Allocators::start(&dir.path().join("anon"), &url, 1, "tls-anon", &flags)?;
    let deadline = Instant::now() + Duration::from_secs(4);
    let mut answered = 0;
    while Instant::now() < deadline {
        let st = anon.client(0)?.status(api::StatusRequest {}).await;
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
    let flags = [format!("--etcd-ca={}", p.ca.display()), "--no-kube".into()];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut plain = Allocators::start(
        &dir.path().join("plain"),
        &format!("http://127.0.0.1:{client_port}"),
        1,
        "tls-plain",
        &flags,
    )?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while plain.procs[0].exited().is_none() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "still running with an http:// endpoint"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = plain.procs[0].log_tail(20);
    assert!(log.contains("use https://"), "{log}");
    plain.procs.clear();
    Ok(())
}
