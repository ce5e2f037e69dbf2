//! What a replica connects and listens with: its connections to etcd and its gRPC endpoint's
//! certificate and authenticator; and [`StartError`], why a replica cannot start.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};
use gpuledger_auth::client::CredentialError;
use gpuledger_auth::tls::TlsError;
use gpuledger_ops::kube_client::KubeClientError;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::archive::ArchiveError;
use crate::config::{Config, EtcdTls};
use crate::shared::Shared;

/// Why a replica cannot start. Each names the flag or the file to look at; the error it wraps,
/// if any, is its [`source`](std::error::Error::source).
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// etcd TLS is configured, but this endpoint would be dialled without it.
    #[error("etcd TLS is configured but endpoint {0} is http://; use https://")]
    PlainEtcd(String),
    /// A file of the etcd TLS configuration cannot be read.
    #[error("reading the etcd {what} {}", path.display())]
    Read {
        /// Which file it is (CA, client certificate, client key).
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// Why it cannot be read.
        source: std::io::Error,
    },
    /// The etcd client cannot be made.
    #[error("connecting to etcd at {endpoints}")]
    Etcd {
        /// The endpoints, comma-separated.
        endpoints: String,
        /// What the etcd client said.
        source: etcd_client::Error,
    },
    /// A port to serve on cannot be bound.
    #[error("listening on {flag}{addr}")]
    Listen {
        /// The flag that names it, with a space after it ("" for the gRPC API's --listen).
        flag: &'static str,
        /// The address.
        addr: SocketAddr,
        /// Why it cannot be bound.
        source: std::io::Error,
    },
    /// The archive directory cannot be opened.
    #[error("opening --archive-dir {}", dir.display())]
    Archive {
        /// The directory.
        dir: PathBuf,
        /// Why it cannot be opened.
        source: ArchiveError,
    },
    /// The gRPC API's certificate cannot be loaded.
    #[error("loading the gRPC API's certificate (--tls-cert, --tls-key, --client-ca)")]
    Tls(#[source] TlsError),
    /// The Kubernetes client that reviews callers' tokens cannot be made.
    #[error("the Kubernetes client that reviews callers' tokens")]
    Kube(#[source] KubeClientError),
    /// Nothing would tell one caller from another.
    #[error(
        "no way to tell callers apart: without a Kubernetes API to review tokens, set --client-ca (client certificates)"
    )]
    NoCallerIdentity,
    /// This replica's credentials towards the other replicas cannot be loaded.
    #[error(
        "this replica's credentials for calling the other replicas (--allocator-ca and --token-file or --client-cert/--client-key)"
    )]
    Peers(#[source] CredentialError),
}

/// Connect to etcd (lazily: the connection is made by the first request).
pub async fn connect(endpoints: &[String], tls: Option<&EtcdTls>) -> Result<Client, StartError> {
    let mut opts = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(1))
        .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
        .with_require_leader(true);
    if let Some(t) = tls {
        if let Some(plain) = endpoints.iter().find(|e| e.starts_with("http://")) {
            return Err(StartError::PlainEtcd(plain.clone()));
        }
        let read = |path: &Path, what: &'static str| {
            std::fs::read(path).map_err(|source| StartError::Read {
                what,
                path: path.to_path_buf(),
                source,
            })
        };
        let mut o = TlsOptions::new();
        if let Some(ca) = &t.ca {
            o = o.ca_certificate(Certificate::from_pem(read(ca, "CA")?));
        }
        if let Some((cert, key)) = &t.identity {
            o = o.identity(Identity::from_pem(
                read(cert, "client certificate")?,
                read(key, "client key")?,
            ));
        }
        opts = opts.with_tls(o);
    }
    Client::connect(endpoints, Some(opts))
        .await
        .map_err(|source| StartError::Etcd {
            endpoints: endpoints.join(","),
            source,
        })
}

/// The gRPC endpoint's certificate and authenticator: client certificates from --client-ca,
/// and ServiceAccount tokens reviewed by the API server when this replica has one.
pub(super) async fn security(
    cfg: &Config,
    shared: &Shared,
    stop: &CancellationToken,
) -> Result<crate::grpc::Security, StartError> {
    use gpuledger_auth::token::{KubeApi, ServiceAccounts, TokenAuthenticator};
    let l = &cfg.limits;
    let bites = shared.metrics.bites.clone();
    let tls = cfg.tls.load(&[b"h2"]).map_err(StartError::Tls)?;
    tls.spawn_reloader(cfg.tls.reload_every(), stop.clone());
    let tokens = if crate::kube_watch::enabled(&cfg.kube) {
        let client = gpuledger_ops::kube_client::client(cfg.kube.kubeconfig.as_deref())
            .await
            .map_err(StartError::Kube)?;
        client.map(|c| {
            let api = Arc::new(KubeApi(c));
            Arc::new(
                TokenAuthenticator::new(
                    api.clone(),
                    api,
                    ServiceAccounts::in_namespace(&cfg.auth_namespace),
                    Duration::from_secs(cfg.token_cache_max_s.max(1)),
                )
                .with_failure_limit(l.max_failed_token_reviews_per_peer, bites.clone()),
            )
        })
    } else {
        None
    };
    if tokens.is_none() {
        if cfg.tls.client_ca.is_none() {
            return Err(StartError::NoCallerIdentity);
        }
        warn!(
            "no Kubernetes API: callers authenticate with client certificates only, and the extender's pods cannot be checked"
        );
    }
    let open_files = gpuledger_auth::limit::raise_open_files();
    let fds_needed = (l.max_connections as u64).saturating_add(1024);
    if open_files.is_some_and(|n| n < fds_needed) {
        warn!(
            open_files = ?open_files,
            max_connections = l.max_connections,
            "the open-file limit is below --max-connections plus room for etcd and the API \
             server: a flood of connections could exhaust file descriptors before the limit \
             bites; lower --max-connections or raise the limit (ulimit -n)"
        );
    }
    Ok(crate::grpc::Security {
        tls,
        listener: gpuledger_auth::tls::ListenerLimits {
            hello_timeout: Duration::from_millis(l.tls_hello_timeout_ms.max(10)),
            handshake_timeout: cfg.tls.handshake_timeout(),
            max_handshakes: l.max_tls_handshakes,
            max_handshakes_per_peer: l.max_tls_handshakes_per_peer,
            max_connections: l.max_connections,
            max_connections_per_peer: l.max_connections_per_peer,
        },
        max_streams_per_connection: l.max_streams_per_connection,
        keepalive: (l.keepalive_ms > 0).then(|| Duration::from_millis(l.keepalive_ms)),
        authenticator: gpuledger_auth::Authenticator::with_limits(
            tokens,
            gpuledger_auth::CallerLimits {
                max_in_flight: l.max_in_flight_per_identity,
                pause: Duration::from_millis(l.over_limit_pause_ms),
                body_timeout: Duration::from_millis(l.request_body_timeout_ms),
                max_body: crate::grpc::MAX_REQUEST_BODY,
            },
            bites.clone(),
        ),
        bites,
    })
}

/// `scheme://host:port` without the scheme and a trailing slash, to compare etcd URLs.
fn bare_url(u: &str) -> &str {
    let u = u.trim_end_matches('/');
    u.split_once("://").map_or(u, |(_, rest)| rest)
}

/// A connection to the etcd member that is raft leader now, for the ledger's commits, when
/// that member is one of the configured endpoints (behind a load balancer or a DNS name there
/// is nothing to pick: `None`, and commits go through the shared connection). Looked up once
/// per leadership: if etcd's leader moves later, the commits still succeed through the old
/// member (forwarded), and a failed commit ends the leadership anyway.
pub(super) async fn etcd_leader_client(cfg: &Config, client: &Client) -> Option<Client> {
    if cfg.etcd_endpoints.len() < 2 {
        return None;
    }
    let mut c = client.clone();
    let find = async {
        let leader = c.status().await.ok()?.leader();
        let members = c.member_list().await.ok()?;
        let m = members.members().iter().find(|m| m.id() == leader)?;
        cfg.etcd_endpoints
            .iter()
            .find(|e| m.client_urls().iter().any(|u| bare_url(u) == bare_url(e)))
            .cloned()
    };
    let timeout = Duration::from_millis(cfg.etcd_timeout_ms);
    let endpoint = tokio::time::timeout(timeout, find).await.ok().flatten()?;
    match connect(std::slice::from_ref(&endpoint), cfg.etcd_tls().as_ref()).await {
        Ok(w) => {
            info!(%endpoint, "ledger commits go to the etcd leader member");
            Some(w)
        }
        Err(e) => {
            warn!(%endpoint, error = &e as &dyn std::error::Error, "no connection to the etcd leader member; committing through any member");
            None
        }
    }
}
