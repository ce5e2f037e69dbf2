//! The kubelet loop of one simulated node: it watches the API server for pods bound to the
//! node, admits each GPU container through the kubelet emulator (GetPreferredAllocation →
//! Allocate → PreStartContainer, one pod at a time like the kubelet's device manager), starts
//! the container's command as a real child process with the env the node agent returned,
//! reports its pid and GPU memory in the fake NVML state, sets the pod Running, and when the
//! process exits (or the pod is deleted) takes it out of NVML, sets the phase Succeeded or
//! Failed and forgets its devices. The allocator's pod watcher then releases the allocation.

mod admit;
mod runs;

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Container, Pod};
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use admit::gpu_count;
pub use runs::{PodRun, RunOutcome, Runs};

use super::ANN_MEM_USED_PERCENT;
use crate::history::{Outcome, PodAt};
use crate::kube::store::{ApiError, Store, now_rfc3339};
use crate::kubelet::node::FakeNvml;
use crate::kubelet::{Allocated, Kubelet};
use admit::{Step, device_step};

/// What one node's loop and its pod tasks share.
pub struct NodeCtx {
    node: String,
    kubelet: Arc<Kubelet>,
    nvml: Arc<Mutex<FakeNvml>>,
    store: Arc<Store>,
    runs: Arc<Runs>,
    admit_timeout: Duration,
    /// One admission at a time, like the kubelet's device manager.
    admit: tokio::sync::Mutex<()>,
    log: Mutex<File>,
    started: Instant,
}

impl NodeCtx {
    /// The context of node `node`, logging to `log`.
    pub fn new(
        node: &str,
        kubelet: Arc<Kubelet>,
        nvml: Arc<Mutex<FakeNvml>>,
        store: Arc<Store>,
        runs: Arc<Runs>,
        admit_timeout: Duration,
        log: &Path,
    ) -> Result<NodeCtx> {
        let f = File::options()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening {}", log.display()))?;
        Ok(NodeCtx {
            node: node.to_string(),
            kubelet,
            nvml,
            store,
            runs,
            admit_timeout,
            admit: tokio::sync::Mutex::new(()),
            log: Mutex::new(f),
            started: Instant::now(),
        })
    }

    fn log(&self, msg: &str) {
        let t = self.started.elapsed().as_secs_f64();
        let mut f = self.log.lock().unwrap_or_else(|p| p.into_inner());
        let _ = writeln!(f, "{t:9.3}s {msg}");
    }

    fn nvml(&self) -> std::sync::MutexGuard<'_, FakeNvml> {
        self.nvml.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Set the pod's phase (and a reason and message when it failed), as the kubelet's status
    /// manager does. A pod already gone is fine.
    fn set_phase(&self, ns: &str, name: &str, uid: &str, phase: &str, message: Option<&str>) {
        let r = self.store.update("v1", "pods", ns, name, |p| {
            if p.pointer("/metadata/uid").and_then(|v| v.as_str()) != Some(uid) {
                return Err(ApiError::new(
                    409,
                    "Conflict",
                    "a different pod of that name",
                ));
            }
            p["status"]["phase"] = json!(phase);
            if phase == "Running" {
                p["status"]["startTime"] = json!(now_rfc3339());
            }
            if let Some(m) = message {
                p["status"]["message"] = json!(m);
                p["status"]["reason"] = json!("Error");
            }
            Ok(())
        });
        match r {
            Ok(_) => self.log(&format!("{ns}/{name}: phase {phase}")),
            Err(e) => self.log(&format!(
                "{ns}/{name}: could not set phase {phase}: {}",
                e.message()
            )),
        }
    }
}

/// Follow the pods bound to the node until `stop` is cancelled (or the watch ends); then stop
/// every pod and wait until each has left NVML and the kubelet.
pub async fn run(ctx: Arc<NodeCtx>, client: kube::Client, stop: CancellationToken) {
    let api: Api<Pod> = Api::all(client);
    let cfg = watcher::Config::default().fields(&format!("spec.nodeName={}", ctx.node));
    let mut stream = watcher(api, cfg).default_backoff().boxed();
    let mut seen: HashSet<String> = HashSet::new();
    let mut stops: HashMap<String, CancellationToken> = HashMap::new();
    let pods = TaskTracker::new();
    let mut listing: Option<HashSet<String>> = None;
    ctx.log(&format!("kubelet loop of {} watching its pods", ctx.node));
    while let Some(Some(ev)) = stop.run_until_cancelled(stream.next()).await {
        let pod = match ev {
            Ok(watcher::Event::Apply(p)) => p,
            Ok(watcher::Event::InitApply(p)) => {
                if let (Some(l), Some(uid)) = (listing.as_mut(), p.metadata.uid.as_ref()) {
                    l.insert(uid.clone());
                }
                p
            }
            Ok(watcher::Event::Delete(p)) => {
                if let Some(s) = p.metadata.uid.as_ref().and_then(|u| stops.get(u)) {
                    s.cancel();
                }
                continue;
            }
            Ok(watcher::Event::Init) => {
                listing = Some(HashSet::new());
                continue;
            }
            Ok(watcher::Event::InitDone) => {
                // Pods gone while the watch was down: stop them.
                if let Some(l) = listing.take() {
                    for (uid, s) in &stops {
                        if !l.contains(uid) {
                            s.cancel();
                        }
                    }
                }
                continue;
            }
            Err(e) => {
                ctx.log(&format!("watch error (retrying): {e}"));
                continue;
            }
        };
        let Some(uid) = pod.metadata.uid.clone() else {
            continue;
        };
        let phase = pod
            .status
            .as_ref()
            .and_then(|s| s.phase.as_deref())
            .unwrap_or("Pending");
        if matches!(phase, "Succeeded" | "Failed") || seen.contains(&uid) {
            continue;
        }
        seen.insert(uid.clone());
        let pod_stop = stop.child_token();
        stops.insert(uid, pod_stop.clone());
        pods.spawn(run_pod(ctx.clone(), pod, pod_stop));
    }
    for s in stops.values() {
        s.cancel();
    }
    pods.close();
    pods.wait().await;
}

/// One pod's life on the node.
async fn run_pod(ctx: Arc<NodeCtx>, pod: Pod, stop: CancellationToken) {
    let ns = pod
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let name = pod.metadata.name.clone().unwrap_or_default();
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let used_pct: u64 = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANN_MEM_USED_PERCENT))
        .and_then(|v| v.parse().ok())
        .unwrap_or(75);
    ctx.runs.lock().insert(
        uid.clone(),
        PodRun {
            namespace: ns.clone(),
            name: name.clone(),
            node: ctx.node.clone(),
            shares: Vec::new(),
            allocation_id: None,
            seen: Instant::now(),
            started: None,
            ended: None,
            outcome: RunOutcome::Running,
        },
    );
    let containers: Vec<Container> = pod
        .spec
        .as_ref()
        .map_or(Vec::new(), |s| s.containers.clone());

    // Admission: Allocate, one pod at a time like the kubelet's device manager.
    let mut allocated: Vec<Option<Allocated>> = Vec::new();
    let mut failure: Option<String> = None;
    {
        let _turn = ctx.admit.lock().await;
        for c in &containers {
            let n = gpu_count(c);
            if n == 0 {
                allocated.push(None);
                continue;
            }
            let who = (ns.as_str(), name.as_str(), uid.as_str());
            match device_step(&ctx, who, &c.name, Step::Allocate(n), &stop).await {
                Ok(a) => allocated.push(a),
                Err(e) => {
                    failure = Some(format!(
                        "UnexpectedAdmissionError: container {}: {e:#}",
                        c.name
                    ));
                    break;
                }
            }
        }
    }
    // Container start: PreStartContainer for each GPU container (concurrently with other
    // pods' admissions, as the kubelet's pod workers do).
    if failure.is_none() {
        for (c, a) in containers.iter().zip(&allocated) {
            let Some(a) = a else { continue };
            let r = device_step(
                &ctx,
                (&ns, &name, &uid),
                &c.name,
                Step::PreStart(&a.device_ids),
                &stop,
            );
            if let Err(e) = r.await {
                failure = Some(format!("CreateContainerError: container {}: {e:#}", c.name));
                break;
            }
        }
    }
    if let Some(why) = failure {
        ctx.log(&format!("{ns}/{name}: {why}"));
        ctx.kubelet.remove_pod(&ns, &name);
        ctx.set_phase(&ns, &name, &uid, "Failed", Some(&why));
        ctx.runs.update(&uid, |r| {
            r.ended = Some(Instant::now());
            r.outcome = RunOutcome::Failed(why);
        });
        return;
    }

    // Start the containers as child processes.
    let mut children = Vec::new();
    let mut nvml_pids = Vec::new();
    for (c, a) in containers.iter().zip(&allocated) {
        let mut argv: Vec<String> = c.command.clone().unwrap_or_default();
        argv.extend(c.args.clone().unwrap_or_default());
        if argv.is_empty() {
            argv = vec!["sleep".into(), "3600".into()];
        }
        let mut cmd = tokio::process::Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        if let Some(a) = a {
            cmd.envs(&a.response.envs);
        }
        let child = match cmd.spawn() {
            Ok(ch) => ch,
            Err(e) => {
                let why = format!("container {}: starting {:?}: {e}", c.name, argv[0]);
                finish(
                    &ctx,
                    &ns,
                    &name,
                    &uid,
                    &mut nvml_pids,
                    RunOutcome::Failed(why),
                );
                return;
            }
        };
        let pid = child.id().unwrap_or(0);
        if let Some(a) = a {
            let envs = &a.response.envs;
            // The GPUs as a CDI-aware runtime resolves them (`<kind>=<UUID>`), else the
            // NVIDIA runtime's variable.
            let cdi: Vec<String> = a
                .response
                .cdi_devices
                .iter()
                .filter_map(|d| Some(d.name.split_once('=')?.1.to_string()))
                .collect();
            let gpus: Vec<String> = if cdi.is_empty() {
                envs.get("NVIDIA_VISIBLE_DEVICES")
                    .map(|v| v.split(',').map(String::from).collect())
                    .unwrap_or_default()
            } else {
                cdi
            };
            let mut shares = Vec::new();
            {
                let mut nv = ctx.nvml();
                for (i, g) in gpus.iter().enumerate() {
                    let limit: u64 = envs
                        .get(&format!("CUDA_DEVICE_MEMORY_LIMIT_{i}"))
                        .and_then(|v| v.trim_end_matches('m').parse().ok())
                        .unwrap_or(0);
                    let cap = nv
                        .gpus
                        .iter()
                        .find(|x| &x.uuid == g)
                        .map_or(0, |x| x.memory_mib);
                    nv.processes.push((pid, limit * used_pct / 100, g.clone()));
                    shares.push((g.clone(), limit, cap));
                }
                if let Err(e) = nv.write() {
                    ctx.log(&format!("writing the fake NVML state: {e:#}"));
                }
            }
            nvml_pids.push(pid);
            let id = envs
                .get("GPULEDGER_ALLOCATION_ID")
                .and_then(|v| v.parse().ok());
            ctx.runs.update(&uid, |r| {
                r.shares.extend(shares);
                r.allocation_id = r.allocation_id.or(id);
            });
        }
        ctx.log(&format!(
            "{ns}/{name}/{}: started pid {pid} {argv:?}",
            c.name
        ));
        children.push((c.name.clone(), child));
    }
    ctx.runs.update(&uid, |r| r.started = Some(Instant::now()));
    ctx.set_phase(&ns, &name, &uid, "Running", None);

    // Wait for every container to exit, or for the pod to be deleted.
    let mut failure: Option<String> = None;
    let mut deleted = false;
    for (cname, child) in &mut children {
        if deleted {
            let _ = child.kill().await;
            continue;
        }
        tokio::select! {
            st = child.wait() => match st {
                Ok(s) if s.success() => {}
                Ok(s) => {
                    use std::os::unix::process::ExitStatusExt;
                    let why = match s.signal() {
                        Some(9) => format!("container {cname} was killed (SIGKILL)"),
                        Some(sig) => format!("container {cname} died of signal {sig}"),
                        None => format!("container {cname} exited with {s}"),
                    };
                    failure.get_or_insert(why);
                }
                Err(e) => {
                    failure.get_or_insert(format!("container {cname}: wait: {e}"));
                }
            },
            () = stop.cancelled() => {
                deleted = true;
                let _ = child.kill().await;
            }
        }
    }
    let outcome = if deleted {
        RunOutcome::Deleted
    } else if let Some(f) = failure {
        RunOutcome::Failed(f)
    } else {
        RunOutcome::Succeeded
    };
    finish(&ctx, &ns, &name, &uid, &mut nvml_pids, outcome);
}

/// The pod ended: out of NVML, phase set, devices forgotten.
fn finish(
    ctx: &NodeCtx,
    ns: &str,
    name: &str,
    uid: &str,
    pids: &mut Vec<u32>,
    outcome: RunOutcome,
) {
    if !pids.is_empty() {
        let mut nv = ctx.nvml();
        nv.processes.retain(|p| !pids.contains(&p.0));
        if let Err(e) = nv.write() {
            ctx.log(&format!("writing the fake NVML state: {e:#}"));
        }
        pids.clear();
    }
    let (result, detail) = match &outcome {
        RunOutcome::Succeeded => (Outcome::Ok, "Succeeded".to_string()),
        RunOutcome::Failed(why) => (Outcome::Fail, why.clone()),
        RunOutcome::Deleted | RunOutcome::Running => (Outcome::Ok, "Deleted".to_string()),
    };
    let pod_key = format!("{ns}/{name}");
    let at = PodAt {
        pod: &pod_key,
        uid,
        node: &ctx.node,
    };
    ctx.runs.history.record("end", at, result, None, detail);
    match &outcome {
        RunOutcome::Succeeded => ctx.set_phase(ns, name, uid, "Succeeded", None),
        RunOutcome::Failed(why) => ctx.set_phase(ns, name, uid, "Failed", Some(why)),
        RunOutcome::Deleted | RunOutcome::Running => {
            ctx.log(&format!("{ns}/{name}: deleted; container stopped"));
        }
    }
    ctx.kubelet.remove_pod(ns, name);
    ctx.runs.update(uid, |r| {
        r.ended = Some(Instant::now());
        r.outcome = outcome;
    });
}
