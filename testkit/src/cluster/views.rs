//! Each node agent's view against the ledger: the allocations and GPU memory an agent's
//! `/metrics` reports for its node, compared with the ledger's part for that node.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpuledger_proto::ledger::v1 as pb;

use super::{LocalCluster, SimNode};

const MIB: f64 = 1_048_576.0;

impl LocalCluster {
    /// Compare every node agent's view (its `/metrics`) with the ledger's part for its node;
    /// retried until they agree or `timeout` passes (both move while pods come and go).
    pub async fn check_agent_views(&self, timeout: Duration) -> Vec<ViewCheck> {
        let mut out = Vec::new();
        for n in &self.nodes {
            out.push(self.check_agent_view(n, timeout).await);
        }
        out
    }

    async fn check_agent_view(&self, n: &SimNode, timeout: Duration) -> ViewCheck {
        let deadline = Instant::now() + timeout;
        let mut tries = 0;
        loop {
            tries += 1;
            let r = async {
                let (code, text) = crate::http::get(&format!("{}/metrics", n.health_url())).await?;
                anyhow::ensure!(code == 200, "/metrics answered {code}");
                let snap = self.dump().await?;
                Ok::<_, anyhow::Error>(compare_view(&n.name, &text, &snap))
            }
            .await;
            let (agree, detail, allocations) = match r {
                Ok(Ok(allocs)) => (true, String::new(), allocs),
                Ok(Err(d)) => (false, d, 0),
                Err(e) => (false, format!("{e:#}"), 0),
            };
            if agree || Instant::now() > deadline {
                return ViewCheck {
                    node: n.name.clone(),
                    agree,
                    allocations,
                    tries,
                    detail,
                };
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// One node's comparison of its agent's view with the ledger.
#[derive(Debug, Clone)]
pub struct ViewCheck {
    /// The node.
    pub node: String,
    /// Whether the agent's view equals the ledger's part for the node.
    pub agree: bool,
    /// Allocations on the node (when they agree).
    pub allocations: usize,
    /// Comparisons made.
    pub tries: u32,
    /// What differed, the last time.
    pub detail: String,
}

/// The value of `series` (a metric name, with its labels in key order when it has any) in a
/// Prometheus text exposition.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    crate::promtext::value(text, series)
}

/// Compare an agent's `/metrics` text with the ledger: the allocation count on `node` and the
/// memory allocated on each of its GPUs. `Ok(count)` when they agree, else what differs.
pub fn compare_view(node: &str, text: &str, snap: &pb::Snapshot) -> Result<usize, String> {
    let mine: Vec<&pb::Allocation> = snap.allocations.iter().filter(|a| a.node == node).collect();
    let mut diffs = Vec::new();
    let agent_allocs = metric(text, "gpuledger_node_agent_allocations");
    if agent_allocs != Some(mine.len() as f64) {
        diffs.push(format!(
            "allocations: agent {agent_allocs:?}, ledger {} (seq {})",
            mine.len(),
            snap.seq
        ));
    }
    let mut per_gpu: BTreeMap<String, u64> = BTreeMap::new();
    if let Some(inv) = snap.nodes.iter().find(|x| x.node == node) {
        for g in &inv.gpus {
            per_gpu.insert(g.uuid.clone(), 0);
        }
    }
    for a in &mine {
        for s in &a.shares {
            *per_gpu.entry(s.gpu_uuid.clone()).or_default() += s.mem_mib;
        }
    }
    for (gpu, mib) in &per_gpu {
        let series = format!("gpuledger_node_agent_gpu_memory_allocated_bytes{{gpu=\"{gpu}\"}}");
        let agent = metric(text, &series);
        if agent != Some(*mib as f64 * MIB) {
            diffs.push(format!(
                "{gpu}: agent {} MiB, ledger {mib} MiB",
                agent.map_or("none".into(), |b| format!("{:.0}", b / MIB))
            ));
        }
    }
    if diffs.is_empty() {
        Ok(mine.len())
    } else {
        Err(diffs.join("; "))
    }
}
