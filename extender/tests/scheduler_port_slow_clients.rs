//! The extender's scheduler-facing HTTPS port against slow and unauthorized clients, on the
//! real binary: a client that connects and never handshakes is cut after
//! `--tls-handshake-timeout-ms`, a client without kube-scheduler's certificate is refused in the
//! handshake, and kube-scheduler's calls are answered meanwhile.

use std::time::{Duration, Instant};

use gpuledger_testkit::kube::{ExtenderClient, KubeStack, StackOptions};
use serde_json::json;
use tokio::io::AsyncReadExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_or_unauthorized_client_is_cut_and_the_scheduler_is_served() -> anyhow::Result<()>
{
    let stack = KubeStack::start(StackOptions {
        etcd_members: 1,
        allocators: 1,
        allocator_flags: vec![],
        extender_flags: Some(vec!["--tls-handshake-timeout-ms=500".into()]),
    })
    .await?;
    let port: u16 = stack
        .extender_url
        .trim_end_matches("/gpuledger")
        .rsplit(':')
        .next()
        .unwrap_or_default()
        .parse()?;
    let scheduler = ExtenderClient::new(stack.extender_config()?)?;
    let filter = json!({"Pod": {"metadata": {"name": "p", "namespace": "default", "uid": "u"},
                                "spec": {"containers": []}},
                        "Nodes": null, "NodeNames": []});

    // Connected, never a ClientHello: cut after the handshake timeout.
    let mut silent = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let t0 = Instant::now();
    // Meanwhile the scheduler is served.
    let (status, _) = scheduler
        .post_raw("filter", serde_json::to_vec(&filter)?)
        .await?;
    assert_eq!(status, 200, "the scheduler's filter while a client stalls");
    let n = tokio::time::timeout(Duration::from_secs(10), silent.read(&mut [0u8; 16])).await;
    assert!(
        matches!(n, Ok(Ok(0)) | Ok(Err(_))),
        "a silent client is still connected after {:?}",
        t0.elapsed()
    );
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "cut only after {:?}",
        t0.elapsed()
    );

    // TLS that trusts the extender, with a client certificate another CA signed: refused in
    // the handshake.
    let other = tempfile::tempdir()?;
    let (cert, key) = gpuledger_testkit::pki::Pki::new(other.path())?
        .client_cert(&gpuledger_auth::identity::Role::Admin, "intruder")?;
    let mut intruder = stack.extender_config()?;
    if let Some(t) = intruder.tls.as_mut() {
        t.cert = cert;
        t.key = key;
    }
    let r = ExtenderClient::new(intruder)?
        .post_raw("filter", serde_json::to_vec(&filter)?)
        .await;
    assert!(
        r.is_err(),
        "a client with another CA's certificate was answered: {r:?}"
    );
    let (status, _) = scheduler
        .post_raw("filter", serde_json::to_vec(&filter)?)
        .await?;
    assert_eq!(status, 200, "and the scheduler is still served");
    Ok(())
}
