//! The agent's view of its node in the ledger: a fold of the node's events, and the decisions
//! made from it (which reservation an Allocate is for, what env a container gets). Pure: no IO.

use std::collections::{BTreeMap, HashMap};

use gpuledger_ledger::state::{ClaimGrant, claim_key};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::deviceplugin::v1beta1 as dp;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_view::Replay;
use pb::event::Body;

use crate::config::DeviceListStrategy;

/// The node's inventory and allocations at `seq`, as the ledger has them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct View {
    /// Highest ledger seq folded in.
    pub seq: u64,
    /// The node's inventory, once registered.
    pub inventory: Option<pb::NodeInventory>,
    /// Live allocations on the node by id (= the seq of their Reserved event: oldest first),
    /// claim grants included (their `pod` names the claim, their `claim` the result).
    pub allocs: BTreeMap<u64, pb::Allocation>,
    /// The latest claim refusals on the node by seq (at most [`MAX_REFUSALS`]): a prepare of a
    /// refused claim fails at once with the allocator's reason.
    pub refusals: BTreeMap<u64, pb::ClaimRefused>,
    /// Why each GPU the ledger holds unhealthy is so, by UUID, as its `DeviceHealthChanged`
    /// said (empty for marks made before the subscription began).
    pub health_reasons: BTreeMap<String, String>,
}

/// How many claim refusals the view keeps (the oldest are forgotten first).
pub const MAX_REFUSALS: usize = 256;

/// A change the agent folds into its view, in the order it folds them.
#[derive(Debug, Clone)]
pub enum Change {
    /// A whole view from the subscription: taken when `force` (the first one) or when it is
    /// not behind (a lagging replica's view must not roll the agent's back).
    Reset {
        /// The node's view at its seq.
        view: View,
        /// Take it whatever its seq.
        force: bool,
    },
    /// One of the node's events.
    Event(pb::Event),
    /// An allocation as the allocator returned it (an Assign answer), ahead of its event.
    Upsert(pb::Allocation),
}

impl Replay for View {
    type Change = Change;

    fn replay(&mut self, change: &Change) {
        match change {
            Change::Reset { view, force } => {
                if *force || view.seq >= self.seq {
                    view.clone_into(self);
                }
            }
            Change::Event(e) => self.apply(e),
            Change::Upsert(a) => self.upsert(a.clone()),
        }
    }
}

impl View {
    /// The view a subscription starts with.
    pub fn from_node_view(v: api::NodeView) -> View {
        View {
            seq: v.seq,
            inventory: v.inventory,
            allocs: v.allocations.into_iter().map(|a| (a.id, a)).collect(),
            refusals: BTreeMap::new(),
            health_reasons: BTreeMap::new(),
        }
    }

    /// Fold one of the node's events. Events at or below `seq` are already in: ignored.
    pub fn apply(&mut self, e: &pb::Event) {
        if e.seq <= self.seq {
            return;
        }
        self.seq = e.seq;
        let Some(body) = &e.body else { return };
        match body {
            Body::NodeRegistered(r) => self.inventory = r.inventory.clone(),
            Body::NodeRemoved(_) => {
                self.inventory = None;
                self.allocs.clear();
                self.refusals.clear();
                self.health_reasons.clear();
            }
            Body::DeviceHealthChanged(h) => {
                if h.healthy {
                    self.health_reasons.remove(&h.gpu_uuid);
                } else {
                    self.health_reasons
                        .insert(h.gpu_uuid.clone(), h.reason.clone());
                }
                if let Some(g) = self
                    .inventory
                    .as_mut()
                    .and_then(|i| i.gpus.iter_mut().find(|g| g.uuid == h.gpu_uuid))
                {
                    g.healthy = h.healthy;
                }
            }
            Body::Reserved(r) => {
                self.allocs.insert(
                    r.allocation_id,
                    pb::Allocation {
                        claim: Default::default(),
                        id: r.allocation_id,
                        pod: r.pod.clone(),
                        container: r.container.clone(),
                        node: r.node.clone(),
                        shares: r.shares.clone(),
                        state: pb::AllocationState::Reserved as i32,
                        reserved_ms: e.time_ms,
                        deadline_ms: r.deadline_ms,
                        device_ids: Vec::new(),
                        cpu_milli: r.cpu_milli,
                        memory_mib: r.memory_mib,
                        epoch: e.epoch,
                        policy: r.policy.clone(),
                    },
                );
            }
            Body::Bound(b) => {
                if let Some(a) = self.allocs.get_mut(&b.allocation_id)
                    && a.state == pb::AllocationState::Reserved as i32
                {
                    a.state = pb::AllocationState::Bound as i32;
                }
            }
            Body::Assigned(x) => {
                if let Some(a) = self.allocs.get_mut(&x.allocation_id) {
                    a.state = pb::AllocationState::Assigned as i32;
                    a.device_ids = x.device_ids.clone();
                }
            }
            Body::IdentityCorrected(c) => self.swap(c.from_allocation_id, c.to_allocation_id),
            Body::Released(r) => {
                self.allocs.remove(&r.allocation_id);
            }
            Body::ClaimGranted(g) => {
                let a = claim_allocation(g, e);
                self.allocs.insert(a.id, a);
            }
            Body::ClaimRefused(r) => {
                self.refusals.insert(e.seq, r.clone());
                while self.refusals.len() > MAX_REFUSALS {
                    self.refusals.pop_first();
                }
            }
            Body::ClaimPrepared(p) => {
                for c in self.claims_mut(&p.allocation_ids) {
                    c.prepared = true;
                    c.cdi_device_ids = p.cdi_device_ids.clone();
                }
            }
            Body::ClaimUnprepared(u) => {
                for c in self.claims_mut(&u.allocation_ids) {
                    c.prepared = false;
                    c.cdi_device_ids.clear();
                }
            }
            // Enforcement charges a pod's processes to the grants the pod consumes.
            Body::ClaimConsumersChanged(x) => {
                for c in self.claims_mut(&x.allocation_ids) {
                    c.consumers = x.consumers.clone();
                }
            }
            Body::LimitViolated(_)
            | Body::LeaderElected(_)
            | Body::QuotaSet(_)
            | Body::BudgetSet(_)
            | Body::BudgetRemoved(_)
            | Body::Nominated(_)
            | Body::NominationEnded(_) => {}
        }
    }

    /// The claim sides of the grants `ids` that the view holds.
    fn claims_mut<'a>(
        &'a mut self,
        ids: &'a [u64],
    ) -> impl Iterator<Item = &'a mut pb::ClaimGrant> {
        self.allocs
            .iter_mut()
            .filter(|(id, _)| ids.contains(id))
            .filter_map(|(_, a)| a.claim.as_deref_mut())
    }

    /// The live grants of claim `uid` on this node.
    pub fn grants_of_claim(&self, uid: &str) -> Vec<&pb::Allocation> {
        self.allocs
            .values()
            .filter(|a| a.claim.is_some() && a.pod.as_ref().is_some_and(|p| p.uid == uid))
            .collect()
    }

    /// The latest refusal of claim `uid`'s allocation result (`request`, `pool`, `device`,
    /// `share_id`), if the view holds one. A refusal of another result of the same request (the
    /// scheduler allocated the claim afresh after it) does not apply.
    pub fn refusal_of(
        &self,
        uid: &str,
        request: &str,
        pool: &str,
        device: &str,
        share_id: &str,
    ) -> Option<&pb::ClaimRefused> {
        self.refusals.values().rev().find(|r| {
            r.request == request
                && r.node == pool
                && r.device == device
                && r.share_id == share_id
                && r.claim.as_ref().is_some_and(|c| c.uid == uid)
        })
    }

    /// Swap the pod identities of two allocations (what `IdentityCorrected` does).
    pub fn swap(&mut self, a: u64, b: u64) {
        if a == b {
            return;
        }
        let (Some(x), Some(y)) = (self.allocs.get(&a).cloned(), self.allocs.get(&b).cloned())
        else {
            return;
        };
        if let Some(x2) = self.allocs.get_mut(&a) {
            x2.pod = y.pod.clone();
            x2.container = y.container.clone();
        }
        if let Some(y2) = self.allocs.get_mut(&b) {
            y2.pod = x.pod;
            y2.container = x.container;
        }
    }

    /// Record an allocation as the allocator returned it (an Assign answer), ahead of its event.
    pub fn upsert(&mut self, a: pb::Allocation) {
        self.allocs.insert(a.id, a);
    }

    /// The reservation an Allocate of `slices` devices is guessed to be for: the oldest bound
    /// one on the node with that many slices (the kubelet admits only pods bound to its node),
    /// else the oldest still only reserved (its pod's `Bound` may be on its way). A reservation
    /// whose pod was never bound here (the extender died before the Binding) is then guessed
    /// only when no bound pod waits. The reservations in `except` are passed over (their pods
    /// are not the one being admitted). Adopted allocations are never guessed: their pods got
    /// their devices from the device plugin of the scheduler that placed them.
    pub fn pending(&self, slices: usize, except: &[u64]) -> Option<&pb::Allocation> {
        let oldest = |state: pb::AllocationState| {
            self.allocs.values().find(|a| {
                a.shares.len() == slices
                    && a.state == state as i32
                    && !except.contains(&a.id)
                    && !gpuledger_ledger::command::is_adopted(&a.policy)
            })
        };
        oldest(pb::AllocationState::Bound).or_else(|| oldest(pb::AllocationState::Reserved))
    }

    /// The allocation already assigned exactly these device IDs (in any order).
    pub fn by_devices(&self, devices: &[String]) -> Option<&pb::Allocation> {
        self.allocs
            .values()
            .find(|a| !a.device_ids.is_empty() && same_set(&a.device_ids, devices))
    }

    /// Allocations holding any of these device IDs.
    pub fn holding_any(&self, devices: &[String]) -> Vec<&pb::Allocation> {
        self.allocs
            .values()
            .filter(|a| a.device_ids.iter().any(|d| devices.contains(d)))
            .collect()
    }

    /// The allocation of one pod container (by namespace/name, as PodResources names pods).
    pub fn by_pod(&self, namespace: &str, name: &str, container: &str) -> Option<&pb::Allocation> {
        self.allocs.values().find(|a| {
            a.container == container
                && a.pod
                    .as_ref()
                    .is_some_and(|p| p.namespace == namespace && p.name == name)
        })
    }

    /// Health of each GPU as the ledger has it.
    pub fn ledger_health(&self) -> HashMap<String, bool> {
        self.inventory
            .iter()
            .flat_map(|i| i.gpus.iter())
            .map(|g| (g.uuid.clone(), g.healthy))
            .collect()
    }
}

/// A claim grant as the ledger holds it: an allocation whose `pod` names the claim and whose
/// `container` is `<request>/<share_id>`, bound as soon as granted.
fn claim_allocation(g: &pb::ClaimGranted, e: &pb::Event) -> pb::Allocation {
    let claim = g.claim.clone().unwrap_or_default();
    pb::Allocation {
        id: g.allocation_id,
        pod: Some(pb::PodRef {
            uid: claim.uid,
            namespace: claim.namespace,
            name: claim.name,
        }),
        container: claim_key(&g.request, &g.share_id),
        node: g.node.clone(),
        shares: g.share.iter().cloned().collect(),
        state: pb::AllocationState::Bound as i32,
        reserved_ms: e.time_ms,
        deadline_ms: 0,
        device_ids: Vec::new(),
        cpu_milli: 0,
        memory_mib: 0,
        epoch: e.epoch,
        policy: String::new(),
        claim: Some(Box::new(ClaimGrant::granted(g).to_pb())),
    }
}

/// Whether two lists hold the same strings (ignoring order).
pub fn same_set(a: &[String], b: &[String]) -> bool {
    let mut x: Vec<&String> = a.iter().collect();
    let mut y: Vec<&String> = b.iter().collect();
    x.sort();
    y.sort();
    x == y
}

/// A device-plugin replica ID: `<GPU-UUID>::<k>`.
pub fn device_id(uuid: &str, k: u32) -> String {
    format!("{uuid}::{k}")
}

/// The GPU UUID and slot of a replica ID, if it is one.
pub fn parse_device_id(id: &str) -> Option<(&str, u32)> {
    let (uuid, k) = id.rsplit_once("::")?;
    if uuid.is_empty() {
        return None;
    }
    Some((uuid, k.parse().ok()?))
}

/// The CDI annotation key prefix (the CDI specification's `AnnotationPrefix`).
pub const CDI_ANNOTATION_PREFIX: &str = "cdi.k8s.io/";

/// The plugin-name part of this agent's CDI annotation keys (`<vendor>.<device type>`).
const CDI_PLUGIN_NAME: &str = "gpuledger.gpu";

/// What Allocate answers besides the allocation itself: how the GPUs are named to the runtime
/// and how the limits are exported.
#[derive(Debug, Clone, Default)]
pub struct AllocateOptions {
    /// Also the MPS variables and pipe-directory mount.
    pub mps: bool,
    /// The MPS pipe directory.
    pub mps_pipe_dir: String,
    /// How the granted GPUs are named to the container runtime.
    pub strategies: Vec<DeviceListStrategy>,
    /// The CDI kind of the GPUs' CDI devices (`nvidia.com/gpu`).
    pub cdi_kind: String,
    /// HAMi-core injected into every container (--isolation=hami-core).
    pub hami_core: Option<crate::isolation::HamiCore>,
    /// The agent's MPS daemons' directory (--isolation=mps): a container gets its GPU's pipe
    /// directory, mounted at `mps_pipe_dir`, and the MPS variables.
    pub mps_daemons: Option<std::path::PathBuf>,
}

/// The CDI annotation for allocation `id`: the key is unique per allocation, as the CDI
/// specification's `AnnotationKey(pluginName, deviceID)` asks, and its value lists the devices.
pub fn cdi_annotation(id: u64, devices: &[String]) -> (String, String) {
    (
        format!("{CDI_ANNOTATION_PREFIX}{CDI_PLUGIN_NAME}_{id}"),
        devices.join(","),
    )
}

/// The Allocate answer for one container holding `grants` (the device plugin's one allocation,
/// or every grant of a DRA request) on GPUs of `inventory`, their shares in order.
pub fn container_response(
    grants: &[&pb::Allocation],
    inventory: Option<&pb::NodeInventory>,
    opts: &AllocateOptions,
) -> dp::ContainerAllocateResponse {
    let mut envs = HashMap::new();
    let id = grants.first().map_or(0, |a| a.id);
    let shares: Vec<&pb::GpuShare> = grants.iter().flat_map(|a| &a.shares).collect();
    let uuids: Vec<&str> = shares.iter().map(|s| s.gpu_uuid.as_str()).collect();
    let mem = shares.first().map_or(0, |s| s.mem_mib);
    let core_pct = shares.first().map_or(0, |s| s.core_milli / 10);
    let cdi_names: Vec<String> = uuids
        .iter()
        .map(|u| format!("{}={u}", opts.cdi_kind))
        .collect();
    let mut annotations = HashMap::new();
    annotations.insert("gpuledger.io/allocation-id".into(), allocation_ids(grants));
    let mut cdi_devices = Vec::new();
    for s in &opts.strategies {
        match s {
            DeviceListStrategy::Envvar => {
                envs.insert("NVIDIA_VISIBLE_DEVICES".into(), uuids.join(","));
            }
            DeviceListStrategy::CdiAnnotations => {
                let (k, v) = cdi_annotation(id, &cdi_names);
                annotations.insert(k, v);
            }
            DeviceListStrategy::CdiCri => {
                cdi_devices = cdi_names
                    .iter()
                    .map(|name| dp::CdiDevice { name: name.clone() })
                    .collect();
            }
        }
    }
    envs.insert("GPULEDGER_ALLOCATION_ID".into(), allocation_ids(grants));
    envs.insert("GPULEDGER_GPU_MEM_MIB".into(), mem.to_string());
    envs.insert("GPULEDGER_GPU_CORE".into(), core_pct.to_string());
    // HAMi-core: one limit per visible device, index within the container.
    for (i, s) in shares.iter().enumerate() {
        envs.insert(
            format!("CUDA_DEVICE_MEMORY_LIMIT_{i}"),
            format!("{}m", s.mem_mib),
        );
    }
    if core_pct > 0 {
        envs.insert("CUDA_DEVICE_SM_LIMIT".into(), core_pct.to_string());
    }
    // gpushare counts whole GiB.
    let dev_mib = inventory
        .and_then(|inv| {
            inv.gpus
                .iter()
                .find(|g| Some(g.uuid.as_str()) == uuids.first().copied())
        })
        .map_or(0, |g| g.memory_mib);
    envs.insert(
        "ALIYUN_COM_GPU_MEM_DEV".into(),
        (dev_mib / 1024).to_string(),
    );
    envs.insert(
        "ALIYUN_COM_GPU_MEM_CONTAINER".into(),
        (mem / 1024).max(u64::from(mem > 0)).to_string(),
    );
    let mut mounts = Vec::new();
    if opts.mps || opts.mps_daemons.is_some() {
        let limits: Vec<String> = shares
            .iter()
            .enumerate()
            .map(|(i, s)| format!("{i}={}M", s.mem_mib))
            .collect();
        envs.insert("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".into(), limits.join(","));
        if core_pct > 0 {
            envs.insert(
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".into(),
                core_pct.to_string(),
            );
        }
        envs.insert("CUDA_MPS_PIPE_DIRECTORY".into(), opts.mps_pipe_dir.clone());
        // A CUDA process talks to one daemon: a container's is its first GPU's.
        let host_path = match (&opts.mps_daemons, uuids.first()) {
            (Some(dir), Some(gpu)) => crate::config::mps_pipe_dir(dir, gpu).display().to_string(),
            _ => opts.mps_pipe_dir.clone(),
        };
        mounts.push(dp::Mount {
            container_path: opts.mps_pipe_dir.clone(),
            host_path,
            read_only: false,
        });
    }
    let mut r = dp::ContainerAllocateResponse {
        envs,
        mounts,
        devices: Vec::new(),
        annotations,
        cdi_devices,
    };
    if let Some(h) = &opts.hami_core {
        h.edit(id, &mut r);
    }
    r
}

/// `GPULEDGER_ALLOCATION_ID` of a container holding `grants`: their ids, comma-separated (one
/// on the device plugin's path), as [`crate::procs::allocations_from_environ`] reads them.
pub fn allocation_ids(grants: &[&pb::Allocation]) -> String {
    let ids: Vec<String> = grants.iter().map(|a| a.id.to_string()).collect();
    ids.join(",")
}

#[cfg(test)]
pub(crate) mod tests;
