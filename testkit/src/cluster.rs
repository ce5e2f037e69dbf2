//! The whole local cluster, every component a real process: a 3-member etcd, allocator
//! replicas watching a fake kube-apiserver, extender replicas, the kube-scheduler emulator
//! using all of them, and simulated GPU nodes (kubelet emulator + fake NVML + a
//! `gpuledger-node-agent` process) whose kubelet loop runs the pods bound to them as child
//! processes. `gpuledger-chaos demo`, `gpuledger-chaos up` and the cluster tests share it.
//!
//! Everything lives in one run directory: `etcd/` (members' data and logs), `alloc<i>.log`,
//! `extender<i>.log`, `agent-<node>.log`, `kubelet-<node>.log` (what the kubelet loop did),
//! `kubeconfig`, and `nodes/<node>/` (kubelet sockets, fake NVML state).

pub mod kubelet_loop;
mod views;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use serde_json::{Value, json};
use tokio_util::sync::{CancellationToken, DropGuard};

pub use kubelet_loop::{PodRun, RunOutcome, Runs};
pub use views::{ViewCheck, compare_view, metric};

use crate::bins::bin_path;
use crate::kube::stack::wait_http;
use crate::kube::{ExtenderConfig, FakeApiServer, SchedulerEmulator};
use crate::kubelet::Kubelet;
use crate::kubelet::node::{FakeNvml, NodeAgent};
use crate::process::{Proc, free_port};
use crate::{Allocators, EtcdCluster};

/// The scheduler name pods use to reach gpuledger (as in `scheduler-config.yaml`).
pub const SCHEDULER_NAME: &str = "gpuledger-scheduler";
/// Pod annotation: percent of its GPU memory limit a container uses, as the fake NVML reports
/// it (default 75).
pub const ANN_MEM_USED_PERCENT: &str = "chaos.gpuledger.io/gpu-mem-used-percent";

/// What to start.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Simulated GPU nodes.
    pub nodes: usize,
    /// GPUs per node.
    pub gpus: u32,
    /// Allocator replicas.
    pub allocators: usize,
    /// Extender replicas.
    pub extenders: usize,
    /// Device-plugin slots per GPU (`--slots-per-gpu` of the agents): at most this many
    /// containers share one GPU.
    pub slots_per_gpu: u32,
    /// Pods the scheduler emulator schedules at once.
    pub scheduler_parallel: usize,
    /// How long an unschedulable pod waits before the scheduler tries it again.
    pub scheduler_backoff: Duration,
    /// How long the kubelet loop keeps retrying Allocate, and then PreStartContainer, of a
    /// container before it fails the pod (the agent may be down for a while).
    pub admit_timeout: Duration,
    /// Node agents' `--enforce-interval`.
    pub enforce_interval: String,
    /// Run directory; a new temporary one (deleted on drop) when unset.
    pub dir: Option<PathBuf>,
    /// Allocator `i` reaches etcd only through its own loopback address
    /// [`allocator_etcd_host`]`(i)`, so a firewall rule on that address partitions it from
    /// etcd alone.
    pub etcd_alias_per_allocator: bool,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        ClusterOptions {
            nodes: 2,
            gpus: 2,
            allocators: 3,
            extenders: 2,
            slots_per_gpu: 32,
            scheduler_parallel: 8,
            scheduler_backoff: Duration::from_millis(500),
            admit_timeout: Duration::from_secs(20),
            enforce_interval: "500ms".into(),
            dir: None,
            etcd_alias_per_allocator: false,
        }
    }
}

/// The GPU model and memory (MiB) of node `i`: A100 40 GB and T4 alternate.
pub fn node_model(i: usize) -> (&'static str, u64) {
    if i.is_multiple_of(2) {
        ("NVIDIA A100-SXM4-40GB", 40_960)
    } else {
        ("Tesla T4", 15_360)
    }
}

/// The loopback address through which allocator `i` reaches etcd when
/// [`ClusterOptions::etcd_alias_per_allocator`] is set.
pub fn allocator_etcd_host(i: usize) -> String {
    format!("127.0.1.{}", i + 1)
}

/// The name of node `i`.
pub fn node_name(i: usize) -> String {
    format!("gpu-node-{i}")
}

/// One simulated GPU node.
pub struct SimNode {
    /// Kubernetes node name (also the ledger's).
    pub name: String,
    /// GPU model.
    pub model: String,
    /// Memory per GPU, MiB.
    pub gpu_mem_mib: u64,
    /// The kubelet emulator (device-plugin side and PodResources).
    pub kubelet: Arc<Kubelet>,
    /// The fake NVML state the agent reads and the kubelet loop writes.
    pub nvml: Arc<Mutex<FakeNvml>>,
    /// The node agent process.
    pub agent: NodeAgent,
    /// The agent's `/metrics`, `/healthz`, `/readyz` port.
    pub health_port: u16,
    /// Stops the kubelet loop, and with it every pod on the node, when the node is dropped.
    _stop: DropGuard,
}

impl SimNode {
    /// `http://127.0.0.1:<port>` of the agent's health server.
    pub fn health_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.health_port)
    }
}

/// The running cluster. Dropping it stops every process.
pub struct LocalCluster {
    /// Run directory (logs, kubeconfig, node state).
    pub dir: PathBuf,
    /// The simulated nodes (declared first: their kubelet loops stop before the rest).
    pub nodes: Vec<SimNode>,
    /// The kube-scheduler emulator.
    pub scheduler: SchedulerEmulator,
    /// Extender processes.
    pub extenders: Vec<Proc>,
    /// Their HTTP ports (`/filter`… under `/gpuledger`, `/metrics`, `/healthz`, `/readyz`).
    pub extender_ports: Vec<u16>,
    /// Allocator replicas.
    pub allocs: Allocators,
    /// The fake API server (in this process).
    pub api: FakeApiServer,
    /// What the kubelet loops ran.
    pub runs: Arc<Runs>,
    /// What was started.
    pub opts: ClusterOptions,
    etcd: EtcdCluster,
    _tmp: Option<tempfile::TempDir>,
}

impl LocalCluster {
    /// Start everything and wait until it is ready: a leader elected, extenders answering,
    /// every agent registered with its kubelet, every node's GPUs in the ledger, every
    /// agent's `/readyz` 200.
    pub async fn start(opts: ClusterOptions) -> Result<LocalCluster> {
        let (dir, tmp) = match &opts.dir {
            Some(d) => {
                std::fs::create_dir_all(d)
                    .with_context(|| format!("creating the run directory {}", d.display()))?;
                (d.clone(), None)
            }
            None => {
                let t = tempfile::Builder::new()
                    .prefix("gpuledger-cluster-")
                    .tempdir()
                    .context("creating a run directory")?;
                (t.path().to_path_buf(), Some(t))
            }
        };
        let n_alloc = opts.allocators.max(1);
        let aliases: Vec<String> = if opts.etcd_alias_per_allocator {
            (0..n_alloc).map(allocator_etcd_host).collect()
        } else {
            Vec::new()
        };
        let etcd = EtcdCluster::start_with_aliases(&dir.join("etcd"), 3, &aliases).await?;
        let api = FakeApiServer::start(&dir).await?;
        let kubeconfig = api.kubeconfig().display().to_string();
        let slots = opts.slots_per_gpu.max(1);
        for i in 0..opts.nodes {
            api.add_node(&node_name(i), opts.gpus * slots)?;
        }
        let kflag = format!("--kubeconfig={kubeconfig}");
        // Archive the log as production should: etcd keeps a short tail, so the chaos checker
        // and `verify` read archive + etcd, and faults hit the archiving too.
        let archive = format!("--archive-dir={}", dir.join("archive").display());
        let archiving = [
            archive.as_str(),
            "--snapshot-every=200",
            "--log-retain-events=100",
            "--archive-interval-ms=1000",
        ];
        let etcd_flags: Vec<String> = if aliases.is_empty() {
            vec![etcd.endpoints_flag(); n_alloc]
        } else {
            aliases.iter().map(|h| etcd.endpoints_flag_via(h)).collect()
        };
        let flags: Vec<&str> = std::iter::once(kflag.as_str()).chain(archiving).collect();
        let allocs = Allocators::start_each(&dir, &etcd_flags, "local", &flags)?;
        allocs.wait_leader(Duration::from_secs(30)).await?;

        let ext_bin = bin_path("gpuledger-extender")?;
        let mut extenders = Vec::new();
        let mut extender_ports = Vec::new();
        for i in 0..opts.extenders.max(1) {
            let port = free_port()?;
            let args = vec![
                format!("--listen=127.0.0.1:{port}"),
                format!("--allocator={}", allocs.addrs.join(",")),
                kflag.clone(),
            ];
            extenders.push(Proc::spawn(
                &dir,
                &format!("extender{i}"),
                &ext_bin,
                args,
                vec![("GPULEDGER_LOG".into(), "info".into())],
            )?);
            extender_ports.push(port);
        }
        for (p, port) in extenders.iter().zip(&extender_ports) {
            wait_http(*port, Duration::from_secs(20))
                .await
                .with_context(|| format!("{} log:\n{}", p.name, p.log_tail(20)))?;
        }
        let cfgs: Vec<ExtenderConfig> = extender_ports
            .iter()
            .map(|p| ExtenderConfig::gpuledger(&format!("http://127.0.0.1:{p}/gpuledger")))
            .collect();
        let scheduler = SchedulerEmulator::start_replicas(
            api.client().await?,
            SCHEDULER_NAME,
            cfgs,
            opts.scheduler_parallel,
            opts.scheduler_backoff,
        );

        let runs = Arc::new(Runs::default());
        let mut nodes = Vec::new();
        for i in 0..opts.nodes {
            nodes.push(Self::start_node(&dir, i, &opts, &allocs, &api, &runs).await?);
        }
        let c = LocalCluster {
            dir,
            nodes,
            scheduler,
            extenders,
            extender_ports,
            allocs,
            api,
            runs,
            opts,
            etcd,
            _tmp: tmp,
        };
        c.wait_nodes_ready(Duration::from_secs(60)).await?;
        c.wait_ready(Duration::from_secs(30)).await?;
        Ok(c)
    }

    /// Wait until every running allocator replica and extender answers `/readyz` with 200.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut not = Vec::new();
            let urls = self
                .allocs
                .http
                .iter()
                .zip(&self.allocs.procs)
                .map(|(h, p)| (format!("http://{h}"), p))
                .chain(
                    self.extenders
                        .iter()
                        .enumerate()
                        .map(|(i, p)| (self.extender_url(i), p)),
                );
            for (u, p) in urls {
                if p.pid().is_none() {
                    continue;
                }
                match crate::http::get(&format!("{u}/readyz")).await {
                    Ok((200, _)) => {}
                    Ok((code, body)) => {
                        not.push(format!("{} ({u}): {code} {}", p.name, body.trim()))
                    }
                    Err(e) => not.push(format!("{} ({u}): {e:#}", p.name)),
                }
            }
            if not.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("not ready within {timeout:?}: {}", not.join("; "));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn start_node(
        dir: &Path,
        i: usize,
        opts: &ClusterOptions,
        allocs: &Allocators,
        api: &FakeApiServer,
        runs: &Arc<Runs>,
    ) -> Result<SimNode> {
        let name = node_name(i);
        let (model, mem) = node_model(i);
        let ndir = dir.join("nodes").join(&name);
        std::fs::create_dir_all(&ndir)?;
        let kubelet = Arc::new(Kubelet::start(&ndir).await?);
        let mut nvml = FakeNvml::new(&ndir, &name, opts.gpus, mem)?;
        for g in &mut nvml.gpus {
            g.name = model.to_string();
        }
        nvml.write()?;
        let health_port = free_port()?;
        let flags = [
            format!("--slots-per-gpu={}", opts.slots_per_gpu.max(1)),
            format!("--enforce-interval={}", opts.enforce_interval),
            format!("--health-listen=127.0.0.1:{health_port}"),
            format!("--kubeconfig={}", api.kubeconfig().display()),
        ];
        let refs: Vec<&str> = flags.iter().map(String::as_str).collect();
        let agent = NodeAgent::start(dir, &name, &allocs.addrs, &nvml, &kubelet, &refs)?;
        let nvml = Arc::new(Mutex::new(nvml));
        let ctx = Arc::new(kubelet_loop::NodeCtx::new(
            &name,
            kubelet.clone(),
            nvml.clone(),
            api.store.clone(),
            runs.clone(),
            opts.admit_timeout,
            &dir.join(format!("kubelet-{name}.log")),
        )?);
        let client = api.client().await?;
        let stop = CancellationToken::new();
        tokio::spawn(kubelet_loop::run(ctx, client, stop.clone()));
        Ok(SimNode {
            name,
            model: model.to_string(),
            gpu_mem_mib: mem,
            kubelet,
            nvml,
            agent,
            health_port,
            _stop: stop.drop_guard(),
        })
    }

    /// Wait until every agent is registered with its kubelet, advertises all its devices,
    /// has its GPUs in the ledger and answers `/readyz` with 200.
    pub async fn wait_nodes_ready(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        for n in &self.nodes {
            let left = deadline.saturating_duration_since(Instant::now());
            n.kubelet
                .wait_registrations(1, left)
                .await
                .with_context(|| {
                    format!("{} log:\n{}", n.agent.proc.name, n.agent.proc.log_tail(30))
                })?;
        }
        loop {
            let snap = self.dump().await.ok();
            let mut missing = Vec::new();
            for n in &self.nodes {
                let in_ledger = snap.as_ref().is_some_and(|s| {
                    s.nodes
                        .iter()
                        .any(|x| x.node == n.name && x.gpus.len() == self.opts.gpus as usize)
                });
                let ready = crate::http::get(&format!("{}/readyz", n.health_url()))
                    .await
                    .is_ok_and(|(c, _)| c == 200);
                if !in_ledger || !ready {
                    missing.push(format!(
                        "{} (in ledger: {in_ledger}, /readyz: {ready})",
                        n.name
                    ));
                }
            }
            if missing.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                let tails: Vec<String> = self
                    .nodes
                    .iter()
                    .map(|n| format!("--- {}:\n{}", n.agent.proc.name, n.agent.proc.log_tail(15)))
                    .collect();
                bail!(
                    "nodes not ready within {timeout:?}: {}\n{}",
                    missing.join(", "),
                    tails.join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// SIGKILL node `i`'s agent, keep it down for `down`, start it again and wait until it
    /// has re-registered with its kubelet and answers `/readyz` with 200 (30 s at most each).
    /// How long from the kill until it was ready.
    pub async fn restart_agent(&mut self, i: usize, down: Duration) -> Result<Duration> {
        let kill_at = Instant::now();
        let n = &mut self.nodes[i];
        n.agent.proc.kill();
        tokio::time::sleep(down).await;
        let regs = n.kubelet.registrations();
        n.agent.proc.start()?;
        n.kubelet
            .wait_registrations(regs + 1, Duration::from_secs(30))
            .await
            .with_context(|| n.agent.proc.log_tail(20))?;
        let url = format!("{}/readyz", n.health_url());
        let ready_deadline = Instant::now() + Duration::from_secs(30);
        while !crate::http::get(&url)
            .await
            .is_ok_and(|(code, _)| code == 200)
        {
            if Instant::now() > ready_deadline {
                bail!(
                    "node agent of {} not ready 30 s after its restart:\n{}",
                    n.name,
                    n.agent.proc.log_tail(20)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(kill_at.elapsed())
    }

    /// The kubeconfig that reaches the fake API server.
    pub fn kubeconfig(&self) -> &Path {
        self.api.kubeconfig()
    }

    /// The etcd cluster.
    pub fn etcd(&mut self) -> &mut EtcdCluster {
        &mut self.etcd
    }

    /// etcd client endpoints.
    pub fn etcd_endpoints(&self) -> Vec<String> {
        self.etcd.endpoints()
    }

    /// `--allocator=` value for the CLI: every replica.
    pub fn allocator_flag(&self) -> String {
        format!("--allocator={}", self.allocs.addrs.join(","))
    }

    /// `http://127.0.0.1:<port>` of extender `i`.
    pub fn extender_url(&self, i: usize) -> String {
        format!("http://127.0.0.1:{}", self.extender_ports[i])
    }

    /// Every live process that has exited on its own (not killed by us), with its log tail:
    /// an error naming the first one.
    pub fn check_processes(&mut self) -> Result<()> {
        let mut dead = Vec::new();
        let procs = self
            .allocs
            .procs
            .iter_mut()
            .chain(self.extenders.iter_mut())
            .chain(self.nodes.iter_mut().map(|n| &mut n.agent.proc));
        for p in procs {
            if let Some(st) = p.exited() {
                dead.push(format!(
                    "{} exited ({st}); last lines of {}:\n{}",
                    p.name,
                    p.log_path().display(),
                    p.log_tail(20)
                ));
            }
        }
        if dead.is_empty() {
            Ok(())
        } else {
            bail!("{}", dead.join("\n"))
        }
    }

    /// A ledger snapshot from the first replica that answers.
    pub async fn dump(&self) -> Result<pb::Snapshot> {
        let mut last = None;
        for i in 0..self.allocs.addrs.len() {
            if self.allocs.procs[i].pid().is_none() {
                continue;
            }
            let Ok(mut c) = self.allocs.client(i) else {
                continue;
            };
            match c.dump(api::DumpRequest {}).await {
                Ok(r) => {
                    if let Some(s) = r.into_inner().snapshot {
                        return Ok(s);
                    }
                }
                Err(e) => last = Some(e),
            }
        }
        match last {
            Some(e) => Err(e).context("no allocator replica answered Dump"),
            None => bail!("no allocator replica is running"),
        }
    }

    /// Create a pod in the API server.
    pub fn add_pod(&self, pod: Value) -> Result<Value> {
        self.api.add_pod(pod)
    }
}

/// A pod's `status.phase` in the API server (`Pending` until the kubelet sets one).
pub fn pod_phase(p: &Value) -> &str {
    p.pointer("/status/phase")
        .and_then(Value::as_str)
        .unwrap_or("Pending")
}

/// A pod for the cluster: one container `main` running `sleep <secs>` with `resources` as
/// limits, scheduled by gpuledger.
pub fn pod_json(name: &str, resources: &[(&str, String)], secs: f64) -> Value {
    let limits: serde_json::Map<String, Value> = resources
        .iter()
        .map(|(k, v)| ((*k).to_string(), json!(v)))
        .collect();
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "schedulerName": SCHEDULER_NAME,
            "restartPolicy": "Never",
            "containers": [{
                "name": "main",
                "image": "busybox",
                "command": ["sleep", format!("{secs:.2}")],
                "resources": {"limits": limits},
            }],
        },
    })
}
