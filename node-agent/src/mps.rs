//! `--isolation=mps`: the CUDA MPS control daemons the agent runs, one per GPU, and the limits
//! it sets in them server-side from the ledger. This file decides (pure): which limit each
//! GPU's daemon holds its clients to, and the control commands that say it; [`daemon`] starts,
//! watches and talks to the daemons.
//!
//! Why one daemon per GPU, not per tenant: the GPU is put in EXCLUSIVE_PROCESS compute mode so
//! that no CUDA context can bypass the MPS server, and that mode lets one context on the GPU:
//! the one MPS server. A second tenant's daemon would have its server refused. Per GPU (not one
//! daemon for the node) because a fatal fault of a client stops its server from taking new
//! clients until every client of that server exited: per GPU, that reaches only the tenants of
//! that GPU.
//!
//! The limits are per server (`set_device_pinned_mem_limit <server PID>`) and the server's
//! defaults for the next one (`set_default_*`); every client of a server gets the same
//! ceiling. A GPU shared by several tenants has its daemon hold each client to the largest
//! share on that GPU, each client's own share is in its environment
//! (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, which can only lower the server's), and the NVML
//! sampling behind every mode kills a client above its own share.

pub mod daemon;

use std::collections::BTreeMap;

use crate::view::View;

/// The device index a daemon names its GPU by: each daemon sees one GPU
/// (`CUDA_VISIBLE_DEVICES=<UUID>`), so it is device 0.
const DEVICE: u32 = 0;

pub use crate::config::mps_pipe_dir as pipe_dir;

/// What a GPU's daemon holds each client to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    /// Pinned device memory, MiB.
    pub mem_mib: u64,
    /// Active thread percentage, 1..=100.
    pub thread_pct: u32,
}

/// The limit each GPU of `gpus` gets from the view: the largest share of the allocations on
/// it (memory and threads apart; a share without a compute part counts as 100 %). A GPU no
/// allocation is on is absent: its daemon keeps what it had, no client belongs there.
pub fn wanted(view: &View, gpus: &[String]) -> BTreeMap<String, Limit> {
    let mut out: BTreeMap<String, Limit> = BTreeMap::new();
    for s in view.allocs.values().flat_map(|a| &a.shares) {
        if !gpus.contains(&s.gpu_uuid) {
            continue;
        }
        let pct = match s.core_milli / 10 {
            0 => 100,
            p => p.min(100),
        };
        let e = out.entry(s.gpu_uuid.clone()).or_insert(Limit {
            mem_mib: 0,
            thread_pct: 1,
        });
        e.mem_mib = e.mem_mib.max(s.mem_mib);
        e.thread_pct = e.thread_pct.max(pct);
    }
    out
}

/// The control commands that set `limit` as the default for the daemon's next servers and on
/// each of its running `servers`.
pub fn commands(limit: Limit, servers: &[u32]) -> Vec<String> {
    let Limit {
        mem_mib,
        thread_pct,
    } = limit;
    let mut out = vec![
        format!("set_default_device_pinned_mem_limit {DEVICE} {mem_mib}M"),
        format!("set_default_active_thread_percentage {thread_pct}"),
    ];
    for pid in servers {
        out.push(format!(
            "set_device_pinned_mem_limit {pid} {DEVICE} {mem_mib}M"
        ));
        out.push(format!("set_active_thread_percentage {pid} {thread_pct}"));
    }
    out
}

/// The server PIDs in `get_server_list`'s answer (one per line); other lines are skipped.
pub fn server_pids(answer: &str) -> Vec<u32> {
    answer
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuledger_proto::ledger::v1 as pb;

    fn alloc(id: u64, gpu: &str, mem_mib: u64, core_milli: u32) -> pb::Allocation {
        pb::Allocation {
            id,
            shares: vec![pb::GpuShare {
                gpu_uuid: gpu.into(),
                mem_mib,
                core_milli,
            }],
            ..Default::default()
        }
    }

    #[test]
    fn a_gpu_is_held_to_its_largest_share_and_an_empty_gpu_to_nothing_new() {
        let mut v = View::default();
        let gpus = vec!["GPU-0".to_string(), "GPU-1".to_string()];
        v.allocs.insert(1, alloc(1, "GPU-0", 10_000, 250));
        v.allocs.insert(2, alloc(2, "GPU-0", 30_000, 0));
        v.allocs.insert(3, alloc(3, "GPU-9", 50_000, 500));
        let w = wanted(&v, &gpus);
        assert_eq!(
            w.get("GPU-0"),
            Some(&Limit {
                mem_mib: 30_000,
                thread_pct: 100
            })
        );
        assert!(!w.contains_key("GPU-1"), "an empty GPU has no limit to set");
        assert!(!w.contains_key("GPU-9"), "not this node's GPU");
        v.allocs.remove(&2);
        assert_eq!(
            wanted(&v, &gpus).get("GPU-0"),
            Some(&Limit {
                mem_mib: 10_000,
                thread_pct: 25
            })
        );
    }

    #[test]
    fn the_commands_set_the_default_and_every_running_server() {
        let l = Limit {
            mem_mib: 4096,
            thread_pct: 50,
        };
        assert_eq!(
            commands(l, &[77]),
            [
                "set_default_device_pinned_mem_limit 0 4096M",
                "set_default_active_thread_percentage 50",
                "set_device_pinned_mem_limit 77 0 4096M",
                "set_active_thread_percentage 77 50",
            ]
        );
        assert_eq!(server_pids("12\n 34 \nno server\n"), [12, 34]);
    }
}
