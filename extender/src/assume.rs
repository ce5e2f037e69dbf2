//! Reservations in flight, counted the way kube-scheduler's assume cache counts pods it has
//! placed but not yet bound.
//!
//! kube-scheduler binds asynchronously: the next pod's filter and prioritize run while the
//! previous pod's bind is still reading the pod and reserving at the allocator, or is reserved
//! but not yet in the ledger replica. Without this, they would offer the capacity that
//! reservation is about to take (with binpack, exactly that GPU) and the next bind would be
//! refused and retried. A bind is assumed from the moment it arrives (with the request its
//! pod's filter carried) until the replica has folded its reservation, or it failed; filter
//! and prioritize judge the nodes it touches as if it were already placed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpuledger_ledger::placement::{self, Filtered};
use gpuledger_ledger::{Fit, Ledger, NodeState, PodRequest};
use gpuledger_proto::allocator::v1 as api;

use crate::replica::Defaults;

/// An assumed bind that never finished is dropped after this long (kube-scheduler's own
/// assume cache expires bound-but-unconfirmed pods after 30 s too).
const FORGET_AFTER: Duration = Duration::from_secs(30);

struct Entry {
    node: String,
    request: api::PodRequest,
    /// The seq of its reservation, once the allocator answered.
    landed: Option<u64>,
    since: Instant,
}

/// Requests seen by filter are kept this long for the bind that follows.
const SEEN_FOR: Duration = Duration::from_secs(60);

/// The binds in flight, by pod uid.
#[derive(Default)]
pub struct InFlight {
    entries: Mutex<HashMap<String, Entry>>,
    /// The last request filter saw for each pod, so that its bind is assumed on arrival.
    seen: Mutex<HashMap<String, (api::PodRequest, Instant)>>,
}

/// One assumed bind. Dropped before [`Assumed::landed`], the bind failed and is forgotten.
pub struct Assumed {
    cache: Arc<InFlight>,
    uid: String,
    landed: bool,
}

impl Assumed {
    /// The allocator reserved it at `seq`: it stays assumed until the replica has `seq`.
    pub fn landed(mut self, seq: u64) {
        let mut e = self.cache.entries.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(x) = e.get_mut(&self.uid) {
            x.landed = Some(seq);
        }
        self.landed = true;
    }
}

impl Drop for Assumed {
    fn drop(&mut self) {
        if !self.landed {
            let mut e = self.cache.entries.lock().unwrap_or_else(|p| p.into_inner());
            e.remove(&self.uid);
        }
    }
}

impl InFlight {
    /// An empty cache.
    pub fn new() -> Arc<InFlight> {
        Arc::new(InFlight::default())
    }

    /// Filter saw `request` (the bind of its pod may follow).
    pub fn saw(&self, request: &api::PodRequest) {
        let Some(uid) = request.pod.as_ref().map(|p| p.uid.clone()) else {
            return;
        };
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.len() >= 4096 {
            seen.retain(|_, (_, t)| t.elapsed() < SEEN_FOR);
        }
        seen.insert(uid, (request.clone(), Instant::now()));
    }

    /// A bind of pod `uid` to `node` arrives: assumed at once with the request filter saw for
    /// it, if any.
    pub fn assume_seen(self: &Arc<Self>, uid: &str, node: &str) -> Option<Assumed> {
        let request = {
            let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
            let (r, t) = seen.remove(uid)?;
            (t.elapsed() < SEEN_FOR).then_some(r)?
        };
        Some(self.assume(uid, node, request))
    }

    /// A bind of pod `uid` to `node` with `request` begins.
    pub fn assume(self: &Arc<Self>, uid: &str, node: &str, request: api::PodRequest) -> Assumed {
        let mut e = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        e.insert(
            uid.to_string(),
            Entry {
                node: node.to_string(),
                request,
                landed: None,
                since: Instant::now(),
            },
        );
        Assumed {
            cache: self.clone(),
            uid: uid.to_string(),
            landed: false,
        }
    }

    /// The nodes that assumed binds touch, as they will be once those are placed (other pods'
    /// binds only, and only those `ledger` does not hold yet).
    fn nodes(&self, ledger: &Ledger, d: &Defaults, pod_uid: &str) -> HashMap<String, NodeState> {
        let mut e = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        e.retain(|_, x| {
            x.since.elapsed() < FORGET_AFTER && x.landed.is_none_or(|s| s > ledger.seq())
        });
        let mut out: HashMap<String, NodeState> = HashMap::new();
        for (uid, x) in e.iter() {
            if uid == pod_uid || !ledger.allocs_of_pod(uid).is_empty() {
                continue;
            }
            let Some(node) = ledger.node(&x.node) else {
                continue;
            };
            let Ok(req) = d.request(x.request.clone()) else {
                continue;
            };
            let n = out.entry(x.node.clone()).or_insert_with(|| node.clone());
            take(n, &req);
        }
        out
    }

    /// `f`, computed on `ledger` for `req`, with the nodes that binds in flight fill moved from
    /// `fits` to `wait`.
    pub fn filter(&self, ledger: &Ledger, d: &Defaults, req: &PodRequest, f: &mut Filtered) {
        let nodes = self.nodes(ledger, d, &req.pod.uid);
        if nodes.is_empty() {
            return;
        }
        let mut fits = Vec::with_capacity(f.fits.len());
        for name in f.fits.drain(..) {
            match nodes.get(&name).map(|n| placement::fit_node(n, req)) {
                None | Some(Fit::Fits) => fits.push(name),
                Some(Fit::Wait(why)) | Some(Fit::Never(why)) => {
                    f.wait
                        .push((name, format!("{why} (counting binds in flight)")));
                }
            }
        }
        f.fits = fits;
    }

    /// `scores` (one per name, computed on `ledger`) rescored where binds in flight land.
    pub fn scores<S: AsRef<str>>(
        &self,
        ledger: &Ledger,
        d: &Defaults,
        req: &PodRequest,
        names: &[S],
        scores: &mut [Option<u32>],
    ) {
        let nodes = self.nodes(ledger, d, &req.pod.uid);
        if nodes.is_empty() {
            return;
        }
        for (name, s) in names.iter().zip(scores.iter_mut()) {
            if let Some(n) = nodes.get(name.as_ref()) {
                *s = Some(placement::score_node(n, req));
            }
        }
    }
}

/// Count `req` on `node` where placement would put it (nothing when it no longer fits).
fn take(node: &mut NodeState, req: &PodRequest) {
    let Ok(placed) = placement::place_on_node(node, req) else {
        return;
    };
    for c in &placed {
        for s in &c.shares {
            if let Some(g) = node.gpus.iter_mut().find(|g| g.uuid == s.gpu_uuid) {
                g.mem_used += s.mem_mib;
                g.core_used += s.core_milli;
                g.holders += 1;
            }
        }
    }
    node.cpu_used += req.cpu_milli;
    node.memory_used += req.memory_mib;
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuledger_ledger::pb;

    fn request(uid: &str, mem: u64) -> api::PodRequest {
        api::PodRequest {
            pod: Some(pb::PodRef {
                uid: uid.into(),
                namespace: "ns".into(),
                name: uid.into(),
            }),
            containers: vec![api::ContainerRequest {
                name: "c".into(),
                slices: 1,
                mem_mib: mem,
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    fn ledger() -> Ledger {
        let mut l = Ledger::new();
        let inv = pb::NodeInventory {
            node: "n1".into(),
            gpus: vec![pb::Gpu {
                uuid: "GPU-1".into(),
                index: 0,
                model: "A10".into(),
                memory_mib: 16_384,
                healthy: true,
            }],
            cpu_milli: 0,
            memory_mib: 0,
        };
        let ev = pb::Event {
            seq: 1,
            epoch: 1,
            time_ms: 1,
            actor: None,
            body: Some(pb::event::Body::NodeRegistered(pb::NodeRegistered {
                inventory: Some(inv),
            })),
        };
        l.apply(&ev).expect("registers");
        l
    }

    #[test]
    fn a_bind_in_flight_takes_its_capacity_until_it_fails() {
        let (l, d, cache) = (ledger(), Defaults::default(), InFlight::new());
        let next = d.request(request("p2", 10_000)).expect("valid");
        let filter = |cache: &InFlight| {
            let mut f = placement::filter_nodes(&l, ["n1"], &next);
            cache.filter(&l, &d, &next, &mut f);
            f
        };
        assert_eq!(filter(&cache).fits, vec!["n1"]);
        let first = cache.assume("p1", "n1", request("p1", 10_000));
        let f = filter(&cache);
        assert!(f.fits.is_empty(), "{f:?}");
        assert!(f.wait[0].1.contains("in flight"), "{f:?}");
        let mut scores = [Some(7)];
        cache.scores(&l, &d, &next, &["n1"], &mut scores);
        assert_eq!(scores, [Some(0)], "a node it no longer fits on scores 0");
        // A pod's own bind does not count against it (the scheduler retries it).
        let own = d.request(request("p1", 10_000)).expect("valid");
        let mut f = placement::filter_nodes(&l, ["n1"], &own);
        cache.filter(&l, &d, &own, &mut f);
        assert_eq!(f.fits, vec!["n1"]);
        drop(first);
        assert_eq!(
            filter(&cache).fits,
            vec!["n1"],
            "a failed bind is forgotten"
        );
        // Landed at a seq the replica has: the ledger counts it, the cache no more.
        cache.assume("p1", "n1", request("p1", 10_000)).landed(1);
        assert_eq!(filter(&cache).fits, vec!["n1"]);
        cache.assume("p1", "n1", request("p1", 10_000)).landed(2);
        assert!(
            filter(&cache).fits.is_empty(),
            "landed beyond the replica: still assumed"
        );
        // A bind arriving for a pod filter saw is assumed before it reads anything.
        let cache = InFlight::new();
        cache.saw(&request("p3", 10_000));
        assert!(cache.assume_seen("p4", "n1").is_none(), "never filtered");
        let early = cache.assume_seen("p3", "n1").expect("seen by filter");
        assert!(filter(&cache).fits.is_empty());
        drop(early);
    }
}
