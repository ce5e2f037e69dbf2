//! HTTPS for axum routers (axum-server over rustls): TLS handshakes, header reads and bodies
//! are bounded, and the certificate follows its files ([`Reloading`]), so a rotation needs no
//! restart. The webhook, the extender's scheduler-facing port and the test kit's API server
//! all serve through this.

use std::convert::Infallible;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum_server::accept::Accept;
use axum_server::tls_rustls::{RustlsAcceptor, RustlsConfig};
use rustls::ServerConfig;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::tls::Reloading;

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
    /// The API server gives a webhook 10 s and kube-scheduler an extender 5 s by default, so a
    /// client slower than that to shake hands or send headers is not one worth waiting for.
    /// 2 MiB bodies (axum's default) hold any pod or extender request: etcd refuses objects over
    /// 1.5 MiB.
    fn default() -> Self {
        Limits {
            handshake: Duration::from_secs(10),
            header_read: Duration::from_secs(10),
            body_bytes: 2 << 20,
        }
    }
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

/// Serve `app` over HTTPS/1.1 on `listener` with `tls` until `shutdown` is cancelled; requests
/// in flight then get a few seconds to finish. `what` names the listener in logs.
pub async fn serve(
    what: &'static str,
    listener: TcpListener,
    tls: Arc<Reloading<ServerConfig>>,
    limits: Limits,
    app: Router,
    shutdown: CancellationToken,
) -> io::Result<()> {
    let config = RustlsConfig::from_config(tls.current());
    let handle = axum_server::Handle::<std::net::SocketAddr>::new();
    let acceptor = RustlsAcceptor::new(config.clone())
        .handshake_timeout(limits.handshake)
        .acceptor(NoDelay);
    let mut server = axum_server::Server::from_listener(listener)
        .acceptor(acceptor)
        .handle(handle.clone())
        // Protocol detection, not http1_only(): only it serves upgrades (the fake API
        // server's port-forward websocket). ALPN offers what the caller configured.
        .first_request_timeout(limits.header_read)
        .accept_error_handler(move |peer, e| {
            warn!(?peer, listener = what, error = %e, "connection refused (TLS handshake or accept)");
        });
    server
        .http_builder()
        .http1()
        .header_read_timeout(limits.header_read);
    let app = app.layer(DefaultBodyLimit::max(limits.body_bytes));
    let mut changes = tls.subscribe();
    let follow = async {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                changed = changes.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    let cfg = changes.borrow_and_update().clone();
                    config.reload_from_config(cfg);
                }
            }
        }
        handle.graceful_shutdown(Some(DRAIN));
        std::future::pending::<Infallible>().await
    };
    tokio::select! {
        served = server.serve(app.into_make_service()) => served,
        never = follow => match never {},
    }
}
