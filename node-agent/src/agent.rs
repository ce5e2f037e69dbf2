//! The agent's shared state and its tasks: ledger view, inventory registration, GPU health.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use backon::{ConstantBuilder, Retryable};
use gpuledger_ops::events::{PodEvent, Recorder};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_view::Views;
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, watch};
use tracing::{info, warn};

use crate::allocator::Pool;
use crate::config::Config;
use crate::isolation::Isolation;
use crate::metrics::Metrics;
use crate::nvml::{GpuInfo, GpuState, NvmlBackend, XidEvent, is_critical_xid};
use crate::view::{AllocateOptions, Change, View};

/// Why the agent could not start. Not retryable: the node or the flags must change.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// NVML could not list the GPUs.
    #[error("discovering GPUs: {0}")]
    Discover(crate::nvml::Error),
    /// The allocator addresses are missing or malformed.
    #[error(transparent)]
    Allocator(#[from] gpuledger_client::ClientError),
}

/// Retry a call to the allocator every second until it is accepted.
fn every_second() -> ConstantBuilder {
    ConstantBuilder::new()
        .with_delay(Duration::from_secs(1))
        .without_max_times()
}

/// Everything the agent's tasks and gRPC handlers share.
pub struct Agent {
    /// Flags.
    pub cfg: Config,
    /// Allocator clients.
    pub pool: Pool,
    /// NVML.
    pub nvml: NvmlBackend,
    /// The node's ledger view, published after each change: readers never hold up the
    /// subscription or an Allocate.
    view: Views<View>,
    /// Set once the first view arrived.
    synced: AtomicBool,
    /// Bumped on every view change (waiters for a reservation watch it).
    view_rev: watch::Sender<u64>,
    /// The GPUs and their health (ListAndWatch streams it).
    pub gpus: watch::Sender<Vec<GpuState>>,
    /// Serializes Allocate and PreStartContainer decisions (the guess and its correction).
    pub decide: tokio::sync::Mutex<()>,
    /// Set while the device plugin is registered with the current kubelet and it watches
    /// the devices.
    pub kubelet_registered: AtomicBool,
    /// ListAndWatch streams open: the kubelet reads the device list only through one.
    pub watchers: watch::Sender<usize>,
    /// What Allocate answers besides the devices' identity: device list, limit variables.
    pub env: AllocateOptions,
    /// Metrics, served at /metrics with the probes.
    pub metrics: Metrics,
    /// The registry `metrics` live in.
    pub registry: Registry,
    /// What the limits of the plain HTTP port refused
    /// (`gpuledger_node_agent_limited_total{listener="http",limit}`).
    pub http_bites: Arc<gpuledger_auth::limit::Bites>,
    /// What the limits of the DRA plugin socket refused
    /// (`gpuledger_node_agent_limited_total{listener="dra",limit}`).
    pub dra_bites: Arc<gpuledger_auth::limit::Bites>,
    /// Pod Events (limit exceeded, identity corrected); unset without a Kubernetes client.
    pub events: OnceLock<Recorder>,
    /// Why enforcement cannot run on this node (the agent is not in the host pid namespace);
    /// `/readyz` says so.
    pub enforcement_refused: Option<String>,
    /// The Kubernetes API (pod Events; with --mode=dra also ResourceClaims and ResourceSlices).
    pub kube: OnceLock<kube::Client>,
    /// With --mode=dra: why the agent serves no DRA now (the API server dropped a slice field a
    /// feature gate guards); every prepare is refused with it and `/readyz` says it.
    pub dra_off: std::sync::Mutex<Option<String>>,
    /// With --mode=dra: the API server dropped the slice's device taints (feature gate
    /// DRADeviceTaints off), so unhealthy GPUs are left out of the slice rather than tainted.
    pub dra_taints_off: AtomicBool,
}

impl Agent {
    /// The agent for `cfg`, with NVML loaded and the GPUs discovered.
    pub fn new(
        cfg: Config,
        nvml: NvmlBackend,
        creds: &gpuledger_auth::Credentials,
    ) -> Result<Arc<Agent>, AgentError> {
        let gpus = nvml.gpus().map_err(AgentError::Discover)?;
        for g in &gpus {
            info!(node = %cfg.node_name, gpu = %g.uuid, model = %g.model, usable_mib = g.memory_mib,
                reserved_mib = g.reserved_mib, "discovered a GPU");
        }
        let pool = Pool::new(&cfg.allocator, creds)?;
        let mut registry = Registry::with_prefix("gpuledger_node_agent");
        let metrics = Metrics::new(&mut registry);
        let http_bites = gpuledger_auth::limit::Bites::new();
        let dra_bites = gpuledger_auth::limit::Bites::new();
        registry.register_collector(Box::new(gpuledger_auth::limit::Limited(vec![
            ("http", http_bites.clone()),
            ("dra", dra_bites.clone()),
        ])));
        let env = AllocateOptions {
            mps: cfg.mps,
            mps_pipe_dir: cfg.mps_pipe_dir.display().to_string(),
            strategies: cfg.device_list_strategy.clone(),
            cdi_kind: cfg.cdi_kind.clone(),
            hami_core: (cfg.isolation == Isolation::HamiCore)
                .then(|| cfg.isolation_wanted().hami_core),
            mps_daemons: (cfg.isolation == Isolation::Mps).then(|| cfg.mps_dir.clone()),
        };
        metrics
            .isolation
            .get_or_create(&vec![("mode", cfg.isolation.as_str().to_string())])
            .set(1);
        let enforcement_refused = crate::procs::host_pid_namespace_problem();
        metrics
            .enforcing
            .set(i64::from(enforcement_refused.is_none()));
        Ok(Arc::new(Agent {
            cfg,
            pool,
            nvml,
            view: Views::new(&View::default()),
            synced: AtomicBool::new(false),
            view_rev: watch::Sender::new(0),
            gpus: watch::Sender::new(gpus.into_iter().map(GpuState::new).collect()),
            decide: tokio::sync::Mutex::new(()),
            kubelet_registered: AtomicBool::new(false),
            watchers: watch::Sender::new(0),
            env,
            metrics,
            registry,
            http_bites,
            dra_bites,
            events: OnceLock::new(),
            enforcement_refused,
            kube: OnceLock::new(),
            dra_off: std::sync::Mutex::new(None),
            dra_taints_off: AtomicBool::new(false),
        }))
    }

    /// Tell the pod's users something through a Kubernetes Event (best effort).
    pub fn event(&self, ev: PodEvent) {
        if let Some(r) = self.events.get() {
            r.emit(ev);
        }
    }

    /// Why DRA is not served now, if it is not.
    pub fn dra_off(&self) -> Option<String> {
        self.dra_off
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Read the view (as of the last change that returned).
    pub fn with_view<T>(&self, f: impl FnOnce(&View) -> T) -> T {
        f(&self.view.latest())
    }

    /// Change the view, publish it, and wake its waiters.
    pub async fn update_view(&self, change: Change) {
        self.view.committed(Arc::new(change));
        drop(self.view.current().await);
        self.view_rev.send_modify(|r| *r += 1);
    }

    /// Bring the metrics' state gauges up to date (called on each scrape).
    pub fn refresh_metrics(&self) {
        // View, then GPUs: the order every other reader takes them in.
        self.with_view(|v| {
            let gpus = self.gpus.borrow();
            self.metrics.refresh(
                &gpus,
                v,
                self.kubelet_registered.load(Ordering::Acquire),
                self.synced(),
            );
        });
    }

    /// Whether the first view arrived.
    pub fn synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// The seq to resume the subscription after (0 = ask for a fresh view).
    pub fn resume_seq(&self) -> u64 {
        if self.synced() {
            self.with_view(|v| v.seq)
        } else {
            0
        }
    }

    /// Fold one subscription message.
    pub async fn on_message(&self, m: api::SubscribeResponse) {
        use api::subscribe_response::Body;
        match m.body {
            Some(Body::View(v)) => {
                let force = !self.synced();
                let view = View::from_node_view(v);
                self.update_view(Change::Reset { view, force }).await;
                self.synced.store(true, Ordering::Release);
            }
            Some(Body::Event(e)) => {
                if let Some(pb::event::Body::DeviceHealthChanged(h)) = &e.body {
                    self.follow_health(h);
                }
                self.update_view(Change::Event(e)).await
            }
            None => {}
        }
    }

    /// A receiver that sees every change of the view from now on.
    pub fn view_changes(&self) -> watch::Receiver<u64> {
        self.view_rev.subscribe()
    }

    /// Wait until `pred` holds on the view, or `timeout`. Returns its last answer.
    pub async fn wait_view<T>(
        &self,
        timeout: Duration,
        mut pred: impl FnMut(&View) -> Option<T>,
    ) -> Option<T> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut rx = self.view_rev.subscribe();
        loop {
            rx.mark_unchanged();
            if self.synced()
                && let Some(t) = self.with_view(&mut pred)
            {
                return Some(t);
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => return None,
            }
        }
    }

    /// The inventory this agent reports: NVML's GPUs with the agent's health marks.
    pub fn inventory(&self) -> pb::NodeInventory {
        pb::NodeInventory {
            mode: match self.cfg.mode {
                crate::config::Mode::DevicePlugin => pb::NodeMode::DevicePlugin,
                crate::config::Mode::Dra => pb::NodeMode::Dra,
            } as i32,
            node: self.cfg.node_name.clone(),
            gpus: self
                .gpus
                .borrow()
                .iter()
                .map(|g| pb::Gpu {
                    uuid: g.info.uuid.clone(),
                    index: g.info.index,
                    model: g.info.model.clone(),
                    memory_mib: g.info.memory_mib,
                    healthy: g.healthy,
                    compute_capability: g.info.compute_capability.clone(),
                })
                .collect(),
            cpu_milli: 0,
            memory_mib: 0,
            isolation: self.cfg.isolation.as_str().into(),
            // The allocator records the cluster's unit (--dra-cores) on registration.
            dra_cores: String::new(),
        }
    }

    /// Register the inventory with the allocator now (retrying every second until it is
    /// accepted).
    async fn register(&self) {
        let inv = self.inventory();
        let r = (|| async {
            self.pool
                .call("RegisterNode", Duration::from_secs(30), |mut c| {
                    let inv = inv.clone();
                    async move {
                        c.register_node(api::RegisterNodeRequest {
                            inventory: Some(inv),
                        })
                        .await
                    }
                })
                .await
        })
        .retry(every_second())
        .notify(|e, _| warn!(node = %inv.node, "registering the inventory failed, retrying: {e}"))
        .await;
        if let Ok(w) = r {
            info!(node = %inv.node, seq = w.seq, changed = w.changed, "inventory registered");
        }
    }

    /// Register the inventory once the ledger view is in (so GPUs the ledger holds unhealthy
    /// stay unhealthy), then again whenever NVML shows a different set of GPUs.
    pub async fn keep_registered(self: Arc<Self>) {
        let start = Instant::now();
        while !self.synced() && start.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let ledger = self.with_view(View::ledger_health);
        self.gpus.send_modify(|gs| {
            for g in gs.iter_mut() {
                if ledger.get(&g.info.uuid) == Some(&false) {
                    warn!(gpu = %g.info.uuid, "the ledger has this GPU unhealthy; keeping it so");
                    g.healthy = false;
                }
            }
        });
        self.register().await;
        loop {
            tokio::time::sleep(self.cfg.rediscover_interval).await;
            let nvml = self.nvml.clone();
            let found = match tokio::task::spawn_blocking(move || nvml.gpus()).await {
                Ok(Ok(g)) => g,
                Ok(Err(e)) => {
                    warn!("rediscovering GPUs: {e}");
                    continue;
                }
                Err(_) => continue,
            };
            let now: Vec<GpuInfo> = self.gpus.borrow().iter().map(|g| g.info.clone()).collect();
            if now != found {
                info!("GPU inventory changed; registering again");
                let health: HashMap<String, (bool, bool)> = self
                    .gpus
                    .borrow()
                    .iter()
                    .map(|g| (g.info.uuid.clone(), (g.healthy, g.lost)))
                    .collect();
                self.gpus.send_replace(
                    found
                        .into_iter()
                        .map(|info| {
                            let (healthy, lost) =
                                health.get(&info.uuid).copied().unwrap_or((true, false));
                            GpuState {
                                healthy,
                                lost,
                                info,
                            }
                        })
                        .collect(),
                );
                self.register().await;
            }
        }
    }

    /// Mark GPUs with critical Xids unhealthy, locally (ListAndWatch) and in the ledger.
    pub async fn watch_health(self: Arc<Self>, mut rx: mpsc::Receiver<XidEvent>) {
        while let Some(x) = rx.recv().await {
            if !is_critical_xid(x.xid) {
                info!(gpu = %x.gpu, xid = x.xid, "non-critical Xid, GPU stays healthy");
                continue;
            }
            warn!(gpu = %x.gpu, xid = x.xid, "critical Xid: marking the GPU unhealthy");
            let xid = u32::try_from(x.xid).unwrap_or(u32::MAX);
            // No longer "lost": an Xid mark stays until an operator clears it.
            self.set_health(
                &x.gpu,
                false,
                Some(false),
                format!("critical Xid {xid}"),
                xid,
            )
            .await;
        }
    }

    /// Probe every GPU each --health-probe-interval: one NVML answers `GPU_IS_LOST` for is
    /// marked unhealthy, and healthy again once it answers.
    pub async fn probe_lost(self: Arc<Self>) {
        loop {
            tokio::time::sleep(self.cfg.health_probe_interval).await;
            let uuids: Vec<String> = self
                .gpus
                .borrow()
                .iter()
                .map(|g| g.info.uuid.clone())
                .collect();
            let nvml = self.nvml.clone();
            let Ok(lost) = tokio::task::spawn_blocking(move || nvml.lost(&uuids)).await else {
                continue;
            };
            let changes: Vec<(String, bool)> = self
                .gpus
                .borrow()
                .iter()
                .filter_map(|g| {
                    let now = lost.contains(&g.info.uuid);
                    g.probed(now).map(|l| (g.info.uuid.clone(), l))
                })
                .collect();
            for (gpu, lost) in changes {
                if lost {
                    warn!(%gpu, "NVML answers GPU_IS_LOST: marking the GPU unhealthy");
                    self.set_health(&gpu, false, Some(true), LOST.into(), 0)
                        .await;
                } else {
                    info!(%gpu, "the lost GPU answers NVML again: marking it healthy");
                    self.set_health(&gpu, true, Some(false), FOUND.into(), 0)
                        .await;
                }
            }
        }
    }

    /// Follow an operator's health mark in the ledger (`SetDeviceHealth` by an admin clears a
    /// critical Xid) on the GPUs this agent serves to the kubelet.
    fn follow_health(&self, h: &pb::DeviceHealthChanged) {
        if h.node != self.cfg.node_name {
            return;
        }
        self.gpus.send_if_modified(|gs| {
            let mut changed = false;
            for g in gs.iter_mut().filter(|g| g.info.uuid == h.gpu_uuid) {
                if g.healthy != h.healthy {
                    g.healthy = h.healthy;
                    changed = true;
                }
                if h.healthy {
                    g.lost = false;
                }
            }
            changed
        });
    }

    /// Mark `gpu` healthy or not, locally (and its lost mark, when given) and in the ledger,
    /// retrying until the allocator answers.
    async fn set_health(
        &self,
        gpu: &str,
        healthy: bool,
        lost: Option<bool>,
        reason: String,
        xid: u32,
    ) {
        self.gpus.send_if_modified(|gs| {
            let mut changed = false;
            for g in gs.iter_mut().filter(|g| g.info.uuid == gpu) {
                changed |= g.healthy != healthy;
                g.healthy = healthy;
                if let Some(l) = lost {
                    g.lost = l;
                }
            }
            changed
        });
        let req = api::SetDeviceHealthRequest {
            node: self.cfg.node_name.clone(),
            gpu_uuid: gpu.to_string(),
            healthy,
            reason,
            xid,
        };
        let r = (|| async {
            self.pool
                .call("SetDeviceHealth", Duration::from_secs(30), |mut c| {
                    let r = req.clone();
                    async move { c.set_device_health(r).await }
                })
                .await
        })
        .retry(every_second())
        // Not registered yet: the registration carries the health mark.
        .when(|e| e.code() != tonic::Code::NotFound)
        .notify(|e, _| warn!(%gpu, "SetDeviceHealth failed, retrying: {e}"))
        .await;
        if let Err(e) = r {
            warn!(%gpu, "SetDeviceHealth: {e}");
        }
    }
}

/// The ledger's reason for a GPU NVML answers `GPU_IS_LOST` for.
pub const LOST: &str = "GPU is lost (NVML: GPU_IS_LOST)";
/// The ledger's reason when a lost GPU answers again.
pub const FOUND: &str = "the lost GPU answers NVML again";
