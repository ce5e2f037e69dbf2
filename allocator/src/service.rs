//! The gRPC API. Reads are served from this replica's committed state; writes go to the
//! leader's sequencer, here or — forwarded transparently — on the leader replica.
//!
//! This file holds the service and the tonic trait, which routes each RPC to the file of its
//! concern: `writes` and `preempt` (which have `forward` make their command on the leader:
//! through this replica's [`Writer`] when it leads, else by forwarding the request), `reads`,
//! and the streams `subscribe`, `replicate`, `read_log` and `read_snapshots`. A write's
//! [`crate::writer::WriteError`] becomes a gRPC status in `crate::status`, in one place.

mod forward;
mod preempt;
mod read_log;
mod read_snapshots;
mod reads;
mod replicate;
mod subscribe;
mod traced;
mod writes;

use std::sync::Arc;
use std::time::Duration;

use gpuledger_auth::identity::Holder;
use gpuledger_auth::limit::{Slot, Slots};
use gpuledger_auth::rules::Call;
use gpuledger_auth::server::{Authenticated, over_limit};
use gpuledger_ledger::{PodRequest, pb};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::allocator::v1::allocator_server::Allocator;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::{Request, Response, Status};

pub use self::forward::{HasSeq, Leaders};
use self::traced::{BoxStream, holding, traced};
use crate::authz::Authz;
use crate::log::EtcdLog;
use crate::log_scans::LogScans;
use crate::read_limits::ReadLimits;
use crate::shared::Shared;
use crate::workload::Learned;
use crate::write_limits::WriteLimits;
use crate::writer::Writer;

/// Convert an API pod request into the ledger's form (no policy = binpack), rejecting what is
/// malformed.
pub fn pod_request(r: Option<api::PodRequest>) -> Result<PodRequest, Status> {
    let r = r.ok_or_else(|| Status::invalid_argument("request is missing"))?;
    PodRequest::from_pb(r, gpuledger_ledger::Policy::default()).map_err(Status::invalid_argument)
}

/// The gRPC service of one replica.
#[derive(Clone)]
pub struct Service {
    shared: Arc<Shared>,
    /// Where this replica's own sequencer takes writes, while it leads.
    writer: Writer,
    /// Where the writes go when it does not.
    leaders: Leaders,
    log: EtcdLog,
    reserve_ttl: Duration,
    placement: Placement,
    archive: Option<crate::archive::Archive>,
    authz: Arc<Authz>,
    budget_guard: crate::budget_watch::GuardSlot,
    write_limits: Arc<WriteLimits>,
    /// Heavy reads per identity and second.
    read_limits: Arc<ReadLimits>,
    /// `ReadLog` scans at once, and each holder's events per second.
    log_scans: Arc<LogScans>,
    /// Open streams per holder of a verified identity.
    streams: Arc<Slots<Holder>>,
    /// Threads that answer CPU-heavy reads, off the async runtime.
    heavy: Arc<Semaphore>,
    preemption: Arc<crate::preemption::Preemption>,
    /// The unit of `cores` recorded on every node registered here (`--dra-cores`).
    dra_cores: gpuledger_request::dra::CoresUnit,
}

/// The limit name of the streams-per-identity refusals.
pub const BITE_STREAMS: &str = "streams_per_identity";
/// Open streams per identity when not configured.
const DEFAULT_STREAMS_PER_IDENTITY: usize = 64;
/// Heavy-read threads when not configured.
const DEFAULT_HEAVY_READ_THREADS: usize = 2;

/// How requests that name no policy are placed, and the workload FGD learns.
#[derive(Clone)]
pub struct Placement {
    /// The policy of requests that do not name one.
    pub default_policy: gpuledger_ledger::Policy,
    /// The pod shapes FGD measures fragmentation against.
    pub learned: Arc<Learned>,
}

impl Service {
    /// A service over `shared` that writes through `writer` while this replica leads, and
    /// forwards writes to `leaders` otherwise.
    pub fn new(
        shared: Arc<Shared>,
        writer: Writer,
        leaders: Leaders,
        log: EtcdLog,
        reserve_ttl: Duration,
        placement: Placement,
        authz: Arc<Authz>,
    ) -> Self {
        let heavy = Arc::new(Semaphore::new(DEFAULT_HEAVY_READ_THREADS));
        let preemption = crate::preemption::Preemption::new(&Default::default(), &shared.metrics);
        Service {
            shared: shared.clone(),
            writer,
            leaders,
            log: log.with_decoders(heavy.clone()),
            reserve_ttl,
            placement,
            archive: None,
            authz,
            budget_guard: Default::default(),
            write_limits: Arc::default(),
            read_limits: Arc::new(ReadLimits::unlimited(shared.metrics.bites.clone())),
            log_scans: Arc::new(LogScans::unlimited(shared.metrics.bites.clone())),
            streams: Slots::new(
                ("streams", BITE_STREAMS),
                0,
                DEFAULT_STREAMS_PER_IDENTITY,
                shared.metrics.bites.clone(),
            ),
            heavy,
            preemption,
            dra_cores: Default::default(),
        }
    }

    /// The same service, recording `cores` as the unit of every node it registers.
    pub fn with_dra_cores(mut self, cores: gpuledger_request::dra::CoresUnit) -> Self {
        self.dra_cores = cores;
        self
    }

    /// The same service, holding callers to `limits`.
    pub fn with_write_limits(mut self, limits: WriteLimits) -> Self {
        self.write_limits = Arc::new(limits);
        self
    }

    /// The same service, holding each identity's heavy reads to `limits`.
    pub fn with_read_limits(mut self, limits: ReadLimits) -> Self {
        self.read_limits = Arc::new(limits);
        self
    }

    /// The same service, running `ReadLog` scans within `bounds`.
    pub fn with_log_scans(mut self, bounds: crate::log_scans::ScanBounds) -> Self {
        let m = &self.shared.metrics;
        self.log_scans = Arc::new(LogScans::new(bounds, m.bites.clone(), m.log_scans.clone()));
        self
    }

    /// The same service with at most `streams_per_identity` open streams per verified
    /// identity, and `heavy_threads` threads for CPU-heavy reads.
    pub fn with_limits(mut self, streams_per_identity: usize, heavy_threads: usize) -> Self {
        self.streams = Slots::new(
            ("streams", BITE_STREAMS),
            0,
            streams_per_identity,
            self.shared.metrics.bites.clone(),
        );
        self.heavy = Arc::new(Semaphore::new(heavy_threads.max(1)));
        self.log = self.log.clone().with_decoders(self.heavy.clone());
        self
    }

    /// The semaphore of the heavy-read threads (shared with the log's page decoding).
    pub fn heavy_reads(&self) -> &Arc<Semaphore> {
        &self.heavy
    }

    /// Run `f` on a view of the committed state on one of the heavy-read threads: a filter
    /// over every node or a dump of a large ledger takes milliseconds of CPU, which must not
    /// be taken from the runtime that keeps the leader's lease alive.
    async fn on_view<T: Send + 'static>(
        &self,
        f: impl FnOnce(&gpuledger_ledger::Ledger) -> T + Send + 'static,
    ) -> Result<T, Status> {
        // The thread first, then the view: a view held while waiting would hold up the
        // publication of newer ones.
        let permit = heavy_thread(&self.heavy).await?;
        let view = self.shared.view().await;
        on_heavy_thread(permit, move || f(&view)).await
    }

    /// A slot of the caller's open streams, or RESOURCE_EXHAUSTED (no slot without a verified
    /// identity: such a request is refused by authorization anyway).
    fn stream_slot<Q>(&self, req: &Request<Q>) -> Result<Option<Slot<Holder>>, Status> {
        let Some(a) = req.extensions().get::<Authenticated>() else {
            return Ok(None);
        };
        let holder = a.holder();
        self.streams
            .try_acquire(holder.clone())
            .map(Some)
            .map_err(|_| {
                over_limit(
                    Status::resource_exhausted(format!(
                        "{holder} has {} streams open, as many as one identity may \
                         (--max-streams-per-identity); close some",
                        self.streams.in_use_by(&holder)
                    )),
                    BITE_STREAMS,
                )
            })
    }

    /// The same service, preempting as `p` bounds it.
    pub fn with_preemption(mut self, p: Arc<crate::preemption::Preemption>) -> Self {
        self.preemption = p;
        self
    }

    /// gpuledger's own preemption: its bounds, Events and metrics.
    pub fn preemption(&self) -> &Arc<crate::preemption::Preemption> {
        &self.preemption
    }

    /// The same service, reading history older than etcd's log from `archive`.
    pub fn with_archive(mut self, archive: Option<crate::archive::Archive>) -> Self {
        self.archive = archive;
        self
    }

    /// A request as the ledger evaluates it: the default policy when it names none, and the
    /// learned workload for FGD.
    fn request(&self, r: Option<api::PodRequest>) -> Result<PodRequest, Status> {
        let r = r.ok_or_else(|| Status::invalid_argument("request is missing"))?;
        self.placement
            .learned
            .defaults(self.placement.default_policy)
            .request(r)
            .map_err(Status::invalid_argument)
    }

    fn check_serving(&self) -> Result<(), Status> {
        self.shared.serving().map_err(Status::unavailable)
    }

    /// This replica's shared state.
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Who may call what.
    pub fn authz(&self) -> &Arc<Authz> {
        &self.authz
    }

    /// What the budget RPCs check against Kubernetes; empty until the GPUBudget watch runs.
    pub fn budget_guard_slot(&self) -> &crate::budget_watch::GuardSlot {
        &self.budget_guard
    }
}

/// One of the heavy-read threads, once free.
async fn heavy_thread(heavy: &Arc<Semaphore>) -> Result<OwnedSemaphorePermit, Status> {
    heavy
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| Status::unavailable("shutting down"))
}

/// Run `f` on the heavy-read thread `permit` holds, off the runtime that keeps the lease.
async fn on_heavy_thread<T: Send + 'static>(
    permit: OwnedSemaphorePermit,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(move || {
        let _thread = permit;
        f()
    })
    .await
    .map_err(|e| Status::internal(format!("the read failed: {e}")))
}

#[tonic::async_trait]
impl Allocator for Service {
    async fn register_node(
        &self,
        req: Request<api::RegisterNodeRequest>,
    ) -> Result<Response<api::WriteResponse>, Status> {
        traced(self, Call::RegisterNode, req, |req| {
            writes::register_node(self, req)
        })
        .await
    }

    async fn remove_node(
        &self,
        req: Request<api::RemoveNodeRequest>,
    ) -> Result<Response<api::WriteResponse>, Status> {
        traced(self, Call::RemoveNode, req, |req| {
            writes::remove_node(self, req)
        })
        .await
    }

    async fn set_device_health(
        &self,
        req: Request<api::SetDeviceHealthRequest>,
    ) -> Result<Response<api::WriteResponse>, Status> {
        traced(self, Call::SetDeviceHealth, req, |req| {
            writes::set_device_health(self, req)
        })
        .await
    }

    async fn filter(
        &self,
        req: Request<api::FilterRequest>,
    ) -> Result<Response<api::FilterResponse>, Status> {
        traced(self, Call::Filter, req, |req| reads::filter(self, req)).await
    }

    async fn score(
        &self,
        req: Request<api::ScoreRequest>,
    ) -> Result<Response<api::ScoreResponse>, Status> {
        traced(self, Call::Score, req, |req| reads::score(self, req)).await
    }

    async fn reserve(
        &self,
        req: Request<api::ReserveRequest>,
    ) -> Result<Response<api::ReserveResponse>, Status> {
        traced(self, Call::Reserve, req, |req| writes::reserve(self, req)).await
    }

    async fn confirm_bound(
        &self,
        req: Request<api::ConfirmBoundRequest>,
    ) -> Result<Response<api::WriteResponse>, Status> {
        traced(self, Call::ConfirmBound, req, |req| {
            writes::confirm_bound(self, req)
        })
        .await
    }

    async fn assign(
        &self,
        req: Request<api::AssignRequest>,
    ) -> Result<Response<api::AssignResponse>, Status> {
        traced(self, Call::Assign, req, |req| writes::assign(self, req)).await
    }

    async fn correct_identity(
        &self,
        req: Request<api::CorrectIdentityRequest>,
    ) -> Result<Response<api::WriteResponse>, Status> {
        traced(self, Call::CorrectIdentity, req, |req| {
            writes::correct_identity(self, req)
        })
        .await
    }

    async fn release(
        &self,
        req: Request<api::ReleaseRequest>,
    ) -> Result<Response<api::WriteResponse>, Status> {
        traced(self, Call::Release, req, |req| writes::release(self, req)).await
    }

    async fn report_violation(
        &self,
        req: Request<api::ReportViolationRequest>,
    ) -> Result<Response<api::WriteResponse>, Status> {
        traced(self, Call::ReportViolation, req, |req| {
            writes::report_violation(self, req)
        })
        .await
    }

    type SubscribeStream = BoxStream<api::SubscribeResponse>;

    async fn subscribe(
        &self,
        req: Request<api::SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        let slot = self.stream_slot(&req)?;
        holding(
            traced(self, Call::Subscribe, req, |req| {
                subscribe::subscribe(self, req)
            })
            .await,
            slot,
        )
    }

    type ReplicateStream = BoxStream<api::ReplicateResponse>;

    async fn replicate(
        &self,
        req: Request<api::ReplicateRequest>,
    ) -> Result<Response<Self::ReplicateStream>, Status> {
        let slot = self.stream_slot(&req)?;
        holding(
            traced(self, Call::Replicate, req, |req| {
                replicate::replicate(self, req)
            })
            .await,
            slot,
        )
    }

    async fn status(
        &self,
        req: Request<api::StatusRequest>,
    ) -> Result<Response<api::StatusResponse>, Status> {
        traced(self, Call::Status, req, |req| reads::status(self, req)).await
    }

    async fn dump(
        &self,
        req: Request<api::DumpRequest>,
    ) -> Result<Response<api::DumpResponse>, Status> {
        traced(self, Call::Dump, req, |req| reads::dump(self, req)).await
    }

    async fn set_budget(
        &self,
        req: Request<api::SetBudgetRequest>,
    ) -> Result<Response<api::WriteResponse>, Status> {
        traced(self, Call::SetBudget, req, |req| {
            writes::set_budget(self, req)
        })
        .await
    }

    async fn set_quota(
        &self,
        req: Request<api::SetQuotaRequest>,
    ) -> Result<Response<api::WriteResponse>, Status> {
        traced(self, Call::SetQuota, req, |req| {
            writes::set_quota(self, req)
        })
        .await
    }

    async fn preempt(
        &self,
        req: Request<api::PreemptRequest>,
    ) -> Result<Response<api::PreemptResponse>, Status> {
        traced(self, Call::Preempt, req, |req| preempt::preempt(self, req)).await
    }

    async fn prepare_claim(
        &self,
        req: Request<api::PrepareClaimRequest>,
    ) -> Result<Response<api::WriteResponse>, Status> {
        traced(self, Call::PrepareClaim, req, |req| {
            writes::prepare_claim(self, req)
        })
        .await
    }

    async fn unprepare_claim(
        &self,
        req: Request<api::UnprepareClaimRequest>,
    ) -> Result<Response<api::WriteResponse>, Status> {
        traced(self, Call::UnprepareClaim, req, |req| {
            writes::unprepare_claim(self, req)
        })
        .await
    }

    async fn grant_claim(
        &self,
        req: Request<api::GrantClaimRequest>,
    ) -> Result<Response<api::WriteResponse>, Status> {
        traced(self, Call::GrantClaim, req, |req| {
            writes::grant_claim(self, req)
        })
        .await
    }

    async fn refuse_claim(
        &self,
        req: Request<api::RefuseClaimRequest>,
    ) -> Result<Response<api::WriteResponse>, Status> {
        traced(self, Call::RefuseClaim, req, |req| {
            writes::refuse_claim(self, req)
        })
        .await
    }

    async fn adopt(
        &self,
        req: Request<api::AdoptRequest>,
    ) -> Result<Response<api::ReserveResponse>, Status> {
        traced(self, Call::Adopt, req, |req| writes::adopt(self, req)).await
    }

    type ReadLogStream = BoxStream<pb::EventBatch>;

    async fn read_log(
        &self,
        req: Request<api::ReadLogRequest>,
    ) -> Result<Response<Self::ReadLogStream>, Status> {
        let slot = self.stream_slot(&req)?;
        holding(
            traced(self, Call::ReadLog, req, |req| {
                read_log::read_log(self, req)
            })
            .await,
            slot,
        )
    }

    type ReadSnapshotsStream = BoxStream<api::SnapshotPart>;

    async fn read_snapshots(
        &self,
        req: Request<api::ReadSnapshotsRequest>,
    ) -> Result<Response<Self::ReadSnapshotsStream>, Status> {
        let slot = self.stream_slot(&req)?;
        holding(
            traced(self, Call::ReadSnapshots, req, |req| {
                read_snapshots::read_snapshots(self, req)
            })
            .await,
            slot,
        )
    }
}

#[cfg(test)]
mod tests;
