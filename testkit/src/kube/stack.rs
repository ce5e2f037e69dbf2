//! A Kubernetes-facing gpuledger stack for tests and benchmarks: real etcd, allocator
//! processes watching a fake API server, and an extender process, all on 127.0.0.1.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use super::FakeApiServer;
use crate::bins::bin_path;
use crate::process::{Proc, free_port};
use crate::{Allocators, EtcdCluster};

/// What to start.
#[derive(Debug, Clone, Default)]
pub struct StackOptions {
    /// etcd members (1 or 3).
    pub etcd_members: usize,
    /// Allocator replicas.
    pub allocators: usize,
    /// Extra allocator flags (`--kubeconfig` is added).
    pub allocator_flags: Vec<String>,
    /// Extra extender flags (`--allocator`, `--kubeconfig`, `--listen` are added); None = no
    /// extender.
    pub extender_flags: Option<Vec<String>>,
}

/// The running stack. Dropping it stops everything.
pub struct KubeStack {
    /// The fake API server.
    pub api: FakeApiServer,
    /// Allocator replicas.
    pub allocs: Allocators,
    /// The extender process, when started.
    pub extender: Option<Proc>,
    /// `http://127.0.0.1:<port>/gpuledger` of the extender.
    pub extender_url: String,
    /// Run directory (logs, kubeconfig).
    pub dir: PathBuf,
    extender_port: u16,
    etcd: EtcdCluster,
    _tmp: tempfile::TempDir,
}

impl KubeStack {
    /// Start etcd, the fake API server, the allocators (leader elected) and the extender.
    pub async fn start(o: StackOptions) -> Result<KubeStack> {
        let tmp = tempfile::Builder::new()
            .prefix("gpuledger-kube-")
            .tempdir()?;
        let dir = tmp.path().to_path_buf();
        let etcd = EtcdCluster::start_in(&dir.join("etcd"), o.etcd_members.max(1)).await?;
        let api = FakeApiServer::start(&dir).await?;
        let mut flags = vec![format!("--kubeconfig={}", api.kubeconfig().display())];
        flags.extend(o.allocator_flags.iter().cloned());
        let refs: Vec<&str> = flags.iter().map(String::as_str).collect();
        let allocs = Allocators::start(
            &dir,
            &etcd.endpoints_flag(),
            o.allocators.max(1),
            "k",
            &refs,
        )?;
        allocs.wait_leader(Duration::from_secs(30)).await?;
        let extender_port = free_port()?;
        let mut s = KubeStack {
            api,
            allocs,
            extender: None,
            extender_url: format!("http://127.0.0.1:{extender_port}/gpuledger"),
            dir,
            extender_port,
            etcd,
            _tmp: tmp,
        };
        if let Some(f) = o.extender_flags {
            s.start_extender(&f).await?;
        }
        Ok(s)
    }

    /// The etcd cluster.
    pub fn etcd(&mut self) -> &mut EtcdCluster {
        &mut self.etcd
    }

    /// (Re)start the extender with `extra` flags and wait until it answers.
    pub async fn start_extender(&mut self, extra: &[String]) -> Result<()> {
        if let Some(mut p) = self.extender.take() {
            p.kill();
        }
        let mut args = vec![
            format!("--listen=127.0.0.1:{}", self.extender_port),
            format!("--allocator={}", self.allocs.addrs.join(",")),
            format!("--kubeconfig={}", self.api.kubeconfig().display()),
        ];
        args.extend(extra.iter().cloned());
        let p = Proc::spawn(
            &self.dir,
            "extender",
            &bin_path("gpuledger-extender")?,
            args,
            vec![("GPULEDGER_LOG".into(), "info".into())],
        )?;
        self.extender = Some(p);
        wait_http(self.extender_port, Duration::from_secs(20)).await?;
        Ok(())
    }

    /// Log directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Wait until something accepts TCP connections on 127.0.0.1:`port`.
pub async fn wait_http(port: u16, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    bail!("nothing listens on 127.0.0.1:{port} after {timeout:?}")
}
