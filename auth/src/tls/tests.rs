use std::time::Instant;

use futures::StreamExt;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::*;
use crate::identity::Role;
use crate::pki::Ca;
use crate::server::{Authenticator, Refusal, caller_of_cert};
use tokio::net::TcpListener;

struct Files {
    dir: tempfile::TempDir,
}

impl Files {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

fn issue(ca: &Ca, f: &Files) {
    ca.write(&f.path("ca.crt")).unwrap();
    ca.server(&["localhost", "127.0.0.1"])
        .unwrap()
        .write(f.dir.path(), "server")
        .unwrap();
    ca.client(&Role::NodeAgent { node: "n1".into() }, "")
        .unwrap()
        .write(f.dir.path(), "client")
        .unwrap();
}

/// A TLS echo server on a free port: each connection answers what it reads.
async fn echo(
    f: &Files,
    clients: ClientCerts,
    timeout: Duration,
) -> (u16, Arc<Reloading<ServerConfig>>, CancellationToken) {
    let tls = server_config(
        &f.path("server.crt"),
        &f.path("server.key"),
        clients,
        &[b"echo"],
    )
    .unwrap();
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let stop = CancellationToken::new();
    let limits = ListenerLimits {
        hello_timeout: timeout,
        handshake_timeout: timeout,
        ..ListenerLimits::default()
    };
    let mut conns = Box::pin(incoming(l, tls.clone(), limits, Bites::new(), stop.clone()));
    tokio::spawn(async move {
        while let Some(Ok(mut s)) = conns.next().await {
            tokio::spawn(async move {
                let mut b = [0u8; 5];
                if s.read_exact(&mut b).await.is_ok() {
                    let _ = s.write_all(&b).await;
                    let _ = s.shutdown().await;
                }
            });
        }
    });
    (port, tls, stop)
}

async fn hello(port: u16, cfg: Arc<ClientConfig>) -> std::io::Result<Vec<u8>> {
    let tcp = TcpStream::connect(("127.0.0.1", port)).await?;
    let name = ServerName::try_from("localhost").unwrap();
    let mut s = tokio_rustls::TlsConnector::from(cfg)
        .connect(name, tcp)
        .await?;
    s.write_all(b"hello").await?;
    let mut b = Vec::new();
    s.read_to_end(&mut b).await?;
    Ok(b)
}

#[tokio::test]
async fn a_client_the_ca_signed_is_served_and_its_identity_read() {
    let f = Files {
        dir: tempfile::tempdir().unwrap(),
    };
    let ca = Ca::new("test").unwrap();
    issue(&ca, &f);
    let (port, _tls, _stop) = echo(
        &f,
        ClientCerts::Required(f.path("ca.crt")),
        Duration::from_secs(5),
    )
    .await;
    let with_cert = client_config(
        &f.path("ca.crt"),
        Some((&f.path("client.crt"), &f.path("client.key"))),
        &[b"echo"],
    )
    .unwrap();
    assert_eq!(hello(port, with_cert.current()).await.unwrap(), b"hello");

    let without = client_config(&f.path("ca.crt"), None, &[b"echo"]).unwrap();
    assert!(
        hello(port, without.current()).await.is_err(),
        "a required client certificate is required"
    );

    // The identity in the certificate.
    let pem = std::fs::read(f.path("client.crt")).unwrap();
    let der = CertificateDer::pem_slice_iter(&pem)
        .next()
        .unwrap()
        .unwrap();
    let c = caller_of_cert(&der).unwrap().unwrap();
    assert_eq!(c.role, Role::NodeAgent { node: "n1".into() });
    let a = Authenticator::new(None);
    let got = a
        .authenticate(&http::HeaderMap::new(), Some(&[der]), None)
        .await
        .unwrap();
    assert_eq!(got.caller, c);
}

#[tokio::test]
async fn a_server_certificate_from_another_ca_is_refused() {
    let f = Files {
        dir: tempfile::tempdir().unwrap(),
    };
    issue(&Ca::new("real").unwrap(), &f);
    let (port, _tls, _stop) = echo(&f, ClientCerts::None, Duration::from_secs(5)).await;
    let other = Files {
        dir: tempfile::tempdir().unwrap(),
    };
    issue(&Ca::new("rogue").unwrap(), &other);
    let cfg = client_config(&other.path("ca.crt"), None, &[b"echo"]).unwrap();
    assert!(hello(port, cfg.current()).await.is_err());
}

#[tokio::test]
async fn rotated_certificates_are_served_without_a_restart() {
    let f = Files {
        dir: tempfile::tempdir().unwrap(),
    };
    issue(&Ca::new("old").unwrap(), &f);
    let old_trust = client_config(&f.path("ca.crt"), None, &[b"echo"]).unwrap();
    let (port, tls, _stop) = echo(&f, ClientCerts::None, Duration::from_secs(5)).await;
    assert_eq!(hello(port, old_trust.current()).await.unwrap(), b"hello");
    assert!(!tls.reload().unwrap(), "nothing changed yet");

    // cert-manager rotates: a new CA and a new certificate in the same files.
    issue(&Ca::new("new").unwrap(), &f);
    let new_trust = client_config(&f.path("ca.crt"), None, &[b"echo"]).unwrap();
    assert!(
        hello(port, new_trust.current()).await.is_err(),
        "still the old certificate"
    );
    assert!(tls.reload().unwrap());
    assert_eq!(hello(port, new_trust.current()).await.unwrap(), b"hello");
    assert!(hello(port, old_trust.current()).await.is_err());

    // A half-written key keeps the previous configuration.
    std::fs::write(f.path("server.key"), "-----BEGIN PRIVATE KEY-----\n").unwrap();
    assert!(tls.reload().is_err());
    assert_eq!(hello(port, new_trust.current()).await.unwrap(), b"hello");
}

#[tokio::test]
async fn a_client_that_never_finishes_its_handshake_is_cut_and_holds_up_nobody() {
    let f = Files {
        dir: tempfile::tempdir().unwrap(),
    };
    issue(&Ca::new("t").unwrap(), &f);
    let (port, _tls, _stop) = echo(&f, ClientCerts::None, Duration::from_millis(300)).await;
    let t0 = Instant::now();
    let mut loris = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    loris.write_all(&[0x16, 0x03, 0x01]).await.unwrap();
    let trust = client_config(&f.path("ca.crt"), None, &[b"echo"]).unwrap();
    assert_eq!(hello(port, trust.current()).await.unwrap(), b"hello");
    assert!(
        t0.elapsed() < Duration::from_millis(300),
        "served while the loris waits"
    );
    let mut b = [0u8; 16];
    let n = tokio::time::timeout(Duration::from_secs(5), loris.read(&mut b))
        .await
        .expect("the server cuts the connection")
        .unwrap_or(0);
    assert_eq!(n, 0, "closed without an answer");
    assert!(t0.elapsed() >= Duration::from_millis(300));
}

#[tokio::test]
async fn no_credentials_and_unknown_certificates_are_unauthenticated() {
    let a = Authenticator::new(None);
    let r = a.authenticate(&http::HeaderMap::new(), None, None).await;
    assert!(
        matches!(r, Err(Refusal::Unauthenticated(ref m)) if m.contains("no credentials")),
        "{r:?}"
    );
    let mut h = http::HeaderMap::new();
    h.insert(http::header::AUTHORIZATION, "Bearer abc".parse().unwrap());
    let r = a.authenticate(&h, None, None).await;
    assert!(
        matches!(r, Err(Refusal::Unauthenticated(ref m)) if m.contains("client certificates only")),
        "{r:?}"
    );

    // A server certificate (no SPIFFE URI SAN) presented as a client certificate.
    let ca = Ca::new("t").unwrap();
    let leaf = ca.server(&["localhost"]).unwrap();
    let der = CertificateDer::pem_slice_iter(leaf.cert_pem.as_bytes())
        .next()
        .unwrap()
        .unwrap();
    let r = a
        .authenticate(&http::HeaderMap::new(), Some(&[der]), None)
        .await;
    assert!(
        matches!(r, Err(Refusal::Unauthenticated(ref m)) if m.contains("names no gpuledger identity")),
        "{r:?}"
    );
    assert_eq!(a.refused(), 3);
}

#[tokio::test]
async fn a_forwarding_header_counts_only_from_an_allocator() {
    let ca = Ca::new("t").unwrap();
    let der = |role: Role| {
        let leaf = ca.client(&role, "ops").unwrap();
        CertificateDer::pem_slice_iter(leaf.cert_pem.as_bytes())
            .next()
            .unwrap()
            .unwrap()
    };
    let admin = crate::Caller {
        role: Role::Admin,
        subject: "spiffe://gpuledger/admin/root".into(),
    };
    let mut h = http::HeaderMap::new();
    h.insert(
        crate::server::ON_BEHALF_OF,
        crate::server::on_behalf_of(&admin),
    );
    let a = Authenticator::new(None);

    // A node agent claiming to forward for an admin stays a node agent.
    let forged = a
        .authenticate(
            &h,
            Some(&[der(Role::NodeAgent { node: "n1".into() })]),
            None,
        )
        .await
        .unwrap();
    assert_eq!(forged.caller.role, Role::NodeAgent { node: "n1".into() });
    assert_eq!(forged.forwarded_by, None);
    assert_eq!(a.forged(), 1);

    // An allocator replica forwarding for an admin: the admin is the caller.
    let fwd = a
        .authenticate(&h, Some(&[der(Role::Allocator)]), None)
        .await
        .unwrap();
    assert_eq!(fwd.caller, admin);
    assert_eq!(
        fwd.forwarded_by.as_deref(),
        Some("spiffe://gpuledger/allocator")
    );
}
