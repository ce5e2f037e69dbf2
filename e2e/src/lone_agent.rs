//! A node agent on a kubelet-less node: the real `gpuledger-node-agent` on the fake NVML
//! library reporting the GPUs [`crate::nodes`] registered for the node, with no kubelet to
//! register its device plugin with (it keeps trying, as on a node whose kubelet is down) and
//! no containers to watch. It does what an agent does to the ledger: registers the node (again
//! at each start), reports the GPUs' health and follows the ledger. Pods bound there still
//! never run. What a restart of it does to the grants on its node is what the versus bench
//! checks during its churn.

use anyhow::Result;
use gpuledger_testkit::kubelet::node::{FakeNvml, fake_nvml_lib};
use gpuledger_testkit::{Proc, bin_path, free_port};

use crate::cluster::E2e;
use crate::gpuledger::NODE_AGENT_SA;
use crate::nodes::NodeShape;
use crate::pki::Identity;

/// A running agent of a kubelet-less node.
pub struct LoneAgent {
    /// The agent process (`kill`, `start` restart it).
    pub proc: Proc,
    /// `127.0.0.1:<port>` of its /healthz, /readyz, /metrics.
    pub http: String,
}

impl E2e {
    /// Start a node agent for kubelet-less node `name`, added with `shape` by
    /// [`E2e::add_nodes`]: its fake GPUs are the ones registered there (UUIDs, model, memory).
    pub fn lone_agent(&self, name: &str, shape: &NodeShape) -> Result<LoneAgent> {
        let dir = self.dir().join(format!("agent-{name}"));
        std::fs::create_dir_all(dir.join("device-plugins"))?;
        let mut nvml = FakeNvml::new(&dir, name, shape.gpus, shape.gpu_mem_mib)?;
        for g in &mut nvml.gpus {
            g.name.clone_from(&shape.model);
        }
        nvml.write()?;
        let http = format!("127.0.0.1:{}", free_port()?);
        let kc = self.cp.pki.kubeconfig(
            &self.cp.server,
            &Identity::ServiceAccount(NODE_AGENT_SA.into()),
        )?;
        let allocs = &self.gl.allocs;
        let args = [
            format!("--node-name={name}"),
            format!("--allocator={}", allocs.addrs.join(",")),
            format!("--nvml-lib={}", fake_nvml_lib()?.display()),
            format!("--kubelet-dir={}", dir.join("device-plugins").display()),
            format!(
                "--pod-resources-socket={}",
                dir.join("pod-resources.sock").display()
            ),
            format!("--health-listen={http}"),
            format!("--kubeconfig={}", kc.display()),
        ]
        .into_iter()
        .chain(
            allocs
                .ids
                .flags(&gpuledger_auth::identity::Role::NodeAgent {
                    node: name.to_string(),
                })?,
        )
        .collect();
        let proc = Proc::spawn(
            self.dir(),
            &format!("agent-{name}"),
            &bin_path("gpuledger-node-agent")?,
            args,
            vec![
                ("FAKE_NVML_CONFIG".into(), nvml.path().display().to_string()),
                ("GPULEDGER_LOG".into(), "info".into()),
            ],
        )?;
        Ok(LoneAgent { proc, http })
    }
}
