//! The gRPC server, built in this one place with the layers every RPC passes through: a
//! `tracing` span per RPC that carries the ids that matter ([`crate::span`]), and
//! authentication (TLS, then the caller's certificate or token) in front of the service, which
//! authorizes each call.

use std::sync::Arc;
use std::time::Duration;

use gpuledger_auth::limit::Bites;
use gpuledger_auth::tls::{ListenerLimits, Reloading};
use gpuledger_auth::{AuthLayer, Authenticator};
use gpuledger_proto::allocator::v1::allocator_server::AllocatorServer;
use rustls::ServerConfig;
use tokio_util::sync::CancellationToken;
use tonic::codegen::http;
use tower_http::trace::{DefaultOnFailure, DefaultOnResponse, TraceLayer};
use tracing::{Level, Span, warn};

use crate::service::Service;
use crate::span::rpc_span;

/// Largest request accepted (a filter over tens of thousands of nodes; writes are held to far
/// less by the service).
const MAX_REQUEST: usize = 4 * 1024 * 1024;
/// Largest request body read before a call is answered: one message and its gRPC frame header.
pub(crate) const MAX_REQUEST_BODY: usize = MAX_REQUEST + 5;
/// Largest answer sent (a dump of a large ledger).
const MAX_ANSWER: usize = 256 * 1024 * 1024;

/// How the gRPC endpoint proves itself and learns who calls it, and what a caller may hold.
pub struct Security {
    /// The server certificate (reloaded when its files change).
    pub tls: Arc<Reloading<ServerConfig>>,
    /// Connections and TLS handshakes admitted, in total and per peer address.
    pub listener: ListenerLimits,
    /// Concurrent streams on one HTTP/2 connection.
    pub max_streams_per_connection: u32,
    /// HTTP/2 keep-alive ping interval (None = off); the peer must answer within half of it.
    pub keepalive: Option<Duration>,
    /// Who each request is from (client certificate or ServiceAccount token).
    pub authenticator: Arc<Authenticator>,
    /// Where refusals by the limits are counted.
    pub bites: Arc<Bites>,
}

/// Serve `service` on `listener` over TLS, every request authenticated by `security` before
/// the service sees it (and authorized by the service), until `stop` is cancelled (then finish
/// the calls in flight).
pub async fn serve(
    service: Service,
    listener: tokio::net::TcpListener,
    security: Security,
    stop: CancellationToken,
) {
    let spans = TraceLayer::new_for_grpc()
        .make_span_with(rpc_span as fn(&http::Request<_>) -> Span)
        // A refused request is an answer, not a server failure: no error line for it.
        .on_response(DefaultOnResponse::new().level(Level::DEBUG))
        .on_failure(DefaultOnFailure::new().level(Level::DEBUG));
    // Each accepted socket gets TCP_NODELAY before its handshake: without it Nagle + delayed
    // ACK add ~40 ms to large answers.
    let incoming = gpuledger_auth::tls::incoming(
        listener,
        security.tls,
        security.listener,
        security.bites,
        stop.clone(),
    );
    let served = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .max_concurrent_streams(security.max_streams_per_connection.max(1))
        .http2_keepalive_interval(security.keepalive)
        .http2_keepalive_timeout(security.keepalive.map(|k| k / 2))
        .layer(spans)
        .layer(AuthLayer(security.authenticator))
        .add_service(
            AllocatorServer::new(service)
                .max_decoding_message_size(MAX_REQUEST)
                .max_encoding_message_size(MAX_ANSWER),
        )
        .serve_with_incoming_shutdown(incoming, stop.cancelled_owned())
        .await;
    if let Err(e) = served {
        warn!(error = %e, "the gRPC endpoint stopped");
    }
}
