//! The Kubernetes control plane: an etcd of its own, kube-apiserver (static tokens, RBAC and
//! Node authorization) and kube-scheduler running the shipped scheduler configuration.
//!
//! There is no kube-controller-manager: nothing creates ServiceAccounts or their tokens (so the
//! `ServiceAccount` admission plugin is off), nothing marks silent nodes NotReady or evicts from
//! them and nothing lifts the not-ready taint of new nodes (so kubelet-less nodes stay
//! schedulable, and `TaintNodesByCondition` is off), nothing deletes pods for a kubelet that is
//! not there (tests force-delete them).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpuledger_testkit::{EtcdCluster, Proc, free_port};

use crate::bins::KubeBins;
use crate::kubectl::Kubectl;
use crate::pki::{Identity, Pki};

/// The shipped configuration of the cluster's default scheduler.
pub const SCHEDULER_CONFIG: &str = "deploy/scheduler/default-scheduler-config.yaml";

/// A running control plane. Dropping it stops every process.
pub struct ControlPlane {
    /// Certificates and identities.
    pub pki: Pki,
    /// `https://127.0.0.1:<port>`.
    pub server: String,
    /// The admin kubeconfig (kubectl, the tests).
    pub admin_kubeconfig: PathBuf,
    /// kube-scheduler, once started.
    pub scheduler: Option<Proc>,
    /// kube-apiserver.
    pub apiserver: Proc,
    bins: KubeBins,
    dir: PathBuf,
    _etcd: EtcdCluster,
}

impl ControlPlane {
    /// Start etcd and kube-apiserver under `dir`, with tokens for `identities`; wait until the
    /// API server is ready (its RBAC bootstrap roles included).
    pub async fn start(
        dir: &Path,
        bins: &KubeBins,
        identities: &[Identity],
    ) -> Result<ControlPlane> {
        let pki = Pki::create(&dir.join("pki"), identities)?;
        let etcd = EtcdCluster::start_in(&dir.join("kube-etcd"), 1).await?;
        let port = free_port()?;
        let server = format!("https://127.0.0.1:{port}");
        let args = vec![
            format!("--etcd-servers={}", etcd.endpoints_flag()),
            "--bind-address=127.0.0.1".into(),
            "--advertise-address=127.0.0.1".into(),
            format!("--secure-port={port}"),
            // 1.20 still serves an unauthenticated port (8080) unless told not to.
            "--insecure-port=0".into(),
            "--endpoint-reconciler-type=none".into(),
            format!("--cert-dir={}", dir.join("apiserver-certs").display()),
            format!("--tls-cert-file={}", pki.apiserver.cert.display()),
            format!("--tls-private-key-file={}", pki.apiserver.key.display()),
            format!("--token-auth-file={}", pki.tokens_file.display()),
            "--authorization-mode=Node,RBAC".into(),
            "--service-cluster-ip-range=10.96.0.0/24".into(),
            format!("--service-account-key-file={}", pki.sa_pub.display()),
            format!(
                "--service-account-signing-key-file={}",
                pki.sa_key.display()
            ),
            "--service-account-issuer=https://kubernetes.default.svc".into(),
            // No controller-manager: nobody makes the `default` ServiceAccounts the first plugin
            // requires, nobody lifts the not-ready taint the second puts on every new node.
            "--disable-admission-plugins=ServiceAccount,TaintNodesByCondition".into(),
            "--profiling=false".into(),
            "--v=1".into(),
        ];
        let apiserver = Proc::spawn(
            dir,
            "kube-apiserver",
            &bins.path("kube-apiserver"),
            args,
            vec![],
        )?;
        let admin_kubeconfig = pki.kubeconfig(&server, &Identity::Admin)?;
        let cp = ControlPlane {
            pki,
            server,
            admin_kubeconfig,
            scheduler: None,
            apiserver,
            bins: bins.clone(),
            dir: dir.to_path_buf(),
            _etcd: etcd,
        };
        cp.wait_ready(Duration::from_secs(60)).await?;
        Ok(cp)
    }

    /// kubectl (1.20.2, the same build) as the admin.
    pub fn kubectl(&self) -> Kubectl {
        Kubectl::new(self.bins.path("kubectl"), self.admin_kubeconfig.clone())
    }

    /// An admin client.
    pub async fn client(&self) -> Result<kube::Client> {
        let kc = kube::config::Kubeconfig::read_from(&self.admin_kubeconfig)?;
        let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
        Ok(kube::Client::try_from(cfg)?)
    }

    async fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let k = self.kubectl();
        let mut last = String::new();
        while Instant::now() < deadline {
            match k.run(&["get", "--raw", "/readyz"]) {
                Ok(o) if o.ok && o.stdout.trim() == "ok" => return Ok(()),
                Ok(o) => last = format!("{}{}", o.stdout, o.stderr),
                Err(e) => last = format!("{e:#}"),
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        bail!(
            "kube-apiserver not ready within {timeout:?}: {last}\n--- kube-apiserver log:\n{}",
            self.apiserver.log_tail(30)
        )
    }

    /// Start kube-scheduler with the shipped configuration, its extender at `extender_url`
    /// (`http://127.0.0.1:<port>/gpuledger`) and, if given, a client QPS of its own instead of
    /// the default 50; wait until it holds its leader lease.
    pub async fn start_scheduler(&mut self, extender_url: &str, qps: Option<u32>) -> Result<()> {
        let mut config = scheduler_config(
            &crate::repo_root().join(SCHEDULER_CONFIG),
            &self.pki.kubeconfig(&self.server, &Identity::Scheduler)?,
            extender_url,
        )?;
        if let Some(q) = qps {
            anyhow::ensure!(
                config.contains("\nclientConnection:\n"),
                "{SCHEDULER_CONFIG} has no clientConnection section to set the QPS in"
            );
            config = config.replacen(
                "\nclientConnection:\n",
                &format!("\nclientConnection:\n  qps: {q}\n  burst: {}\n", 2 * q),
                1,
            );
        }
        let path = self.dir.join("kube-scheduler.yaml");
        std::fs::write(&path, config)?;
        let args = vec![
            format!("--config={}", path.display()),
            // 1.20 serves an unauthenticated port (10251) unless told not to.
            "--port=0".into(),
            format!("--secure-port={}", free_port()?),
            "--bind-address=127.0.0.1".into(),
            "--v=2".into(),
        ];
        self.scheduler = Some(Proc::spawn(
            &self.dir,
            "kube-scheduler",
            &self.bins.path("kube-scheduler"),
            args,
            vec![],
        )?);
        let k = self.kubectl();
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            let o = k.run(&[
                "-n",
                "kube-system",
                "get",
                "lease",
                "kube-scheduler",
                "-o",
                "jsonpath={.spec.holderIdentity}",
            ])?;
            if o.ok && !o.stdout.trim().is_empty() {
                return Ok(());
            }
            if let Some(p) = self.scheduler.as_mut()
                && let Some(st) = p.exited()
            {
                bail!("kube-scheduler exited ({st}):\n{}", p.log_tail(30));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let tail = self
            .scheduler
            .as_ref()
            .map(|p| p.log_tail(30))
            .unwrap_or_default();
        bail!("kube-scheduler did not take its leader lease within 60 s:\n{tail}")
    }

    /// The run directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// The shipped KubeSchedulerConfiguration made runnable here: the API version 1.20 reads
/// (`v1beta1`; `v1` is 1.25+), this run's kubeconfig and extender address. Everything else is
/// the file as shipped; a change to the lines replaced here fails loudly.
pub fn scheduler_config(shipped: &Path, kubeconfig: &Path, extender_url: &str) -> Result<String> {
    let text = std::fs::read_to_string(shipped)
        .with_context(|| format!("reading {}", shipped.display()))?;
    let swaps = [
        (
            "apiVersion: kubescheduler.config.k8s.io/v1\n",
            "apiVersion: kubescheduler.config.k8s.io/v1beta1\n".to_string(),
        ),
        (
            "kubeconfig: /etc/kubernetes/scheduler.conf\n",
            format!("kubeconfig: {}\n", kubeconfig.display()),
        ),
        (
            "urlPrefix: http://127.0.0.1:32788/gpuledger\n",
            format!("urlPrefix: {extender_url}\n"),
        ),
    ];
    let mut out = text;
    for (from, to) in swaps {
        let n = out.matches(from).count();
        if n != 1 {
            bail!(
                "{}: expected the line {:?} once, found it {n} times (the shipped configuration changed; update e2e/src/control_plane.rs)",
                shipped.display(),
                from.trim()
            );
        }
        out = out.replace(from, &to);
    }
    Ok(out)
}
