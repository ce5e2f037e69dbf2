//! The span of one RPC and the ids that fill it in.
//!
//! The gRPC server's tower layer opens the span for every call, named after the method, with
//! the ids left empty; [`Ids`] says which ids each request and response holds, and the service
//! records them (`service::traced`), so every log line of the call carries them.

use gpuledger_proto::allocator::v1 as api;
use tonic::codegen::http;
use tracing::field::{Empty, display};
use tracing::{Span, info_span};

/// The span of one RPC: its method, and the ids its request and answer fill in.
pub fn rpc_span<B>(req: &http::Request<B>) -> Span {
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

impl Ids for api::PrepareClaimRequest {
    fn record(&self, span: &Span) {
        node(&self.node, span);
        allocation(self.allocation_ids.first().copied().unwrap_or(0), span);
    }
}

impl Ids for api::UnprepareClaimRequest {
    fn record(&self, span: &Span) {
        node(&self.node, span);
        allocation(self.allocation_ids.first().copied().unwrap_or(0), span);
    }
}

impl Ids for api::GrantClaimRequest {
    fn record(&self, span: &Span) {
        if let Some(g) = &self.grant {
            node(&g.node, span);
        }
    }
}

impl Ids for api::RefuseClaimRequest {
    fn record(&self, span: &Span) {
        if let Some(r) = &self.refusal {
            node(&r.node, span);
        }
    }
}

impl Ids for api::AdoptRequest {
    fn record(&self, span: &Span) {
        node(&self.node, span);
        if let Some(p) = &self.pod {
            span.record("pod_uid", display(&p.uid));
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

impl Ids for api::PreemptRequest {
    fn record(&self, span: &Span) {
        pod_of(self.request.as_ref(), span);
    }
}

impl Ids for api::PreemptResponse {
    fn record(&self, span: &Span) {
        at(self.seq, self.epoch, span);
        if let Some(n) = &self.nomination {
            node(&n.node, span);
        }
    }
}
