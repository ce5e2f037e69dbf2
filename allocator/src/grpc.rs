//! The gRPC server, built in this one place with the layers every RPC passes through: a
//! `tracing` span per RPC that carries the ids that matter, and authentication (TLS, then the
//! caller's certificate or token) in front of the service, which authorizes each call.
//!
//! The span is opened by a tower layer for every call, named after the method, with the ids
//! left empty; [`Ids`] says which ids each request and response holds, and the service records
//! them (`service::traced`), so every log line of the call carries them.

use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::allocator::v1::allocator_server::AllocatorServer;
use std::sync::Arc;
use std::time::Duration;

use gpuledger_auth::limit::Bites;
use gpuledger_auth::tls::{ListenerLimits, Reloading};
use gpuledger_auth::{AuthLayer, Authenticator};
use rustls::ServerConfig;
use tokio_util::sync::CancellationToken;
use tonic::codegen::http;
use tower_http::trace::{DefaultOnFailure, DefaultOnResponse, TraceLayer};
use tracing::field::{Empty, display};
use tracing::{Level, Span, info_span, warn};

use crate::service::Service;

/// Largest request accepted (a filter over tens of thousands of nodes; writes are held to far
/// less by the service).
const MAX_REQUEST: usize = 4 * 1024 * 1024;
/// Largest answer sent (a dump of a large ledger).
const MAX_ANSWER: usize = 256 * 1024 * 1024;

/// The span of one RPC: its method, and the ids its request and answer fill in.
fn rpc_span<B>(req: &http::Request<B>) -> Span {
    info_span!(
        "rpc",
        method = %req.uri().path().rsplit('/').next().unwrap_or(""),
        pod_uid = Empty,
        allocation = Empty,
        node = Empty,
        seq = Empty,
        epoch = Empty,
        caller = Empty,
    )
}

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

/// The ids a request or an answer holds, recorded into the RPC's span.
pub trait Ids {
    /// Record what this message says into `span` (fields the span does not have are ignored).
    fn record(&self, _span: &Span) {}
}

fn pod_of(r: Option<&api::PodRequest>, span: &Span) {
    if let Some(p) = r.and_then(|r| r.pod.as_ref()) {
        span.record("pod_uid", display(&p.uid));
    }
}

fn node(n: &str, span: &Span) {
    if !n.is_empty() {
        span.record("node", display(n));
    }
}

fn allocation(id: u64, span: &Span) {
    if id > 0 {
        span.record("allocation", id);
    }
}

fn at(seq: u64, epoch: u64, span: &Span) {
    span.record("seq", seq);
    span.record("epoch", epoch);
}

impl Ids for api::RegisterNodeRequest {
    fn record(&self, span: &Span) {
        if let Some(i) = &self.inventory {
            node(&i.node, span);
        }
    }
}

impl Ids for api::RemoveNodeRequest {
    fn record(&self, span: &Span) {
        node(&self.node, span);
    }
}

impl Ids for api::SetDeviceHealthRequest {
    fn record(&self, span: &Span) {
        node(&self.node, span);
    }
}

impl Ids for api::SetBudgetRequest {}
impl Ids for api::SetQuotaRequest {}

impl Ids for api::FilterRequest {
    fn record(&self, span: &Span) {
        pod_of(self.request.as_ref(), span);
    }
}

impl Ids for api::ScoreRequest {
    fn record(&self, span: &Span) {
        pod_of(self.request.as_ref(), span);
    }
}

impl Ids for api::ReserveRequest {
    fn record(&self, span: &Span) {
        pod_of(self.request.as_ref(), span);
        node(&self.node, span);
    }
}

impl Ids for api::ConfirmBoundRequest {
    fn record(&self, span: &Span) {
        span.record("pod_uid", display(&self.pod_uid));
        node(&self.node, span);
    }
}

impl Ids for api::AssignRequest {
    fn record(&self, span: &Span) {
        node(&self.node, span);
        allocation(self.allocation_id, span);
    }
}

impl Ids for api::CorrectIdentityRequest {
    fn record(&self, span: &Span) {
        node(&self.node, span);
        allocation(self.from_allocation_id, span);
    }
}

impl Ids for api::ReleaseRequest {
    fn record(&self, span: &Span) {
        if !self.pod_uid.is_empty() {
            span.record("pod_uid", display(&self.pod_uid));
        }
        allocation(self.allocation_id, span);
    }
}

impl Ids for api::ReportViolationRequest {
    fn record(&self, span: &Span) {
        if let Some(v) = &self.violation {
            node(&v.node, span);
            allocation(v.allocation_id, span);
        }
    }
}

impl Ids for api::SubscribeRequest {
    fn record(&self, span: &Span) {
        node(&self.node, span);
    }
}

impl Ids for api::ReplicateRequest {}
impl Ids for api::ReadLogRequest {}
impl Ids for api::ReadSnapshotsRequest {}
impl Ids for api::StatusRequest {}
impl Ids for api::DumpRequest {}
impl Ids for api::StatusResponse {}
impl Ids for api::DumpResponse {}
impl Ids for api::FilterResponse {}
impl Ids for api::ScoreResponse {}

impl Ids for api::WriteResponse {
    fn record(&self, span: &Span) {
        at(self.seq, self.epoch, span);
    }
}

impl Ids for api::ReserveResponse {
    fn record(&self, span: &Span) {
        at(self.seq, self.epoch, span);
        if let [one] = self.allocations.as_slice() {
            allocation(one.id, span);
        }
    }
}

impl Ids for api::AssignResponse {
    fn record(&self, span: &Span) {
        at(self.seq, self.epoch, span);
    }
}
