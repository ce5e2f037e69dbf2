//! The whole tier in one value: control plane, the shipped manifests, gpuledger, the scheduler
//! and, when asked, a real GPU node.

use std::path::{Path, PathBuf};

use anyhow::Result;
use gpuledger_testkit::free_port;

use crate::bins::KubeBins;
use crate::certs::Shipped;
use crate::control_plane::ControlPlane;
use crate::gpuledger::{ALLOCATOR_SA, EXTENDER_SA, Gpuledger, NODE_AGENT_SA};
use crate::kubectl::Kubectl;
use crate::manifests::Installed;
use crate::nodes::NodeShape;
use crate::pki::Identity;
use crate::real_node::RealNode;

/// The name of the real node.
pub const REAL_NODE: &str = "e2e-gpu-node";

/// What to start.
#[derive(Debug, Clone)]
pub struct Options {
    /// Allocator replicas.
    pub allocators: usize,
    /// Whether to start a real node (containerd, kubelet, node agent).
    pub real_node: bool,
    /// The real node's agent serves its device-plugin socket outside the kubelet's
    /// device-plugin directory (a DaemonSet with the wrong hostPath).
    pub misplaced_plugin_socket: bool,
    /// Fake GPUs of the real node: (count, MiB each).
    pub real_node_gpus: (u32, u64),
    /// Extra extender flags.
    pub extender_flags: Vec<String>,
    /// Extra flags of every allocator replica (e.g. `--dra-cores=fraction`).
    pub allocator_flags: Vec<String>,
    /// Extra flags of kube-scheduler (e.g. a feature gate).
    pub scheduler_flags: Vec<String>,
    /// kube-scheduler's client QPS (None: the shipped configuration's, i.e. the default 50).
    pub scheduler_qps: Option<u32>,
    /// kube-controller-manager's client QPS, each controller's (None: the default 20). Its
    /// resource-claim controller makes two API calls per claim pod.
    pub controller_manager_qps: Option<u32>,
    /// DRA mode: the `dra` overlay (DeviceClass, webhook converting GPU pods to claims), its
    /// second scheduler with DynamicResources, and the real node's agent as a kubelet DRA
    /// plugin (`--mode=dra`).
    pub dra: bool,
    /// The real node's agent's `--allocate-wait` (None: its default, 10 s): how long an
    /// Allocate waits for a reservation of its pod.
    pub agent_allocate_wait: Option<std::time::Duration>,
    /// More flags of the real node's agent (e.g. `--isolation=hami-core`).
    pub agent_flags: Vec<String>,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            allocators: 2,
            real_node: false,
            misplaced_plugin_socket: false,
            real_node_gpus: (2, 16_384),
            extender_flags: Vec::new(),
            allocator_flags: Vec::new(),
            scheduler_flags: Vec::new(),
            scheduler_qps: None,
            controller_manager_qps: None,
            dra: false,
            agent_allocate_wait: None,
            agent_flags: Vec::new(),
        }
    }
}

/// The running tier. Dropping it stops everything (the real node first).
pub struct E2e {
    /// Renews the kubelet-less nodes' Leases.
    pub heartbeat: crate::nodes::Heartbeat,
    /// The real node, when started.
    pub node: Option<RealNode>,
    /// gpuledger's processes.
    pub gl: Gpuledger,
    /// The control plane.
    pub cp: ControlPlane,
    /// What the shipped overlay installed.
    pub installed: Installed,
    /// gpuledger's certificates, as the shipped script installed them.
    pub certs: Shipped,
    /// An admin client.
    pub client: kube::Client,
    /// The Kubernetes binaries.
    pub bins: KubeBins,
    dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
}

impl E2e {
    /// Start everything. The run directory is removed afterwards unless `GPULEDGER_E2E_KEEP`
    /// is set (then its path is printed: every process logs there).
    pub async fn start(o: Options) -> Result<E2e> {
        let bins = KubeBins::get()?;
        let keep = std::env::var_os("GPULEDGER_E2E_KEEP").is_some();
        let tmp = tempfile::Builder::new()
            .prefix("gpuledger-e2e-")
            .disable_cleanup(keep)
            .tempdir()?;
        let dir = tmp.path().to_path_buf();
        if keep {
            eprintln!("e2e run directory (kept): {}", dir.display());
        }
        let identities = [
            Identity::Scheduler,
            Identity::ControllerManager,
            Identity::Node(REAL_NODE.into()),
            Identity::ServiceAccount(ALLOCATOR_SA.into()),
            Identity::ServiceAccount(EXTENDER_SA.into()),
            Identity::ServiceAccount(NODE_AGENT_SA.into()),
            Identity::ServiceAccount(crate::control_plane::DRA_SCHEDULER_SA.into()),
            // HAMi's scheduler, when a test starts it beside gpuledger (crate::hami).
            Identity::ServiceAccount(crate::hami::SERVICE_ACCOUNT.into()),
            // dra-example-driver's controller, likewise (crate::draex).
            Identity::ServiceAccount(crate::draex::SERVICE_ACCOUNT.into()),
        ];
        let mut cp =
            ControlPlane::start(&dir, &bins, &identities, o.controller_manager_qps).await?;
        let webhook_port = free_port()?;
        let (overlay, scheduler) = if o.dra {
            (
                crate::manifests::DRA_OVERLAY,
                crate::control_plane::DRA_SCHEDULER,
            )
        } else {
            (
                crate::manifests::OVERLAY,
                crate::control_plane::DEFAULT_SCHEDULER,
            )
        };
        let installed = crate::manifests::install(&cp.kubectl(), webhook_port, overlay)?;
        let client = cp.client().await?;
        let certs = Shipped::install(&dir, &bins, &cp.admin_kubeconfig, &client).await?;
        let mut extender_flags = o.extender_flags.clone();
        if o.dra {
            // As the dra overlay's extender runs: GPU pods become claims and go to its
            // second scheduler.
            extender_flags.extend([
                "--pod-path=dra".to_string(),
                "--scheduler-name=gpuledger-scheduler".to_string(),
            ]);
        }
        let gl = Gpuledger::start(
            &dir,
            (&cp.pki, &certs),
            (&cp.server, &client),
            (o.allocators, webhook_port),
            (&o.allocator_flags, &extender_flags),
            o.dra,
        )
        .await?;
        cp.start_scheduler(
            &gl.extender_url,
            o.scheduler_qps,
            &certs,
            &scheduler,
            &o.scheduler_flags,
        )
        .await?;
        let node = match o.real_node {
            false => None,
            true => Some(
                RealNode::start(
                    &dir,
                    &bins,
                    &cp.pki,
                    &cp.server,
                    &client,
                    &gl.allocs,
                    REAL_NODE,
                    o.real_node_gpus,
                    o.misplaced_plugin_socket,
                    o.dra,
                    o.agent_allocate_wait,
                    &o.agent_flags,
                )
                .await?,
            ),
        };
        Ok(E2e {
            heartbeat: crate::nodes::Heartbeat::start(&client),
            node,
            gl,
            cp,
            installed,
            certs,
            client,
            bins,
            dir,
            _tmp: Some(tmp),
        })
    }

    /// Start, add `nodes` kubelet-less nodes `gpu-<i>` with `gpus` GPUs of 16 GiB each, and
    /// create namespace `ns` opted into the webhooks; the node names.
    pub async fn with_gpu_nodes(
        o: Options,
        nodes: usize,
        gpus: u32,
        ns: &str,
    ) -> Result<(E2e, Vec<String>)> {
        let e = E2e::start(o).await?;
        let names: Vec<String> = (0..nodes).map(|i| format!("gpu-{i}")).collect();
        let shape = NodeShape {
            gpus,
            ..NodeShape::default()
        };
        e.add_nodes(&names, &shape).await?;
        e.namespace(ns).await?;
        Ok((e, names))
    }

    /// The cluster's kubectl as the admin.
    pub fn kubectl(&self) -> Kubectl {
        self.cp.kubectl()
    }

    /// Create namespace `ns` (the webhooks see every namespace but those the overlay
    /// excludes) and wait for its `default` ServiceAccount.
    pub async fn namespace(&self, ns: &str) -> Result<()> {
        crate::pods::namespace(&self.client, ns, &[]).await
    }

    /// Add kubelet-less GPU nodes.
    pub async fn add_nodes(&self, names: &[String], shape: &NodeShape) -> Result<()> {
        crate::nodes::add(
            &self.client,
            (&self.gl.allocs, &self.heartbeat),
            names,
            shape,
        )
        .await
    }

    /// The run directory (every process's log is `<name>.log` there).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The last lines of the scheduler's, extender's and allocators' logs, for a failure.
    pub fn log_tails(&self, n: usize) -> String {
        let mut out = String::new();
        if let Some(s) = &self.cp.scheduler {
            out.push_str(&format!("--- kube-scheduler:\n{}\n", s.log_tail(n)));
        }
        out.push_str(&format!(
            "--- extender:\n{}\n",
            self.gl.extender.log_tail(n)
        ));
        for p in &self.gl.allocs.procs {
            out.push_str(&format!("--- {}:\n{}\n", p.name, p.log_tail(n)));
        }
        if let Some(node) = &self.node {
            out.push_str(&format!("--- node agent:\n{}\n", node.agent.log_tail(n)));
            out.push_str(&format!("--- kubelet:\n{}\n", node.kubelet.log_tail(n)));
        }
        out
    }
}
