//! The node agent's metrics (`gpuledger_node_agent_*`): device-plugin Allocate latency,
//! NVML-measured memory per GPU, GPU health, violations, and how far the ledger view is.

use std::sync::atomic::{AtomicI64, AtomicU64};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use crate::nvml::GpuState;
use crate::view::View;

type Labels = Vec<(&'static str, String)>;

/// Every series the agent exports. Values that are state (health, capacity, view seq) are
/// refreshed from the agent on each scrape; events (Allocate, violations) are counted where
/// they happen.
pub struct Metrics {
    /// Time to answer one device-plugin Allocate, claim through the allocator included.
    pub allocate_latency: Family<Labels, Histogram>,
    /// Violations found, by action (kill, report, rogue, rogue-kill).
    pub violations: Family<Labels, Counter>,
    /// 1 while memory limits are enforced (0 when the agent refuses, e.g. outside the host pid
    /// namespace).
    pub enforcing: Gauge,
    /// 1 for the node's first isolation layer (`mode`: nvml, hami-core, mps, dmem); NVML
    /// sampling stands behind every one.
    pub isolation: Family<Labels, Gauge>,
    /// What the first isolation layer holds to, in bytes, as it answered (`mode`; `target`:
    /// the GPU of an MPS daemon, `<pod uid>/<region>` of a dmem limit).
    pub isolation_limit: Family<Labels, Gauge<i64, AtomicI64>>,
    /// MPS control daemons found dead and started again, by GPU.
    pub mps_restarts: Family<Labels, Counter>,
    /// GPU memory in use per GPU as NVML measures it (sum over its processes), in bytes.
    pub memory_used: Family<Labels, Gauge<i64, AtomicI64>>,
    memory_total: Family<Labels, Gauge<i64, AtomicI64>>,
    memory_allocated: Family<Labels, Gauge<i64, AtomicI64>>,
    core_allocated: Family<Labels, Gauge>,
    healthy: Family<Labels, Gauge>,
    allocations: Gauge,
    ledger_seq: Gauge<u64, AtomicU64>,
    registered: Gauge,
    synced: Gauge,
    /// Time to answer one claim of a DRA NodePrepareResources (grant wait, claim GET, CDI
    /// write and the ClaimPrepared commit included), by outcome.
    pub prepare_latency: Family<Labels, Histogram>,
    /// Time each step of a successful DRA prepare took, by step (`claim_read`: the claim's
    /// GET from the API server, `grant_wait`: the ledger view's decision, `cdi_write`: the
    /// spec's atomic write, `commit`: ClaimPrepared through the allocator).
    pub prepare_steps: Family<Labels, Histogram>,
    /// DRA NodeUnprepareResources claims answered, by outcome.
    pub unprepares: Family<Labels, Counter>,
    /// Registrations the kubelet reported failed (NotifyRegistrationStatus).
    pub dra_registration_failures: Counter,
    /// 1 while the API server drops a field our ResourceSlice needs (a feature gate is off):
    /// the agent then serves no DRA, labelled with the gate.
    pub dra_gate_off: Family<Labels, Gauge>,
    /// ResourceSlice writes (create or update), by why (missing, changed).
    pub slice_writes: Family<Labels, Counter>,
}

fn allocate_histogram() -> Histogram {
    // 0.25 ms .. ~8 s.
    Histogram::new(exponential_buckets(0.000_25, 2.0, 16))
}

impl Metrics {
    /// The metrics, registered in `registry`.
    pub fn new(registry: &mut Registry) -> Metrics {
        let m = Metrics {
            allocate_latency: Family::new_with_constructor(allocate_histogram as fn() -> _),
            violations: Family::default(),
            enforcing: Gauge::default(),
            isolation: Family::default(),
            isolation_limit: Family::default(),
            mps_restarts: Family::default(),
            memory_used: Family::default(),
            memory_total: Family::default(),
            memory_allocated: Family::default(),
            core_allocated: Family::default(),
            healthy: Family::default(),
            allocations: Gauge::default(),
            ledger_seq: Gauge::default(),
            registered: Gauge::default(),
            synced: Gauge::default(),
            prepare_latency: Family::new_with_constructor(allocate_histogram as fn() -> _),
            prepare_steps: Family::new_with_constructor(allocate_histogram as fn() -> _),
            unprepares: Family::default(),
            dra_registration_failures: Counter::default(),
            dra_gate_off: Family::default(),
            slice_writes: Family::default(),
        };
        registry.register_with_unit(
            "allocate_duration",
            "Time to answer a device-plugin Allocate (the claim through the allocator included), by outcome",
            Unit::Seconds,
            m.allocate_latency.clone(),
        );
        registry.register(
            "violations",
            "Processes found over their memory limit or on no allocation, by action",
            m.violations.clone(),
        );
        registry.register(
            "enforcing",
            "1 while memory limits are enforced on this node (0: refused, /readyz says why)",
            m.enforcing.clone(),
        );
        registry.register(
            "isolation",
            "1 for the node's first isolation layer (mode); NVML sampling with a kill stands behind every one",
            m.isolation.clone(),
        );
        registry.register_with_unit(
            "isolation_limit",
            "What the first isolation layer holds to, as it answered (mode; target: the GPU of an MPS daemon, <pod uid>/<region> of a dmem.max)",
            Unit::Bytes,
            m.isolation_limit.clone(),
        );
        registry.register(
            "mps_daemon_restarts",
            "MPS control daemons found dead and started again, by GPU",
            m.mps_restarts.clone(),
        );
        registry.register_with_unit(
            "gpu_memory_used",
            "GPU memory used per GPU as NVML measures it (sum over its processes)",
            Unit::Bytes,
            m.memory_used.clone(),
        );
        registry.register_with_unit(
            "gpu_memory_total",
            "GPU memory per GPU that processes can use: NVML's total less the driver's reserve (the capacity in the ledger)",
            Unit::Bytes,
            m.memory_total.clone(),
        );
        registry.register_with_unit(
            "gpu_memory_allocated",
            "GPU memory the ledger allocates on each GPU of this node",
            Unit::Bytes,
            m.memory_allocated.clone(),
        );
        registry.register(
            "gpu_core_allocated_permille",
            "GPU compute the ledger allocates on each GPU of this node, in thousandths of a GPU",
            m.core_allocated.clone(),
        );
        registry.register(
            "gpu_healthy",
            "1 while the GPU is healthy (0 after a critical Xid)",
            m.healthy.clone(),
        );
        registry.register(
            "allocations",
            "Allocations the ledger holds on this node",
            m.allocations.clone(),
        );
        registry.register(
            "ledger_seq",
            "Ledger seq of this agent's view of its node",
            m.ledger_seq.clone(),
        );
        registry.register(
            "kubelet_registered",
            "1 while the device plugin (or, with --mode=dra, the DRA plugin) is registered with the kubelet",
            m.registered.clone(),
        );
        registry.register(
            "ledger_synced",
            "1 once the agent follows the ledger",
            m.synced.clone(),
        );
        registry.register_with_unit(
            "dra_prepare_duration",
            "Time to prepare one ResourceClaim for the kubelet (grant wait, claim read, CDI spec write and ClaimPrepared commit), by outcome",
            Unit::Seconds,
            m.prepare_latency.clone(),
        );
        registry.register_with_unit(
            "dra_prepare_step_duration",
            "Time each step of a successful ResourceClaim prepare took (claim_read, grant_wait, cdi_write, commit)",
            Unit::Seconds,
            m.prepare_steps.clone(),
        );
        registry.register(
            "dra_unprepares",
            "ResourceClaims unprepared for the kubelet, by outcome",
            m.unprepares.clone(),
        );
        registry.register(
            "dra_registration_failures",
            "DRA plugin registrations the kubelet reported failed",
            m.dra_registration_failures.clone(),
        );
        registry.register(
            "dra_gate_off",
            "1 while the API server drops ResourceSlice fields gpuledger needs, by the feature gate that is off; the agent then refuses every prepare",
            m.dra_gate_off.clone(),
        );
        registry.register(
            "dra_slice_writes",
            "ResourceSlice creations and updates by this agent, by why (missing, changed)",
            m.slice_writes.clone(),
        );
        // Series that count events exist from the start (at 0).
        for outcome in ["ok", "error"] {
            let _ = m
                .allocate_latency
                .get_or_create(&vec![("outcome", outcome.to_string())]);
            let _ = m
                .prepare_latency
                .get_or_create(&vec![("outcome", outcome.to_string())]);
            let _ = m
                .unprepares
                .get_or_create(&vec![("outcome", outcome.to_string())]);
        }
        for action in ["kill", "report", "rogue", "rogue-kill"] {
            let _ = m
                .violations
                .get_or_create(&vec![("action", action.to_string())]);
        }
        m
    }

    /// Bring the state gauges up to date with the GPUs, the ledger view and the agent's
    /// registration and sync flags (called on each scrape).
    pub fn refresh(&self, gpus: &[GpuState], view: &View, registered: bool, synced: bool) {
        const MIB: i64 = 1 << 20;
        for g in gpus {
            let l = vec![("gpu", g.info.uuid.clone())];
            self.healthy.get_or_create(&l).set(i64::from(g.healthy));
            self.memory_total
                .get_or_create(&l)
                .set(i64::try_from(g.info.memory_mib).unwrap_or(i64::MAX) * MIB);
        }
        self.ledger_seq.set(view.seq);
        self.allocations
            .set(i64::try_from(view.allocs.len()).unwrap_or(i64::MAX));
        let mut per_gpu: std::collections::HashMap<&str, (i64, i64)> = gpus
            .iter()
            .map(|g| (g.info.uuid.as_str(), (0, 0)))
            .collect();
        for a in view.allocs.values() {
            for s in &a.shares {
                let e = per_gpu.entry(&s.gpu_uuid).or_default();
                e.0 += i64::try_from(s.mem_mib).unwrap_or(0);
                e.1 += i64::from(s.core_milli);
            }
        }
        for (gpu, (mib, core)) in per_gpu {
            let l = vec![("gpu", gpu.to_string())];
            self.memory_allocated.get_or_create(&l).set(mib * MIB);
            self.core_allocated.get_or_create(&l).set(core);
        }
        self.registered.set(i64::from(registered));
        self.synced.set(i64::from(synced));
    }
}
