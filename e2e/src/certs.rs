//! gpuledger's certificates as an operator makes them: `deploy/scripts/gpuledger-certs.sh`,
//! run against the cluster after the shipped overlay is applied, creates the CA, the serving
//! and client certificates, installs them as Secrets and the ConfigMap `gpuledger-ca`, and
//! sets the webhooks' `caBundle`. The tier reads them back from the API server (what a pod
//! would mount) and gives the files to the processes. Callers the script makes no
//! certificate for (node agents, the allocator replicas forwarding to each other, the tests'
//! own clients) get client certificates from the same CA, as a certificate-mode install
//! issues them.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use gpuledger_testkit::pki::{Identities, Pki as TlsPki};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::Api;

use crate::bins::KubeBins;
use crate::pki::{CertFiles, GPULEDGER_NAMESPACE};

/// The shipped script.
pub const SCRIPT: &str = "deploy/scripts/gpuledger-certs.sh";

/// The certificates the shipped script installed, as files.
pub struct Shipped {
    /// The CA (ConfigMap `gpuledger-ca`) every client of the allocator and kube-scheduler trust.
    pub ca_file: PathBuf,
    /// The extender's serving certificate (Secret `gpuledger-webhook-tls`): its webhook and its
    /// scheduler-facing port.
    pub extender: CertFiles,
    /// The allocator's serving certificate (Secret `gpuledger-allocator-tls`).
    pub allocator: CertFiles,
    /// kube-scheduler's client certificate for the extender (Secret `gpuledger-scheduler-tls`).
    pub scheduler: CertFiles,
    /// The same CA, to issue the client certificates the script does not make.
    pub tls: Arc<TlsPki>,
}

impl Shipped {
    /// Run the shipped script as the admin of `kubeconfig` with the cluster's kubectl, then read
    /// what it installed back from the API server into `<dir>/gpuledger-tls/`.
    pub async fn install(
        dir: &Path,
        bins: &KubeBins,
        kubeconfig: &Path,
        client: &kube::Client,
    ) -> Result<Shipped> {
        let script = crate::repo_root().join(SCRIPT);
        // The script keeps its CA (and key) in --out-dir, as an operator keeps them for renewals.
        let out = dir.join("gpuledger-certs");
        let path = format!(
            "{}:{}",
            bins.dir().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let o = Command::new("bash")
            .arg(&script)
            .arg("--out-dir")
            .arg(&out)
            .env("PATH", path)
            .env("KUBECONFIG", kubeconfig)
            .output()
            .with_context(|| format!("running {}", script.display()))?;
        if !o.status.success() {
            bail!(
                "{SCRIPT} failed ({}):\n{}{}",
                o.status,
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        let files = dir.join("gpuledger-tls");
        std::fs::create_dir_all(&files)?;
        let secrets: Api<Secret> = Api::namespaced(client.clone(), GPULEDGER_NAMESPACE);
        let leaf = |name: &'static str| {
            let secrets = secrets.clone();
            let files = files.clone();
            async move {
                let s = secrets
                    .get(name)
                    .await
                    .with_context(|| format!("{SCRIPT} installed no Secret {name}"))?;
                let data = s.data.unwrap_or_default();
                let write = |key: &str| -> Result<PathBuf> {
                    let v = data
                        .get(key)
                        .with_context(|| format!("Secret {name} has no {key}"))?;
                    let p = files.join(format!("{name}.{key}"));
                    std::fs::write(&p, &v.0)?;
                    Ok(p)
                };
                anyhow::Ok(CertFiles {
                    cert: write("tls.crt")?,
                    key: write("tls.key")?,
                })
            }
        };
        let extender = leaf("gpuledger-webhook-tls").await?;
        let allocator = leaf("gpuledger-allocator-tls").await?;
        let scheduler = leaf("gpuledger-scheduler-tls").await?;
        let maps: Api<ConfigMap> = Api::namespaced(client.clone(), GPULEDGER_NAMESPACE);
        let ca = maps
            .get("gpuledger-ca")
            .await
            .with_context(|| format!("{SCRIPT} installed no ConfigMap gpuledger-ca"))?
            .data
            .and_then(|d| d.get("ca.crt").cloned())
            .context("ConfigMap gpuledger-ca has no ca.crt")?;
        let ca_file = files.join("ca.crt");
        std::fs::write(&ca_file, &ca)?;
        let tls = TlsPki::adopt(
            dir,
            &ca_file,
            &out.join("ca.key"),
            &[("allocator", (allocator.cert.clone(), allocator.key.clone()))],
        )?;
        Ok(Shipped {
            ca_file,
            extender,
            allocator,
            scheduler,
            tls,
        })
    }

    /// How gpuledger's callers prove who they are to the allocator: client certificates of the
    /// shipped CA (the allocator's own serving certificate is the script's).
    pub fn identities(&self) -> Identities {
        Identities::certs(self.tls.clone())
    }

    /// The flags with which a gpuledger binary calls the allocator with the token in `file`.
    pub fn token_flags(&self, file: &Path) -> Vec<String> {
        vec![
            format!("--allocator-ca={}", self.ca_file.display()),
            format!("--token-file={}", file.display()),
        ]
    }
}
