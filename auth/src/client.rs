//! A client's credentials: TLS to the server it calls, and the token or certificate that says
//! who it is. Every gpuledger client of the allocator connects through [`Credentials::channel`].

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use futures::future::BoxFuture;
use http::Uri;
use hyper_util::rt::TokioIo;
use rustls::ClientConfig;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tracing::{info, warn};

use crate::tls::{Reloading, TlsError, client_config};

/// A channel to the allocator that carries the caller's credentials on every call.
pub type AuthChannel = InterceptedService<Channel, Bearer>;

/// A ServiceAccount token read from a file (a projected volume the kubelet rotates).
pub struct TokenFile {
    path: PathBuf,
    header: ArcSwap<MetadataValue<Ascii>>,
}

fn bearer(path: &Path) -> Result<MetadataValue<Ascii>, TlsError> {
    let raw = std::fs::read_to_string(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let token = raw.trim();
    if token.is_empty() {
        return Err(TlsError::Pem {
            path: path.to_path_buf(),
            what: "the token file is empty".into(),
        });
    }
    format!("Bearer {token}")
        .parse()
        .map_err(|_| TlsError::Pem {
            path: path.to_path_buf(),
            what: "the token has characters a header cannot carry".into(),
        })
}

impl TokenFile {
    /// Read the token in `path`.
    pub fn open(path: &Path) -> Result<Arc<Self>, TlsError> {
        Ok(Arc::new(TokenFile {
            path: path.to_path_buf(),
            header: ArcSwap::from_pointee(bearer(path)?),
        }))
    }

    /// Read the file again (a rotated token); keeps the old token when the file is unreadable.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let h = bearer(&self.path)?;
        if **self.header.load() == h {
            return Ok(false);
        }
        self.header.store(Arc::new(h));
        Ok(true)
    }
}

/// Adds `authorization: Bearer <token>` to every call (nothing when the client authenticates
/// with a certificate alone).
#[derive(Clone, Default)]
pub struct Bearer(Option<Arc<TokenFile>>);

impl Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(t) = &self.0 {
            req.metadata_mut()
                .insert("authorization", (**t.header.load()).clone());
        }
        Ok(req)
    }
}

/// Where a client's credentials come from.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct CredentialArgs {
    /// PEM CA bundle that signed the allocator's server certificate.
    #[arg(long = "allocator-ca", env = "GPULEDGER_ALLOCATOR_CA")]
    pub ca: Option<PathBuf>,
    /// A ServiceAccount token file (audience `gpuledger`) that says who this client is; the
    /// kubelet rotates a projected token in place and it is read again.
    #[arg(long = "token-file", env = "GPULEDGER_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// PEM client certificate whose URI SAN names this client
    /// (`spiffe://gpuledger/<role>[/<name>]`), for installs without tokens (with --client-key).
    #[arg(
        long = "client-cert",
        env = "GPULEDGER_CLIENT_CERT",
        requires = "client_key"
    )]
    pub client_cert: Option<PathBuf>,
    /// PEM private key of --client-cert.
    #[arg(
        long = "client-key",
        env = "GPULEDGER_CLIENT_KEY",
        requires = "client_cert"
    )]
    pub client_key: Option<PathBuf>,
    /// The name the allocator's certificate must carry, when it is not the host dialled (a
    /// port-forward dials 127.0.0.1; the certificate names the Service).
    #[arg(long = "tls-server-name", env = "GPULEDGER_TLS_SERVER_NAME")]
    pub server_name: Option<String>,
}

/// Why a client's credentials cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CredentialError {
    /// No CA bundle to check the server with.
    #[error("no CA to verify the allocator with: set --allocator-ca (GPULEDGER_ALLOCATOR_CA)")]
    NoCa,
    /// No way to say who the client is.
    #[error(
        "no credentials: set --token-file (a ServiceAccount token for audience gpuledger) or \
         --client-cert and --client-key"
    )]
    NoIdentity,
    /// A file could not be used.
    #[error(transparent)]
    Tls(#[from] TlsError),
}

/// TLS plus an identity, shared by every channel a client opens.
#[derive(Clone)]
pub struct Credentials {
    tls: Arc<Reloading<ClientConfig>>,
    token: Option<Arc<TokenFile>>,
    server_name: Option<String>,
}

impl Credentials {
    /// Load what `args` names.
    pub fn load(args: &CredentialArgs) -> Result<Self, CredentialError> {
        let ca = args.ca.as_deref().ok_or(CredentialError::NoCa)?;
        let identity = args.client_cert.as_deref().zip(args.client_key.as_deref());
        if identity.is_none() && args.token_file.is_none() {
            return Err(CredentialError::NoIdentity);
        }
        Ok(Credentials {
            tls: client_config(ca, identity, &[b"h2"])?,
            token: args
                .token_file
                .as_deref()
                .map(TokenFile::open)
                .transpose()?,
            server_name: args.server_name.clone(),
        })
    }

    /// Re-read rotated certificates and tokens every `every` until `stop`.
    pub fn spawn_reloader(&self, every: Duration, stop: CancellationToken) {
        self.tls.spawn_reloader(every, stop.clone());
        if let Some(t) = self.token.clone() {
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tick.tick() => {}
                    }
                    match t.reload() {
                        Ok(true) => info!(file = %t.path.display(), "read the rotated token"),
                        Ok(false) => {}
                        Err(e) => {
                            warn!(error = %e, "the token file does not read; keeping the previous token")
                        }
                    }
                }
            });
        }
    }

    /// A lazily connecting channel to `endpoint` (its timeouts and keep-alives as the caller
    /// set them) over TLS, carrying this identity. The endpoint's scheme is ignored: TLS is
    /// always on.
    pub fn channel(&self, endpoint: Endpoint) -> AuthChannel {
        let connector = Connector {
            tls: self.tls.clone(),
            server_name: self.server_name.clone(),
        };
        InterceptedService::new(
            endpoint.connect_with_connector_lazy(connector),
            Bearer(self.token.clone()),
        )
    }
}

/// `http://host:port` for an allocator address given as `host:port`, `http://…` or
/// `https://…` (the channel does TLS itself, under an `http` URI).
pub fn endpoint(addr: &str) -> Result<Endpoint, tonic::transport::Error> {
    let bare = addr
        .trim_end_matches('/')
        .split_once("://")
        .map_or(addr, |(_, rest)| rest);
    Endpoint::from_shared(format!("http://{bare}"))
}

/// Opens TCP and then TLS to the URI's host, checking its certificate for that host name.
#[derive(Clone)]
struct Connector {
    tls: Arc<Reloading<ClientConfig>>,
    server_name: Option<String>,
}

impl tower::Service<Uri> for Connector {
    type Response = TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;
    type Error = std::io::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let cfg = self.tls.current();
        let name_override = self.server_name.clone();
        Box::pin(async move {
            let bad = |why: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, why);
            let host = uri.host().ok_or_else(|| bad("no host in the address"))?;
            let host = host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string();
            let port = uri.port_u16().unwrap_or(443);
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            let name = ServerName::try_from(name_override.unwrap_or(host))
                .map_err(|_| bad("not a host name or IP"))?;
            let tls = tokio_rustls::TlsConnector::from(cfg)
                .connect(name, tcp)
                .await?;
            Ok(TokioIo::new(tls))
        })
    }
}
