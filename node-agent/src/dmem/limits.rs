//! `--isolation=dmem`: keep each pod cgroup's `dmem.max` equal to the ledger, written when the
//! pod's cgroup is there (the kubelet makes it before the pod's containers start) and again on
//! every change of the view, each write read back and reported as the kernel kept it
//! (`gpuledger_node_agent_isolation_limit_bytes{mode="dmem"}`).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tracing::{info, warn};

use super::{Limit, apply, wanted};
use crate::agent::Agent;
use crate::cgroup::pod_uid_of_component;

/// The node's cgroup v2 mount and the dmem region of each GPU, by UUID.
#[derive(Debug, Clone)]
pub struct Dmem {
    /// `--cgroup-root`.
    pub root: PathBuf,
    /// GPU UUID → region (`nvidia/0000:3b:00.0/vidmem`).
    pub regions: BTreeMap<String, String>,
}

/// One limit written: the pod, the region, what was asked and what the kernel kept (or why
/// the write failed).
#[derive(Debug)]
pub struct Written {
    /// Pod UID.
    pub pod: String,
    /// The region.
    pub region: String,
    /// What the ledger gives the pod there.
    pub asked: Limit,
    /// What `dmem.max` says after the write.
    pub kept: Result<Limit, String>,
}

/// The pod cgroups under the kubelet's `kubepods` cgroup (either driver, any QoS level), by
/// pod UID.
pub fn pod_dirs(root: &Path) -> HashMap<String, PathBuf> {
    fn walk(dir: &Path, depth: u32, out: &mut HashMap<String, PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let name = e.file_name();
            match pod_uid_of_component(&name.to_string_lossy()) {
                Some(uid) => {
                    out.insert(uid, e.path());
                }
                // A QoS level (`burstable`, `kubepods-besteffort.slice`).
                None if depth == 0 => walk(&e.path(), 1, out),
                None => {}
            }
        }
    }
    let mut out = HashMap::new();
    for top in ["kubepods", "kubepods.slice"] {
        walk(&root.join(top), 0, &mut out);
    }
    out
}

/// Turn the dmem controller on in every cgroup from `root` down to `pod`'s parent, so that the
/// pod's cgroup has `dmem.max` (the kubelet enables only the controllers it knows).
fn enable(root: &Path, pod: &Path) -> Result<(), String> {
    let Ok(below) = pod.strip_prefix(root) else {
        return Err(format!("{} is not under {}", pod.display(), root.display()));
    };
    let mut at = root.to_path_buf();
    let mut parts: Vec<_> = below.components().collect();
    parts.pop();
    for i in 0..=parts.len() {
        let file = at.join("cgroup.subtree_control");
        let on = std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        if !on.split_whitespace().any(|c| c == "dmem") {
            std::fs::write(&file, "+dmem")
                .map_err(|e| format!("enabling dmem in {}: {e}", file.display()))?;
        }
        if let Some(p) = parts.get(i) {
            at.push(p);
        }
    }
    Ok(())
}

impl Dmem {
    /// Bring every pod's `dmem.max` to `want` (pod → region → bytes): a pod the agent limited
    /// before and that has nothing left on a region gets 0 there. `applied` is what was
    /// asked and kept so far; pods whose cgroup is gone are forgotten. What was written.
    pub fn reconcile(
        &self,
        want: &BTreeMap<String, BTreeMap<String, u64>>,
        applied: &mut HashMap<(String, String), Limit>,
    ) -> Vec<Written> {
        let dirs = pod_dirs(&self.root);
        applied.retain(|(pod, _), _| dirs.contains_key(pod));
        let mut targets: Vec<(String, String, Limit)> = want
            .iter()
            .flat_map(|(pod, rs)| {
                rs.iter()
                    .map(|(r, b)| (pod.clone(), r.clone(), Limit::Bytes(*b)))
            })
            .collect();
        for (pod, region) in applied.keys() {
            if !want.get(pod).is_some_and(|rs| rs.contains_key(region)) {
                targets.push((pod.clone(), region.clone(), Limit::Bytes(0)));
            }
        }
        let mut out = Vec::new();
        for (pod, region, asked) in targets {
            let Some(dir) = dirs.get(&pod) else { continue };
            let key = (pod.clone(), region.clone());
            if applied.get(&key) == Some(&asked) {
                continue;
            }
            let kept = enable(&self.root, dir).and_then(|()| apply(dir, &region, asked));
            if kept.is_ok() {
                applied.insert(key, asked);
            }
            out.push(Written {
                pod,
                region,
                asked,
                kept,
            });
        }
        out
    }
}

/// Keep the pods' `dmem.max` equal to the ledger, on every change of the view and every
/// --enforce-interval (a pod cgroup made since is written then).
pub async fn run(agent: Arc<Agent>, d: Arc<Dmem>) {
    let mut applied: HashMap<(String, String), Limit> = HashMap::new();
    let mut changes = agent.view_changes();
    loop {
        changes.mark_unchanged();
        if agent.synced() {
            let want = agent.with_view(|v| wanted(v, &d.regions));
            let (dd, mut ap) = (d.clone(), std::mem::take(&mut applied));
            match tokio::task::spawn_blocking(move || {
                let w = dd.reconcile(&want, &mut ap);
                (w, ap)
            })
            .await
            {
                Ok((written, ap)) => {
                    applied = ap;
                    report(&agent, written);
                }
                Err(e) => warn!("writing the pods' dmem.max: {e}"),
            }
        }
        tokio::select! {
            _ = changes.changed() => {}
            _ = tokio::time::sleep(agent.cfg.enforce_interval) => {}
        }
    }
}

fn report(agent: &Agent, written: Vec<Written>) {
    for w in written {
        let labels = vec![
            ("mode", "dmem".to_string()),
            ("target", format!("{}/{}", w.pod, w.region)),
        ];
        match w.kept {
            Ok(kept) => {
                let bytes = match kept {
                    Limit::Bytes(b) => i64::try_from(b).unwrap_or(i64::MAX),
                    Limit::Max => i64::MAX,
                };
                agent
                    .metrics
                    .isolation_limit
                    .get_or_create(&labels)
                    .set(bytes);
                if kept == w.asked {
                    info!(pod_uid = %w.pod, region = %w.region, limit = %kept, "dmem.max written");
                } else {
                    warn!(pod_uid = %w.pod, region = %w.region, asked = %w.asked, kept = %kept,
                        "the kernel kept another dmem.max than the ledger's");
                }
            }
            Err(e) => {
                warn!(pod_uid = %w.pod, region = %w.region, "writing dmem.max: {e}");
            }
        }
    }
}
