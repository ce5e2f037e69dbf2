//! A Kubernetes-facing gpuledger stack for tests and benchmarks: real etcd, allocator
//! processes watching a fake API server, and an extender process, all on 127.0.0.1.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use gpuledger_auth::identity::Role;
use gpuledger_ledger::pb;
use gpuledger_proto::allocator::v1 as api;

use super::FakeApiServer;
use super::scheduler::{ExtenderConfig, ExtenderTls};
use crate::bins::bin_path;
use crate::pki::{Identities, Pki};
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
    /// `https://127.0.0.1:<port>/gpuledger` of the extender.
    pub extender_url: String,
    /// `http://127.0.0.1:<port>` of the extender's `/metrics`, `/healthz`, `/readyz`.
    pub extender_http_url: String,
    /// How callers of this stack prove who they are (ServiceAccount tokens of the fake API
    /// server; TLS from its CA).
    pub ids: Identities,
    /// Run directory (logs, kubeconfig).
    pub dir: PathBuf,
    extender_port: u16,
    extender_http_port: u16,
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
        let ids = Identities::tokens(api.pki.clone(), api.store.clone());
        let allocs = Allocators::start_each(
            &dir,
            &etcd,
            &vec![etcd.endpoints_flag(); o.allocators.max(1)],
            "k",
            &refs,
            ids.clone(),
        )?;
        allocs.wait_leader(Duration::from_secs(30)).await?;
        let (extender_port, extender_http_port) = (free_port()?, free_port()?);
        let mut s = KubeStack {
            api,
            allocs,
            extender: None,
            extender_url: format!("https://127.0.0.1:{extender_port}/gpuledger"),
            extender_http_url: format!("http://127.0.0.1:{extender_http_port}"),
            ids,
            dir,
            extender_port,
            extender_http_port,
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
            format!("--http-listen=127.0.0.1:{}", self.extender_http_port),
            format!("--allocator={}", self.allocs.addrs.join(",")),
            format!("--kubeconfig={}", self.api.kubeconfig().display()),
        ];
        args.extend(extender_tls_flags(&self.ids.pki)?);
        args.extend(self.ids.flags(&Role::Extender)?);
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

    /// Give `namespace` a demote budget of 1 GPU-MiB-hour a day (spent in a fraction of a
    /// second by a pod holding GPU memory), demoting to a PriorityClass `class` of value -10
    /// created in the fake API server; written by an admin as `source`.
    pub async fn demote_budget(&self, namespace: &str, class: &str, source: &str) -> Result<()> {
        self.api
            .store
            .create(
                "scheduling.k8s.io/v1",
                "priorityclasses",
                "",
                serde_json::json!({"metadata": {"name": class}, "value": -10}),
            )
            .map_err(|e| anyhow::anyhow!("{}", e.message()))?;
        self.allocs
            .admin(0)?
            .set_budget(api::SetBudgetRequest {
                budget: Some(pb::BudgetSet {
                    namespace: namespace.into(),
                    unit: pb::BudgetUnit::GpuMibHours as i32,
                    amount: 1,
                    window: pb::BudgetWindow::Day as i32,
                    policy: pb::BudgetPolicy::Demote as i32,
                    priority_class: class.into(),
                    source: source.into(),
                    ..Default::default()
                }),
                remove: false,
            })
            .await?;
        Ok(())
    }

    /// Log directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The scheduler's `extenders[]` entry for this stack's extender: HTTPS, with the
    /// scheduler's client certificate.
    pub fn extender_config(&self) -> Result<ExtenderConfig> {
        Ok(ExtenderConfig::gpuledger(
            &self.extender_url,
            Some(scheduler_tls(&self.ids.pki)?),
        ))
    }
}

/// The extender's serving certificate and the CA of the scheduler's client certificate.
pub fn extender_tls_flags(pki: &Pki) -> Result<Vec<String>> {
    let (cert, key) = pki.server("extender")?;
    Ok(vec![
        format!("--tls-cert={}", cert.display()),
        format!("--tls-key={}", key.display()),
        format!("--client-ca={}", pki.ca_file().display()),
    ])
}

/// kube-scheduler's `tlsConfig` for calling the extender: the CA and its client certificate,
/// named `gpuledger-scheduler` as the installs issue it (the extender's
/// `--scheduler-client-names` default).
pub fn scheduler_tls(pki: &Pki) -> Result<ExtenderTls> {
    let (cert, key) = pki.peer("gpuledger-scheduler")?;
    Ok(ExtenderTls {
        ca: pki.ca_file().to_path_buf(),
        cert,
        key,
    })
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
