//! Writes: to the local sequencer when this replica leads, else forwarded to the leader
//! (once: a forwarded request is never forwarded again), retried across a failover.

use std::time::Duration;

use backon::Retryable;
use gpuledger_auth::AuthChannel;
use gpuledger_auth::server::{self, Authenticated};
use gpuledger_ledger::{Command, pb};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::allocator::v1::allocator_client::AllocatorClient;
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};
use tracing::debug;

use super::Service;
use crate::shared::Committed;

/// Metadata key marking a request already forwarded once (never forwarded twice).
const FORWARDED: &str = "x-gpuledger-forwarded";
/// How long a write may wait for a leader to appear (covers a failover).
const FORWARD_WINDOW: Duration = Duration::from_secs(6);

/// How one attempt at a write failed: worth another try (no leader reachable yet), or not.
enum Attempt {
    Again(Status),
    Final(Status),
}

impl Service {
    /// Submit to the local sequencer when leading, as this replica's own decision (expiry,
    /// node sync); None when not leading (only the leader writes: watchers on followers
    /// observe but do not act).
    pub async fn local(&self, cmd: Command) -> Option<Result<Committed, Status>> {
        let me = self.shared.actor();
        self.local_as(cmd, me).await
    }

    /// [`Service::local`] on behalf of `actor`.
    async fn local_as(&self, cmd: Command, actor: pb::Actor) -> Option<Result<Committed, Status>> {
        let tx = self
            .shared
            .sequencer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()?;
        let (otx, orx) = oneshot::channel();
        if tx
            .send(crate::shared::Request {
                cmd,
                actor: Some(actor),
                reply: otx,
            })
            .await
            .is_err()
        {
            return Some(Err(Status::unavailable("leadership lost; retry")));
        }
        Some(match orx.await {
            Ok(r) => r,
            Err(_) => Err(Status::unavailable("leader stepped down; retry")),
        })
    }

    async fn leader_channel(&self, refresh: bool) -> Result<(String, AuthChannel), Status> {
        let mut addr = self.shared.role_info().leader;
        if refresh || addr.is_empty() || addr == self.shared.address {
            match crate::election::current_leader(&self.etcd, &self.log.election_name()).await {
                Some((a, _)) => addr = a,
                None => {
                    let why = self.shared.serving().err().unwrap_or_else(|| {
                        "no allocator leader is elected right now (election in progress)".into()
                    });
                    return Err(Status::unavailable(why));
                }
            }
        }
        if addr == self.shared.address {
            return Err(Status::unavailable(
                "this replica was leader but is stepping down; retry",
            ));
        }
        if let Some(c) = self
            .channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&addr)
        {
            return Ok((addr, c.clone()));
        }
        let ep = gpuledger_auth::endpoint(&addr)
            .map_err(|e| Status::internal(format!("bad leader address {addr}: {e}")))?
            .connect_timeout(Duration::from_millis(500))
            .tcp_nodelay(true);
        let ch = self.peers.channel(ep);
        self.channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(addr.clone(), ch.clone());
        Ok((addr, ch))
    }

    /// Run `cmd` on the leader: locally, or by forwarding `req` with `call`.
    pub(super) async fn write<Q, R, F, Fut>(
        &self,
        req: Request<Q>,
        cmd: impl Fn() -> Result<Command, Status>,
        local_reply: impl Fn(Committed) -> Result<R, Status>,
        call: F,
    ) -> Result<Response<R>, Status>
    where
        Q: Clone,
        R: HasSeq,
        F: Fn(AllocatorClient<AuthChannel>, Request<Q>) -> Fut,
        Fut: std::future::Future<Output = Result<Response<R>, Status>>,
    {
        let forwarded = req.metadata().get(FORWARDED).is_some();
        let (_, mut extensions, inner) = req.into_parts();
        // The leader judges a forwarded write as its original caller's, and records the
        // replica that forwarded it.
        let auth = extensions.remove::<Authenticated>();
        let actor = auth.as_ref().map_or_else(
            || self.shared.actor(),
            |a| pb::Actor {
                via: a.forwarded_by.clone().unwrap_or_default(),
                ..actor_of(&a.caller)
            },
        );
        let started = tokio::time::Instant::now();
        let mut attempts = 0u32;
        let attempt = || {
            attempts += 1;
            // After a failed forward the leader may have changed: look it up again.
            let refresh = attempts > 1;
            let inner = inner.clone();
            let (cmd, local_reply, call) = (&cmd, &local_reply, &call);
            let auth = auth.as_ref();
            let actor = &actor;
            async move {
                if let Some(r) = self
                    .local_as(cmd().map_err(Attempt::Final)?, actor.clone())
                    .await
                {
                    return r
                        .and_then(local_reply)
                        .map(Response::new)
                        .map_err(Attempt::Final);
                }
                if forwarded {
                    return Err(Attempt::Final(Status::unavailable(
                        "not the leader (forwarded request)",
                    )));
                }
                let (addr, ch) = self.leader_channel(refresh).await.map_err(Attempt::Again)?;
                let mut r = Request::new(inner);
                r.metadata_mut()
                    .insert(FORWARDED, tonic::metadata::MetadataValue::from_static("1"));
                // A token caller's own token, which the leader reviews itself; for a
                // certificate caller, a claim this replica's own certificate vouches for.
                match auth {
                    Some(Authenticated { token: Some(t), .. }) => {
                        let v =
                            t.0.to_str()
                                .ok()
                                .and_then(|v| v.parse().ok())
                                .ok_or_else(|| {
                                    Attempt::Final(Status::invalid_argument(
                                        "the caller's token cannot be forwarded to the leader",
                                    ))
                                })?;
                        r.metadata_mut().insert(server::FORWARDED_AUTHORIZATION, v);
                    }
                    Some(a) => {
                        if let Some(v) = server::on_behalf_of(&a.caller)
                            .to_str()
                            .ok()
                            .and_then(|v| v.parse().ok())
                        {
                            r.metadata_mut().insert(server::ON_BEHALF_OF, v);
                        }
                    }
                    None => {}
                }
                r.set_timeout(Duration::from_secs(10));
                match call(AllocatorClient::new(ch), r).await {
                    Ok(resp) => {
                        // Read-your-writes through this replica: answer once the write is
                        // folded here too (bounded; the leader has it durably either way).
                        self.shared
                            .wait_applied(resp.get_ref().seq(), Duration::from_secs(2))
                            .await;
                        Ok(resp)
                    }
                    Err(s) if s.code() == tonic::Code::Unavailable => {
                        debug!(leader = %addr, error = %s.message(), "forward failed; looking for the leader again");
                        Err(Attempt::Again(s))
                    }
                    Err(s) => Err(Attempt::Final(s)),
                }
            }
        };
        attempt
            .retry(crate::retry::forever(Duration::from_millis(50)))
            .when(|e| matches!(e, Attempt::Again(_)) && started.elapsed() <= FORWARD_WINDOW)
            .await
            .map_err(|(Attempt::Again(s) | Attempt::Final(s))| s)
    }
}

/// The actor recorded for a verified caller.
pub fn actor_of(c: &gpuledger_auth::identity::Caller) -> pb::Actor {
    pb::Actor {
        role: c.role.kind().into(),
        name: c.subject.clone(),
        node: c.node().unwrap_or_default().into(),
        via: String::new(),
    }
}

/// Responses to writes carry the seq they were answered at.
pub trait HasSeq {
    /// The seq of the write (or of the state an idempotent repeat was answered from).
    fn seq(&self) -> u64;
}

impl HasSeq for api::WriteResponse {
    fn seq(&self) -> u64 {
        self.seq
    }
}

impl HasSeq for api::ReserveResponse {
    fn seq(&self) -> u64 {
        self.seq
    }
}

impl HasSeq for api::AssignResponse {
    fn seq(&self) -> u64 {
        self.seq
    }
}
