//! Writes: to the local sequencer when this replica leads, else forwarded to the leader
//! (once: a forwarded request is never forwarded again), retried across a failover.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backon::Retryable;
use gpuledger_auth::server::{self, Authenticated};
use gpuledger_auth::{AuthChannel, Credentials};
use gpuledger_ledger::{Command, pb};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::allocator::v1::allocator_client::AllocatorClient;
use tonic::{Request, Response, Status};
use tracing::debug;

use super::Service;
use crate::shared::Shared;
use crate::writer::{Committed, WriteError};

/// Metadata key marking a request already forwarded once (never forwarded twice).
const FORWARDED: &str = "x-gpuledger-forwarded";
/// How long a write may wait for a leader to appear (covers a failover).
const FORWARD_WINDOW: Duration = Duration::from_secs(6);

/// How this replica reaches the leader replica to forward the writes it cannot make itself.
#[derive(Clone)]
pub struct Leaders {
    /// Where the election says who leads.
    etcd: etcd_client::Client,
    /// The election's name in etcd.
    election: String,
    /// This replica's credentials towards the other replicas.
    peers: Credentials,
    /// One channel per leader address seen.
    channels: Arc<Mutex<HashMap<String, AuthChannel>>>,
}

impl Leaders {
    /// Leaders as election `election` in `etcd` names them, called with `peers`.
    pub fn new(etcd: etcd_client::Client, election: String, peers: Credentials) -> Self {
        Leaders {
            etcd,
            election,
            peers,
            channels: Arc::default(),
        }
    }

    /// The leader's address and a channel to it (`refresh`: ask the election again rather
    /// than trust what this replica last heard).
    async fn channel(
        &self,
        shared: &Shared,
        refresh: bool,
    ) -> Result<(String, AuthChannel), Status> {
        let mut addr = shared.role_info().leader;
        if refresh || addr.is_empty() || addr == shared.address {
            match crate::election::current_leader(&self.etcd, &self.election).await {
                Some((a, _)) => addr = a,
                None => {
                    let why = shared.serving().err().unwrap_or_else(|| {
                        "no allocator leader is elected right now (election in progress)".into()
                    });
                    return Err(Status::unavailable(why));
                }
            }
        }
        if addr == shared.address {
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
}

/// Where a write was made.
pub(super) enum Written<R> {
    /// By this replica's sequencer: the command's committed reply.
    Here(Committed),
    /// By the leader replica, which answered the forwarded request.
    There(Response<R>),
}

/// A write request that the leader answers when it is forwarded there.
pub(super) trait Forwardable: Clone + Send + Sync + 'static {
    /// The leader's answer.
    type Answer: HasSeq;

    /// Make the same call on the leader through `client`.
    fn forward(
        client: AllocatorClient<AuthChannel>,
        req: Request<Self>,
    ) -> impl Future<Output = Result<Response<Self::Answer>, Status>> + Send;
}

/// Each write request, forwarded by the client call of the same name.
macro_rules! forwardable {
    ($($request:ident => $answer:ident by $call:ident;)*) => {$(
        impl Forwardable for api::$request {
            type Answer = api::$answer;

            fn forward(
                mut client: AllocatorClient<AuthChannel>,
                req: Request<Self>,
            ) -> impl Future<Output = Result<Response<Self::Answer>, Status>> + Send {
                async move { client.$call(req).await }
            }
        }
    )*};
}

forwardable! {
    RegisterNodeRequest => WriteResponse by register_node;
    RemoveNodeRequest => WriteResponse by remove_node;
    SetDeviceHealthRequest => WriteResponse by set_device_health;
    ReserveRequest => ReserveResponse by reserve;
    ConfirmBoundRequest => WriteResponse by confirm_bound;
    AssignRequest => AssignResponse by assign;
    CorrectIdentityRequest => WriteResponse by correct_identity;
    ReleaseRequest => WriteResponse by release;
    ReportViolationRequest => WriteResponse by report_violation;
    SetBudgetRequest => WriteResponse by set_budget;
    SetQuotaRequest => WriteResponse by set_quota;
    PreemptRequest => PreemptResponse by preempt;
    PrepareClaimRequest => WriteResponse by prepare_claim;
    UnprepareClaimRequest => WriteResponse by unprepare_claim;
    GrantClaimRequest => WriteResponse by grant_claim;
    RefuseClaimRequest => WriteResponse by refuse_claim;
    AdoptRequest => ReserveResponse by adopt;
}

/// How one attempt at a write failed: worth another try (no leader reachable yet), or not.
enum Attempt {
    Again(Status),
    Final(Status),
}

impl Service {
    /// Write `cmd`, which `req` asks for: through this replica's sequencer when it leads,
    /// else by forwarding `req` to the leader replica, looking for the leader again for as
    /// long as a failover takes.
    pub(super) async fn write<Q: Forwardable>(
        &self,
        req: Request<Q>,
        cmd: Command,
    ) -> Result<Written<Q::Answer>, Status> {
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
            let (cmd, actor, inner, auth) = (cmd.clone(), actor.clone(), inner.clone(), &auth);
            async move {
                match self.writer.submit_as(cmd, actor).await {
                    Ok(c) => return Ok(Written::Here(c)),
                    Err(WriteError::NotLeader) => {}
                    Err(e) => return Err(Attempt::Final(e.into())),
                }
                if forwarded {
                    return Err(Attempt::Final(Status::unavailable(
                        "not the leader (forwarded request)",
                    )));
                }
                let (addr, ch) = self
                    .leaders
                    .channel(&self.shared, refresh)
                    .await
                    .map_err(Attempt::Again)?;
                let r = forwarding(inner, auth.as_ref()).map_err(Attempt::Final)?;
                match Q::forward(AllocatorClient::new(ch), r).await {
                    Ok(resp) => {
                        // Read-your-writes through this replica: answer once the write is
                        // folded here too (bounded; the leader has it durably either way).
                        self.shared
                            .wait_applied(resp.get_ref().seq(), Duration::from_secs(2))
                            .await;
                        Ok(Written::There(resp))
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

/// `inner` as it is sent to the leader: marked as forwarded, carrying its caller as the leader
/// verifies it. A token caller's own token, which the leader reviews itself; for a certificate
/// caller, a claim this replica's own certificate vouches for.
fn forwarding<Q>(inner: Q, auth: Option<&Authenticated>) -> Result<Request<Q>, Status> {
    let mut r = Request::new(inner);
    r.metadata_mut()
        .insert(FORWARDED, tonic::metadata::MetadataValue::from_static("1"));
    match auth {
        Some(Authenticated { token: Some(t), .. }) => {
            let v = t
                .0
                .to_str()
                .ok()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| {
                    Status::invalid_argument("the caller's token cannot be forwarded to the leader")
                })?;
            r.metadata_mut().insert(server::FORWARDED_AUTHORIZATION, v);
        }
        Some(a) => {
            if let Some(v) = server::on_behalf_of_holder(&a.holder())
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
    Ok(r)
}

/// The actor recorded for a verified caller.
fn actor_of(c: &gpuledger_auth::identity::Caller) -> pb::Actor {
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

impl HasSeq for api::PreemptResponse {
    fn seq(&self) -> u64 {
        self.seq
    }
}
