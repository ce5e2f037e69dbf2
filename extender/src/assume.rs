//! Reservations in flight, counted the way kube-scheduler's assume cache counts pods it has
//! placed but not yet bound.
//!
//! kube-scheduler binds asynchronously: once it has chosen a node for a pod it goes on to the
//! next pod at once, and the chosen pod's bind can reach the extender after the next pod's
//! filter and prioritize ran. Without this, they would offer the capacity that pod is about to
//! take (with binpack, exactly that GPU) and the next bind would be refused and retried.
//!
//! The extender does not learn the scheduler's choice until the bind arrives, so a pod is
//! assumed from its filter on, on *every* node that filter found feasible: with the shipped
//! weight (1) an extender score is worth 0-100 of the scheduler's own points and each of its
//! default score plugins (least allocated, balanced allocation, taints, affinity, topology
//! spread) up to 100 more, so the node with the best extender score is not reliably the one
//! chosen; any feasible node can be, and only those can (the extender's filter runs last, so
//! its answer is the scheduler's feasible set). The bind narrows the assumption to its node,
//! and it lasts until the replica has folded the reservation, or the bind failed. An
//! assumption no bind followed (the scheduler's own reserve or permit plugins refused the
//! pod, or another extender replica bound it) expires after [`TENTATIVE_FOR`].
//! A pod feasible on more than [`TENTATIVE_NODES`] nodes is counted only once its bind
//! arrives: then any node is unlikely to be the one both it and the next pod need.
//!
//! Filter's pod is whatever JSON reached the port (only kube-scheduler's certificate gets onto
//! it), so each filtered pod is also checked against the API server
//! ([`InFlight::verified`]): it exists with that UID, is pending, is scheduled by a gpuledger
//! scheduler, and from then on the request counted is the one the API server's copy asks for.
//! Until the check answers (milliseconds) the pod counts with filter's request, provisionally:
//! the scheduler's next pod is filtered before that read returns, and must already see it. A
//! made-up pod is forgotten when its check fails and never reaches a bind; a real pod holds no
//! more than its own request once checked. At most [`MAX_VERIFYING`] checks run at once; a
//! pod filtered while they are all busy counts with filter's request for [`UNCHECKED_FOR`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpuledger_ledger::placement::{self, Defaults, Filtered};
use gpuledger_ledger::{Fit, Ledger, NodeState, PodRequest};
use gpuledger_proto::allocator::v1 as api;
use prometheus_client::metrics::counter::Counter;

/// An assumed bind that never finished is dropped after this long (kube-scheduler's own
/// assume cache expires bound-but-unconfirmed pods after 30 s too).
const FORGET_AFTER: Duration = Duration::from_secs(30);

/// A pod filtered but never bound stops being assumed after this long. The bind normally
/// follows its filter within milliseconds (a second or two on a loaded control plane); past
/// this, the pod is not coming and would only hold capacity that others wait for.
pub const TENTATIVE_FOR: Duration = Duration::from_secs(15);

/// A filtered pod that could not be checked against the API server (every check busy) is
/// counted for this long only: enough for kube-scheduler's bind to follow its filter, short
/// enough that a flood of made-up pods holds nothing for long.
pub const UNCHECKED_FOR: Duration = Duration::from_secs(2);

/// A pod found feasible on more nodes than this is not counted on any of them before its bind
/// arrives (its request is kept for that bind). Counting it on every feasible node costs a
/// copy and a placement per node for every later filter: with 32 binds in flight and 500
/// feasible nodes each, `gpuledger-bench extender` fell from ~500 to 72 pods/s. The refused
/// bind it guards against needs the next pod to want the very slot this one takes, which is
/// likely only when few nodes fit.
pub const TENTATIVE_NODES: usize = 16;

/// At most this many pods assumed at once; beyond, new ones are not (the cache stays bounded
/// whatever the scheduler sends).
const MAX_ENTRIES: usize = 4096;

/// Filtered pods checked against the API server at once.
pub const MAX_VERIFYING: usize = 16;

struct Entry {
    /// Where it may land: every node its filter found feasible, then the one its bind names.
    nodes: Vec<String>,
    request: api::PodRequest,
    /// Its bind arrived (the nodes are the one it names).
    bound: bool,
    /// The seq of its reservation, once the allocator answered.
    landed: Option<u64>,
    /// The API server has the pod as filter described it, and `request` is its own (a bind's
    /// entry is: bind read the pod). Only such entries are counted.
    verified: bool,
    /// Forgotten from this instant on.
    until: Instant,
}

/// The pods placed and not yet in the ledger replica, by pod uid.
pub struct InFlight {
    entries: Mutex<HashMap<String, Entry>>,
    verifying: Arc<tokio::sync::Semaphore>,
    /// Filtered pods never counted: the API server does not have them as filter said, or
    /// every check was busy.
    unverified: Counter,
}

impl Default for InFlight {
    fn default() -> Self {
        InFlight {
            entries: Mutex::default(),
            verifying: Arc::new(tokio::sync::Semaphore::new(MAX_VERIFYING)),
            unverified: Counter::default(),
        }
    }
}

/// A filtered pod to check against the API server before it counts; holds one of the
/// [`MAX_VERIFYING`] slots until dropped.
pub struct Verify {
    /// Pod UID, as filter said.
    pub uid: String,
    /// Namespace, as filter said.
    pub namespace: String,
    /// Name, as filter said.
    pub name: String,
    _slot: tokio::sync::OwnedSemaphorePermit,
}

/// One assumed bind. Dropped before [`Assumed::landed`], the bind failed and is forgotten.
pub struct Assumed {
    cache: Arc<InFlight>,
    uid: String,
    landed: bool,
}

impl Assumed {
    /// The bind read the pod: from now on it counts with the pod's own `request` (what the
    /// API server has, not what filter's JSON said).
    pub fn confirm(&self, request: api::PodRequest) {
        if let Some(x) = self.cache.lock().get_mut(&self.uid) {
            x.request = request;
            x.verified = true;
        }
    }

    /// The allocator reserved it at `seq`: it stays assumed until the replica has `seq`.
    pub fn landed(mut self, seq: u64) {
        let mut e = self.cache.lock();
        if let Some(x) = e.get_mut(&self.uid) {
            x.landed = Some(seq);
        }
        self.landed = true;
    }
}

impl Drop for Assumed {
    fn drop(&mut self) {
        if !self.landed {
            let mut e = self.cache.lock();
            if e.get(&self.uid)
                .is_some_and(|x| x.bound && x.landed.is_none())
            {
                e.remove(&self.uid);
            }
        }
    }
}

impl InFlight {
    /// An empty cache.
    pub fn new() -> Arc<InFlight> {
        Arc::new(InFlight::default())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Filter found `request` feasible on `nodes`: the scheduler binds it to one of them next.
    /// It counts once the API server confirms it: check the pod the answer names and report
    /// with [`InFlight::verified`] (None: nothing to check, or no check slot free).
    pub fn feasible(&self, request: &api::PodRequest, nodes: &[String]) -> Option<Verify> {
        self.feasible_at(request, nodes, Instant::now())
    }

    fn feasible_at(
        &self,
        request: &api::PodRequest,
        nodes: &[String],
        now: Instant,
    ) -> Option<Verify> {
        let pod = request.pod.as_ref()?;
        let uid = pod.uid.as_str();
        let mut e = self.lock();
        if e.get(uid).is_some_and(|x| x.bound) {
            // Its bind is under way; that node is where it goes.
            return None;
        }
        if nodes.is_empty() {
            e.remove(uid);
            return None;
        }
        if e.len() >= MAX_ENTRIES {
            e.retain(|_, x| x.until > now);
            if e.len() >= MAX_ENTRIES {
                return None;
            }
        }
        let nodes = if nodes.len() > TENTATIVE_NODES {
            Vec::new()
        } else {
            nodes.to_vec()
        };
        if let Some(x) = e.get_mut(uid).filter(|x| x.verified) {
            // Filtered again (the scheduler's retry): still the pod the API server has, with
            // its own request.
            x.nodes = nodes;
            x.until = now + TENTATIVE_FOR;
            return None;
        }
        // Every check busy (a burst of pods, or a flood of made-up ones): counted with
        // filter's request for UNCHECKED_FOR only, long enough for its bind to arrive.
        let slot = self.verifying.clone().try_acquire_owned().ok();
        if slot.is_none() {
            self.unverified.inc();
        }
        e.insert(
            uid.to_string(),
            Entry {
                nodes,
                request: request.clone(),
                bound: false,
                landed: None,
                until: now
                    + if slot.is_some() {
                        TENTATIVE_FOR
                    } else {
                        UNCHECKED_FOR
                    },
                verified: false,
            },
        );
        let slot = slot?;
        Some(Verify {
            uid: uid.to_string(),
            namespace: pod.namespace.clone(),
            name: pod.name.clone(),
            _slot: slot,
        })
    }

    /// What the API server said of a filtered pod: `Some(its own request)` when it has the pod,
    /// pending and scheduled by gpuledger (from then on it counts, with that request); None
    /// when not (it is forgotten).
    pub fn verified(&self, uid: &str, own: Option<api::PodRequest>) {
        let mut e = self.lock();
        match (e.get_mut(uid), own) {
            (Some(x), _) if x.bound => {}
            (Some(x), Some(r)) => {
                x.request = r;
                x.verified = true;
            }
            (Some(_), None) => {
                e.remove(uid);
                self.unverified.inc();
            }
            (None, _) => {}
        }
    }

    /// Filtered pods never counted (made up, or every check was busy), for `/metrics`.
    pub fn unverified(&self) -> &Counter {
        &self.unverified
    }

    /// A bind of pod `uid` to `node` arrives: assumed at once on that node alone with the
    /// request its filter carried, if filter saw it, so that it counts without a gap while the
    /// bind reads the pod (then [`Assumed::confirm`] sets the pod's own request).
    pub fn assume_seen(self: &Arc<Self>, uid: &str, node: &str) -> Option<Assumed> {
        let now = Instant::now();
        let (request, verified) = {
            let mut e = self.lock();
            if e.get(uid).is_none_or(|x| x.bound) {
                return None;
            }
            let x = e.remove(uid)?;
            (x.until > now).then_some((x.request, x.verified))?
        };
        let a = self.assume_at(uid, node, request, now);
        if let Some(x) = self.lock().get_mut(uid) {
            x.verified = verified;
        }
        Some(a)
    }

    /// A bind of pod `uid` to `node` with `request` begins.
    pub fn assume(self: &Arc<Self>, uid: &str, node: &str, request: api::PodRequest) -> Assumed {
        self.assume_at(uid, node, request, Instant::now())
    }

    fn assume_at(
        self: &Arc<Self>,
        uid: &str,
        node: &str,
        request: api::PodRequest,
        now: Instant,
    ) -> Assumed {
        self.lock().insert(
            uid.to_string(),
            Entry {
                nodes: vec![node.to_string()],
                request,
                bound: true,
                landed: None,
                until: now + FORGET_AFTER,
                verified: true,
            },
        );
        Assumed {
            cache: self.clone(),
            uid: uid.to_string(),
            landed: false,
        }
    }

    /// The nodes that other pods' assumptions touch, as they will be once those are placed
    /// (only pods `ledger` does not hold yet).
    fn nodes(
        &self,
        ledger: &Ledger,
        d: &Defaults,
        pod_uid: &str,
        now: Instant,
    ) -> HashMap<String, NodeState> {
        let mut e = self.lock();
        e.retain(|_, x| x.until > now && x.landed.is_none_or(|s| s > ledger.seq()));
        let mut out: HashMap<String, NodeState> = HashMap::new();
        for (uid, x) in e.iter() {
            if uid == pod_uid || !ledger.allocs_of_pod(uid).is_empty() {
                continue;
            }
            let Ok(req) = d.request(x.request.clone()) else {
                continue;
            };
            for name in &x.nodes {
                if let Some(n) = out.get_mut(name) {
                    take(n, &req);
                } else if let Some(node) = ledger.node(name) {
                    let mut n = node.clone();
                    take(&mut n, &req);
                    out.insert(name.clone(), n);
                }
            }
        }
        out
    }

    /// `f`, computed on `ledger` for `req`, with the nodes that binds in flight fill moved from
    /// `fits` to `wait`.
    pub fn filter(&self, ledger: &Ledger, d: &Defaults, req: &PodRequest, f: &mut Filtered) {
        self.filter_at(ledger, d, req, f, Instant::now());
    }

    fn filter_at(
        &self,
        ledger: &Ledger,
        d: &Defaults,
        req: &PodRequest,
        f: &mut Filtered,
        now: Instant,
    ) {
        let nodes = self.nodes(ledger, d, &req.pod.uid, now);
        if nodes.is_empty() {
            return;
        }
        // The node where the pod holds GPUs already is its own room (placement::filter_nodes).
        let held = ledger.node_of_pod(&req.pod.uid);
        let mut fits = Vec::with_capacity(f.fits.len());
        for name in f.fits.drain(..) {
            if held == Some(name.as_str()) {
                fits.push(name);
                continue;
            }
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
        let nodes = self.nodes(ledger, d, &req.pod.uid, Instant::now());
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
mod tests;
