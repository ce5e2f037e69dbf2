//! A one-node GPU cluster for the agent's tests: real etcd, a real allocator process, the fake
//! NVML library, the kubelet emulator and a real node-agent process.

#![allow(dead_code)]

pub mod cgroups;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpuledger_auth::identity::Role;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::allocators::Client;
use gpuledger_testkit::kubelet::Kubelet;
use gpuledger_testkit::kubelet::node::{FakeNvml, NodeAgent, fake_nvml_lib};
use gpuledger_testkit::workload::pod;
use gpuledger_testkit::{Allocators, EtcdCluster, Proc, bin_path};
use nvidia_ml::FakeConfig;

pub const NODE: &str = "gpu-node-1";
pub const SLOTS: u32 = 4;
pub const GPU_MIB: u64 = 40_960;

pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub etcd: EtcdCluster,
    pub allocs: Allocators,
    pub kubelet: Kubelet,
    pub nvml: FakeNvml,
    pub agent: NodeAgent,
}

/// A change to the fake NVML state.
pub type NvmlEdit = Box<dyn FnOnce(&mut FakeConfig)>;

/// A test cluster beyond the defaults of [`Cluster::start`].
pub struct Options {
    /// Allocator replicas (the agent gets all).
    pub replicas: usize,
    /// GPUs of the node.
    pub gpus: u32,
    /// Extra agent flags.
    pub flags: Vec<String>,
    /// Edits the fake NVML state before the agent starts.
    pub nvml: Option<NvmlEdit>,
    /// Namespaces the agent runs in.
    pub agent_in: AgentIn,
}

/// Where the agent process runs.
#[derive(Debug, Clone, Default)]
pub enum AgentIn {
    /// Beside the test, in the host's namespaces.
    #[default]
    Host,
    /// In a pid namespace of its own (`unshare --pid`), as a DaemonSet without hostPID.
    OwnPidNamespace,
    /// In a private cgroup namespace rooted at this cgroup directory, as a container on cgroup
    /// v2: it reads every other cgroup as a path relative to that one.
    CgroupNamespace(PathBuf),
}

impl Default for Options {
    fn default() -> Options {
        Options {
            replicas: 1,
            gpus: 1,
            flags: Vec::new(),
            nvml: None,
            agent_in: AgentIn::Host,
        }
    }
}

impl Cluster {
    /// Everything up, the agent registered with the kubelet and its GPUs in the ledger.
    pub async fn start(gpus: u32, agent_flags: &[&str]) -> Result<Cluster> {
        Self::start_with(1, gpus, agent_flags).await
    }

    /// Like [`Cluster::start`] with `replicas` allocator replicas (the agent gets all).
    pub async fn start_with(replicas: usize, gpus: u32, agent_flags: &[&str]) -> Result<Cluster> {
        Self::start_opts(Options {
            replicas,
            gpus,
            flags: agent_flags.iter().map(|f| f.to_string()).collect(),
            ..Options::default()
        })
        .await
    }

    /// Like [`Cluster::start`], as `o` says.
    pub async fn start_opts(o: Options) -> Result<Cluster> {
        let Options {
            replicas,
            gpus,
            flags: agent_flags,
            nvml: edit_nvml,
            agent_in,
        } = o;
        let dir = tempfile::tempdir()?;
        let etcd = EtcdCluster::start(1).await?;
        let allocs = Allocators::start(
            &dir.path().join("alloc"),
            &etcd,
            replicas,
            "t",
            &["--no-kube"],
        )?;
        allocs.wait_leader(Duration::from_secs(30)).await?;
        let kubelet = Kubelet::start(&dir.path().join("kubelet")).await?;
        let nvml = FakeNvml::new(dir.path(), NODE, gpus, GPU_MIB)?;
        if let Some(f) = edit_nvml {
            edit_fake_nvml(nvml.path(), f)?;
        }
        let slots = format!("--slots-per-gpu={SLOTS}");
        // The agent proves to the allocator that it is the node agent of NODE.
        let identity = allocs.ids.flags(&Role::NodeAgent { node: NODE.into() })?;
        let mut flags = vec![slots.as_str(), "--enforce-interval=200ms"];
        flags.extend(identity.iter().map(String::as_str));
        flags.extend(agent_flags.iter().map(String::as_str));
        let agent = match agent_in {
            AgentIn::Host => {
                NodeAgent::start(dir.path(), NODE, &allocs.addrs, &nvml, &kubelet, &flags)?
            }
            wrapped => start_wrapped(dir.path(), &allocs, &nvml, &kubelet, &flags, &wrapped)?,
        };
        let c = Cluster {
            dir,
            etcd,
            allocs,
            kubelet,
            nvml,
            agent,
        };
        c.kubelet
            .wait_registrations(1, Duration::from_secs(20))
            .await
            .with_context(|| c.agent_log())?;
        let want = (gpus * SLOTS) as usize;
        c.kubelet
            .wait_devices(Duration::from_secs(10), |d| d.len() == want)
            .await?;
        c.wait_ledger(Duration::from_secs(20), |s| {
            s.nodes
                .iter()
                .any(|n| n.node == NODE && n.gpus.len() == gpus as usize)
        })
        .await
        .with_context(|| c.agent_log())?;
        Ok(c)
    }

    /// Change the fake NVML state in place (what the test kit's `FakeNvml` does not model:
    /// the driver's reserve, CUDA contexts). Its later writes start from its own copy.
    pub fn edit_nvml(&self, f: impl FnOnce(&mut FakeConfig)) -> Result<()> {
        edit_fake_nvml(self.nvml.path(), f)
    }

    pub fn agent_log(&self) -> String {
        format!("agent log:\n{}", self.agent.proc.log_tail(40))
    }

    pub fn gpu(&self, i: usize) -> String {
        self.nvml.gpus[i].uuid.clone()
    }

    /// A running replica (the first one alive).
    fn live(&self) -> usize {
        (0..self.allocs.procs.len())
            .find(|i| self.allocs.procs[*i].pid().is_some())
            .unwrap_or(0)
    }

    /// A client to a running replica as the scheduler extender.
    pub fn extender(&self) -> Result<Client> {
        self.allocs.extender(self.live())
    }

    /// A client to a running replica as an operator who reads.
    pub fn viewer(&self) -> Result<Client> {
        self.allocs.viewer(self.live())
    }

    /// A client to a running replica as an operator who writes (releases what Kubernetes
    /// would: these clusters have no API server for the allocator to watch).
    pub fn admin(&self) -> Result<Client> {
        self.allocs.admin(self.live())
    }

    /// Reserve one slice of `mem_mib` for pod `uid` (optionally on one GPU) and confirm it bound.
    pub async fn reserve(
        &self,
        uid: &str,
        mem_mib: u64,
        gpu: Option<&str>,
    ) -> Result<pb::Allocation> {
        let mut req = pod(uid, mem_mib, 10);
        if let Some(g) = gpu {
            req.placement = Some(api::Placement {
                gpu_uuids: vec![g.to_string()],
                ..Default::default()
            });
        }
        self.reserve_request(req).await
    }

    /// Reserve `req` on the node and confirm its pod bound.
    pub async fn reserve_request(&self, req: api::PodRequest) -> Result<pb::Allocation> {
        let uid = req.pod.as_ref().map(|p| p.uid.clone()).unwrap_or_default();
        let mut c = self.extender()?;
        let r = c
            .reserve(api::ReserveRequest {
                request: Some(req),
                node: NODE.into(),
                ttl_ms: 600_000,
            })
            .await?
            .into_inner();
        c.confirm_bound(api::ConfirmBoundRequest {
            pod_uid: uid,
            node: NODE.into(),
        })
        .await?;
        r.allocations.into_iter().next().context("no allocation")
    }

    /// Fail unless `p` (`what`) ends by SIGKILL within 10 s.
    pub async fn killed(&self, p: &mut cgroups::Sleeper, what: &str) -> Result<()> {
        use std::os::unix::process::ExitStatusExt;
        let st = p.ended(Duration::from_secs(10)).await;
        if st.and_then(|st| st.signal()) != Some(9) {
            bail!("{what} was not SIGKILLed ({st:?})\n{}", self.agent_log());
        }
        Ok(())
    }

    pub async fn dump(&self) -> Result<pb::Snapshot> {
        self.viewer()?
            .dump(api::DumpRequest {})
            .await?
            .into_inner()
            .snapshot
            .context("no snapshot")
    }

    /// Poll the ledger until `pred` holds.
    pub async fn wait_ledger(
        &self,
        timeout: Duration,
        pred: impl Fn(&pb::Snapshot) -> bool,
    ) -> Result<pb::Snapshot> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(s) = self.dump().await
                && pred(&s)
            {
                return Ok(s);
            }
            if Instant::now() > deadline {
                bail!("ledger did not reach the expected state in {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Every event in the log.
    pub async fn events(&self) -> Result<Vec<pb::Event>> {
        self.allocs.events(self.live()).await
    }

    /// Wait until there is a LimitViolated for each of `pids`; they are returned in that order.
    pub async fn wait_violations(
        &self,
        pids: &[u32],
        timeout: Duration,
    ) -> Result<Vec<pb::LimitViolated>> {
        let deadline = Instant::now() + timeout;
        loop {
            let all = self.violations().await?;
            let found: Vec<pb::LimitViolated> = pids
                .iter()
                .filter_map(|pid| all.iter().find(|v| v.pid == *pid).cloned())
                .collect();
            if found.len() == pids.len() {
                return Ok(found);
            }
            if Instant::now() > deadline {
                bail!(
                    "LimitViolated for {pids:?} not all in {timeout:?}: {all:?}\n{}",
                    self.agent_log()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The LimitViolated events so far.
    pub async fn violations(&self) -> Result<Vec<pb::LimitViolated>> {
        Ok(self
            .events()
            .await?
            .into_iter()
            .filter_map(|e| match e.body {
                Some(pb::event::Body::LimitViolated(v)) => Some(v),
                _ => None,
            })
            .collect())
    }
}

/// The agent as [`NodeAgent::start`] runs it, inside the namespaces `wrap` names.
fn start_wrapped(
    dir: &Path,
    allocs: &Allocators,
    nvml: &FakeNvml,
    kubelet: &Kubelet,
    flags: &[&str],
    wrap: &AgentIn,
) -> Result<NodeAgent> {
    let mut agent = vec![
        bin_path("gpuledger-node-agent")?.display().to_string(),
        format!("--node-name={NODE}"),
        format!("--allocator={}", allocs.addrs.join(",")),
        format!("--nvml-lib={}", fake_nvml_lib()?.display()),
        format!("--kubelet-dir={}", kubelet.device_plugin_dir().display()),
        format!(
            "--pod-resources-socket={}",
            kubelet.pod_resources_socket().display()
        ),
    ];
    agent.extend(flags.iter().map(|f| f.to_string()));
    let (program, mut args): (&str, Vec<String>) = match wrap {
        AgentIn::Host => bail!("not a wrapped agent"),
        // --kill-child: the agent dies with the unshare process the test kit kills.
        AgentIn::OwnPidNamespace => (
            "unshare",
            ["--pid", "--fork", "--kill-child"]
                .map(String::from)
                .to_vec(),
        ),
        AgentIn::CgroupNamespace(cg) => (
            "sh",
            vec![
                "-c".into(),
                r#"echo $$ > "$0" && exec unshare --cgroup "$@""#.into(),
                cg.join("cgroup.procs").display().to_string(),
            ],
        ),
    };
    args.extend(agent);
    let proc = Proc::spawn(
        dir,
        &format!("agent-{NODE}"),
        Path::new(program),
        args,
        vec![
            ("FAKE_NVML_CONFIG".into(), nvml.path().display().to_string()),
            ("GPULEDGER_LOG".into(), "info".into()),
        ],
    )?;
    Ok(NodeAgent { proc })
}

/// Read the fake NVML state at `path`, apply `f`, write it back atomically.
pub fn edit_fake_nvml(path: &Path, f: impl FnOnce(&mut FakeConfig)) -> Result<()> {
    let mut cfg: FakeConfig = serde_json::from_slice(&std::fs::read(path)?)
        .with_context(|| format!("reading the fake NVML state {}", path.display()))?;
    f(&mut cfg);
    cfg.write_to(path)?;
    Ok(())
}

/// The live allocation of pod `uid`.
pub fn alloc_of<'a>(s: &'a pb::Snapshot, uid: &str) -> Option<&'a pb::Allocation> {
    s.allocations
        .iter()
        .find(|a| a.pod.as_ref().is_some_and(|p| p.uid == uid))
}

/// The GPU a device ID is on.
pub fn gpu_of(device: &str) -> &str {
    device.rsplit_once("::").map_or(device, |(g, _)| g)
}

/// The GPU UUIDs an Allocate answer grants, from its CDI devices (the default device list
/// strategy), comma-joined as NVIDIA_VISIBLE_DEVICES would list them.
pub fn granted(r: &gpuledger_proto::deviceplugin::v1beta1::ContainerAllocateResponse) -> String {
    r.cdi_devices
        .iter()
        .map(|d| {
            d.name
                .split_once('=')
                .map_or(d.name.as_str(), |(_, uuid)| uuid)
        })
        .collect::<Vec<_>>()
        .join(",")
}
