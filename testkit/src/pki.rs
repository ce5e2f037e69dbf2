//! The certificates and credentials of a test run: one CA per run, server certificates for
//! every listener, and for every caller either a client certificate (`spiffe://gpuledger/…`) or
//! a ServiceAccount token from the fake API server — TLS and authentication are on in every
//! test, as in production.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use gpuledger_auth::CredentialArgs;
use gpuledger_auth::identity::Role;
use gpuledger_auth::pki::Ca;

use crate::kube::store::Store;

/// The namespace gpuledger's ServiceAccounts live in, in every test cluster.
pub const NAMESPACE: &str = "gpuledger-system";

/// Every loopback address a test server may be reached on: 127.0.0.1, and the per-replica
/// aliases the chaos run partitions with (127.0.1.x).
pub fn loopback_hosts() -> Vec<String> {
    let mut h = vec!["127.0.0.1".to_string(), "localhost".to_string()];
    h.extend((1..=16).map(|i| format!("127.0.1.{i}")));
    h
}

/// One run's CA and what it issued, as files under `<dir>/pki`.
pub struct Pki {
    dir: PathBuf,
    ca: Ca,
    ca_file: PathBuf,
    issued: Mutex<HashMap<String, (PathBuf, PathBuf)>>,
}

impl Pki {
    /// A new CA whose files live under `<dir>/pki`.
    pub fn new(dir: &Path) -> Result<Arc<Pki>> {
        let dir = dir.join("pki");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let ca = Ca::new("gpuledger test CA")?;
        let ca_file = dir.join("ca.crt");
        ca.write(&ca_file)?;
        Ok(Arc::new(Pki {
            dir,
            ca,
            ca_file,
            issued: Mutex::new(HashMap::new()),
        }))
    }

    /// An existing CA (its certificate and private key as PEM files, e.g. what
    /// `deploy/scripts/gpuledger-certs.sh` made) with its files under `<dir>/pki`;
    /// `issued` are certificates it already issued, `name` → (certificate, key), served as
    /// they are instead of new ones.
    pub fn adopt(
        dir: &Path,
        ca_cert: &Path,
        ca_key: &Path,
        issued: &[(&str, (PathBuf, PathBuf))],
    ) -> Result<Arc<Pki>> {
        let dir = dir.join("pki");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let read = |p: &Path| {
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
        };
        let ca = Ca::from_pem(&read(ca_cert)?, &read(ca_key)?)
            .with_context(|| format!("loading the CA {}", ca_cert.display()))?;
        let ca_file = dir.join("ca.crt");
        ca.write(&ca_file)?;
        let issued = issued
            .iter()
            .map(|(n, files)| (n.to_string(), files.clone()))
            .collect();
        Ok(Arc::new(Pki {
            dir,
            ca,
            ca_file,
            issued: Mutex::new(issued),
        }))
    }

    /// The CA certificate every client and server of the run trusts.
    pub fn ca_file(&self) -> &Path {
        &self.ca_file
    }

    fn issue(
        &self,
        name: &str,
        make: impl FnOnce(&Ca) -> Result<gpuledger_auth::pki::Leaf, rcgen::Error>,
    ) -> Result<(PathBuf, PathBuf)> {
        let mut issued = self.issued.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = issued.get(name) {
            return Ok(p.clone());
        }
        let files = make(&self.ca)?.write(&self.dir, name)?;
        issued.insert(name.to_string(), files.clone());
        Ok(files)
    }

    /// A server certificate (and key) for every loopback address and the in-cluster Service
    /// name `gpuledger-<name>.gpuledger-system.svc` (what the kubectl plugin expects through a
    /// port-forward), under `name`.
    pub fn server(&self, name: &str) -> Result<(PathBuf, PathBuf)> {
        self.issue(name, |ca| {
            let mut hosts = loopback_hosts();
            hosts.push(format!("gpuledger-{name}.{NAMESPACE}.svc"));
            let refs: Vec<&str> = hosts.iter().map(String::as_str).collect();
            ca.server(&refs)
        })
    }

    /// A certificate good as server and client (etcd members, etcd's clients).
    pub fn peer(&self, name: &str) -> Result<(PathBuf, PathBuf)> {
        self.issue(name, |ca| {
            let hosts = loopback_hosts();
            let refs: Vec<&str> = hosts.iter().map(String::as_str).collect();
            ca.peer(&refs, name)
        })
    }

    /// A client certificate naming `role` (and operator `name`).
    pub fn client_cert(&self, role: &Role, name: &str) -> Result<(PathBuf, PathBuf)> {
        let file = match role {
            Role::NodeAgent { node } => format!("client-node-agent-{node}"),
            Role::Viewer | Role::Admin => format!("client-{}-{name}", role.kind()),
            r => format!("client-{}", r.kind()),
        };
        self.issue(&file, |ca| ca.client(role, name))
    }
}

/// How a run's callers prove who they are.
#[derive(Clone)]
pub enum Issuer {
    /// Client certificates (no API server in the run).
    Certs,
    /// ServiceAccount tokens the fake API server issues and reviews.
    Tokens(Arc<Store>),
}

/// Credentials for each caller of a run.
#[derive(Clone)]
pub struct Identities {
    /// The run's CA and certificates.
    pub pki: Arc<Pki>,
    /// Certificates or tokens.
    pub issuer: Issuer,
}

impl Identities {
    /// Client certificates from `pki`.
    pub fn certs(pki: Arc<Pki>) -> Self {
        Identities {
            pki,
            issuer: Issuer::Certs,
        }
    }

    /// ServiceAccount tokens from the fake API server `store`, TLS from `pki`.
    pub fn tokens(pki: Arc<Pki>, store: Arc<Store>) -> Self {
        Identities {
            pki,
            issuer: Issuer::Tokens(store),
        }
    }

    /// What a caller in `role` passes to reach the allocator: the CA, and a client
    /// certificate or a token file (written under the run's `pki` directory).
    pub fn credentials(&self, role: &Role) -> Result<CredentialArgs> {
        let ca = Some(self.pki.ca_file().to_path_buf());
        match &self.issuer {
            Issuer::Certs => {
                let (cert, key) = self.pki.client_cert(role, "test")?;
                Ok(CredentialArgs {
                    ca,
                    token_file: None,
                    client_cert: Some(cert),
                    client_key: Some(key),
                    server_name: None,
                })
            }
            Issuer::Tokens(store) => {
                let (account, bound) = match role {
                    Role::Allocator => ("gpuledger-allocator", None),
                    Role::Extender => ("gpuledger-extender", None),
                    Role::Viewer => ("gpuledger-viewer", None),
                    Role::Admin => ("gpuledger-admin", None),
                    Role::NodeAgent { node } => (
                        "gpuledger-node-agent",
                        Some(store.node_agent_pod(NAMESPACE, node)?),
                    ),
                };
                let token = store
                    .issue_token(
                        NAMESPACE,
                        account,
                        &[gpuledger_auth::token::AUDIENCE],
                        24 * 3600,
                        bound.as_ref(),
                    )
                    .map_err(|e| anyhow::anyhow!("{}", e.message()))?;
                let name = match role {
                    Role::NodeAgent { node } => format!("token-node-agent-{node}"),
                    r => format!("token-{}", r.kind()),
                };
                let file = self.pki.dir.join(name);
                std::fs::write(&file, token)?;
                Ok(CredentialArgs {
                    ca,
                    token_file: Some(file),
                    client_cert: None,
                    client_key: None,
                    server_name: None,
                })
            }
        }
    }

    /// The same credentials as command-line flags of a gpuledger binary.
    pub fn flags(&self, role: &Role) -> Result<Vec<String>> {
        Ok(credential_flags(&self.credentials(role)?))
    }
}

/// `--allocator-ca`, `--token-file` / `--client-cert` `--client-key` for `c`.
pub fn credential_flags(c: &CredentialArgs) -> Vec<String> {
    let mut f = Vec::new();
    let mut push = |flag: &str, p: &Option<PathBuf>| {
        if let Some(p) = p {
            f.push(format!("--{flag}={}", p.display()));
        }
    };
    push("allocator-ca", &c.ca);
    push("token-file", &c.token_file);
    push("client-cert", &c.client_cert);
    push("client-key", &c.client_key);
    f
}
