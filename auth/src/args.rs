//! The command-line flags every gpuledger server shares for TLS, client identities and its
//! plain port of probes and metrics.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rustls::ServerConfig;

use crate::tls::{ClientCerts, Reloading, TlsError, server_config};

/// A server's certificate, and whose client certificates it accepts.
#[derive(Debug, Clone, clap::Args)]
pub struct ServerTlsArgs {
    /// PEM certificate this server presents (cert-manager's `tls.crt`); re-read when it changes.
    #[arg(long = "tls-cert", env = "GPULEDGER_TLS_CERT")]
    pub cert: PathBuf,
    /// PEM private key of --tls-cert (`tls.key`).
    #[arg(long = "tls-key", env = "GPULEDGER_TLS_KEY")]
    pub key: PathBuf,
    /// PEM CA bundle whose client certificates are accepted as identities (a
    /// `spiffe://gpuledger/<role>[/<name>]` URI SAN). Without it, clients identify with
    /// ServiceAccount tokens only.
    #[arg(long = "client-ca", env = "GPULEDGER_CLIENT_CA")]
    pub client_ca: Option<PathBuf>,
    /// How often the certificate, key and CA files are checked for changes, in milliseconds.
    #[arg(
        long = "tls-reload-ms",
        env = "GPULEDGER_TLS_RELOAD_MS",
        default_value_t = 10_000
    )]
    pub reload_ms: u64,
    /// A TLS handshake not finished within this many milliseconds is cut (slow clients hold
    /// up nobody either way: each handshake runs on its own task).
    #[arg(
        long = "tls-handshake-timeout-ms",
        env = "GPULEDGER_TLS_HANDSHAKE_TIMEOUT_MS",
        default_value_t = 5_000
    )]
    pub handshake_timeout_ms: u64,
}

impl ServerTlsArgs {
    /// The configuration these files give, offering `alpn`, asking for client certificates
    /// (optional ones) when --client-ca is set.
    pub fn load(&self, alpn: &[&[u8]]) -> Result<Arc<Reloading<ServerConfig>>, TlsError> {
        let clients = match &self.client_ca {
            Some(ca) => ClientCerts::Optional(ca.clone()),
            None => ClientCerts::None,
        };
        server_config(&self.cert, &self.key, clients, alpn)
    }

    /// How often to check the files.
    pub fn reload_every(&self) -> Duration {
        Duration::from_millis(self.reload_ms.max(100))
    }

    /// The handshake timeout.
    pub fn handshake_timeout(&self) -> Duration {
        Duration::from_millis(self.handshake_timeout_ms.max(100))
    }
}

/// The bounds of a server's plain HTTP port (`/healthz`, `/readyz`, `/metrics`): the kubelet's
/// probes and Prometheus need a handful of connections, nothing more.
#[derive(Debug, Clone, clap::Args)]
pub struct PlainHttpArgs {
    /// Open connections at once on the plain HTTP port; when it is full, a peer holding few
    /// takes the slot of an idle connection of the peer holding the most, else the new
    /// connection is closed at once.
    #[arg(
        id = "http_max_connections",
        value_name = "HTTP_MAX_CONNECTIONS",
        long = "http-max-connections",
        env = "GPULEDGER_HTTP_MAX_CONNECTIONS",
        default_value_t = 256
    )]
    pub max_connections: usize,
    /// Open connections at once on the plain HTTP port from one peer address.
    #[arg(
        id = "http_max_connections_per_peer",
        value_name = "HTTP_MAX_CONNECTIONS_PER_PEER",
        long = "http-max-connections-per-peer",
        env = "GPULEDGER_HTTP_MAX_CONNECTIONS_PER_PEER",
        default_value_t = 32
    )]
    pub max_connections_per_peer: usize,
    /// Longest wait for a request's headers on the plain HTTP port, in milliseconds (and so
    /// the longest a kept-alive connection may sit idle).
    #[arg(
        id = "http_header_read_timeout_ms",
        value_name = "HTTP_HEADER_READ_TIMEOUT_MS",
        long = "http-header-read-timeout-ms",
        env = "GPULEDGER_HTTP_HEADER_READ_TIMEOUT_MS",
        default_value_t = 5_000
    )]
    pub header_read_timeout_ms: u64,
}

impl PlainHttpArgs {
    /// The limits these flags give.
    pub fn limits(&self) -> crate::https::Limits {
        crate::https::Limits::plain(
            self.max_connections,
            self.max_connections_per_peer,
            Duration::from_millis(self.header_read_timeout_ms.max(100)),
        )
    }
}
