//! kube-scheduler's DefaultPreemption (PostFilter) as the emulator runs it after a pod fits on
//! no node: the eligibility check, the dry run over the resources the scheduler itself sees
//! (CPU, memory, the pod count and extended resources that are not `ignoredByScheduler`), the
//! extender's `preempt` verb for the candidates, and the deletion of the chosen node's victims.
//!
//! As in kube-scheduler since 1.22 (`pkg/scheduler/framework/preemption`, kubernetes PR
//! #101560; kubernetes#139270): the dry run removes the lower-priority pods, checks the pod
//! fits, and reprieves every pod it can, most important first; a node left with no victim is
//! no candidate ("expected at least one victim pod on node"), and with no candidate the
//! extender's `preempt` is never called. When only GPU memory or compute (ignored by the
//! scheduler) is short, that is always the case.

use std::collections::BTreeMap;

use anyhow::{Result, bail};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, ListParams};
use serde_json::{Value, json};

use super::Stats;
use super::extender::ExtenderClient;

/// What one PostFilter run came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Preemption {
    /// The pod may not preempt (`preemptionPolicy: Never`).
    NotEligible,
    /// No node is a candidate: why, per node.
    NoCandidate(Vec<(String, String)>),
    /// The victims of `node` were deleted.
    Preempted {
        /// The chosen node.
        node: String,
        /// `namespace/name` of the pods deleted.
        victims: Vec<String>,
    },
}

/// A pod of a node, as the dry run counts it.
struct Running {
    uid: String,
    key: String,
    priority: i32,
    requests: BTreeMap<String, f64>,
}

/// A node's victims, most important first.
struct Candidate {
    node: String,
    victims: Vec<Running>,
}

fn priority(p: &Pod) -> i32 {
    p.spec.as_ref().and_then(|s| s.priority).unwrap_or(0)
}

/// What `pod` requests of the resources the scheduler counts itself: CPU, memory, one pod,
/// and the extended resources not in `ignored` (a container's limits stand for requests it
/// does not set, as the API server's defaulting makes them).
fn requests(pod: &Pod, ignored: &[String]) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::from([("pods".to_string(), 1.0)]);
    let Some(spec) = pod.spec.as_ref() else {
        return out;
    };
    for c in &spec.containers {
        let Some(r) = c.resources.as_ref() else {
            continue;
        };
        let mut named: BTreeMap<&String, &str> = BTreeMap::new();
        for m in [r.limits.as_ref(), r.requests.as_ref()]
            .into_iter()
            .flatten()
        {
            for (k, q) in m {
                named.insert(k, q.0.as_str());
            }
        }
        for (k, q) in named {
            if ignored.contains(k) {
                continue;
            }
            let v = gpuledger_ops::quantity::parse(q).unwrap_or(0.0);
            *out.entry(k.clone()).or_default() += v;
        }
    }
    out
}

fn allocatable(n: &Node) -> BTreeMap<String, f64> {
    n.status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .map(|a| {
            a.iter()
                .map(|(k, q)| {
                    (
                        k.clone(),
                        gpuledger_ops::quantity::parse(&q.0).unwrap_or(0.0),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Whether `want` fits in `alloc` beside `used` (NodeResourcesFit on the scheduler's resources).
fn fits(
    alloc: &BTreeMap<String, f64>,
    used: &BTreeMap<String, f64>,
    want: &BTreeMap<String, f64>,
) -> bool {
    want.iter().all(|(k, v)| {
        let have = alloc.get(k).copied().unwrap_or(0.0) - used.get(k).copied().unwrap_or(0.0);
        *v <= have + 1e-9
    })
}

fn add(used: &mut BTreeMap<String, f64>, r: &BTreeMap<String, f64>) {
    for (k, v) in r {
        *used.entry(k.clone()).or_default() += v;
    }
}

/// SelectVictimsOnNode: the victims of `node` for `pod`, or why the node is no candidate.
fn victims_on(
    node: &Node,
    pods: Vec<Running>,
    pod: &Pod,
    ignored: &[String],
) -> std::result::Result<Vec<Running>, String> {
    let name = node.metadata.name.clone().unwrap_or_default();
    let me = priority(pod);
    let want = requests(pod, ignored);
    let alloc = allocatable(node);
    let (mut lower, higher): (Vec<Running>, Vec<Running>) =
        pods.into_iter().partition(|p| p.priority < me);
    if lower.is_empty() {
        return Err("No preemption victims found for incoming pod".into());
    }
    let mut used = BTreeMap::new();
    for p in &higher {
        add(&mut used, &p.requests);
    }
    if !fits(&alloc, &used, &want) {
        return Err("Insufficient resources even without the lower-priority pods".into());
    }
    // Reprieve the most important first; whoever does not fit back is a victim.
    lower.sort_by(|a, b| b.priority.cmp(&a.priority).then_with(|| a.key.cmp(&b.key)));
    let mut victims = Vec::new();
    for p in lower {
        let mut with = used.clone();
        add(&mut with, &p.requests);
        if fits(&alloc, &with, &want) {
            used = with;
        } else {
            victims.push(p);
        }
    }
    if victims.is_empty() {
        return Err(format!("expected at least one victim pod on node {name:?}"));
    }
    Ok(victims)
}

/// Run DefaultPreemption for `pod`, which fits on none of `nodes`; `unschedulable` are the
/// nodes whose status leaves room for preemption (failed, not failed-and-unresolvable).
pub(super) async fn preempt(
    kube: &kube::Client,
    ext: &ExtenderClient,
    pod: &Pod,
    nodes: &[Node],
    unschedulable: &[String],
    stats: &Stats,
) -> Result<Preemption> {
    let spec = pod.spec.as_ref();
    if spec.and_then(|s| s.preemption_policy.as_deref()) == Some("Never") {
        return Ok(Preemption::NotEligible);
    }
    let all: Vec<Pod> = Api::<Pod>::all(kube.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let ignored = &ext.cfg.ignored_by_scheduler;
    let mut on: BTreeMap<String, Vec<Running>> = BTreeMap::new();
    for p in &all {
        let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
        if p.metadata.deletion_timestamp.is_some() || matches!(phase, Some("Succeeded" | "Failed"))
        {
            continue;
        }
        let Some(n) = p.spec.as_ref().and_then(|s| s.node_name.clone()) else {
            continue;
        };
        on.entry(n).or_default().push(Running {
            uid: p.metadata.uid.clone().unwrap_or_default(),
            key: format!(
                "{}/{}",
                p.metadata.namespace.as_deref().unwrap_or("default"),
                p.metadata.name.as_deref().unwrap_or("")
            ),
            priority: priority(p),
            requests: requests(p, ignored),
        });
    }
    let mut why = Vec::new();
    let mut candidates = Vec::new();
    for n in nodes {
        let Some(name) = n.metadata.name.clone() else {
            continue;
        };
        if !unschedulable.contains(&name) {
            continue;
        }
        match victims_on(n, on.remove(&name).unwrap_or_default(), pod, ignored) {
            Ok(victims) => candidates.push(Candidate {
                node: name,
                victims,
            }),
            Err(e) => why.push((name, e)),
        }
    }
    if candidates.is_empty() {
        return Ok(Preemption::NoCandidate(why));
    }
    if ext.cfg.preempt && ext.interested(pod) {
        candidates = ask_extender(ext, pod, candidates, nodes, stats).await?;
        if candidates.is_empty() {
            return Ok(Preemption::NoCandidate(why));
        }
    }
    // pickOneNodeForPreemption: the lowest highest victim priority, then the lowest sum, then
    // the fewest victims, then the name.
    candidates.sort_by_key(|c| {
        (
            c.victims
                .iter()
                .map(|v| v.priority)
                .max()
                .unwrap_or(i32::MIN),
            c.victims.iter().map(|v| i64::from(v.priority)).sum::<i64>(),
            c.victims.len(),
            c.node.clone(),
        )
    });
    let best = candidates.swap_remove(0);
    let mut deleted = Vec::new();
    for v in &best.victims {
        let (ns, name) = v.key.split_once('/').unwrap_or(("default", &v.key));
        let api: Api<Pod> = Api::namespaced(kube.clone(), ns);
        api.delete(name, &DeleteParams::default()).await?;
        deleted.push(v.key.clone());
    }
    stats
        .preempted
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .extend(deleted.iter().cloned());
    Ok(Preemption::Preempted {
        node: best.node,
        victims: deleted,
    })
}

/// The extender's `preempt` verb over `candidates`, in the form its configuration asks
/// (victims as UIDs when nodeCacheCapable); its answer replaces them.
async fn ask_extender(
    ext: &ExtenderClient,
    pod: &Pod,
    candidates: Vec<Candidate>,
    nodes: &[Node],
    stats: &Stats,
) -> Result<Vec<Candidate>> {
    let mut meta = serde_json::Map::new();
    for c in &candidates {
        let pods: Vec<Value> = c.victims.iter().map(|v| json!({"UID": v.uid})).collect();
        meta.insert(c.node.clone(), json!({"Pods": pods, "NumPDBViolations": 0}));
    }
    let body = if ext.cfg.node_cache_capable {
        json!({"Pod": pod, "NodeNameToVictims": null, "NodeNameToMetaVictims": meta})
    } else {
        bail!("the emulator sends preemption victims as UIDs only (nodeCacheCapable)")
    };
    stats
        .preempt_calls
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let r = ext.post("preempt", &body).await?;
    let mut known: BTreeMap<String, Running> = BTreeMap::new();
    for c in candidates {
        for v in c.victims {
            known.insert(v.uid.clone(), v);
        }
    }
    let mut out = Vec::new();
    for (node, v) in r["NodeNameToMetaVictims"].as_object().into_iter().flatten() {
        if !nodes
            .iter()
            .any(|n| n.metadata.name.as_deref() == Some(node))
        {
            continue;
        }
        let uids: Vec<&str> = v["Pods"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p["UID"].as_str())
            .collect();
        if uids.is_empty() {
            // Not ignorable: the scheduling cycle fails.
            bail!("expected at least one victim pod on node {node:?}");
        }
        let victims = uids
            .iter()
            .map(|u| {
                known.remove(*u).unwrap_or(Running {
                    uid: (*u).to_string(),
                    key: String::new(),
                    priority: 0,
                    requests: BTreeMap::new(),
                })
            })
            .collect();
        out.push(Candidate {
            node: node.clone(),
            victims,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(cpu: &str, slots: u32) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": "n1"},
            "status": {"allocatable": {"cpu": cpu, "memory": "64Gi", "pods": "110",
                                       "gpuledger.io/gpu": slots.to_string()}},
        }))
        .expect("a node")
    }

    fn pod(name: &str, prio: i32, cpu: &str, gpu_mem: Option<&str>) -> Pod {
        let mut limits = json!({"cpu": cpu});
        if let Some(m) = gpu_mem {
            limits["gpuledger.io/gpu"] = json!("1");
            limits["gpuledger.io/gpu-mem"] = json!(m);
        }
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns", "uid": name},
            "spec": {"priority": prio, "containers": [{"name": "c", "resources": {"limits": limits}}]},
        }))
        .expect("a pod")
    }

    fn running(p: &Pod, ignored: &[String]) -> Running {
        Running {
            uid: p.metadata.uid.clone().unwrap_or_default(),
            key: format!("ns/{}", p.metadata.name.clone().unwrap_or_default()),
            priority: priority(p),
            requests: requests(p, ignored),
        }
    }

    fn ignored() -> Vec<String> {
        vec!["gpuledger.io/gpu-mem".into()]
    }

    #[test]
    fn gpu_memory_alone_short_leaves_no_victim() {
        // The GPU is full in the ledger, but the scheduler sees 2 of 64 slots used and CPU free:
        // it reprieves every pod.
        let on = [
            pod("low", 1, "1", Some("12000")),
            pod("lowest", 0, "1", Some("4000")),
        ];
        let me = pod("me", 100, "1", Some("8000"));
        let e = victims_on(
            &node("8", 64),
            on.iter().map(|p| running(p, &ignored())).collect(),
            &me,
            &ignored(),
        )
        .err()
        .expect("no victim");
        assert!(e.contains("expected at least one victim pod"), "{e}");
    }

    #[test]
    fn a_resource_the_scheduler_sees_makes_victims_least_important_first() {
        // 4 CPUs: the preemptor's 2 need one of the 2-CPU pods gone; the higher one is reprieved.
        let on = [pod("a", 5, "2", None), pod("b", 1, "2", None)];
        let me = pod("me", 100, "2", Some("8000"));
        let v = victims_on(
            &node("4", 64),
            on.iter().map(|p| running(p, &ignored())).collect(),
            &me,
            &ignored(),
        )
        .expect("victims");
        assert_eq!(
            v.iter().map(|r| r.key.as_str()).collect::<Vec<_>>(),
            ["ns/b"]
        );
        // Nobody of lower priority: no candidate at all.
        let e = victims_on(
            &node("4", 64),
            on.iter().map(|p| running(p, &ignored())).collect(),
            &pod("peer", 1, "2", None),
            &ignored(),
        )
        .err()
        .expect("no candidate");
        assert!(e.contains("No preemption victims"), "{e}");
    }
}
