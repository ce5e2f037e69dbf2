//! HTTPS and plain HTTP for axum routers (axum-server, over rustls for HTTPS): connections
//! (total and per peer, a newcomer taking an idle connection's slot from the heaviest peer
//! when full), TLS handshakes, header reads and bodies are bounded, and the certificate follows
//! its files ([`Reloading`]), so a rotation needs no restart. The webhook, the extender's
//! scheduler-facing port and the test kit's API server serve HTTPS through [`serve`]; every
//! plain port of probes and metrics serves through [`serve_plain`]. Handlers learn the peer's
//! address from `ConnectInfo<SocketAddr>`.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::extract::connect_info::ConnectInfo;
use axum::extract::{DefaultBodyLimit, Request};
use axum::middleware::AddExtension;
use axum::response::Response;
use axum_server::accept::Accept;
use axum_server::tls_rustls::{RustlsAcceptor, RustlsConfig};
use rustls::ServerConfig;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tower_http::timeout::RequestBodyDeadlineLayer;
use tracing::debug;

use crate::limit::{Bites, Conn, Held, Slots, peer_key};
use crate::tls::{Reloading, bite as tls_bite};

/// How long requests in flight may finish after shutdown is asked for.
const DRAIN: Duration = Duration::from_secs(5);

/// What clients may hold of the server.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Longest TLS handshake.
    pub handshake: Duration,
    /// Longest wait for a request's headers, the first request's included (and so the longest
    /// a kept-alive connection may sit idle).
    pub header_read: Duration,
    /// Largest request body, in bytes (413 above it).
    pub body_bytes: usize,
    /// Longest time a request's body may take to arrive, however it trickles in.
    pub body_time: Duration,
    /// Open connections at once (handshakes included); 0 = no bound.
    pub max_connections: usize,
    /// Open connections at once from one peer address; 0 = no bound.
    pub max_connections_per_peer: usize,
    /// After answering a request whose body was not read (413), how long what the client still
    /// sends is read and dropped before the connection is closed, so that the client reads the
    /// answer instead of a reset connection.
    pub linger: Duration,
}

impl Default for Limits {
    /// The API server gives a webhook 10 s and kube-scheduler an extender 5 s by default, so a
    /// client slower than that to shake hands, send headers or send its body is not one worth
    /// waiting for. 2 MiB bodies (axum's default) hold any pod or extender request: etcd
    /// refuses objects over 1.5 MiB. The API server and kube-scheduler are a few addresses
    /// with a pool of connections each.
    fn default() -> Self {
        Limits {
            handshake: Duration::from_secs(10),
            header_read: Duration::from_secs(10),
            body_bytes: 2 << 20,
            body_time: Duration::from_secs(10),
            max_connections: 1024,
            max_connections_per_peer: 256,
            linger: Duration::from_secs(2),
        }
    }
}

impl Limits {
    /// The bounds of a plain port of probes and metrics: `max_connections` (`per_peer` from
    /// one address), `header_read` for a request's head; its GET requests carry no body, so
    /// 64 KiB arriving within `header_read` is plenty.
    pub fn plain(max_connections: usize, per_peer: usize, header_read: Duration) -> Self {
        Limits {
            header_read,
            body_bytes: 64 << 10,
            body_time: header_read,
            max_connections,
            max_connections_per_peer: per_peer,
            ..Limits::default()
        }
    }
}

/// The limit names [`serve`] and [`serve_plain`] count refusals under (besides
/// [`crate::tls::bite`]'s connection limits for HTTPS).
pub mod bite {
    /// A request body over the size limit (413).
    pub const BODY_BYTES: &str = "http_body_bytes";
    /// A request body that did not arrive in time (408).
    pub const BODY_TIME: &str = "http_body_time";
    /// An idle connection of the peer holding the most was closed to admit a peer holding
    /// fewer, the listener being full.
    pub const CONNECTIONS_EVICTED: &str = super::tls_bite::CONNECTIONS_EVICTED;
    /// Plain HTTP: every connection slot was taken.
    pub const HTTP_CONNECTIONS: &str = "http_connections";
    /// Plain HTTP: the peer held as many connections as one peer may.
    pub const HTTP_CONNECTIONS_PER_PEER: &str = "http_connections_per_peer";
    /// Plain HTTP: an idle connection was closed to admit a peer holding fewer.
    pub const HTTP_CONNECTIONS_EVICTED: &str = "http_connections_evicted";
}

/// Admits a connection while the connection limits allow (else closes it at once, before the
/// TLS handshake), with TCP_NODELAY so that an answer leaves at once instead of waiting for the
/// client's delayed ACK; its requests mark it busy, so that only idle connections are evicted.
#[derive(Debug, Clone)]
struct Admit {
    slots: Arc<Slots<IpAddr>>,
    linger: Duration,
}

/// The names [`Admit`] counts refusals and evictions under: all connections, one peer's, an
/// idle connection closed for a newcomer.
type Names = (&'static str, &'static str, &'static str);

/// HTTPS ports count under the TLS listeners' names.
const HTTPS_NAMES: Names = (
    tls_bite::CONNECTIONS,
    tls_bite::CONNECTIONS_PER_PEER,
    bite::CONNECTIONS_EVICTED,
);

/// Plain ports count under names of their own (the allocator's gRPC port and its plain port
/// share one metric without a listener label).
const PLAIN_NAMES: Names = (
    bite::HTTP_CONNECTIONS,
    bite::HTTP_CONNECTIONS_PER_PEER,
    bite::HTTP_CONNECTIONS_EVICTED,
);

impl Admit {
    /// Admission within `limits`, refusals counted as `names`.
    fn new(limits: &Limits, names: Names, bites: &Arc<Bites>) -> Self {
        Admit {
            slots: Slots::evicting(
                (names.0, names.1),
                names.2,
                limits.max_connections,
                limits.max_connections_per_peer,
                bites.clone(),
            ),
            linger: limits.linger,
        }
    }
}

impl<S> Accept<TcpStream, S> for Admit {
    type Stream = Conn;
    type Service = Tracked<S>;
    type Future = std::future::Ready<io::Result<(Conn, Tracked<S>)>>;

    fn accept(&self, stream: TcpStream, service: S) -> Self::Future {
        let peer = match stream.peer_addr() {
            Ok(p) => p,
            Err(e) => return std::future::ready(Err(e)),
        };
        let slot = match self.slots.try_acquire(peer_key(&peer)) {
            Ok(s) => s,
            Err(full) => {
                return std::future::ready(Err(io::Error::other(format!(
                    "too many connections ({full:?})"
                ))));
            }
        };
        // Best effort: without it the connection still works, only slower.
        let _ = stream.set_nodelay(true);
        let held = slot.held().cloned().unwrap_or_default();
        std::future::ready(Ok((
            Conn::new(stream, slot, self.linger),
            Tracked {
                inner: service,
                held,
            },
        )))
    }
}

/// A connection's service that marks the connection busy from a request's arrival until its
/// answer's body is sent, and for good once it is upgraded to another protocol.
#[derive(Debug, Clone)]
pub struct Tracked<S> {
    inner: S,
    held: Arc<Held>,
}

impl<S, B> tower::Service<http::Request<B>> for Tracked<S>
where
    S: tower::Service<http::Request<B>, Response = Response>,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let busy = self.held.busy();
        let held = self.held.clone();
        let answer = self.inner.call(req);
        Box::pin(async move {
            let res = answer.await?;
            if res.status() == http::StatusCode::SWITCHING_PROTOCOLS {
                held.upgraded();
            }
            // The guard lives as long as the body being sent.
            Ok(res.map(|b| {
                axum::body::Body::new(http_body_util::BodyExt::map_err(b, move |e| {
                    let _busy = &busy;
                    e
                }))
            }))
        })
    }
}

/// Turns the errors of the body limits into their status codes and counts them: axum answers
/// a body over the size limit with 413 itself, and any other body error with 400, which for a
/// body that did not arrive in time is 408.
async fn body_errors(
    bites: axum::extract::State<Arc<Bites>>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    let timed_out = Arc::new(AtomicBool::new(false));
    let flag = timed_out.clone();
    let req = req.map(move |b| {
        axum::body::Body::new(http_body_util::BodyExt::map_err(b, move |e| {
            if is_timeout(&e) {
                flag.store(true, Ordering::Relaxed);
            }
            e
        }))
    });
    let mut res = next.run(req).await;
    if res.status() == http::StatusCode::PAYLOAD_TOO_LARGE {
        bites.bite(bite::BODY_BYTES);
    } else if timed_out.load(Ordering::Relaxed) {
        bites.bite(bite::BODY_TIME);
        *res.status_mut() = http::StatusCode::REQUEST_TIMEOUT;
    }
    res
}

fn is_timeout(e: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if s.is::<tower_http::timeout::TimeoutError>() {
            return true;
        }
        source = s.source();
    }
    false
}

/// Serve `app` over HTTPS/1.1 on `listener` with `tls` until `shutdown` is cancelled; requests
/// in flight then get a few seconds to finish. `what` names the listener in logs.
pub async fn serve(
    what: &'static str,
    listener: TcpListener,
    tls: Arc<Reloading<ServerConfig>>,
    limits: Limits,
    bites: Arc<Bites>,
    app: Router,
    shutdown: CancellationToken,
) -> io::Result<()> {
    let admit = Admit::new(&limits, HTTPS_NAMES, &bites);
    let config = RustlsConfig::from_config(tls.current());
    let acceptor = RustlsAcceptor::new(config.clone())
        .handshake_timeout(limits.handshake)
        .acceptor(admit);
    let mut changes = tls.subscribe();
    let follow = async move {
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
    };
    serve_with(what, listener, acceptor, limits, bites, app, follow).await
}

/// Serve `app` over plain HTTP/1.1 on `listener` within `limits` (the handshake's aside) until
/// `shutdown` is cancelled: the ports of probes and metrics, which the kubelet and Prometheus
/// reach without TLS. Connection refusals are counted as [`bite::HTTP_CONNECTIONS`] and
/// [`bite::HTTP_CONNECTIONS_PER_PEER`].
pub async fn serve_plain(
    what: &'static str,
    listener: TcpListener,
    limits: Limits,
    bites: Arc<Bites>,
    app: Router,
    shutdown: CancellationToken,
) -> io::Result<()> {
    let admit = Admit::new(&limits, PLAIN_NAMES, &bites);
    let stopped = shutdown.cancelled_owned();
    serve_with(what, listener, admit, limits, bites, app, stopped).await
}

/// The service each connection gets before [`Admit`] wraps it.
type PerConnection = AddExtension<Router, ConnectInfo<SocketAddr>>;

/// What HTTPS and plain HTTP share: the header read timeout, the body limits, and a graceful
/// shutdown once `follow` ends.
async fn serve_with<Acc>(
    what: &'static str,
    listener: TcpListener,
    acceptor: Acc,
    limits: Limits,
    bites: Arc<Bites>,
    app: Router,
    follow: impl Future<Output = ()>,
) -> io::Result<()>
where
    Acc: Accept<TcpStream, PerConnection> + Clone + Send + Sync + 'static,
    Acc::Stream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send,
    Acc::Service: axum_server::service::SendService<http::Request<hyper::body::Incoming>> + Send,
    Acc::Future: Send,
{
    bites.declare(bite::BODY_BYTES);
    bites.declare(bite::BODY_TIME);
    let handle = axum_server::Handle::<SocketAddr>::new();
    let mut server = axum_server::Server::from_listener(listener)
        .acceptor(acceptor)
        .handle(handle.clone())
        // Protocol detection, not http1_only(): only it serves upgrades (the fake API
        // server's port-forward websocket). ALPN offers what the caller configured.
        .first_request_timeout(limits.header_read)
        // Debug only: under a flood of refused connections a line each would flood the log;
        // the refusals are counted (connection limits) instead.
        .accept_error_handler(move |peer, e| {
            debug!(?peer, listener = what, error = %e, "connection refused (limits, TLS handshake or accept)");
        });
    server
        .http_builder()
        .http1()
        .header_read_timeout(limits.header_read);
    // Outermost first: the body's deadline starts when the request's head is read.
    let app = app
        .layer(DefaultBodyLimit::max(limits.body_bytes))
        .layer(axum::middleware::from_fn_with_state(bites, body_errors))
        .layer(RequestBodyDeadlineLayer::new(limits.body_time));
    let follow = async {
        follow.await;
        handle.graceful_shutdown(Some(DRAIN));
        std::future::pending::<Infallible>().await
    };
    tokio::select! {
        served = server.serve(app.into_make_service_with_connect_info::<SocketAddr>()) => served,
        never = follow => match never {},
    }
}

#[cfg(test)]
mod tests;
