//! The webhook's HTTPS server: a certificate rotated on disk is served without a restart (a
//! broken one is not), and clients that stall the handshake or the headers, or send too large a
//! body, are cut off.

use crate::kit;

use std::time::{Duration, Instant};

use gpuledger_extender::allocator::Allocators;
use gpuledger_extender::webhook;
use gpuledger_testkit::kube::stack::wait_http;
use gpuledger_testkit::{Proc, bin_path, eventually, free_port};
use serde_json::json;
use tokio::io::AsyncReadExt;
use tokio_util::sync::CancellationToken;

fn pod() -> serde_json::Value {
    json!({"metadata": {"name": "p", "namespace": "default"},
           "spec": {"containers": [{"name": "c", "image": "x",
              "resources": {"limits": {"aliyun.com/gpu-mem": "3"}}}]}})
}

/// Whether a client trusting only `ca` gets a mutate answer.
async fn answered(ca: &str, port: u16) -> bool {
    let Ok(client) = kit::Https::trusting(ca, port) else {
        return false;
    };
    matches!(
        client.post("/mutate", &kit::review(&pod(), "u")).await,
        Ok((200, _))
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_certificate_is_served_without_a_restart() -> anyhow::Result<()> {
    let mut certs = kit::TestTls::new()?;
    let old = certs.cert_pem.clone();
    let dir = tempfile::tempdir()?;
    let (port, hook) = (free_port()?, free_port()?);
    let mut flags = certs.flags(hook);
    flags.extend([
        format!("--listen=127.0.0.1:{port}"),
        format!("--allocator=127.0.0.1:{}", free_port()?),
        "--tls-reload-ms=100".into(),
    ]);
    let mut p = Proc::spawn(
        dir.path(),
        "extender",
        &bin_path("gpuledger-extender")?,
        flags,
        vec![],
    )?;
    wait_http(hook, Duration::from_secs(20)).await?;
    assert!(
        answered(&old, hook).await,
        "the first certificate is served"
    );

    let new = certs.rotate()?;
    eventually(
        "the rotated certificate is served",
        Duration::from_secs(10),
        || async { Ok(answered(&new, hook).await) },
    )
    .await?;
    assert!(
        !answered(&old, hook).await,
        "a client that trusts only the old certificate is refused"
    );

    // A broken pair (a rotation caught half-way) keeps the good one served.
    certs.replace(b"not a certificate", b"not a key")?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(answered(&new, hook).await, "still the rotated certificate");
    let log = std::fs::read_to_string(p.log_path())?;
    assert!(log.contains("do not load"), "{log}");
    assert!(p.exited().is_none(), "the extender never restarted");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_handshakes_and_headers_and_large_bodies_are_cut_off() -> anyhow::Result<()> {
    let certs = kit::TestTls::new()?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let creds = gpuledger_auth::Credentials::load(&gpuledger_auth::CredentialArgs {
        ca: Some(certs.cert_path()),
        token_file: None,
        client_cert: Some(certs.cert_path()),
        client_key: Some(certs.key_path()),
        server_name: None,
    })?;
    let app = webhook::router(webhook::Webhook {
        allocators: Allocators::new(
            &[format!("127.0.0.1:{}", free_port()?)],
            Duration::from_millis(200),
            &creds,
        )?,
        feasible: webhook::Feasibility::new(0, 0, gpuledger_auth::limit::Bites::new()),
        scheduler_name: None,
        replica: None,
        namespaces: None,
        pod_path: webhook::PodPath::DevicePlugin,
        dra_cores: Default::default(),
    });
    let limits = gpuledger_auth::https::Limits {
        handshake: Duration::from_millis(300),
        header_read: Duration::from_millis(300),
        body_bytes: 64 << 10,
        ..Default::default()
    };
    let tls = gpuledger_auth::tls::server_config(
        &certs.cert_path(),
        &certs.key_path(),
        gpuledger_auth::tls::ClientCerts::None,
        &[b"http/1.1"],
    )?;
    let stop = CancellationToken::new();
    let server = tokio::spawn(gpuledger_auth::https::serve(
        "webhook",
        listener,
        tls,
        limits,
        gpuledger_auth::limit::Bites::new(),
        app,
        stop.clone(),
    ));
    let client = kit::Https::new(&certs, port)?;
    assert!(answered(&certs.cert_pem, port).await);

    // Connected, but no ClientHello: closed after the handshake timeout.
    let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let t0 = Instant::now();
    let n = tokio::time::timeout(Duration::from_secs(5), tcp.read(&mut [0u8; 16])).await;
    assert!(
        matches!(n, Ok(Ok(0)) | Ok(Err(_))),
        "a silent client is still connected after {:?}",
        t0.elapsed()
    );
    // Handshake done, but no request: closed after the header timeout.
    let mut tls_conn = client.connect().await?;
    let t0 = Instant::now();
    let n = tokio::time::timeout(Duration::from_secs(5), tls_conn.read(&mut [0u8; 16])).await;
    assert!(
        matches!(n, Ok(Ok(0)) | Ok(Err(_))),
        "a client that sends no request is still connected after {:?}",
        t0.elapsed()
    );
    // A body over the limit is refused before the handler reads it.
    let (status, _) = client.post_raw("/mutate", vec![b' '; 128 << 10]).await?;
    assert_eq!(status, 413);
    assert!(
        answered(&certs.cert_pem, port).await,
        "and the server goes on"
    );

    stop.cancel();
    tokio::time::timeout(Duration::from_secs(10), server).await???;
    Ok(())
}
