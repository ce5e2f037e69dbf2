//! The Kubernetes control plane: an etcd of its own (the 3.6 that `e2e/kube/build.sh` builds),
//! kube-apiserver (static tokens, RBAC and Node authorization, NodeRestriction),
//! kube-controller-manager (ServiceAccounts and the root CA, garbage collection, node
//! lifecycle, the resource-claim controller) and kube-scheduler running the shipped scheduler
//! configuration.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpuledger_testkit::{EtcdCluster, Proc, free_port};

use crate::bins::KubeBins;
use crate::kubectl::Kubectl;
use crate::pki::{CertFiles, Identity, Pki};

/// The shipped configuration of the cluster's default scheduler.
pub const SCHEDULER_CONFIG: &str = "deploy/scheduler/default-scheduler-config.yaml";

/// Which shipped scheduler runs, as whom, and the Lease it takes once it leads.
#[derive(Debug, Clone, Copy)]
pub struct SchedulerFlavor {
    /// The shipped configuration.
    pub config: &'static str,
    /// Who it runs as.
    pub identity: fn() -> Identity,
    /// Its leader Lease: (namespace, name).
    pub lease: (&'static str, &'static str),
}

/// The cluster's default scheduler calling the extender.
pub const DEFAULT_SCHEDULER: SchedulerFlavor = SchedulerFlavor {
    config: SCHEDULER_CONFIG,
    identity: || Identity::Scheduler,
    lease: ("kube-system", "kube-scheduler"),
};

/// The DRA overlay's second scheduler (`gpuledger-scheduler`): DynamicResources and the
/// extender, as its ServiceAccount (the overlay's RBAC).
pub const DRA_SCHEDULER: SchedulerFlavor = SchedulerFlavor {
    config: "deploy/scheduler/dra-scheduler-config.yaml",
    identity: || Identity::ServiceAccount(DRA_SCHEDULER_SA.into()),
    lease: ("gpuledger-system", "gpuledger-scheduler"),
};

/// The name the extender's shipped certificate carries (its Service's DNS name).
const EXTENDER_SERVICE_NAME: &str = "gpuledger-extender.gpuledger-system.svc";

/// The ServiceAccount of the DRA overlay's scheduler.
pub const DRA_SCHEDULER_SA: &str = "gpuledger-scheduler";

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
    /// kube-controller-manager.
    pub controller_manager: Option<Proc>,
    /// kube-apiserver.
    pub apiserver: Proc,
    bins: KubeBins,
    dir: PathBuf,
    _etcd: EtcdCluster,
}

impl ControlPlane {
    /// Start etcd and kube-apiserver under `dir`, with tokens for `identities`; wait until the
    /// API server is ready (its RBAC bootstrap roles included); then kube-controller-manager,
    /// with each controller's client QPS `controller_qps` (None: its default, 20).
    pub async fn start(
        dir: &Path,
        bins: &KubeBins,
        identities: &[Identity],
        controller_qps: Option<u32>,
    ) -> Result<ControlPlane> {
        let pki = Pki::create(dir, identities)?;
        let etcd =
            EtcdCluster::start_in_with(&dir.join("kube-etcd"), 1, &bins.path("etcd")).await?;
        let port = free_port()?;
        let server = format!("https://127.0.0.1:{port}");
        let mut args = vec![
            format!("--etcd-servers={}", etcd.endpoints_flag()),
            "--bind-address=127.0.0.1".into(),
            "--advertise-address=127.0.0.1".into(),
            format!("--secure-port={port}"),
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
            // As clusters run it (kubeadm turns it on): a kubelet may change only its own
            // node and the pods bound to it.
            "--enable-admission-plugins=NodeRestriction".into(),
            "--profiling=false".into(),
            "--v=1".into(),
        ];
        args.extend(etcd_tls_flags(&etcd)?);
        args.extend(bins.feature_gate_flags()?);
        let apiserver = Proc::spawn(
            dir,
            "kube-apiserver",
            &bins.path("kube-apiserver"),
            args,
            vec![],
        )?;
        let admin_kubeconfig = pki.kubeconfig(&server, &Identity::Admin)?;
        let mut cp = ControlPlane {
            pki,
            server,
            admin_kubeconfig,
            scheduler: None,
            controller_manager: None,
            apiserver,
            bins: bins.clone(),
            dir: dir.to_path_buf(),
            _etcd: etcd,
        };
        cp.wait_ready(Duration::from_secs(60)).await?;
        cp.start_controller_manager(controller_qps).await?;
        Ok(cp)
    }

    /// Start kube-controller-manager with every default controller (ServiceAccounts and their
    /// `kube-root-ca.crt`, garbage collection, node lifecycle, the resource-claim controller,
    /// ...) as `system:kube-controller-manager`, each controller with its own ServiceAccount as
    /// clusters run it; wait until the `default` ServiceAccount of `default` exists. `qps`:
    /// `--kube-api-qps` (burst twice that) instead of the default 20.
    async fn start_controller_manager(&mut self, qps: Option<u32>) -> Result<()> {
        let kc = self
            .pki
            .kubeconfig(&self.server, &Identity::ControllerManager)?;
        let mut args = vec![
            format!("--kubeconfig={}", kc.display()),
            format!("--authentication-kubeconfig={}", kc.display()),
            format!("--authorization-kubeconfig={}", kc.display()),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={}", free_port()?),
            format!(
                "--cert-dir={}",
                self.dir.join("controller-manager-certs").display()
            ),
            format!(
                "--service-account-private-key-file={}",
                self.pki.sa_key.display()
            ),
            format!("--root-ca-file={}", self.pki.ca_file.display()),
            "--use-service-account-credentials=true".into(),
            // One instance: no lease to wait for at every start.
            "--leader-elect=false".into(),
            "--profiling=false".into(),
            "--v=1".into(),
        ];
        args.extend(self.bins.feature_gate_flags()?);
        if let Some(q) = qps {
            args.extend([
                format!("--kube-api-qps={q}"),
                format!("--kube-api-burst={}", 2 * q),
            ]);
        }
        self.controller_manager = Some(Proc::spawn(
            &self.dir,
            "kube-controller-manager",
            &self.bins.path("kube-controller-manager"),
            args,
            vec![],
        )?);
        let k = self.kubectl();
        let started = self.controller_manager.as_mut().context("just started")?;
        until_up(started, "make the `default` ServiceAccount", || {
            Ok(
                k.run(&["-n", "default", "get", "serviceaccount", "default"])?
                    .ok,
            )
        })
        .await
    }

    /// kubectl (the cluster's own version) as the admin.
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
    /// (`https://127.0.0.1:<port>/gpuledger`, called with the run's scheduler client
    /// certificate the shipped script made) and, if given, a client QPS of its own instead of the default 50; wait
    /// until it holds its leader lease.
    pub async fn start_scheduler(
        &mut self,
        extender_url: &str,
        qps: Option<u32>,
        certs: &crate::certs::Shipped,
        flavor: &SchedulerFlavor,
        extra: &[String],
    ) -> Result<()> {
        let mut config = scheduler_config(
            &crate::repo_root().join(flavor.config),
            &Runnable {
                kubeconfig: &self.pki.kubeconfig(&self.server, &(flavor.identity)())?,
                extender_url,
                client: &certs.scheduler,
                ca: &certs.ca_file,
            },
        )?;
        if let Some(q) = qps {
            anyhow::ensure!(
                config.contains("\nclientConnection:\n"),
                "{} has no clientConnection section to set the QPS in",
                flavor.config
            );
            config = config.replacen(
                "\nclientConnection:\n",
                &format!("\nclientConnection:\n  qps: {q}\n  burst: {}\n", 2 * q),
                1,
            );
        }
        let path = self.dir.join("kube-scheduler.yaml");
        std::fs::write(&path, config)?;
        let mut args = vec![
            format!("--config={}", path.display()),
            format!("--secure-port={}", free_port()?),
            "--bind-address=127.0.0.1".into(),
            "--v=2".into(),
        ];
        args.extend(self.bins.feature_gate_flags()?);
        args.extend(extra.iter().cloned());
        self.scheduler = Some(Proc::spawn(
            &self.dir,
            "kube-scheduler",
            &self.bins.path("kube-scheduler"),
            args,
            vec![],
        )?);
        let k = self.kubectl();
        let started = self.scheduler.as_mut().context("just started")?;
        until_up(started, "take its leader lease", || {
            let o = k.run(&[
                "-n",
                flavor.lease.0,
                "get",
                "lease",
                flavor.lease.1,
                "-o",
                "jsonpath={.spec.holderIdentity}",
            ])?;
            Ok(o.ok && !o.stdout.trim().is_empty())
        })
        .await
    }

    /// The run directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Wait up to 60 s until `ready` says the component `p` started is up, failing at once with
/// its log if it exits, or with its log and what it did not do (`what`) at the deadline.
async fn until_up(p: &mut Proc, what: &str, ready: impl Fn() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if ready()? {
            return Ok(());
        }
        if let Some(st) = p.exited() {
            bail!("{} exited ({st}):\n{}", p.name, p.log_tail(30));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    bail!("{} did not {what} within 60 s:\n{}", p.name, p.log_tail(30))
}

/// kube-apiserver's flags for the test kit's etcd, which serves TLS and demands a client
/// certificate: the files gpuledger's allocator is given, under the API server's flag names.
fn etcd_tls_flags(etcd: &EtcdCluster) -> Result<Vec<String>> {
    etcd.tls_flags()
        .into_iter()
        .map(|f| {
            let (name, value) = f
                .split_once('=')
                .with_context(|| format!("etcd flag {f:?} has no value"))?;
            let apiserver = match name {
                "--etcd-ca" => "--etcd-cafile",
                "--etcd-cert" => "--etcd-certfile",
                "--etcd-key" => "--etcd-keyfile",
                _ => bail!("no kube-apiserver flag for the etcd flag {name}"),
            };
            Ok(format!("{apiserver}={value}"))
        })
        .collect()
}

/// What [`scheduler_config`] puts into the shipped configuration.
#[derive(Debug, Clone, Copy)]
pub struct Runnable<'a> {
    /// kube-scheduler's kubeconfig (`clientConnection.kubeconfig`).
    pub kubeconfig: &'a Path,
    /// The extender's `urlPrefix`.
    pub extender_url: &'a str,
    /// kube-scheduler's client certificate for the extender (`tlsConfig.certFile`, `keyFile`).
    pub client: &'a CertFiles,
    /// The CA of the extender's serving certificate (`tlsConfig.caFile`).
    pub ca: &'a Path,
}

/// The shipped KubeSchedulerConfiguration made runnable here: this run's kubeconfig, extender
/// address and the files of the extender's `tlsConfig`. Everything else is the file as shipped
/// (`v1`, HTTPS with a client certificate, the `serverName` the extender's certificate names);
/// a change to the lines replaced here fails loudly.
pub fn scheduler_config(shipped: &Path, run: &Runnable<'_>) -> Result<String> {
    let mut text = std::fs::read_to_string(shipped)
        .with_context(|| format!("reading {}", shipped.display()))?;
    // A configuration for a scheduler in the cluster reaches the API server in-cluster; this
    // one runs as a process of the test, with a kubeconfig.
    if !text.lines().any(|l| l.starts_with("clientConnection:")) {
        text.push_str("clientConnection:\n  kubeconfig: in-cluster\n");
    }
    // The extender is called at 127.0.0.1 here, not at the Service name of the shipped
    // urlPrefix: check its certificate for that name, as a configuration that names its
    // server explicitly does.
    if !text.contains("serverName:") {
        let ca = text
            .lines()
            .find(|l| l.trim_start().starts_with("caFile:"))
            .map(str::to_string);
        if let Some(ca) = ca {
            let lead = &ca[..ca.len() - ca.trim_start().len()];
            text = text.replacen(
                &ca,
                &format!("{ca}\n{lead}serverName: {EXTENDER_SERVICE_NAME}"),
                1,
            );
        }
    }
    runnable(&text, run).with_context(|| {
        format!(
            "{}: the shipped configuration changed; update e2e/src/control_plane.rs",
            shipped.display()
        )
    })
}

/// [`scheduler_config`] on the file's text.
fn runnable(text: &str, run: &Runnable<'_>) -> Result<String> {
    let mut out = Vec::new();
    let mut seen: std::collections::BTreeMap<&str, usize> = Default::default();
    // Indentation of the `tlsConfig:` line while inside that block.
    let mut tls_block: Option<usize> = None;
    for line in text.lines() {
        let indent = line.len() - line.trim_start().len();
        let body = line.trim_start().trim_start_matches("- ");
        let key = body.split_once(':').map(|(k, _)| k.trim()).unwrap_or("");
        if tls_block.is_some_and(|i| indent <= i && !body.is_empty() && !body.starts_with('#')) {
            tls_block = None;
        }
        let lead = &line[..line.len() - body.len()];
        let value = match (tls_block.is_some(), key) {
            (false, "apiVersion") if indent == 0 => {
                if body.trim() != "apiVersion: kubescheduler.config.k8s.io/v1" {
                    bail!("expected `apiVersion: kubescheduler.config.k8s.io/v1`, found {body:?}");
                }
                *seen.entry(key).or_default() += 1;
                None
            }
            (false, "kubeconfig") => Some(run.kubeconfig.display().to_string()),
            (false, "urlPrefix") => Some(run.extender_url.to_string()),
            (false, "enableHTTPS") => {
                if body.trim() != "enableHTTPS: true" {
                    bail!(
                        "the extender is called without `enableHTTPS: true` ({body:?}), but its \
                         scheduler-facing port serves HTTPS only"
                    );
                }
                None
            }
            (false, "tlsConfig") => {
                tls_block = Some(indent);
                None
            }
            (true, "certFile") => Some(run.client.cert.display().to_string()),
            (true, "keyFile") => Some(run.client.key.display().to_string()),
            (true, "caFile") => Some(run.ca.display().to_string()),
            (true, "insecure") if body.trim() != "insecure: false" => {
                bail!("the extender's tlsConfig skips verification ({body:?})")
            }
            (true, k @ ("certData" | "keyData" | "caData")) => {
                bail!("the extender's tlsConfig carries {k} inline; expected file paths")
            }
            _ => None,
        };
        match value {
            Some(v) => {
                *seen.entry(key).or_default() += 1;
                out.push(format!("{lead}{key}: {v}"));
            }
            None => {
                if matches!(key, "enableHTTPS" | "tlsConfig") {
                    *seen.entry(key).or_default() += 1;
                }
                out.push(line.to_string());
            }
        }
    }
    for key in [
        "apiVersion",
        "kubeconfig",
        "urlPrefix",
        "enableHTTPS",
        "tlsConfig",
        "certFile",
        "keyFile",
        "caFile",
    ] {
        let n = seen.get(key).copied().unwrap_or(0);
        if n != 1 {
            bail!(
                "expected `{key}:` once (one extender, called over HTTPS with a client certificate), found it {n} times"
            );
        }
    }
    Ok(out.join("\n") + "\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<'a>(client: &'a CertFiles) -> Runnable<'a> {
        Runnable {
            kubeconfig: Path::new("/run/scheduler.kubeconfig"),
            extender_url: "https://127.0.0.1:4443/gpuledger",
            client,
            ca: Path::new("/run/ca.crt"),
        }
    }

    #[test]
    fn the_shipped_configuration_calls_the_extender_with_this_runs_certificates() -> Result<()> {
        let client = CertFiles {
            cert: "/run/sched.crt".into(),
            key: "/run/sched.key".into(),
        };
        let out = scheduler_config(&crate::repo_root().join(SCHEDULER_CONFIG), &run(&client))?;
        for line in [
            "apiVersion: kubescheduler.config.k8s.io/v1",
            "      serverName: gpuledger-extender.gpuledger-system.svc",
            "  kubeconfig: /run/scheduler.kubeconfig",
            "  - urlPrefix: https://127.0.0.1:4443/gpuledger",
            "    enableHTTPS: true",
            "      certFile: /run/sched.crt",
            "      keyFile: /run/sched.key",
            "      caFile: /run/ca.crt",
        ] {
            assert!(out.lines().any(|l| l == line), "no {line:?} in:\n{out}");
        }
        let node_files = out
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .any(|l| l.contains("/etc/kubernetes"));
        assert!(
            !node_files,
            "a path of the control-plane node is left:\n{out}"
        );
        Ok(())
    }

    #[test]
    fn the_dra_configuration_runs_with_a_kubeconfig_and_checks_the_services_name() -> Result<()> {
        let client = CertFiles {
            cert: "/run/sched.crt".into(),
            key: "/run/sched.key".into(),
        };
        let out = scheduler_config(
            &crate::repo_root().join(DRA_SCHEDULER.config),
            &run(&client),
        )?;
        for line in [
            "  kubeconfig: /run/scheduler.kubeconfig",
            "      serverName: gpuledger-extender.gpuledger-system.svc",
            "      caFile: /run/ca.crt",
            "          bindingTimeout: 120s",
            "      - name: gpuledger.io/dra",
        ] {
            assert!(out.lines().any(|l| l == line), "no {line:?} in:\n{out}");
        }
        Ok(())
    }

    #[test]
    fn a_configuration_that_calls_the_extender_over_plain_http_is_refused() {
        let client = CertFiles {
            cert: "/c".into(),
            key: "/k".into(),
        };
        let plain = "apiVersion: kubescheduler.config.k8s.io/v1\nclientConnection:\n  kubeconfig: /k\n\
                     extenders:\n  - urlPrefix: http://127.0.0.1:1/gpuledger\n    enableHTTPS: false\n";
        let err = runnable(plain, &run(&client)).map(|_| ()).unwrap_err();
        assert!(format!("{err:#}").contains("enableHTTPS"), "{err:#}");
        let no_client_cert = "apiVersion: kubescheduler.config.k8s.io/v1\nclientConnection:\n  kubeconfig: /k\n\
                     extenders:\n  - urlPrefix: https://127.0.0.1:1/gpuledger\n    enableHTTPS: true\n    tlsConfig:\n      caFile: /ca\n    weight: 1\n";
        let err = runnable(no_client_cert, &run(&client))
            .map(|_| ())
            .unwrap_err();
        assert!(format!("{err:#}").contains("certFile"), "{err:#}");
    }
}
