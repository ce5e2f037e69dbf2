//! The webhook's HTTPS server (axum-server over rustls): TLS handshakes, header reads and
//! bodies are bounded, and the certificate is read again when its files change, so a rotation
//! (cert-manager renewing the Secret) needs no restart.

use std::convert::Infallible;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum_server::accept::Accept;
use axum_server::tls_rustls::{RustlsAcceptor, RustlsConfig};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// How long requests in flight may finish after shutdown is asked for.
const DRAIN: Duration = Duration::from_secs(5);

/// What one client may hold of the server.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Longest TLS handshake.
    pub handshake: Duration,
    /// Longest wait for a request's headers, the first request's included.
    pub header_read: Duration,
    /// Largest request body, in bytes.
    pub body_bytes: usize,
}

impl Default for Limits {
    /// The API server gives a webhook 10 s by default, so a client slower than that to shake
    /// hands or send headers is not one worth waiting for. 2 MiB bodies (axum's default) hold
    /// the review of any pod: etcd refuses objects over 1.5 MiB.
    fn default() -> Self {
        Limits {
            handshake: Duration::from_secs(10),
            header_read: Duration::from_secs(10),
            body_bytes: 2 << 20,
        }
    }
}

/// The PEM files of the certificate chain and its key, and how often they are read again.
#[derive(Debug, Clone)]
pub struct CertFiles {
    /// PEM certificate chain.
    pub cert: PathBuf,
    /// PEM private key.
    pub key: PathBuf,
    /// How often both files are read again to see whether they changed.
    pub reload_every: Duration,
}

/// TLS settings from PEM files.
pub fn tls_config(cert: &Path, key: &Path) -> anyhow::Result<rustls::ServerConfig> {
    let cert_pem = std::fs::read(cert).with_context(|| format!("reading {}", cert.display()))?;
    let key_pem = std::fs::read(key).with_context(|| format!("reading {}", key.display()))?;
    tls_config_pem(&cert_pem, &key_pem)
        .with_context(|| format!("loading {} and {}", cert.display(), key.display()))
}

/// TLS settings from a PEM certificate chain and key.
fn tls_config_pem(cert: &[u8], key: &[u8]) -> anyhow::Result<rustls::ServerConfig> {
    let certs: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(cert).collect::<Result<_, _>>()?;
    anyhow::ensure!(!certs.is_empty(), "no certificate in the certificate file");
    let key = PrivateKeyDer::from_pem_slice(key)?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_single_cert(certs, key)?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

/// Sets TCP_NODELAY before the handshake: an answer leaves at once instead of waiting for the
/// client's delayed ACK.
#[derive(Debug, Clone, Copy)]
struct NoDelay;

impl<S> Accept<TcpStream, S> for NoDelay {
    type Stream = TcpStream;
    type Service = S;
    type Future = std::future::Ready<io::Result<(TcpStream, S)>>;

    fn accept(&self, stream: TcpStream, service: S) -> Self::Future {
        // Best effort: without it the connection still works, only slower.
        let _ = stream.set_nodelay(true);
        std::future::ready(Ok((stream, service)))
    }
}

/// Serve `app` over HTTPS on `listener` with `first` (from [`tls_config`]) until `shutdown` is
/// cancelled; requests in flight then get a few seconds to finish.
pub async fn serve(
    listener: TcpListener,
    first: rustls::ServerConfig,
    files: CertFiles,
    limits: Limits,
    app: Router,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let config = RustlsConfig::from_config(Arc::new(first));
    let handle = axum_server::Handle::<std::net::SocketAddr>::new();
    let acceptor = RustlsAcceptor::new(config.clone())
        .handshake_timeout(limits.handshake)
        .acceptor(NoDelay);
    let mut server = axum_server::Server::from_listener(listener)
        .acceptor(acceptor)
        .handle(handle.clone())
        .http1_only()
        .first_request_timeout(limits.header_read)
        .accept_error_handler(|peer, e| {
            warn!(?peer, error = %e, "webhook connection refused (TLS handshake or accept)");
        });
    server
        .http_builder()
        .http1()
        .header_read_timeout(limits.header_read);
    let app = app.layer(DefaultBodyLimit::max(limits.body_bytes));
    let stop = async {
        shutdown.cancelled().await;
        handle.graceful_shutdown(Some(DRAIN));
    };
    let beside = async {
        tokio::join!(reload_on_change(&files, &config, &shutdown), stop);
        std::future::pending::<Infallible>().await
    };
    tokio::select! {
        served = server.serve(app.into_make_service()) => served.context("serving the webhook"),
        never = beside => match never {},
    }
}

/// Read both files every `reload_every`; a changed pair that loads is served to new
/// connections. Polling sees every way the files get replaced (the kubelet swaps a Secret
/// volume's symlinks); a pair caught mid-rotation, or broken, keeps the previous one served and
/// is tried again once it changes.
async fn reload_on_change(files: &CertFiles, config: &RustlsConfig, shutdown: &CancellationToken) {
    async fn read(f: &CertFiles) -> (Option<Vec<u8>>, Option<Vec<u8>>) {
        (
            tokio::fs::read(&f.cert).await.ok(),
            tokio::fs::read(&f.key).await.ok(),
        )
    }
    let mut served = read(files).await;
    let mut refused = None;
    let mut tick = tokio::time::interval(files.reload_every.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let now = read(files).await;
        if now == served || refused.as_ref() == Some(&now) {
            continue;
        }
        let loaded = match &now {
            (Some(cert), Some(key)) => tls_config_pem(cert, key),
            _ => Err(anyhow::anyhow!("a file is missing")),
        };
        match loaded {
            Ok(cfg) => {
                config.reload_from_config(Arc::new(cfg));
                info!(cert = %files.cert.display(), "webhook certificate reloaded");
                served = now;
                refused = None;
            }
            Err(e) => {
                warn!(cert = %files.cert.display(), key = %files.key.display(), error = %format!("{e:#}"),
                    "the changed webhook certificate does not load; still serving the previous one");
                refused = Some(now);
            }
        }
    }
}
