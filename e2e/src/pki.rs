//! Certificates, identities and kubeconfigs: the one place where the tier decides how every
//! component proves who it is and whom it trusts. Today the API server serves TLS from a CA made
//! here and authenticates static tokens (one per identity below, authorized by the real RBAC and
//! Node authorizers); gpuledger's own listeners are plain HTTP and gRPC, except the webhook
//! (HTTPS, as the API server demands). When gpuledger's listeners take TLS and tokens, their
//! flags and certificates go here too.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use base64::Engine;
use rand::Rng;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa, KeyPair,
};

/// The namespace of gpuledger's ServiceAccounts in the shipped manifests.
pub const GPULEDGER_NAMESPACE: &str = "gpuledger-system";

/// Who a component is to the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// The test itself and kubectl: `system:masters`.
    Admin,
    /// kube-scheduler: the built-in `system:kube-scheduler` user and its bootstrap RBAC.
    Scheduler,
    /// A kubelet: `system:node:<name>` in `system:nodes` (the Node authorizer's subjects).
    Node(String),
    /// A gpuledger component by its shipped ServiceAccount name (`gpuledger-allocator`, …):
    /// authorized only by the shipped ClusterRoles.
    ServiceAccount(String),
}

impl Identity {
    /// (user, groups) as the API server sees them.
    pub fn user(&self) -> (String, Vec<String>) {
        match self {
            Identity::Admin => ("e2e-admin".into(), vec!["system:masters".into()]),
            Identity::Scheduler => ("system:kube-scheduler".into(), vec![]),
            Identity::Node(n) => (format!("system:node:{n}"), vec!["system:nodes".into()]),
            Identity::ServiceAccount(sa) => (
                format!("system:serviceaccount:{GPULEDGER_NAMESPACE}:{sa}"),
                vec![
                    "system:serviceaccounts".into(),
                    format!("system:serviceaccounts:{GPULEDGER_NAMESPACE}"),
                ],
            ),
        }
    }

    fn file_stem(&self) -> String {
        match self {
            Identity::Admin => "admin".into(),
            Identity::Scheduler => "kube-scheduler".into(),
            Identity::Node(n) => format!("node-{n}"),
            Identity::ServiceAccount(sa) => sa.clone(),
        }
    }
}

/// A PEM certificate and its key, as files.
#[derive(Debug, Clone)]
pub struct CertFiles {
    /// Certificate chain.
    pub cert: PathBuf,
    /// Private key (PKCS#8).
    pub key: PathBuf,
}

/// The run's CA, serving certificates, ServiceAccount signing key and token file.
pub struct Pki {
    dir: PathBuf,
    /// The CA certificate (PEM) every client trusts.
    pub ca_pem: String,
    /// The CA certificate file.
    pub ca_file: PathBuf,
    /// kube-apiserver's serving certificate (127.0.0.1, localhost).
    pub apiserver: CertFiles,
    /// The admission webhook's serving certificate (127.0.0.1).
    pub webhook: CertFiles,
    /// ServiceAccount token signing key (ECDSA P-256).
    pub sa_key: PathBuf,
    /// Its public half, which the API server verifies tokens with.
    pub sa_pub: PathBuf,
    /// `--token-auth-file` of the API server.
    pub tokens_file: PathBuf,
    tokens: Vec<(Identity, String)>,
}

impl Pki {
    /// Make everything under `dir`, with a token for each of `identities` (and the admin).
    pub fn create(dir: &Path, identities: &[Identity]) -> Result<Pki> {
        std::fs::create_dir_all(dir)?;
        let write = |name: &str, text: &str| -> Result<PathBuf> {
            let p = dir.join(name);
            std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))?;
            Ok(p)
        };
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;
        let leaf = |name: &str, sans: &[&str]| -> Result<CertFiles> {
            let mut p =
                CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())?;
            p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
            let key = KeyPair::generate()?;
            let cert = p.signed_by(&key, &ca)?;
            Ok(CertFiles {
                cert: write(&format!("{name}.crt"), &cert.pem())?,
                key: write(&format!("{name}.key"), &key.serialize_pem())?,
            })
        };
        let apiserver = leaf(
            "apiserver",
            &[
                "127.0.0.1",
                "localhost",
                "kubernetes",
                "kubernetes.default.svc",
            ],
        )?;
        let webhook = leaf("webhook", &["127.0.0.1", "localhost"])?;
        let sa = KeyPair::generate()?;
        let sa_key = write("sa.key", &sa.serialize_pem())?;
        let sa_pub = write("sa.pub", &sa.public_key_pem())?;
        let mut all = vec![Identity::Admin];
        all.extend(
            identities
                .iter()
                .filter(|i| **i != Identity::Admin)
                .cloned(),
        );
        let mut rng = rand::rng();
        let tokens: Vec<(Identity, String)> = all
            .into_iter()
            .map(|i| {
                let t: String = (0..32)
                    .map(|_| {
                        char::from(b"abcdefghijklmnopqrstuvwxyz0123456789"[rng.random_range(0..36)])
                    })
                    .collect();
                (i, t)
            })
            .collect();
        let csv: String = tokens
            .iter()
            .map(|(i, t)| {
                let (user, groups) = i.user();
                format!("{t},{user},{user},\"{}\"\n", groups.join(","))
            })
            .collect();
        let ca_pem = ca.pem();
        Ok(Pki {
            dir: dir.to_path_buf(),
            ca_file: write("ca.crt", &ca_pem)?,
            ca_pem,
            apiserver,
            webhook,
            sa_key,
            sa_pub,
            tokens_file: write("tokens.csv", &csv)?,
            tokens,
        })
    }

    /// The bearer token of `who`.
    pub fn token(&self, who: &Identity) -> Result<&str> {
        self.tokens
            .iter()
            .find(|(i, _)| i == who)
            .map(|(_, t)| t.as_str())
            .with_context(|| format!("no token was made for {who:?}"))
    }

    /// The CA as a webhook's `caBundle` (base64 of the PEM).
    pub fn ca_bundle(&self) -> String {
        base64::engine::general_purpose::STANDARD.encode(&self.ca_pem)
    }

    /// Write (once) and return a kubeconfig for `who` against `server`.
    pub fn kubeconfig(&self, server: &str, who: &Identity) -> Result<PathBuf> {
        let p = self.dir.join(format!("{}.kubeconfig", who.file_stem()));
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: e2e\n  cluster:\n    server: {server}\n    \
             certificate-authority-data: {ca}\nusers:\n- name: {user}\n  user:\n    token: {token}\n\
             contexts:\n- name: e2e\n  context:\n    cluster: e2e\n    user: {user}\ncurrent-context: e2e\n",
            ca = self.ca_bundle(),
            user = who.file_stem(),
            token = self.token(who)?,
        );
        std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))?;
        Ok(p)
    }
}
