//! The gRPC API. Reads are served from this replica's committed state; writes go to the
//! leader's sequencer, here or — forwarded transparently — on the leader replica.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::Stream;
use gpuledger_ledger::placement;
use gpuledger_ledger::{Command, CommandError, PodRequest, Reply, pb};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::allocator::v1::allocator_client::AllocatorClient;
use gpuledger_proto::allocator::v1::allocator_server::Allocator;
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};
use tracing::debug;

use crate::log::EtcdLog;
use crate::shared::{Committed, Role, Shared};
use crate::workload::Learned;

/// Metadata key marking a request already forwarded once (never forwarded twice).
const FORWARDED: &str = "x-gpuledger-forwarded";
/// How long a write may wait for a leader to appear (covers a failover).
const FORWARD_WINDOW: Duration = Duration::from_secs(6);

/// Map a refused command to a gRPC status.
pub fn status_of(e: &CommandError) -> Status {
    match e {
        CommandError::Invalid(m) => Status::invalid_argument(m.clone()),
        CommandError::NotFound(m) => Status::not_found(m.clone()),
        CommandError::NoCapacity(m) => Status::resource_exhausted(m.clone()),
        CommandError::Unsatisfiable(m) => Status::failed_precondition(m.clone()),
        CommandError::Conflict(m) => Status::already_exists(m.clone()),
        CommandError::Bug(m) => Status::internal(m.to_string()),
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Convert an API pod request into the ledger's form (no policy = binpack), rejecting what is
/// malformed.
pub fn pod_request(r: Option<api::PodRequest>) -> Result<PodRequest, Status> {
    decode(r, gpuledger_ledger::Policy::default())
}

fn decode(
    r: Option<api::PodRequest>,
    default_policy: gpuledger_ledger::Policy,
) -> Result<PodRequest, Status> {
    let r = r.ok_or_else(|| Status::invalid_argument("request is missing"))?;
    PodRequest::from_pb(r, default_policy).map_err(Status::invalid_argument)
}

/// The gRPC service of one replica.
#[derive(Clone)]
pub struct Service {
    shared: Arc<Shared>,
    etcd: etcd_client::Client,
    log: EtcdLog,
    reserve_ttl: Duration,
    channels: Arc<Mutex<HashMap<String, Channel>>>,
    placement: Placement,
    archive: Option<crate::archive::Archive>,
}

/// How requests that name no policy are placed, and the workload FGD learns.
#[derive(Clone)]
pub struct Placement {
    /// The policy of requests that do not name one.
    pub default_policy: gpuledger_ledger::Policy,
    /// The pod shapes FGD measures fragmentation against.
    pub learned: Arc<Learned>,
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

impl Service {
    /// A service over `shared`.
    pub fn new(
        shared: Arc<Shared>,
        etcd: etcd_client::Client,
        log: EtcdLog,
        reserve_ttl: Duration,
        placement: Placement,
    ) -> Self {
        Service {
            shared,
            etcd,
            log,
            reserve_ttl,
            channels: Arc::new(Mutex::new(HashMap::new())),
            placement,
            archive: None,
        }
    }

    /// The same service, reading history older than etcd's log from `archive`.
    pub fn with_archive(mut self, archive: Option<crate::archive::Archive>) -> Self {
        self.archive = archive;
        self
    }

    /// A request as the ledger evaluates it: the default policy when it names none, and the
    /// learned workload for FGD.
    fn request(&self, r: Option<api::PodRequest>) -> Result<PodRequest, Status> {
        let mut pr = decode(r, self.placement.default_policy)?;
        self.placement.learned.attach(&mut pr);
        Ok(pr)
    }

    fn check_serving(&self) -> Result<(), Status> {
        self.shared.serving().map_err(Status::unavailable)
    }

    /// This replica's shared state.
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Submit to the local sequencer when leading; None when not leading (only the leader
    /// writes: watchers on followers observe but do not act).
    pub async fn local(&self, cmd: Command) -> Option<Result<Committed, Status>> {
        let tx = self
            .shared
            .sequencer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()?;
        let (otx, orx) = oneshot::channel();
        if tx
            .send(crate::shared::Request { cmd, reply: otx })
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

    async fn leader_channel(&self, refresh: bool) -> Result<(String, Channel), Status> {
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
        let ep = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| Status::internal(format!("bad leader address {addr}: {e}")))?
            .connect_timeout(Duration::from_millis(500))
            .tcp_nodelay(true);
        let ch = ep.connect_lazy();
        self.channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(addr.clone(), ch.clone());
        Ok((addr, ch))
    }

    /// Run `cmd` on the leader: locally, or by forwarding `req` with `call`.
    async fn write<Q, R, F, Fut>(
        &self,
        req: Request<Q>,
        cmd: impl Fn() -> Result<Command, Status>,
        local_reply: impl Fn(Committed) -> Result<R, Status>,
        call: F,
    ) -> Result<Response<R>, Status>
    where
        Q: Clone,
        R: HasSeq,
        F: Fn(AllocatorClient<Channel>, Request<Q>) -> Fut,
        Fut: std::future::Future<Output = Result<Response<R>, Status>>,
    {
        let forwarded = req.metadata().get(FORWARDED).is_some();
        let inner = req.into_inner();
        let started = tokio::time::Instant::now();
        let mut refresh = false;
        loop {
            if let Some(r) = self.local(cmd()?).await {
                return r.and_then(local_reply).map(Response::new);
            }
            if forwarded {
                return Err(Status::unavailable("not the leader (forwarded request)"));
            }
            let last = match self.leader_channel(refresh).await {
                Ok((addr, ch)) => {
                    let mut r = Request::new(inner.clone());
                    r.metadata_mut()
                        .insert(FORWARDED, tonic::metadata::MetadataValue::from_static("1"));
                    r.set_timeout(Duration::from_secs(10));
                    match call(AllocatorClient::new(ch), r).await {
                        Ok(resp) => {
                            // Read-your-writes through this replica: answer once the write is
                            // folded here too (bounded; the leader has it durably either way).
                            self.shared
                                .wait_applied(resp.get_ref().seq(), Duration::from_secs(2))
                                .await;
                            return Ok(resp);
                        }
                        Err(s) if s.code() == tonic::Code::Unavailable => {
                            debug!(leader = %addr, error = %s.message(), "forward failed; looking for the leader again");
                            s
                        }
                        Err(s) => return Err(s),
                    }
                }
                Err(s) => s,
            };
            if started.elapsed() > FORWARD_WINDOW {
                return Err(last);
            }
            refresh = true;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
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

fn done(c: Committed) -> Result<api::WriteResponse, Status> {
    let changed = matches!(c.reply, Reply::Done { changed: true });
    Ok(api::WriteResponse {
        seq: c.seq,
        epoch: c.epoch,
        changed,
    })
}

/// How often Replicate tells a replica that the stream is alive.
const REPLICATE_HEARTBEAT: Duration = Duration::from_millis(500);

/// What a replica of the ledger needs to place requests as this replica does.
fn placement_defaults(
    policy: gpuledger_ledger::Policy,
    workload: &gpuledger_ledger::placement::Workload,
) -> api::PlacementDefaults {
    api::PlacementDefaults {
        default_policy: policy.as_str().to_string(),
        workload: workload
            .counts()
            .map(|(s, count)| api::WorkloadShape {
                cpu_milli: s.cpu_milli,
                memory_mib: s.memory_mib,
                gpus: s.gpus,
                core_milli: s.core_milli,
                models: s.models.clone(),
                count,
            })
            .collect(),
    }
}

fn event_node(e: &pb::Event) -> Option<&str> {
    use pb::event::Body;
    Some(match e.body.as_ref()? {
        Body::NodeRegistered(r) => r.inventory.as_ref()?.node.as_str(),
        Body::NodeRemoved(r) => &r.node,
        Body::DeviceHealthChanged(h) => &h.node,
        Body::Reserved(r) => &r.node,
        Body::Bound(b) => &b.node,
        Body::Assigned(a) => &a.node,
        Body::IdentityCorrected(c) => &c.node,
        Body::Released(r) => &r.node,
        Body::LimitViolated(v) => &v.node,
        Body::LeaderElected(_) | Body::QuotaSet(_) => return None,
    })
}

fn for_node(e: &pb::Event, node: &str) -> bool {
    event_node(e).is_none_or(|n| n == node)
}

#[tonic::async_trait]
impl Allocator for Service {
    async fn register_node(
        &self,
        req: Request<api::RegisterNodeRequest>,
    ) -> Result<Response<api::WriteResponse>, Status> {
        let inv = req
            .get_ref()
            .inventory
            .clone()
            .ok_or_else(|| Status::invalid_argument("inventory is missing"))?;
        self.write(
            req,
            || Ok(Command::RegisterNode(inv.clone())),
            done,
            |mut c, r| async move { c.register_node(r).await },
        )
        .await
    }

    async fn remove_node(
        &self,
        req: Request<api::RemoveNodeRequest>,
    ) -> Result<Response<api::WriteResponse>, Status> {
        let r = req.get_ref().clone();
        self.write(
            req,
            || {
                Ok(Command::RemoveNode {
                    node: r.node.clone(),
                    reason: r.reason.clone(),
                })
            },
            done,
            |mut c, r| async move { c.remove_node(r).await },
        )
        .await
    }

    async fn set_device_health(
        &self,
        req: Request<api::SetDeviceHealthRequest>,
    ) -> Result<Response<api::WriteResponse>, Status> {
        let r = req.get_ref().clone();
        self.write(
            req,
            || {
                Ok(Command::SetDeviceHealth(pb::DeviceHealthChanged {
                    node: r.node.clone(),
                    gpu_uuid: r.gpu_uuid.clone(),
                    healthy: r.healthy,
                    reason: r.reason.clone(),
                    xid: r.xid,
                }))
            },
            done,
            |mut c, r| async move { c.set_device_health(r).await },
        )
        .await
    }

    async fn filter(
        &self,
        req: Request<api::FilterRequest>,
    ) -> Result<Response<api::FilterResponse>, Status> {
        self.check_serving()?;
        let r = req.into_inner();
        let pr = self.request(r.request)?;
        let resp = self.shared.read(|l| {
            let names: Vec<String> = if r.nodes.is_empty() {
                l.nodes().keys().cloned().collect()
            } else {
                r.nodes
            };
            let f = placement::filter_nodes(l, names, &pr);
            api::FilterResponse {
                nodes: f.fits,
                failed: f.wait.into_iter().collect(),
                unresolvable: f.never.into_iter().collect(),
                seq: l.seq(),
            }
        });
        Ok(Response::new(resp))
    }

    async fn score(
        &self,
        req: Request<api::ScoreRequest>,
    ) -> Result<Response<api::ScoreResponse>, Status> {
        self.check_serving()?;
        let r = req.into_inner();
        let pr = self.request(r.request)?;
        let resp = self.shared.read(|l| api::ScoreResponse {
            seq: l.seq(),
            scores: placement::score_nodes(l, r.nodes.iter().map(String::as_str), &pr)
                .map(|(n, score)| api::NodeScore {
                    node: n.to_string(),
                    score: score.unwrap_or(0),
                })
                .collect(),
        });
        Ok(Response::new(resp))
    }

    async fn reserve(
        &self,
        req: Request<api::ReserveRequest>,
    ) -> Result<Response<api::ReserveResponse>, Status> {
        let r = req.get_ref().clone();
        if r.node.is_empty() {
            return Err(Status::invalid_argument(
                "node is empty: reserve needs the node the scheduler chose",
            ));
        }
        let pr = self.request(r.request.clone())?;
        let ttl = if r.ttl_ms > 0 {
            Duration::from_millis(r.ttl_ms)
        } else {
            self.reserve_ttl
        };
        self.write(
            req,
            || {
                Ok(Command::Reserve {
                    request: pr.clone(),
                    node: r.node.clone(),
                    deadline_ms: now_ms() + ttl.as_millis() as i64,
                })
            },
            |c| match c.reply {
                Reply::Reserved {
                    allocations,
                    created,
                } => Ok(api::ReserveResponse {
                    allocations,
                    seq: c.seq,
                    epoch: c.epoch,
                    created,
                }),
                other => Err(Status::internal(format!("unexpected reply {other:?}"))),
            },
            |mut c, r| async move { c.reserve(r).await },
        )
        .await
    }

    async fn confirm_bound(
        &self,
        req: Request<api::ConfirmBoundRequest>,
    ) -> Result<Response<api::WriteResponse>, Status> {
        let r = req.get_ref().clone();
        self.write(
            req,
            || {
                Ok(Command::ConfirmBound {
                    pod_uid: r.pod_uid.clone(),
                    node: r.node.clone(),
                    reason: "confirmed by the extender".into(),
                })
            },
            done,
            |mut c, r| async move { c.confirm_bound(r).await },
        )
        .await
    }

    async fn assign(
        &self,
        req: Request<api::AssignRequest>,
    ) -> Result<Response<api::AssignResponse>, Status> {
        let r = req.get_ref().clone();
        self.write(
            req,
            || {
                Ok(Command::Assign {
                    node: r.node.clone(),
                    allocation_id: r.allocation_id,
                    device_ids: r.device_ids.clone(),
                })
            },
            |c| match c.reply {
                Reply::Assigned(a) => Ok(api::AssignResponse {
                    allocation: Some(*a),
                    seq: c.seq,
                    epoch: c.epoch,
                }),
                other => Err(Status::internal(format!("unexpected reply {other:?}"))),
            },
            |mut c, r| async move { c.assign(r).await },
        )
        .await
    }

    async fn correct_identity(
        &self,
        req: Request<api::CorrectIdentityRequest>,
    ) -> Result<Response<api::WriteResponse>, Status> {
        let r = req.get_ref().clone();
        self.write(
            req,
            || {
                Ok(Command::CorrectIdentity {
                    node: r.node.clone(),
                    from_allocation_id: r.from_allocation_id,
                    to_allocation_id: r.to_allocation_id,
                    device_ids: r.device_ids.clone(),
                })
            },
            done,
            |mut c, r| async move { c.correct_identity(r).await },
        )
        .await
    }

    async fn release(
        &self,
        req: Request<api::ReleaseRequest>,
    ) -> Result<Response<api::WriteResponse>, Status> {
        let r = req.get_ref().clone();
        if r.pod_uid.is_empty() && r.allocation_id == 0 {
            return Err(Status::invalid_argument(
                "release needs pod_uid or allocation_id",
            ));
        }
        self.write(
            req,
            || {
                Ok(Command::Release {
                    pod_uid: r.pod_uid.clone(),
                    container: r.container.clone(),
                    allocation_id: r.allocation_id,
                    reason: if r.reason.is_empty() {
                        "released".into()
                    } else {
                        r.reason.clone()
                    },
                })
            },
            done,
            |mut c, r| async move { c.release(r).await },
        )
        .await
    }

    async fn report_violation(
        &self,
        req: Request<api::ReportViolationRequest>,
    ) -> Result<Response<api::WriteResponse>, Status> {
        let v = req
            .get_ref()
            .violation
            .clone()
            .ok_or_else(|| Status::invalid_argument("violation is missing"))?;
        self.write(
            req,
            || Ok(Command::ReportViolation(v.clone())),
            done,
            |mut c, r| async move { c.report_violation(r).await },
        )
        .await
    }

    type SubscribeStream = BoxStream<api::SubscribeResponse>;

    async fn subscribe(
        &self,
        req: Request<api::SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        self.check_serving()?;
        let r = req.into_inner();
        if r.node.is_empty() {
            return Err(Status::invalid_argument("node is empty"));
        }
        let mut rx = self.shared.batches.subscribe();
        let shared = self.shared.clone();
        let node = r.node;
        let (tx, out) = mpsc::channel(256);
        // Start: a view of the node, or the recent events after from_seq.
        let (first, mut last) = {
            let resume = if r.from_seq > 0 {
                shared.recent_after(r.from_seq)
            } else {
                None
            };
            let epoch = shared.role_info().epoch;
            match resume {
                Some(batches) if shared.read(|l| l.seq()) >= r.from_seq => {
                    let msgs: Vec<api::SubscribeResponse> = batches
                        .iter()
                        .flat_map(|b| b.events.iter())
                        .filter(|e| e.seq > r.from_seq && for_node(e, &node))
                        .map(|e| api::SubscribeResponse {
                            epoch: e.epoch.max(epoch),
                            body: Some(api::subscribe_response::Body::Event(e.clone())),
                        })
                        .collect();
                    let last = batches
                        .last()
                        .and_then(|b| b.events.last())
                        .map_or(r.from_seq, |e| e.seq);
                    (msgs, last)
                }
                _ => shared.read(|l| {
                    let mut allocations: Vec<pb::Allocation> = l
                        .node(&node)
                        .map(|n| {
                            n.allocs
                                .iter()
                                .filter_map(|id| l.alloc(*id))
                                .map(|a| a.to_pb())
                                .collect()
                        })
                        .unwrap_or_default();
                    allocations.sort_by_key(|a| a.id);
                    let view = api::NodeView {
                        seq: l.seq(),
                        inventory: l.node(&node).map(|n| n.inventory()),
                        allocations,
                    };
                    (
                        vec![api::SubscribeResponse {
                            epoch: l.epoch().max(epoch),
                            body: Some(api::subscribe_response::Body::View(view)),
                        }],
                        l.seq(),
                    )
                }),
            }
        };
        tokio::spawn(async move {
            for m in first {
                if tx.send(Ok(m)).await.is_err() {
                    return;
                }
            }
            loop {
                match rx.recv().await {
                    Ok(b) => {
                        for e in &b.events {
                            if e.seq <= last {
                                continue;
                            }
                            last = e.seq;
                            if !for_node(e, &node) {
                                continue;
                            }
                            let m = api::SubscribeResponse {
                                epoch: e.epoch,
                                body: Some(api::subscribe_response::Body::Event(e.clone())),
                            };
                            if tx.send(Ok(m)).await.is_err() {
                                return;
                            }
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        let _ = tx
                            .send(Err(Status::resource_exhausted(format!(
                                "subscriber fell {n} batches behind; resubscribe from seq {last}"
                            ))))
                            .await;
                        return;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(out))))
    }

    type ReplicateStream = BoxStream<api::ReplicateResponse>;

    async fn replicate(
        &self,
        req: Request<api::ReplicateRequest>,
    ) -> Result<Response<Self::ReplicateStream>, Status> {
        use api::replicate_response::Body;
        self.check_serving()?;
        let from = req.into_inner().from_seq;
        let shared = self.shared.clone();
        // Subscribe before reading the state: every batch after the start point is then queued.
        let mut rx = shared.batches.subscribe();
        let mut learned = self.placement.learned.watch();
        let default_policy = self.placement.default_policy;
        if from > 0 && shared.read(|l| l.seq()) < from {
            // The receiver saw more than this replica folded: give it a moment to catch up.
            shared.wait_applied(from, Duration::from_secs(2)).await;
            if shared.read(|l| l.seq()) < from {
                return Err(Status::unavailable(format!(
                    "this replica is behind seq {from}; try another"
                )));
            }
        }
        let epoch_now = |s: &Shared| s.read(|l| l.epoch()).max(s.role_info().epoch);
        let epoch = epoch_now(&shared);
        let placement = placement_defaults(default_policy, &learned.borrow_and_update());
        let mut first = vec![api::ReplicateResponse {
            epoch,
            body: Some(Body::Placement(placement)),
        }];
        let resume = if from > 0 {
            shared.recent_after(from)
        } else {
            None
        };
        let mut last = match resume {
            Some(batches) => {
                first.extend(batches.iter().map(|b| api::ReplicateResponse {
                    epoch: b.epoch,
                    body: Some(Body::Batch(pb::EventBatch::clone(b))),
                }));
                batches
                    .last()
                    .and_then(|b| b.events.last())
                    .map_or(from, |e| e.seq)
            }
            None => shared.read(|l| {
                first.push(api::ReplicateResponse {
                    epoch,
                    body: Some(Body::Snapshot(l.to_snapshot())),
                });
                l.seq()
            }),
        };
        let (tx, out) = mpsc::channel(256);
        tokio::spawn(async move {
            for m in first {
                if tx.send(Ok(m)).await.is_err() {
                    return;
                }
            }
            let mut beat = tokio::time::interval(REPLICATE_HEARTBEAT);
            loop {
                let m = tokio::select! {
                    b = rx.recv() => match b {
                        Ok(b) => {
                            let Some(end) = b.events.last().map(|e| e.seq) else { continue };
                            if end <= last {
                                continue;
                            }
                            last = end;
                            Ok(api::ReplicateResponse {
                                epoch: b.epoch,
                                body: Some(Body::Batch(pb::EventBatch::clone(&b))),
                            })
                        }
                        Err(broadcast::error::RecvError::Lagged(n)) => Err(Status::resource_exhausted(
                            format!("replica fell {n} batches behind; resume from seq {last}"),
                        )),
                        Err(broadcast::error::RecvError::Closed) => return,
                    },
                    c = learned.changed() => {
                        if c.is_err() {
                            return;
                        }
                        let p = placement_defaults(default_policy, &learned.borrow_and_update());
                        Ok(api::ReplicateResponse {
                            epoch: epoch_now(&shared),
                            body: Some(Body::Placement(p)),
                        })
                    }
                    _ = beat.tick() => match shared.serving() {
                        // A replica that cannot serve must not keep a cache looking fresh.
                        Err(why) => Err(Status::unavailable(why)),
                        Ok(()) => Ok(api::ReplicateResponse {
                            epoch: epoch_now(&shared),
                            body: Some(Body::Heartbeat(api::Heartbeat {
                                seq: *shared.applied.borrow(),
                            })),
                        }),
                    },
                };
                let end = m.is_err();
                if tx.send(m).await.is_err() || end {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(out))))
    }

    async fn status(
        &self,
        _req: Request<api::StatusRequest>,
    ) -> Result<Response<api::StatusResponse>, Status> {
        let role = self.shared.role_info();
        let (seq, nodes, allocations) = self
            .shared
            .read(|l| (l.seq(), l.nodes().len() as u64, l.allocs().len() as u64));
        let serving = self.shared.serving();
        let leader_known = role.role == Role::Leader || !role.leader.is_empty();
        let not_ready = match (&serving, leader_known) {
            (Err(e), _) => e.clone(),
            (Ok(()), false) => "no allocator leader is elected right now".into(),
            _ => String::new(),
        };
        Ok(Response::new(api::StatusResponse {
            replica: self.shared.replica.clone(),
            address: self.shared.address.clone(),
            role: role.role.as_str().into(),
            leader: role.leader,
            epoch: role.epoch,
            seq,
            ready: not_ready.is_empty(),
            not_ready_reason: not_ready,
            nodes,
            allocations,
        }))
    }

    async fn dump(
        &self,
        _req: Request<api::DumpRequest>,
    ) -> Result<Response<api::DumpResponse>, Status> {
        let snapshot = self.shared.read(|l| l.to_snapshot());
        Ok(Response::new(api::DumpResponse {
            snapshot: Some(snapshot),
            replica: self.shared.replica.clone(),
        }))
    }

    type ReadLogStream = BoxStream<pb::EventBatch>;

    async fn read_log(
        &self,
        req: Request<api::ReadLogRequest>,
    ) -> Result<Response<Self::ReadLogStream>, Status> {
        let r = req.into_inner();
        let (log, archive) = (self.log.clone(), self.archive.clone());
        let (tx, out) = mpsc::channel(64);
        tokio::spawn(async move {
            let to = r.to_seq;
            let mut from = r.from_seq.max(1);
            loop {
                // The archive first, while it holds `from` (files: off the runtime's threads).
                if let Some(a) = &archive {
                    let tx2 = tx.clone();
                    let read = a
                        .off_thread(move |a| a.read(from, to, |b| tx2.blocking_send(Ok(b)).is_ok()))
                        .await;
                    match read {
                        Ok(0) => {}
                        Ok(last) => {
                            if tx.is_closed() || (to > 0 && last >= to) {
                                return;
                            }
                            from = last + 1;
                        }
                        Err(e) => {
                            let _ = tx
                                .send(Err(Status::data_loss(format!("reading the archive: {e}"))))
                                .await;
                            return;
                        }
                    }
                }
                // Then etcd, a page at a time. Batches are handed over synchronously; a
                // bounded channel with blocking_send would stall the runtime.
                let first_in_etcd = loop {
                    let mut page = Vec::new();
                    let res = log
                        .read_with(from, to, 0, |b| {
                            page.push(b);
                            page.len() < 256
                        })
                        .await;
                    if let Err(e) = res {
                        let _ = tx
                            .send(Err(Status::unavailable(format!("reading the log: {e}"))))
                            .await;
                        return;
                    }
                    if let Some(first) = page.first()
                        && first.first_seq > from
                    {
                        break first.first_seq;
                    }
                    let Some(last) = page.last().and_then(|b| b.events.last()).map(|e| e.seq)
                    else {
                        return;
                    };
                    let n = page.len();
                    for b in page {
                        if tx.send(Ok(b)).await.is_err() {
                            return;
                        }
                    }
                    if n < 256 || (to > 0 && last >= to) {
                        return;
                    }
                    from = last + 1;
                };
                // etcd no longer holds `from`: archived, perhaps since the archive was read.
                let archived = match &archive {
                    Some(a) => a
                        .off_thread(crate::archive::Archive::last_seq)
                        .await
                        .unwrap_or(0),
                    None => 0,
                };
                if archived < from {
                    let why = if archive.is_some() {
                        "and the archive does not hold them"
                    } else {
                        "and this replica has no --archive-dir to read them from"
                    };
                    let _ = tx
                        .send(Err(Status::failed_precondition(format!(
                            "seqs {from}..{} are no longer in etcd (archived) {why}",
                            first_in_etcd - 1
                        ))))
                        .await;
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(out))))
    }
}
