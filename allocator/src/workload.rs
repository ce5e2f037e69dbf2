//! The workload FGD places against, learned from the ledger's recent reservations.
//!
//! Fragmentation gradient descent needs the distribution of pod shapes the cluster runs. Every
//! replica follows the committed batches and keeps the shapes of the last `--fgd-window` pods
//! reserved (GPUs, compute per GPU, CPU and host memory, from their `Reserved` events); while
//! fewer than `--fgd-min-samples` have been seen, it uses [`Workload::prior`]. Each rebuilt
//! distribution learns from the ledger's nodes which share of the cluster's GPUs could host each
//! shape ([`Workload::on_cluster`]). Requests with an FGD policy get the current distribution
//! attached before they are evaluated.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use gpuledger_ledger::placement::{Defaults, PodRequest, PodShape, Workload};
use gpuledger_ledger::{CORE_MILLI_PER_GPU, Ledger, Policy};
use gpuledger_proto::ledger::v1 as pb;
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::watch;

use crate::shared::Shared;

/// How many new shapes make the distribution be recomputed.
const REBUILD_EVERY: usize = 16;

/// The learned distribution and the window it comes from.
pub struct Learned {
    current: watch::Sender<Arc<Workload>>,
    window: usize,
    min_samples: usize,
    seen: std::sync::Mutex<Window>,
}

#[derive(Default)]
struct Window {
    shapes: VecDeque<PodShape>,
    counts: HashMap<PodShape, u64>,
    since_rebuild: usize,
}

impl Learned {
    /// Empty (the prior) for a window of `window` pods, learned once `min_samples` are in.
    pub fn new(window: usize, min_samples: usize) -> Arc<Learned> {
        Arc::new(Learned {
            current: watch::channel(Arc::new(Workload::prior())).0,
            window: window.max(1),
            min_samples: min_samples.min(window.max(1)),
            seen: std::sync::Mutex::new(Window::default()),
        })
    }

    /// The distribution FGD uses now.
    pub fn get(&self) -> Arc<Workload> {
        self.current.borrow().clone()
    }

    /// The distribution now and whenever it is rebuilt (what replicas of the ledger follow).
    pub fn watch(&self) -> watch::Receiver<Arc<Workload>> {
        self.current.subscribe()
    }

    /// What a request that leaves them out is evaluated with: `policy`, and the current
    /// distribution for FGD.
    pub fn defaults(&self, policy: Policy) -> Defaults {
        Defaults {
            policy,
            workload: Some(self.get()),
        }
    }

    /// Give an FGD request the current distribution (unless it brings its own).
    pub fn attach(&self, req: &mut PodRequest) {
        self.defaults(req.policy).attach(req);
    }

    /// Pods reserved in the window so far.
    pub fn samples(&self) -> usize {
        self.seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .shapes
            .len()
    }

    /// Count the pods reserved by one committed batch, and rebuild the distribution on the
    /// nodes of `cluster` when it is due.
    pub fn observe(&self, batch: &pb::EventBatch, cluster: &Ledger) {
        if let Some(w) = self.count(batch) {
            self.publish(w, cluster);
        }
    }

    /// Make `learned` the current distribution, on the nodes of `cluster`.
    fn publish(&self, learned: Workload, cluster: &Ledger) {
        let w = learned.on_cluster(cluster.nodes().values());
        self.current.send_replace(Arc::new(w));
    }

    /// Count the pods reserved by one committed batch; the rebuilt distribution (not yet on a
    /// cluster) when a rebuild is due.
    fn count(&self, batch: &pb::EventBatch) -> Option<Workload> {
        let shapes = pod_shapes(batch);
        if shapes.is_empty() {
            return None;
        }
        let mut w = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        for s in shapes {
            *w.counts.entry(s.clone()).or_default() += 1;
            w.shapes.push_back(s);
            w.since_rebuild += 1;
            while w.shapes.len() > self.window {
                if let Some(old) = w.shapes.pop_front()
                    && let Some(n) = w.counts.get_mut(&old)
                {
                    *n -= 1;
                    if *n == 0 {
                        w.counts.remove(&old);
                    }
                }
            }
        }
        let enough = w.shapes.len() >= self.min_samples;
        if !(enough && (w.since_rebuild >= REBUILD_EVERY || w.shapes.len() == self.min_samples)) {
            return None;
        }
        w.since_rebuild = 0;
        Some(Workload::from_counts(
            w.counts.iter().map(|(s, n)| (s.clone(), *n)),
            Workload::DEFAULT_COVERAGE,
        ))
    }
}

/// The shape of every pod a batch reserves (a pod's containers are reserved together).
fn pod_shapes(batch: &pb::EventBatch) -> Vec<PodShape> {
    let mut order: Vec<String> = Vec::new();
    let mut by_pod: HashMap<String, PodShape> = HashMap::new();
    for ev in &batch.events {
        let Some(pb::event::Body::Reserved(r)) = &ev.body else {
            continue;
        };
        let uid = r.pod.as_ref().map(|p| p.uid.clone()).unwrap_or_default();
        let s = by_pod.entry(uid.clone()).or_insert_with(|| {
            order.push(uid);
            PodShape::default()
        });
        s.gpus += u32::try_from(r.shares.len()).unwrap_or(u32::MAX);
        let core = r.shares.iter().map(|g| g.core_milli).max().unwrap_or(0);
        s.core_milli = s.core_milli.max(core);
        s.cpu_milli += r.cpu_milli;
        s.memory_mib += r.memory_mib;
    }
    order
        .into_iter()
        .filter_map(|u| by_pod.remove(&u))
        .map(|mut s| {
            if s.gpus > 1 {
                s.core_milli = CORE_MILLI_PER_GPU;
            }
            s
        })
        .collect()
}

/// Follow the committed batches of `shared` forever.
pub async fn follow(shared: Arc<Shared>, learned: Arc<Learned>) {
    let mut rx = shared.batches.subscribe();
    loop {
        match rx.recv().await {
            Ok(b) => {
                // A view only when a rebuild is due (every few reservations), held briefly.
                if let Some(w) = learned.count(&b) {
                    learned.publish(w, &*shared.view().await);
                }
            }
            Err(RecvError::Lagged(_)) => continue,
            Err(RecvError::Closed) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reserved(uid: &str, cores: &[u32]) -> pb::Event {
        pb::Event {
            body: Some(pb::event::Body::Reserved(pb::Reserved {
                pod: Some(pb::PodRef {
                    uid: uid.into(),
                    ..Default::default()
                }),
                shares: cores
                    .iter()
                    .map(|c| pb::GpuShare {
                        core_milli: *c,
                        ..Default::default()
                    })
                    .collect(),
                cpu_milli: 500,
                ..Default::default()
            })),
            ..Default::default()
        }
    }

    #[test]
    fn a_pods_containers_make_one_shape_and_the_window_forgets_old_pods() {
        let l = Learned::new(3, 2);
        assert_eq!(*l.get(), Workload::prior());
        let b = pb::EventBatch {
            events: vec![
                reserved("a", &[250]),
                reserved("b", &[1000, 1000]),
                reserved("b", &[1000]),
            ],
            ..Default::default()
        };
        let shapes = pod_shapes(&b);
        assert_eq!(shapes.len(), 2);
        assert_eq!((shapes[1].gpus, shapes[1].core_milli), (3, 1000));
        assert_eq!(shapes[1].cpu_milli, 1000);
        l.observe(&b, &Ledger::default());
        assert_ne!(*l.get(), Workload::prior(), "learned at min_samples");
        let quarter = |n: &str| pb::EventBatch {
            events: vec![reserved(n, &[250])],
            ..Default::default()
        };
        for n in ["c", "d"] {
            l.observe(&quarter(n), &Ledger::default());
        }
        assert_eq!(l.samples(), 3, "the window keeps the last 3 pods");
        // Rebuilt on the 16th shape; until then the old distribution stands. Feed enough.
        for i in 0..REBUILD_EVERY {
            l.observe(&quarter(&format!("q{i}")), &Ledger::default());
        }
        let only: Vec<_> = l.get().shapes().map(|(s, _)| s.clone()).collect();
        assert_eq!(only.len(), 1, "{only:?}");
        assert_eq!((only[0].gpus, only[0].core_milli), (1, 250));
    }

    /// A ledger with one node of `gpus` GPUs per entry.
    fn cluster(gpus: &[u32]) -> Ledger {
        let mut l = Ledger::new();
        for (k, &n) in gpus.iter().enumerate() {
            let node = format!("n{k}");
            let inventory = pb::NodeInventory {
                mode: Default::default(),
                gpus: (0..n)
                    .map(|i| pb::Gpu {
                        uuid: format!("{node}-g{i}"),
                        index: i,
                        model: "A100".into(),
                        memory_mib: 40_960,
                        healthy: true,
                        compute_capability: String::new(),
                    })
                    .collect(),
                node,
                cpu_milli: 64_000,
                memory_mib: 0,
                isolation: String::new(),
                dra_cores: String::new(),
            };
            l.apply(&pb::Event {
                seq: k as u64 + 1,
                epoch: 1,
                body: Some(pb::event::Body::NodeRegistered(pb::NodeRegistered {
                    inventory: Some(inventory),
                })),
                ..Default::default()
            })
            .expect("registers");
        }
        l
    }

    #[test]
    fn the_learned_workload_knows_which_share_of_the_cluster_can_host_each_shape() {
        let l = Learned::new(4, 2);
        // Two 2-GPU nodes and one 8-GPU node: a 4-GPU pod fits only the 8 GPUs of 12.
        let b = pb::EventBatch {
            events: vec![reserved("a", &[1000; 4]), reserved("b", &[1000])],
            ..Default::default()
        };
        l.observe(&b, &cluster(&[2, 2, 8]));
        let hosts: Vec<(u32, f64)> = l
            .get()
            .shapes_with_hosts()
            .map(|(s, _, h)| (s.gpus, h))
            .collect();
        assert_eq!(hosts.len(), 2, "{hosts:?}");
        for (gpus, h) in hosts {
            let want = if gpus == 4 { 8.0 / 12.0 } else { 1.0 };
            assert!((h - want).abs() < 1e-9, "{gpus} GPUs: {h}");
        }
    }
}
