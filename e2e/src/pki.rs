//! The cluster's certificates, identities and kubeconfigs: a CA of the run signs the API
//! server's serving certificate; the API server authenticates static tokens, one per identity
//! below, authorized by the real RBAC and Node authorizers, and issues the ServiceAccount
//! tokens (audience `gpuledger`) that the extender and the operator's CLI call the allocator
//! with; the allocator checks those with the API server's TokenReview. gpuledger's own
//! certificates are the shipped script's ([`crate::certs`]).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use base64::Engine;
use rand::Rng;
use rcgen::KeyPair;

/// The namespace of gpuledger's ServiceAccounts in the shipped manifests.
pub const GPULEDGER_NAMESPACE: &str = "gpuledger-system";

/// Who a component is to the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// The test itself and kubectl: `system:masters`.
    Admin,
    /// kube-scheduler: the built-in `system:kube-scheduler` user and its bootstrap RBAC.
    Scheduler,
    /// kube-controller-manager: `system:kube-controller-manager` and its bootstrap RBAC.
    ControllerManager,
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
            Identity::ControllerManager => ("system:kube-controller-manager".into(), vec![]),
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
            Identity::ControllerManager => "kube-controller-manager".into(),
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
    /// The CA certificate (PEM) of the API server's serving certificate.
    pub ca_pem: String,
    /// The CA certificate file.
    pub ca_file: PathBuf,
    /// kube-apiserver's serving certificate (127.0.0.1, localhost).
    pub apiserver: CertFiles,
    /// ServiceAccount token signing key (ECDSA P-256).
    pub sa_key: PathBuf,
    /// Its public half, which the API server verifies tokens with.
    pub sa_pub: PathBuf,
    /// `--token-auth-file` of the API server.
    pub tokens_file: PathBuf,
    tokens: Vec<(Identity, String)>,
}

impl Pki {
    /// Make everything under `<run>/pki`, with a token for each of `identities` (and the admin).
    pub fn create(run: &Path, identities: &[Identity]) -> Result<Pki> {
        let tls = gpuledger_testkit::pki::Pki::new(run)?;
        let dir = run.join("pki");
        let write = |name: &str, text: &str| -> Result<PathBuf> {
            let p = dir.join(name);
            std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))?;
            Ok(p)
        };
        let files = |(cert, key): (PathBuf, PathBuf)| CertFiles { cert, key };
        let apiserver = files(tls.server("apiserver")?);
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
        let ca_file = tls.ca_file().to_path_buf();
        let ca_pem = std::fs::read_to_string(&ca_file)
            .with_context(|| format!("reading {}", ca_file.display()))?;
        Ok(Pki {
            dir: dir.clone(),
            ca_file,
            ca_pem,
            apiserver,
            sa_key,
            sa_pub,
            tokens_file: write("tokens.csv", &csv)?,
            tokens,
        })
    }

    /// Ask the API server for a token of gpuledger's ServiceAccount `account` with audience
    /// `gpuledger` (TokenRequest, as `kubectl create token` does; a projected token in a pod is
    /// the same thing) and write it to a file of its own; the file.
    pub async fn request_token(&self, client: &kube::Client, account: &str) -> Result<PathBuf> {
        use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
        use k8s_openapi::api::core::v1::ServiceAccount;
        let accounts: kube::Api<ServiceAccount> =
            kube::Api::namespaced(client.clone(), GPULEDGER_NAMESPACE);
        let req = TokenRequest {
            spec: TokenRequestSpec {
                audiences: vec![gpuledger_auth::token::AUDIENCE.to_string()],
                expiration_seconds: Some(24 * 3600),
                ..Default::default()
            },
            ..Default::default()
        };
        let issued = accounts
            .create_token_request(account, &Default::default(), &req)
            .await
            .with_context(|| format!("requesting a token of ServiceAccount {account}"))?;
        let token = issued
            .status
            .map(|s| s.token)
            .filter(|t| !t.is_empty())
            .with_context(|| format!("the API server issued no token for {account}"))?;
        let p = self.dir.join(format!("{account}.token"));
        std::fs::write(&p, token).with_context(|| format!("writing {}", p.display()))?;
        Ok(p)
    }

    /// The bearer token of `who`.
    pub fn token(&self, who: &Identity) -> Result<&str> {
        self.tokens
            .iter()
            .find(|(i, _)| i == who)
            .map(|(_, t)| t.as_str())
            .with_context(|| format!("no token was made for {who:?}"))
    }

    /// The CA as base64 of the PEM (a kubeconfig's `certificate-authority-data`).
    fn ca_bundle(&self) -> String {
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
