//! What one caller may write: how fast a node agent may change the ledger, and how large an
//! inventory it may register. Checked on the replica a call reaches, before the sequencer; the
//! leader checks a forwarded write again as its original caller's.

use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use gpuledger_auth::identity::Caller;
use gpuledger_auth::rules::Call;
use gpuledger_auth::server::over_limit;
use gpuledger_ledger::command::bounds::InventoryLimits;
use gpuledger_ledger::pb;
use tonic::Status;
use tracing::warn;

use crate::metrics::Metrics;

/// Flags of the write limits.
#[derive(clap::Args, Debug, Clone)]
pub struct WriteLimitArgs {
    /// Ledger writes per second one node agent may make, sustained: RegisterNode,
    /// SetDeviceHealth, CorrectIdentity, ReportViolation, PrepareClaim and UnprepareClaim (a
    /// claim prepared and unprepared in a loop writes each time), each started KiB of a request
    /// counting as one more write (Assign is bounded by the node's reservations). Past the
    /// burst a write is refused with RESOURCE_EXHAUSTED. 0 = no limit.
    #[arg(long, env = "GPULEDGER_NODE_WRITES_PER_S", default_value_t = 10)]
    pub node_writes_per_s: u32,

    /// How many such writes a node agent may make at once before --node-writes-per-s applies
    /// (a node agent's restart re-registers and reports at once).
    #[arg(long, env = "GPULEDGER_NODE_WRITE_BURST", default_value_t = 200)]
    pub node_write_burst: u32,

    /// Most GPUs one node may register; more is refused (RegisterNode INVALID_ARGUMENT).
    /// At most 1024.
    #[arg(long, env = "GPULEDGER_MAX_GPUS_PER_NODE", default_value_t = 64)]
    pub max_gpus_per_node: usize,

    /// Most memory one GPU may register, in MiB; more is refused (RegisterNode
    /// INVALID_ARGUMENT). At most 1073741824 (a pebibyte).
    #[arg(long, env = "GPULEDGER_MAX_GPU_MEMORY_MIB", default_value_t = 1 << 20)]
    pub max_gpu_memory_mib: u64,
}

impl Default for WriteLimitArgs {
    fn default() -> Self {
        WriteLimitArgs {
            node_writes_per_s: 10,
            node_write_burst: 200,
            max_gpus_per_node: 64,
            max_gpu_memory_mib: 1 << 20,
        }
    }
}

/// The write limits of one replica.
pub struct WriteLimits {
    args: WriteLimitArgs,
    inventory: InventoryLimits,
    /// Write budget per node (None: unlimited).
    nodes: Option<DefaultKeyedRateLimiter<String>>,
    /// One warning per node a minute, however hard it is throttled.
    warned: DefaultKeyedRateLimiter<String>,
}

impl Default for WriteLimits {
    fn default() -> Self {
        WriteLimits::new(WriteLimitArgs::default())
    }
}

impl WriteLimits {
    /// The limits the flags set (capped at the ledger's own ceilings).
    pub fn new(args: WriteLimitArgs) -> Self {
        let inventory = InventoryLimits {
            max_gpus: args.max_gpus_per_node,
            max_gpu_memory_mib: args.max_gpu_memory_mib,
        }
        .capped();
        let nodes = NonZeroU32::new(args.node_writes_per_s).map(|rate| {
            let burst = NonZeroU32::new(args.node_write_burst.max(rate.get())).unwrap_or(rate);
            RateLimiter::keyed(Quota::per_second(rate).allow_burst(burst))
        });
        WriteLimits {
            args,
            inventory,
            nodes,
            warned: RateLimiter::keyed(Quota::per_minute(NonZeroU32::MIN)),
        }
    }

    /// Refuse a write of `bytes` by `caller` when its node's write budget is spent.
    pub fn admit(
        &self,
        caller: &Caller,
        call: Call,
        bytes: usize,
        metrics: &Metrics,
    ) -> Result<(), Status> {
        let (Some(limiter), Some(node)) = (&self.nodes, caller.node()) else {
            return Ok(());
        };
        if !matches!(
            call,
            Call::RegisterNode
                | Call::SetDeviceHealth
                | Call::CorrectIdentity
                | Call::ReportViolation
                | Call::PrepareClaim
                | Call::UnprepareClaim
        ) {
            return Ok(());
        }
        let burst = self.args.node_write_burst.max(self.args.node_writes_per_s);
        let units = u32::try_from(1 + bytes / 1024)
            .unwrap_or(u32::MAX)
            .min(burst);
        let units = NonZeroU32::new(units).unwrap_or(NonZeroU32::MIN);
        let key = node.to_string();
        let wait = match limiter.check_key_n(&key, units) {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(not_until)) => not_until.wait_time_from(DefaultClock::default().now()),
            Err(_) => Duration::from_secs(1),
        };
        metrics.refused("node_write_rate");
        if self.warned.check_key(&key).is_ok() {
            warn!(
                node,
                call = call.name(),
                rate = self.args.node_writes_per_s,
                burst,
                "a node agent writes faster than --node-writes-per-s allows: refusing its writes \
                 (logged once a minute per node; metric gpuledger_allocator_writes_refused_total)"
            );
        }
        Err(over_limit(
            Status::resource_exhausted(format!(
                "node {node} writes faster than this allocator allows (--node-writes-per-s {}, \
                 --node-write-burst {burst}); retry in {} ms",
                self.args.node_writes_per_s,
                wait.as_millis().max(1)
            )),
            "node_write_rate",
        ))
    }

    /// Refuse an inventory past --max-gpus-per-node or --max-gpu-memory-mib.
    pub fn check_inventory(
        &self,
        inv: &pb::NodeInventory,
        metrics: &Metrics,
    ) -> Result<(), Status> {
        self.inventory.check(inv).map_err(|why| {
            let max = &self.inventory;
            let limit = if inv.gpus.len() > max.max_gpus {
                "gpus_per_node"
            } else if inv
                .gpus
                .iter()
                .any(|g| g.memory_mib > max.max_gpu_memory_mib)
            {
                "gpu_memory"
            } else {
                "inventory"
            };
            metrics.refused(limit);
            Status::invalid_argument(format!(
                "{why} (--max-gpus-per-node {}, --max-gpu-memory-mib {})",
                self.inventory.max_gpus, self.inventory.max_gpu_memory_mib
            ))
        })
    }
}
