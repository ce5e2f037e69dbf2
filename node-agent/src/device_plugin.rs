//! The kubelet device plugin for `gpuledger.io/gpu`: replica devices per GPU, the guess of
//! which reservation an Allocate is for, and its verification before the container starts.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::Stream;
use gpuledger_ops::events::{Kind, PodEvent};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::deviceplugin::v1beta1 as dp;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_proto::podresources::v1 as podres;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::WatchStream;
use tonic::{Request, Response, Status};
use tracing::field::{self, Empty};
use tracing::{Instrument, Span, info, info_span, warn};

use self::allocate::{Admitting, Allocate, Answered, Note, Step, admitting};
use crate::agent::Agent;
use crate::nvml::GpuState;
use crate::view::{Change, container_response, device_id, parse_device_id};

mod allocate;

/// The resource this plugin advertises.
pub const RESOURCE: &str = "gpuledger.io/gpu";

/// The DevicePlugin gRPC service.
#[derive(Clone)]
pub struct Plugin {
    agent: Arc<Agent>,
}

impl Plugin {
    /// The service for `agent`.
    pub fn new(agent: Arc<Agent>) -> Plugin {
        Plugin { agent }
    }

    fn devices(&self, gpus: &[GpuState]) -> Vec<dp::Device> {
        devices(gpus, self.agent.cfg.slots_per_gpu)
    }

    /// Refuse device IDs this agent does not advertise (nothing is claimed then).
    fn check_ids(&self, ids: &[String]) -> Result<(), Status> {
        if ids.is_empty() {
            return Err(Status::invalid_argument("no device ids"));
        }
        let gpus = self.agent.gpus.borrow();
        for id in ids {
            let Some((uuid, k)) = parse_device_id(id) else {
                return Err(Status::invalid_argument(format!(
                    "{id:?} is not a {RESOURCE} device id (<GPU-UUID>::<slot>)"
                )));
            };
            if k >= self.agent.cfg.slots_per_gpu || !gpus.iter().any(|g| g.info.uuid == uuid) {
                return Err(Status::not_found(format!(
                    "device {id:?} is not advertised by node {}",
                    self.agent.cfg.node_name
                )));
            }
        }
        Ok(())
    }

    /// Claim the reservation for one container's devices; a repeat returns the same answer.
    async fn allocate_all(
        &self,
        reqs: Vec<dp::ContainerAllocateRequest>,
    ) -> Result<dp::AllocateResponse, Status> {
        for c in &reqs {
            self.check_ids(&c.devices_ids)?;
        }
        let _turn = self.agent.decide.lock().await;
        let mut out = Vec::new();
        for c in reqs {
            let span = info_span!("container", devices = ?c.devices_ids, allocation = Empty,
                pod_uid = Empty, pod = Empty, seq = Empty, epoch = Empty);
            let alloc = self.allocate_one(c.devices_ids).instrument(span).await?;
            if let Some(h) = &self.agent.env.hami_core {
                h.make_cache_dir(alloc.id).map_err(|e| {
                    Status::internal(format!(
                        "creating HAMi-core's cache directory of allocation {}: {e}",
                        alloc.id
                    ))
                })?;
            }
            let r = self.agent.with_view(|v| {
                container_response(&[&alloc], v.inventory.as_ref(), &self.agent.env)
            });
            out.push(r);
        }
        Ok(dp::AllocateResponse {
            container_responses: out,
        })
    }

    /// Run the [`Allocate`] state machine for one container's devices: feed it the view, the
    /// time and the answers of PodResources and the allocator until it answers or refuses.
    async fn allocate_one(&self, ids: Vec<String>) -> Result<pb::Allocation, Status> {
        let a = &self.agent;
        let mut m = Allocate::new(ids.clone(), &a.cfg.node_name, a.cfg.allocate_wait);
        let mut changed = a.view_changes();
        changed.mark_unchanged();
        let mut step = a.with_view(|v| m.start(v, a.synced(), Instant::now()));
        loop {
            step = match step {
                Step::AskOwner(held) => {
                    let holds = self.still_holds(&held, &ids).await;
                    changed.mark_unchanged();
                    a.with_view(|v| m.owner(holds, v, a.synced(), Instant::now()))
                }
                Step::Confirm(guess) => {
                    let answer = self.list().await.map(|l| admitting(&l, &guess, RESOURCE));
                    if let Ok(Admitting::No(why)) = &answer {
                        info!(
                            allocation = guess.id,
                            "passed over: the kubelet is not admitting its pod ({why})"
                        );
                    }
                    changed.mark_unchanged();
                    a.with_view(|v| m.listed(answer, v, a.synced(), Instant::now()))
                }
                Step::Wait { until, note } => {
                    match note {
                        Some(Note::StaleHolders(stale)) => {
                            warn!(allocations = ?stale, devices = ?ids,
                            "devices handed out again while the ledger still has them on finished containers; waiting for their release")
                        }
                        Some(Note::Refused { allocation, status }) => warn!(
                            allocation,
                            "Assign refused ({status}); re-reading the ledger"
                        ),
                        None => {}
                    }
                    let _ = tokio::time::timeout_at(until.into(), changed.changed()).await;
                    changed.mark_unchanged();
                    a.with_view(|v| m.view(v, a.synced(), Instant::now()))
                }
                Step::Assign(guess) => {
                    let sent = Instant::now();
                    let req = api::AssignRequest {
                        node: a.cfg.node_name.clone(),
                        allocation_id: guess,
                        device_ids: ids.clone(),
                    };
                    let r = a
                        .pool
                        .call("Assign", Duration::from_secs(10), |mut c| {
                            let r = req.clone();
                            async move { c.assign(r).await }
                        })
                        .await;
                    let answer = r.map(|resp| {
                        let span = Span::current();
                        span.record("seq", resp.seq);
                        span.record("epoch", resp.epoch);
                        resp.allocation
                    });
                    changed.mark_unchanged();
                    let seq = a.with_view(|v| v.seq);
                    let next = m.assigned(answer, seq, Instant::now());
                    if let Step::Answer(alloc, Answered::Claimed { started, refusals }) = &next {
                        info!(
                            waited_us = sent.duration_since(*started).as_micros() as u64,
                            assign_us = sent.elapsed().as_micros() as u64,
                            refusals,
                            total_us = started.elapsed().as_micros() as u64,
                            "Allocate: claimed the oldest pending reservation"
                        );
                        a.update_view(Change::Upsert(alloc.clone())).await;
                    }
                    next
                }
                Step::Answer(alloc, how) => {
                    record_allocation(&alloc);
                    match how {
                        Answered::Repeat => {
                            info!("Allocate repeated for assigned devices: same answer");
                        }
                        Answered::Lost => {
                            let pod = alloc.pod.clone().unwrap_or_default();
                            warn!(allocation = alloc.id, pod = %format!("{}/{}", pod.namespace, pod.name), devices = ?ids,
                                "no release came for the allocation on these devices: its Allocate answer was most likely lost; answering with it again");
                        }
                        Answered::Assigned | Answered::Claimed { .. } => {}
                    }
                    return Ok(alloc);
                }
                Step::Refuse(status) => return Err(status),
            };
        }
    }

    /// Which pod/container the kubelet gave `ids` to, from the PodResources API.
    /// Whether the container that `held` belongs to still has `ids` at the kubelet: then an
    /// Allocate for them is a repeat (kubelet restart). When the kubelet has given the devices
    /// to someone else, `held` is a finished container whose release the ledger has not
    /// folded yet. Without PodResources the answer is yes (the safe, old behaviour).
    async fn still_holds(&self, held: &pb::Allocation, ids: &[String]) -> bool {
        let pod = held.pod.clone().unwrap_or_default();
        match self.owner_of(ids).await {
            Ok(Some((ns, name, container))) => {
                ns == pod.namespace && name == pod.name && container == held.container
            }
            Ok(None) => false,
            Err(e) => {
                warn!(allocation = held.id, error = %e.message(), "PodResources unavailable: treating the Allocate as a repeat");
                true
            }
        }
    }

    /// The kubelet's PodResources `List`: every pod it knows, with each container's devices.
    async fn list(&self) -> Result<podres::ListPodResourcesResponse, Status> {
        let path = &self.agent.cfg.pod_resources_socket;
        let ch = crate::uds::channel(path).await.map_err(|e| {
            Status::unavailable(format!("PodResources socket {}: {e}", path.display()))
        })?;
        let mut c = podres::pod_resources_lister_client::PodResourcesListerClient::new(ch);
        Ok(c.list(podres::ListPodResourcesRequest {})
            .await?
            .into_inner())
    }

    async fn owner_of(&self, ids: &[String]) -> Result<Option<(String, String, String)>, Status> {
        let list = self.list().await?;
        for p in list.pod_resources {
            for ctr in &p.containers {
                let hit = ctr.devices.iter().any(|d| {
                    d.resource_name == RESOURCE && d.device_ids.iter().any(|x| ids.contains(x))
                });
                if hit {
                    return Ok(Some((
                        p.namespace.clone(),
                        p.name.clone(),
                        ctr.name.clone(),
                    )));
                }
            }
        }
        Ok(None)
    }
}

/// Name the allocation and its pod on the current RPC's span.
fn record_allocation(a: &pb::Allocation) {
    let span = Span::current();
    span.record("allocation", a.id);
    if let Some(p) = &a.pod {
        span.record("pod_uid", p.uid.as_str());
        span.record(
            "pod",
            field::display(format_args!("{}/{}", p.namespace, p.name)),
        );
    }
}

/// The replica devices of `gpus`.
pub fn devices(gpus: &[GpuState], slots: u32) -> Vec<dp::Device> {
    let mut out = Vec::with_capacity(gpus.len() * slots as usize);
    for g in gpus {
        let health = if g.healthy { "Healthy" } else { "Unhealthy" };
        for k in 0..slots {
            out.push(dp::Device {
                id: device_id(&g.info.uuid, k),
                health: health.into(),
                topology: None,
            });
        }
    }
    out
}

/// Prefer, for a reservation on `gpus`, one available device on each of them (the must-include
/// ones first); `None` when the available devices do not cover those GPUs.
pub fn prefer(
    gpus: &[String],
    available: &[String],
    must: &[String],
    size: usize,
) -> Option<Vec<String>> {
    let mut out: Vec<String> = must.to_vec();
    for g in gpus {
        if out
            .iter()
            .any(|d| parse_device_id(d).is_some_and(|(u, _)| u == g))
        {
            continue;
        }
        let d = available
            .iter()
            .find(|d| !out.contains(d) && parse_device_id(d).is_some_and(|(u, _)| u == g))?;
        out.push(d.clone());
    }
    (out.len() == size).then_some(out)
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<dp::ListAndWatchResponse, Status>> + Send>>;

/// One open ListAndWatch stream, counted in `Agent::watchers` until dropped.
struct Watching(tokio::sync::watch::Sender<usize>);

impl Watching {
    fn new(count: &tokio::sync::watch::Sender<usize>) -> Watching {
        count.send_modify(|n| *n += 1);
        Watching(count.clone())
    }
}

impl Drop for Watching {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

#[tonic::async_trait]
impl dp::device_plugin_server::DevicePlugin for Plugin {
    type ListAndWatchStream = DeviceStream;

    async fn get_device_plugin_options(
        &self,
        _req: Request<dp::Empty>,
    ) -> Result<Response<dp::DevicePluginOptions>, Status> {
        let _span =
            info_span!("GetDevicePluginOptions", node = %self.agent.cfg.node_name).entered();
        Ok(Response::new(options()))
    }

    async fn list_and_watch(
        &self,
        _req: Request<dp::Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let _span = info_span!("ListAndWatch", node = %self.agent.cfg.node_name).entered();
        info!("the kubelet watches the devices");
        let me = self.clone();
        // Counted open while the kubelet holds the stream (kubelet.rs checks that it does).
        let open = Watching::new(&self.agent.watchers);
        let s = WatchStream::new(self.agent.gpus.subscribe()).map(move |gpus| {
            let _ = &open;
            Ok(dp::ListAndWatchResponse {
                devices: me.devices(&gpus),
            })
        });
        Ok(Response::new(Box::pin(s)))
    }

    async fn get_preferred_allocation(
        &self,
        req: Request<dp::PreferredAllocationRequest>,
    ) -> Result<Response<dp::PreferredAllocationResponse>, Status> {
        let span = info_span!("GetPreferredAllocation", node = %self.agent.cfg.node_name);
        self.preferred(req.into_inner()).instrument(span).await
    }

    async fn allocate(
        &self,
        req: Request<dp::AllocateRequest>,
    ) -> Result<Response<dp::AllocateResponse>, Status> {
        let t0 = Instant::now();
        let span = info_span!("Allocate", node = %self.agent.cfg.node_name);
        let res = self
            .allocate_all(req.into_inner().container_requests)
            .instrument(span)
            .await;
        let outcome = if res.is_ok() { "ok" } else { "error" };
        self.agent
            .metrics
            .allocate_latency
            .get_or_create(&vec![("outcome", outcome.to_string())])
            .observe(t0.elapsed().as_secs_f64());
        res.map(Response::new)
    }

    async fn pre_start_container(
        &self,
        req: Request<dp::PreStartContainerRequest>,
    ) -> Result<Response<dp::PreStartContainerResponse>, Status> {
        let ids = req.into_inner().devices_ids;
        let span = info_span!("PreStartContainer", node = %self.agent.cfg.node_name, devices = ?ids,
            allocation = Empty, pod_uid = Empty, pod = Empty, seq = Empty, epoch = Empty);
        self.pre_start(ids).instrument(span).await
    }
}

impl Plugin {
    /// Prefer the devices of the reservation Allocate will claim.
    async fn preferred(
        &self,
        req: dp::PreferredAllocationRequest,
    ) -> Result<Response<dp::PreferredAllocationResponse>, Status> {
        let a = &self.agent;
        let mut out = Vec::new();
        let mut taken: Vec<u64> = Vec::new();
        // Only the reservations of the pod the kubelet is admitting, as Allocate will choose;
        // without PodResources, Allocate refuses anyway and any preference will do.
        let list = self.list().await.ok();
        for c in req.container_requests {
            let size = usize::try_from(c.allocation_size).unwrap_or(0);
            // Steer to the GPUs of the reservation Allocate will guess.
            let pick = a.with_view(|v| {
                let cand = v.allocs.values().find(|x| {
                    !taken.contains(&x.id)
                        && x.shares.len() == size
                        && x.device_ids.is_empty()
                        && x.state != pb::AllocationState::Assigned as i32
                        && list
                            .as_ref()
                            .is_none_or(|l| admitting(l, x, RESOURCE) == Admitting::Yes)
                })?;
                let gpus: Vec<String> = cand.shares.iter().map(|s| s.gpu_uuid.clone()).collect();
                Some((
                    cand.id,
                    prefer(
                        &gpus,
                        &c.available_device_i_ds,
                        &c.must_include_device_i_ds,
                        size,
                    ),
                ))
            });
            let ids = match pick {
                Some((id, Some(ids))) => {
                    taken.push(id);
                    ids
                }
                _ => {
                    let mut ids = c.must_include_device_i_ds.clone();
                    for d in &c.available_device_i_ds {
                        if ids.len() >= size {
                            break;
                        }
                        if !ids.contains(d) {
                            ids.push(d.clone());
                        }
                    }
                    ids
                }
            };
            out.push(dp::ContainerPreferredAllocationResponse { device_i_ds: ids });
        }
        Ok(Response::new(dp::PreferredAllocationResponse {
            container_responses: out,
        }))
    }

    /// Check with PodResources that the pod Allocate guessed for `ids` got them, and correct
    /// the ledger when it was another.
    async fn pre_start(
        &self,
        ids: Vec<String>,
    ) -> Result<Response<dp::PreStartContainerResponse>, Status> {
        self.check_ids(&ids)?;
        let a = &self.agent;
        let _turn = a.decide.lock().await;
        let Some(guessed) = a
            .wait_view(Duration::from_secs(5), |v| v.by_devices(&ids).cloned())
            .await
        else {
            return Err(Status::failed_precondition(format!(
                "no allocation holds devices {ids:?} (was Allocate called?)"
            )));
        };
        // The kubelet records the devices before it starts the container; a short retry covers
        // a listing taken in between.
        let mut owner = None;
        for _ in 0..20 {
            owner = self.owner_of(&ids).await?;
            if owner.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let Some((ns, name, container)) = owner else {
            return Err(Status::failed_precondition(format!(
                "PodResources does not list devices {ids:?}"
            )));
        };
        let gp = guessed.pod.clone().unwrap_or_default();
        if gp.namespace == ns && gp.name == name && guessed.container == container {
            record_allocation(&guessed);
            info!("PreStartContainer: identity confirmed");
            return Ok(Response::new(dp::PreStartContainerResponse {}));
        }
        let Some(right) = a.with_view(|v| v.by_pod(&ns, &name, &container).cloned()) else {
            return Err(Status::failed_precondition(format!(
                "pod {ns}/{name} container {container} got devices {ids:?} but has no gpuledger allocation on node {}",
                a.cfg.node_name
            )));
        };
        warn!(guessed = guessed.id, right = right.id, pod = %format!("{ns}/{name}"), %container,
            "Allocate guessed the wrong pod; correcting the ledger");
        let req = api::CorrectIdentityRequest {
            node: a.cfg.node_name.clone(),
            from_allocation_id: guessed.id,
            to_allocation_id: right.id,
            device_ids: ids.clone(),
        };
        let w = a
            .pool
            .call("CorrectIdentity", Duration::from_secs(10), |mut c| {
                let r = req.clone();
                async move { c.correct_identity(r).await }
            })
            .await?;
        record_allocation(&right);
        let span = Span::current();
        span.record("seq", w.seq);
        span.record("epoch", w.epoch);
        info!("identity corrected");
        a.wait_view(Duration::from_secs(5), |v| (v.seq >= w.seq).then_some(()))
            .await;
        let gpus: Vec<String> = guessed.shares.iter().map(|s| s.gpu_uuid.clone()).collect();
        a.event(PodEvent {
            namespace: ns,
            name: name.clone(),
            uid: right.pod.as_ref().map(|p| p.uid.clone()).unwrap_or_default(),
            kind: Kind::Normal,
            reason: "GpuIdentityCorrected",
            message: format!(
                "the kubelet gave container {container} the devices on {} that Allocate had matched to {}/{}; the ledger now records them for this pod (allocation {})",
                gpus.join(", "),
                gp.namespace,
                gp.name,
                guessed.id
            ),
        });
        Ok(Response::new(dp::PreStartContainerResponse {}))
    }
}

/// The options this plugin registers with.
pub fn options() -> dp::DevicePluginOptions {
    dp::DevicePluginOptions {
        pre_start_required: true,
        get_preferred_allocation_available: true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preference_takes_one_device_per_reserved_gpu() {
        let avail: Vec<String> = ["A::0", "A::1", "B::0", "C::0"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(
            prefer(&["B".into()], &avail, &[], 1),
            Some(vec!["B::0".to_string()])
        );
        assert_eq!(
            prefer(&["A".into(), "C".into()], &avail, &[], 2),
            Some(vec!["A::0".to_string(), "C::0".to_string()])
        );
        assert_eq!(prefer(&["D".into()], &avail, &[], 1), None);
        // A must-include device on another GPU makes the reserved GPUs unreachable.
        assert_eq!(prefer(&["B".into()], &avail, &["A::1".into()], 1), None);
    }
}
