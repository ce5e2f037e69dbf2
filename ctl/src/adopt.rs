//! `gpuledger adopt`: take over the GPU pods another scheduler (HAMi, gpushare, gpu-manager)
//! placed, while they keep running. A thin shell: read the pods (API server or a saved pod
//! list) and the ledger, print the plan ([`plan`]), and with `--apply` commit each adoptable
//! pod through the allocator's `Adopt`.

mod plan;

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use gpuledger_ledger::{Ledger, pb};
use gpuledger_proto::allocator::v1 as api;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};

use crate::client::{Target, connect, dump_of};
use crate::discover;
use crate::table::Table;

use plan::PlanOutcome;

/// How `gpuledger adopt` works, for `--help`.
pub const LONG_ABOUT: &str = "\
Take over running GPU pods that HAMi, gpushare or gpu-manager placed, without restarting them.

Each running pod's allocation is read as its scheduler recorded it in the pod's annotations \
(HAMi: hami.io/vgpu-devices-allocated, hami.io/vgpu-node, hami.io/bind-phase; gpushare: \
ALIYUN_COM_GPU_MEM_IDX/_POD/_DEV/_ASSIGNED; gpu-manager: tencent.com/predicate-gpu-idx-N, \
tencent.com/predicate-node, tencent.com/gpu-assigned), its GPUs are found among the GPUs the \
node agents registered (by UUID, or by index on the node), and the ledger's own checks decide \
it on a copy of the ledger: the plan printed is what --apply commits.

Dry run by default: per node, every such pod and what becomes of it: adopt, held (the ledger \
has it already), or cannot (why: a GPU the peer over-committed, naming the pods on it; a GPU \
or node not registered; partial annotations; devices not handed over yet). --apply commits \
the adoptable ones (admin credential), each as a grant bound at once with policy \
adopted-from=<peer>; running it again adopts nothing twice. The last line reads \
`adopt nodes=<n> adopt=<n> held=<n> cannot=<n> applied=<n>`.";

/// Arguments of `gpuledger adopt`.
#[derive(clap::Args, Debug)]
pub struct AdoptArgs {
    #[command(flatten)]
    target: Target,
    /// Commit the plan (needs an admin credential). Without it nothing is written.
    #[arg(long)]
    apply: bool,
    /// Read the pods from this file (`kubectl get pods -A -o json`) instead of the API server.
    #[arg(long, value_name = "FILE")]
    pods_file: Option<PathBuf>,
    /// Only pods on this node (repeatable; default: every node).
    #[arg(long = "node", value_name = "NODE")]
    nodes: Vec<String>,
}

/// The pods: from the file given, else every pod the kubeconfig's cluster has.
async fn pods(a: &AdoptArgs) -> Result<Vec<Pod>> {
    let mut pods: Vec<Pod> = match &a.pods_file {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            #[derive(serde::Deserialize)]
            struct List {
                items: Vec<Pod>,
            }
            serde_json::from_str::<List>(&text)
                .with_context(|| {
                    format!(
                        "{} is not a pod list (kubectl get pods -A -o json)",
                        path.display()
                    )
                })?
                .items
        }
        None => {
            let client = discover::client(&a.target.kube).await?;
            Api::<Pod>::all(client)
                .list(&ListParams::default())
                .await
                .context("listing pods")?
                .items
        }
    };
    if !a.nodes.is_empty() {
        pods.retain(|p| {
            p.spec
                .as_ref()
                .and_then(|s| s.node_name.as_ref())
                .is_some_and(|n| a.nodes.contains(n))
        });
    }
    Ok(pods)
}

fn shares(cs: &[pb::NominatedContainer]) -> String {
    cs.iter()
        .map(|c| {
            let s: Vec<String> = c
                .shares
                .iter()
                .map(|s| format!("{} {}MiB {}%", s.gpu_uuid, s.mem_mib, s.core_milli / 10))
                .collect();
            format!("{}: {}", c.container, s.join(" + "))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// `gpuledger adopt`.
pub async fn adopt(a: AdoptArgs) -> Result<()> {
    let pods = pods(&a).await?;
    let mut c = connect(&a.target).await?;
    let (_, snap) = dump_of(&mut c).await?;
    let mut ledger = Ledger::from_snapshot(&snap)
        .map_err(|e| anyhow::anyhow!("the allocator's state does not load: {e}"))?;
    let entries = plan::plan(&mut ledger, &pods);
    let mut table = Table::new(&["NODE", "POD", "PEER", "SHARES", "PLAN"]);
    let (mut adopt, mut held, mut cannot, mut applied) = (0, 0, 0, 0);
    let mut nodes = std::collections::BTreeSet::new();
    let mut failed = Vec::new();
    for e in &entries {
        nodes.insert(e.node.clone());
        let what = match &e.outcome {
            PlanOutcome::Adopt if a.apply => {
                adopt += 1;
                let r = c
                    .adopt(api::AdoptRequest {
                        pod: Some(e.pod.clone()),
                        node: e.node.clone(),
                        containers: e.containers.clone(),
                        source: e.peer.map_or("", |p| p.as_str()).into(),
                    })
                    .await;
                match r {
                    Ok(r) => {
                        let r = r.into_inner();
                        applied += usize::from(r.created);
                        let ids: Vec<String> =
                            r.allocations.iter().map(|x| x.id.to_string()).collect();
                        format!(
                            "adopted as allocation(s) {} at seq {}",
                            ids.join(","),
                            r.seq
                        )
                    }
                    Err(s) => {
                        failed.push(format!(
                            "{}/{}: {}",
                            e.pod.namespace,
                            e.pod.name,
                            s.message()
                        ));
                        format!("refused by the allocator: {}", s.message())
                    }
                }
            }
            PlanOutcome::Adopt => {
                adopt += 1;
                "adopt".to_string()
            }
            PlanOutcome::Held(ids) => {
                held += 1;
                let ids: Vec<String> = ids.iter().map(u64::to_string).collect();
                format!("held already (allocation(s) {})", ids.join(","))
            }
            PlanOutcome::Refused(why) => {
                cannot += 1;
                format!("cannot: {why}")
            }
        };
        table.row(vec![
            e.node.clone(),
            format!("{}/{}", e.pod.namespace, e.pod.name),
            e.peer.map_or("?", |p| p.as_str()).to_string(),
            shares(&e.containers),
            what,
        ]);
    }
    print!("{}", table.render());
    if !a.apply && adopt > 0 {
        println!("dry run: nothing written; --apply commits the {adopt} pod(s) marked adopt");
    }
    println!(
        "adopt nodes={} adopt={adopt} held={held} cannot={cannot} applied={applied}",
        nodes.len()
    );
    if !failed.is_empty() {
        bail!(
            "the allocator refused {} adoption(s) the plan expected: {}",
            failed.len(),
            failed.join("; ")
        );
    }
    Ok(())
}
