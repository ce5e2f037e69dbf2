//! What every RPC passes through after authentication: authorization, the size and rate
//! limits of its caller, and the ids of its request and answer in its span.

use std::future::Future;
use std::pin::Pin;

use futures::{Stream, StreamExt};
use gpuledger_auth::identity::Holder;
use gpuledger_auth::limit::Slot;
use gpuledger_auth::rules::Call;
use tonic::{Request, Response, Status};
use tracing::Span;

use super::Service;
use crate::authz::Touches;
use crate::span::Ids;

pub(super) type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

impl<T> Ids for BoxStream<T> {}

/// `r`'s stream, holding `slot` until the stream is dropped (the client went away or it ended).
pub(super) fn holding<T: Send + 'static>(
    r: Result<Response<BoxStream<T>>, Status>,
    slot: Option<Slot<Holder>>,
) -> Result<Response<BoxStream<T>>, Status> {
    r.map(|resp| {
        resp.map(|s| -> BoxStream<T> {
            Box::pin(s.map(move |item| {
                let _held = &slot;
                item
            }))
        })
    })
}

/// Largest write request: a node of 64 GPUs or a pod of 64 containers is a few KiB, and each
/// write's events must fit one etcd transaction (1.5 MiB) with room to spare.
const MAX_WRITE_BYTES: usize = 256 * 1024;

/// Run an RPC's handler, if its caller may make `call`, with the ids of its request, then of
/// its answer, in its span.
pub(super) async fn traced<Q: Ids + Touches + prost::Message, R: Ids, Fut>(
    svc: &Service,
    call: Call,
    req: Request<Q>,
    handler: impl FnOnce(Request<Q>) -> Fut,
) -> Result<Response<R>, Status>
where
    Fut: Future<Output = Result<Response<R>, Status>>,
{
    let span = Span::current();
    req.get_ref().record(&span);
    let caller = svc.authz.check(&req, call, &svc.shared).await?;
    let holder = req
        .extensions()
        .get::<gpuledger_auth::server::Authenticated>()
        .map_or_else(
            || Holder {
                caller: caller.clone(),
                instance: String::new(),
            },
            gpuledger_auth::server::Authenticated::holder,
        );
    if call.writes() && req.get_ref().encoded_len() > MAX_WRITE_BYTES {
        // A larger event could not fit one etcd transaction: refused here, it never reaches
        // the sequencer (where a failed commit would end the leadership).
        return Err(Status::invalid_argument(format!(
            "{} request of {} bytes: writes are limited to {MAX_WRITE_BYTES} bytes",
            call.name(),
            req.get_ref().encoded_len()
        )));
    }
    span.record("caller", tracing::field::display(&caller));
    svc.read_limits.admit(&holder, call).await?;
    if call.writes() {
        svc.write_limits.admit(
            &caller,
            call,
            req.get_ref().encoded_len(),
            &svc.shared.metrics,
        )?;
    }
    let answer = handler(req).await;
    if let Ok(a) = &answer {
        a.get_ref().record(&span);
    }
    answer
}
