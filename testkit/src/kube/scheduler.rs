//! A kube-scheduler emulator: takes pending pods of one scheduler name from the API server and
//! runs them through an extender's filter → prioritize → bind over HTTP, with the JSON
//! kube-scheduler sends. Like the real one, only pods that request a managed resource go to
//! the extender; the others are bound directly. A pod that fits on no node goes through
//! DefaultPreemption as current kube-scheduler runs it ([`preemption`]).

mod extender;
mod preemption;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, PostParams};
use serde_json::{Value, json};
use tokio_util::sync::{CancellationToken, DropGuard};

pub use extender::{ExtenderClient, ExtenderConfig, ExtenderTls};
pub use preemption::Preemption;

use crate::history::{Outcome, PodAt};
use extender::{FilterAnswer, HostScore, unreachable};

/// Latencies (µs) and counts of what the emulator did.
#[derive(Default)]
pub struct Stats {
    /// Pods bound.
    pub bound: AtomicU64,
    /// Scheduling attempts that failed (will be retried).
    pub failed: AtomicU64,
    /// Per-verb latencies in microseconds.
    pub filter_us: Mutex<Vec<u64>>,
    /// Prioritize latencies.
    pub prioritize_us: Mutex<Vec<u64>>,
    /// Bind latencies.
    pub bind_us: Mutex<Vec<u64>>,
    /// Last failure messages by pod.
    pub last_error: Mutex<HashMap<String, String>>,
    /// `(sent, answered)` of every successful bind call, in completion order.
    pub binds: Mutex<Vec<(Instant, Instant)>>,
    /// Successful scheduling attempts per extender (index into the configured list).
    pub bound_by_extender: Mutex<Vec<u64>>,
    /// Attempts that moved on to the next extender because one did not accept connections.
    pub extender_failovers: AtomicU64,
    /// Every bind call and what came back.
    pub history: crate::history::History,
    /// Calls of the extender's `preempt` verb (only for candidates the dry run found victims
    /// on, as kube-scheduler makes them).
    pub preempt_calls: AtomicU64,
    /// `namespace/name` of every pod the emulator's own preemption deleted.
    pub preempted: Mutex<Vec<String>>,
    /// What each preemption attempt came to, by pod.
    pub preemptions: Mutex<Vec<(String, Preemption)>>,
}

/// A scheduling cycle that found no node: kube-scheduler's FitError, with the nodes whose
/// status leaves room for preemption (failed, not failed-and-unresolvable).
#[derive(Debug)]
struct FitError {
    message: String,
    unschedulable: Vec<String>,
}

impl std::fmt::Display for FitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for FitError {}

/// How many feasible nodes kube-scheduler looks for before it stops filtering
/// (`numFeasibleNodesToFind`): only those reach the extender.
pub fn num_feasible_nodes_to_find(all: usize, percentage: u32) -> usize {
    const MIN_NODES: usize = 100;
    if all < MIN_NODES || percentage >= 100 {
        return all;
    }
    let pct = if percentage == 0 {
        (50i64 - all as i64 / 125).max(5) as usize
    } else {
        percentage as usize
    };
    (all * pct / 100).max(MIN_NODES)
}

/// A running scheduler emulator.
pub struct SchedulerEmulator {
    /// What it did.
    pub stats: Arc<Stats>,
    /// Stops scheduling when the emulator is dropped (binds in flight finish).
    _stop: DropGuard,
}

fn key(p: &Pod) -> String {
    format!(
        "{}/{}",
        p.metadata.namespace.as_deref().unwrap_or("default"),
        p.metadata.name.as_deref().unwrap_or("")
    )
}

fn micros(t: Instant) -> u64 {
    t.elapsed().as_micros() as u64
}

/// Run `f` against extender `first` of `n`, moving on to the next replica when one cannot be
/// reached (as a Service in front of the replicas would): the answer and the index that gave it.
async fn failover<T, F, Fut>(n: usize, first: usize, stats: &Stats, mut f: F) -> Result<(T, usize)>
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let mut last = None;
    for k in 0..n {
        let i = (first + k) % n;
        match f(i).await {
            Ok(v) => return Ok((v, i)),
            Err(e) if unreachable(&e) && k + 1 < n => {
                stats.extender_failovers.fetch_add(1, Ordering::Relaxed);
                last = Some(e);
            }
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("no extender configured")))
}

/// One scheduling cycle of `pod`: filter and prioritize, the chosen node on success.
async fn decide(
    ext: &ExtenderClient,
    nodes: &[Node],
    pod: &Pod,
    stats: &Stats,
    rr: usize,
    start: usize,
) -> Result<String> {
    if nodes.is_empty() {
        bail!("0/0 nodes are available");
    }
    if !ext.interested(pod) {
        return Ok(nodes[rr % nodes.len()]
            .metadata
            .name
            .clone()
            .unwrap_or_default());
    }
    // kube-scheduler's own filters pass every node here (the emulator models no CPU or
    // memory); it stops after numFeasibleNodesToFind, starting where the last pod stopped.
    let want = num_feasible_nodes_to_find(nodes.len(), ext.cfg.percentage_of_nodes_to_score);
    let window: Vec<&Node> = (0..want)
        .map(|k| &nodes[(start + k) % nodes.len()])
        .collect();
    let args = ext.args(pod, &window)?;
    let t = Instant::now();
    let f: FilterAnswer = ext.post_as("filter", &args).await?;
    stats
        .filter_us
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(micros(t));
    if !f.error.is_empty() {
        bail!("filter: {}", f.error);
    }
    let feasible: Vec<String> = match f.node_names {
        Some(a) => a,
        None => f
            .nodes
            .map(|l| {
                l.items
                    .into_iter()
                    .filter_map(|n| n.metadata.name)
                    .collect()
            })
            .unwrap_or_default(),
    };
    if feasible.is_empty() {
        let keys = |v: &Value| -> Vec<String> {
            v.as_object()
                .map(|m| m.keys().cloned().collect())
                .unwrap_or_default()
        };
        let never = keys(&f.failed_and_unresolvable_nodes);
        return Err(FitError {
            message: format!("0/{} nodes are available: {}", nodes.len(), f.failed_nodes),
            unschedulable: keys(&f.failed_nodes)
                .into_iter()
                .filter(|n| !never.contains(n))
                .collect(),
        }
        .into());
    }
    if feasible.len() == 1 {
        return Ok(feasible[0].clone());
    }
    let keep: HashSet<&str> = feasible.iter().map(String::as_str).collect();
    let chosen: Vec<&Node> = window
        .into_iter()
        .filter(|n| n.metadata.name.as_deref().is_some_and(|x| keep.contains(x)))
        .collect();
    let t = Instant::now();
    let p: Vec<HostScore> = ext.post_as("prioritize", &ext.args(pod, &chosen)?).await?;
    stats
        .prioritize_us
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(micros(t));
    let best = p.into_iter().map(|h| (h.host, h.score)).fold(
        None::<(String, i64)>,
        |acc, (h, s)| match acc {
            Some((_, bs)) if bs >= s => acc,
            _ => Some((h, s)),
        },
    );
    Ok(best.map_or_else(|| feasible[rr % feasible.len()].clone(), |(h, _)| h))
}

/// Bind `pod` to `node`: through the extender's bind verb when it manages the pod, else
/// with a Binding as kube-scheduler's default binder makes it.
async fn bind(
    kube: kube::Client,
    ext: &ExtenderClient,
    pod: &Pod,
    node: &str,
    stats: &Stats,
) -> Result<()> {
    let ns = pod
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let name = pod.metadata.name.clone().unwrap_or_default();
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    if !ext.interested(pod) {
        let pods: Api<Pod> = Api::namespaced(kube, &ns);
        let b = json!({"apiVersion": "v1", "kind": "Binding",
                       "metadata": {"name": name, "namespace": ns, "uid": uid},
                       "target": {"apiVersion": "v1", "kind": "Node", "name": node}});
        let _: Value = pods
            .create_subresource("binding", &name, &PostParams::default(), &b)
            .await?;
        return Ok(());
    }
    if !ext.cfg.bind {
        bail!("extender without bindVerb is not emulated");
    }
    let t = Instant::now();
    let pod_key = format!("{ns}/{name}");
    let at = PodAt {
        pod: &pod_key,
        uid: &uid,
        node,
    };
    let r = match ext
        .post(
            "bind",
            &json!({"PodName": name, "PodNamespace": ns, "PodUID": uid, "Node": node}),
        )
        .await
    {
        Ok(r) => r,
        Err(e) => {
            // Not reachable, or an HTTP error status: the extender answered nothing was bound.
            // A timeout or a connection lost after sending: nobody knows.
            let refused = unreachable(&e) || format!("{e}").contains("HTTP ");
            let outcome = if refused {
                Outcome::Fail
            } else {
                Outcome::Unknown
            };
            stats
                .history
                .record("bind", at, outcome, None, format!("{e:#}"));
            return Err(e);
        }
    };
    stats
        .bind_us
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(micros(t));
    if let Some(e) = r
        .get("Error")
        .and_then(Value::as_str)
        .filter(|e| !e.is_empty())
    {
        stats.history.record("bind", at, Outcome::Fail, None, e);
        bail!("bind: {e}");
    }
    stats.history.record("bind", at, Outcome::Ok, None, "");
    stats
        .binds
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push((t, Instant::now()));
    Ok(())
}

/// Record how one pod's attempt ended and let the loop take it again (after `backoff` when it
/// failed).
fn finish(
    st: &Stats,
    in_flight: &Mutex<HashSet<String>>,
    retry_at: &Mutex<HashMap<String, Instant>>,
    k: &str,
    res: Result<usize>,
    backoff: Duration,
) {
    match res {
        Ok(i) => {
            st.bound.fetch_add(1, Ordering::Relaxed);
            if let Some(n) = st
                .bound_by_extender
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_mut(i)
            {
                *n += 1;
            }
            // A list taken before the bind may still show it pending.
            retry_at
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(k.to_string(), Instant::now() + Duration::from_secs(5));
            st.last_error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(k);
        }
        Err(e) => {
            st.failed.fetch_add(1, Ordering::Relaxed);
            retry_at
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(k.to_string(), Instant::now() + backoff);
            st.last_error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(k.to_string(), format!("{e:#}"));
        }
    }
    in_flight
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(k);
}

impl SchedulerEmulator {
    /// Schedule pods with `spec.schedulerName == scheduler_name` through `ext` as kube-scheduler
    /// does: filter and prioritize one pod at a time, then bind in the background, with up to
    /// `parallel` binds in flight. Failed pods are retried after `backoff`.
    pub fn start(
        kube: kube::Client,
        scheduler_name: &str,
        ext: ExtenderConfig,
        parallel: usize,
        backoff: Duration,
    ) -> Result<SchedulerEmulator> {
        Self::start_replicas(kube, scheduler_name, vec![ext], parallel, backoff)
    }

    /// Like [`SchedulerEmulator::start`] with several extender replicas: pods alternate between
    /// them, and an attempt moves on to the next replica when one does not accept connections.
    pub fn start_replicas(
        kube: kube::Client,
        scheduler_name: &str,
        exts: Vec<ExtenderConfig>,
        parallel: usize,
        backoff: Duration,
    ) -> Result<SchedulerEmulator> {
        let stats = Arc::new(Stats {
            bound_by_extender: Mutex::new(vec![0; exts.len()]),
            ..Stats::default()
        });
        let st = stats.clone();
        let sched = scheduler_name.to_string();
        let exts: Arc<Vec<ExtenderClient>> = Arc::new(
            exts.into_iter()
                .map(ExtenderClient::new)
                .collect::<Result<_>>()?,
        );
        let pct = exts
            .first()
            .map_or(100, |e| e.cfg.percentage_of_nodes_to_score);
        let stop = CancellationToken::new();
        let running = stop.clone();
        let schedule = async move {
            let pods_api: Api<Pod> = Api::all(kube.clone());
            let nodes_api: Api<Node> = Api::all(kube.clone());
            let sem = Arc::new(tokio::sync::Semaphore::new(parallel.max(1)));
            let in_flight = Arc::new(Mutex::new(HashSet::<String>::new()));
            let retry_at = Arc::new(Mutex::new(HashMap::<String, Instant>::new()));
            let mut nodes: Arc<Vec<Node>> = Arc::new(Vec::new());
            let mut nodes_at = Instant::now() - Duration::from_secs(60);
            let mut rr = 0usize;
            let mut next_start = 0usize;
            loop {
                if nodes_at.elapsed() > Duration::from_secs(1)
                    && let Ok(l) = nodes_api.list(&ListParams::default()).await
                {
                    nodes = Arc::new(l.items);
                    nodes_at = Instant::now();
                }
                let lp = ListParams::default()
                    .fields(&format!("spec.schedulerName={sched},spec.nodeName="));
                let pending = match pods_api.list(&lp).await {
                    Ok(l) => l.items,
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let mut started = 0;
                for pod in pending {
                    let k = key(&pod);
                    if in_flight
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .contains(&k)
                    {
                        continue;
                    }
                    if retry_at
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get(&k)
                        .is_some_and(|t| *t > Instant::now())
                    {
                        continue;
                    }
                    let Ok(permit) = sem.clone().acquire_owned().await else {
                        return;
                    };
                    in_flight
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(k.clone());
                    started += 1;
                    rr += 1;
                    let start = next_start;
                    if !nodes.is_empty() {
                        let want = num_feasible_nodes_to_find(nodes.len(), pct);
                        next_start = (next_start + want) % nodes.len();
                    }
                    // The scheduling cycle runs one pod at a time, as kube-scheduler's
                    // does; only the binding cycle runs in the background.
                    let decided = failover(exts.len(), rr, &st, |i| {
                        decide(&exts[i], &nodes, &pod, &st, rr, start)
                    })
                    .await;
                    let (node, i) = match decided {
                        Ok(d) => d,
                        Err(e) => {
                            // PostFilter, in the scheduling cycle as kube-scheduler runs it.
                            if let Some(fe) = e.downcast_ref::<FitError>() {
                                let ext = &exts[rr % exts.len()];
                                let r = preemption::preempt(
                                    &kube,
                                    ext,
                                    &pod,
                                    &nodes,
                                    &fe.unschedulable,
                                    &st,
                                )
                                .await;
                                if let Ok(r) = r {
                                    st.preemptions
                                        .lock()
                                        .unwrap_or_else(|p| p.into_inner())
                                        .push((k.clone(), r));
                                }
                            }
                            finish(&st, &in_flight, &retry_at, &k, Err(e), backoff);
                            drop(permit);
                            continue;
                        }
                    };
                    let (kube, exts, st, in_flight, retry_at) = (
                        kube.clone(),
                        exts.clone(),
                        st.clone(),
                        in_flight.clone(),
                        retry_at.clone(),
                    );
                    tokio::spawn(async move {
                        let res = failover(exts.len(), i, &st, |j| {
                            bind(kube.clone(), &exts[j], &pod, &node, &st)
                        })
                        .await
                        .map(|((), j)| j);
                        finish(&st, &in_flight, &retry_at, &k, res, backoff);
                        drop(permit);
                    });
                }
                if started == 0 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        };
        tokio::spawn(async move { running.run_until_cancelled(schedule).await });
        Ok(SchedulerEmulator {
            stats,
            _stop: stop.drop_guard(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::num_feasible_nodes_to_find as n;

    #[test]
    fn feasible_nodes_like_kube_scheduler() {
        assert_eq!(n(50, 0), 50);
        assert_eq!(n(1000, 0), 420);
        assert_eq!(n(5000, 0), 500);
        assert_eq!(n(100_000, 0), 5000);
        assert_eq!(n(5000, 100), 5000);
        assert_eq!(n(5000, 1), 100);
    }
}
