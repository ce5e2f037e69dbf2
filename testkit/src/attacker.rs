//! Connections as another machine on the network would open them: from another loopback
//! address (127.0.0.2 and up; every 127/8 address reaches this host), so that per-address limits
//! tell an attacker from the honest clients on 127.0.0.1.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use anyhow::Result;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// A TCP connection to `to` from the loopback address `source`.
pub async fn tcp_from(source: &str, to: SocketAddr) -> std::io::Result<tokio::net::TcpStream> {
    let s = tokio::net::TcpSocket::new_v4()?;
    s.bind(
        format!("{source}:0")
            .parse::<SocketAddr>()
            .map_err(std::io::Error::other)?,
    )?;
    s.connect(to).await
}

/// A TLS client (no client certificate) that trusts the servers the CA in `ca_file` signed,
/// speaking HTTP/1.1.
pub fn tls_trusting(ca_file: &Path) -> Result<tokio_rustls::TlsConnector> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca_file)? {
        roots.add(c?)?;
    }
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(cfg)))
}

/// A TLS connection from `source` to `to` (whose certificate names `localhost`) with `tls`.
pub async fn tls_from(
    tls: &tokio_rustls::TlsConnector,
    source: &str,
    to: SocketAddr,
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let tcp = tcp_from(source, to).await?;
    let name = rustls::pki_types::ServerName::try_from("localhost")
        .map_err(std::io::Error::other)?
        .to_owned();
    tls.connect(name, tcp).await
}
