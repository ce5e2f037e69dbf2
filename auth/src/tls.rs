//! TLS configurations built from PEM files and rebuilt when the files change (cert-manager and
//! the kubelet rotate them in place), and the TLS accept stream with a handshake timeout.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{
    ClientConfig, DigitallySignedStruct, DistinguishedName, RootCertStore, ServerConfig,
    SignatureScheme,
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::limit::Bites;

/// A certificate, key or CA bundle that could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file holds no usable PEM item of the expected kind.
    #[error("{path}: {what}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        what: String,
    },
    /// rustls refused the combination (key does not match the certificate, bad CA, …).
    #[error("building the TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    /// The client-certificate verifier could not be built from the CA bundle.
    #[error("building the client-certificate verifier: {0}")]
    Verifier(String),
}

/// Whether and how a server asks clients for certificates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientCerts {
    /// It does not ask.
    None,
    /// It asks and verifies against this CA bundle, but a client may come without one (and
    /// present a token instead).
    Optional(PathBuf),
    /// It refuses a client without a certificate this CA bundle verifies.
    Required(PathBuf),
}

/// A value built from files, rebuilt when their contents change.
pub struct Reloading<T> {
    what: &'static str,
    paths: Vec<PathBuf>,
    #[allow(clippy::type_complexity)]
    build: Box<dyn Fn(&[(PathBuf, Vec<u8>)]) -> Result<T, TlsError> + Send + Sync>,
    seen: Mutex<Vec<Vec<u8>>>,
    current: watch::Sender<Arc<T>>,
}

fn read_all(paths: &[PathBuf]) -> Result<Vec<(PathBuf, Vec<u8>)>, TlsError> {
    paths
        .iter()
        .map(|p| {
            std::fs::read(p)
                .map(|b| (p.clone(), b))
                .map_err(|source| TlsError::Read {
                    path: p.clone(),
                    source,
                })
        })
        .collect()
}

impl<T: Send + Sync + 'static> Reloading<T> {
    fn new(
        what: &'static str,
        paths: Vec<PathBuf>,
        build: impl Fn(&[(PathBuf, Vec<u8>)]) -> Result<T, TlsError> + Send + Sync + 'static,
    ) -> Result<Arc<Self>, TlsError> {
        let files = read_all(&paths)?;
        let value = build(&files)?;
        Ok(Arc::new(Reloading {
            what,
            paths,
            build: Box::new(build),
            seen: Mutex::new(files.into_iter().map(|(_, b)| b).collect()),
            current: watch::channel(Arc::new(value)).0,
        }))
    }

    /// The value built from the files as they were at the last (re)load.
    pub fn current(&self) -> Arc<T> {
        self.current.borrow().clone()
    }

    /// Every new value as it is built.
    pub fn subscribe(&self) -> watch::Receiver<Arc<T>> {
        self.current.subscribe()
    }

    /// Rebuild if any file changed; a value that does not build (a half-written file) keeps
    /// the previous one. True when a new value was installed.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let files = read_all(&self.paths)?;
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if files.iter().map(|(_, b)| b).eq(seen.iter()) {
            return Ok(false);
        }
        let value = (self.build)(&files)?;
        *seen = files.into_iter().map(|(_, b)| b).collect();
        self.current.send_replace(Arc::new(value));
        Ok(true)
    }

    /// Check the files every `every` until `stop`, installing what changed.
    pub fn spawn_reloader(self: &Arc<Self>, every: Duration, stop: CancellationToken) {
        let this = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                match this.reload() {
                    Ok(true) => {
                        info!(what = this.what, files = ?this.paths, "reloaded changed TLS files")
                    }
                    Ok(false) => {}
                    Err(e) => {
                        warn!(what = this.what, error = %e, "changed TLS files do not load; keeping the previous ones")
                    }
                }
            }
        });
    }
}

fn certs(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<_> = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::Pem {
            path: path.to_path_buf(),
            what: format!("not a PEM certificate file: {e}"),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Pem {
            path: path.to_path_buf(),
            what: "no CERTIFICATE in the file".into(),
        });
    }
    Ok(certs)
}

fn key(path: &Path, pem: &[u8]) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| TlsError::Pem {
        path: path.to_path_buf(),
        what: format!("no usable PRIVATE KEY in the file: {e}"),
    })
}

fn roots(path: &Path, pem: &[u8]) -> Result<RootCertStore, TlsError> {
    let mut store = RootCertStore::empty();
    for c in certs(path, pem)? {
        store.add(c).map_err(|e| TlsError::Pem {
            path: path.to_path_buf(),
            what: format!("not a usable CA certificate: {e}"),
        })?;
    }
    Ok(store)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A server's TLS configuration from `cert` and `key` (PEM), asking clients for certificates
/// as `clients` says, offering `alpn` (e.g. `h2` for gRPC); rebuilt when the files change.
pub fn server_config(
    cert: &Path,
    key_file: &Path,
    clients: ClientCerts,
    alpn: &[&[u8]],
) -> Result<Arc<Reloading<ServerConfig>>, TlsError> {
    build_server(cert, key_file, clients, None, alpn)
}

/// A server's TLS configuration that admits only clients with a certificate `ca` signed that
/// names one of `names` (its subject's common name, a DNS name or a URI in its subject
/// alternative names); another certificate fails the handshake, counted in `bites` as
/// [`bite::CLIENT_NAME`]. For a port only one peer may call (kube-scheduler's extender
/// port), where `ca` also signs other identities.
pub fn server_config_for_named_clients(
    cert: &Path,
    key_file: &Path,
    ca: &Path,
    names: Vec<String>,
    bites: Arc<Bites>,
    alpn: &[&[u8]],
) -> Result<Arc<Reloading<ServerConfig>>, TlsError> {
    bites.declare(bite::CLIENT_NAME);
    build_server(
        cert,
        key_file,
        ClientCerts::Required(ca.to_path_buf()),
        Some((names, bites)),
        alpn,
    )
}

fn build_server(
    cert: &Path,
    key_file: &Path,
    clients: ClientCerts,
    named: Option<(Vec<String>, Arc<Bites>)>,
    alpn: &[&[u8]],
) -> Result<Arc<Reloading<ServerConfig>>, TlsError> {
    let mut paths = vec![cert.to_path_buf(), key_file.to_path_buf()];
    if let ClientCerts::Optional(ca) | ClientCerts::Required(ca) = &clients {
        paths.push(ca.clone());
    }
    let alpn: Vec<Vec<u8>> = alpn.iter().map(|a| a.to_vec()).collect();
    Reloading::new("server certificate", paths, move |files| {
        let p = provider();
        let builder =
            ServerConfig::builder_with_provider(p.clone()).with_safe_default_protocol_versions()?;
        let builder = match &clients {
            ClientCerts::None => builder.with_no_client_auth(),
            ClientCerts::Optional(_) | ClientCerts::Required(_) => {
                let (ca, pem) = &files[2];
                let v = WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca, pem)?), p);
                let v = if matches!(clients, ClientCerts::Optional(_)) {
                    v.allow_unauthenticated()
                } else {
                    v
                };
                let v = v.build().map_err(|e| TlsError::Verifier(e.to_string()))?;
                match &named {
                    None => builder.with_client_cert_verifier(v),
                    Some((names, bites)) => builder.with_client_cert_verifier(Arc::new(Named {
                        inner: v,
                        names: names.clone(),
                        bites: bites.clone(),
                    })),
                }
            }
        };
        let mut cfg = builder.with_single_cert(
            certs(&files[0].0, &files[0].1)?,
            key(&files[1].0, &files[1].1)?,
        )?;
        cfg.alpn_protocols = alpn.clone();
        Ok(cfg)
    })
}

/// Every name a certificate goes by: its subject's common names, DNS names and URIs.
pub fn names_of(cert: &CertificateDer<'_>) -> Vec<String> {
    let Ok((_, parsed)) = x509_parser::parse_x509_certificate(cert.as_ref()) else {
        return Vec::new();
    };
    let mut names: Vec<String> = parsed
        .subject()
        .iter_common_name()
        .filter_map(|cn| cn.as_str().ok().map(str::to_string))
        .collect();
    if let Ok(Some(san)) = parsed.subject_alternative_name() {
        for n in &san.value.general_names {
            match n {
                x509_parser::extensions::GeneralName::DNSName(d) => names.push(d.to_string()),
                x509_parser::extensions::GeneralName::URI(u) => names.push(u.to_string()),
                _ => {}
            }
        }
    }
    names
}

/// A client-certificate verifier that also demands one of `names` (see
/// [`server_config_for_named_clients`]).
#[derive(Debug)]
struct Named {
    inner: Arc<dyn ClientCertVerifier>,
    names: Vec<String>,
    bites: Arc<Bites>,
}

impl ClientCertVerifier for Named {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let ok = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        let names = names_of(end_entity);
        if names.iter().any(|n| self.names.contains(n)) {
            return Ok(ok);
        }
        self.bites.bite(bite::CLIENT_NAME);
        warn!(
            presented = ?names,
            expected = ?self.names,
            "refused a client certificate of the right CA that names another identity"
        );
        Err(rustls::Error::InvalidCertificate(
            rustls::CertificateError::ApplicationVerificationFailure,
        ))
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// A client's TLS configuration trusting the servers `ca` signed, presenting `identity`
/// (certificate, key) when given, offering `alpn`; rebuilt when the files change.
pub fn client_config(
    ca: &Path,
    identity: Option<(&Path, &Path)>,
    alpn: &[&[u8]],
) -> Result<Arc<Reloading<ClientConfig>>, TlsError> {
    let mut paths = vec![ca.to_path_buf()];
    if let Some((c, k)) = identity {
        paths.extend([c.to_path_buf(), k.to_path_buf()]);
    }
    let alpn: Vec<Vec<u8>> = alpn.iter().map(|a| a.to_vec()).collect();
    Reloading::new("client certificate", paths, move |files| {
        let builder = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots(&files[0].0, &files[0].1)?);
        let mut cfg = match files.get(1..3) {
            Some([(cp, c), (kp, k)]) => {
                builder.with_client_auth_cert(certs(cp, c)?, key(kp, k)?)?
            }
            _ => builder.with_no_client_auth(),
        };
        cfg.alpn_protocols = alpn.clone();
        Ok(cfg)
    })
}

mod listener;
pub use listener::{ListenerLimits, bite, incoming};

#[cfg(test)]
mod tests;
