//! Connections as another machine on the network would open them: from another loopback
//! address (127.0.0.2 and up; every 127/8 address reaches this host), so that per-address limits
//! tell an attacker from the honest clients on 127.0.0.1. Raw TCP, TLS, and allocator clients.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use gpuledger_auth::CredentialArgs;
use gpuledger_proto::allocator::v1::allocator_client::AllocatorClient;
use hyper_util::rt::TokioIo;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

/// A client of the allocator API whose connections come from another loopback address.
pub type ClientFrom = AllocatorClient<InterceptedService<Channel, Token>>;

/// Sends `authorization: Bearer <token>` on every call, when there is a token.
#[derive(Clone)]
pub struct Token(Option<MetadataValue<Ascii>>);

impl Interceptor for Token {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(t) = &self.0 {
            req.metadata_mut().insert("authorization", t.clone());
        }
        Ok(req)
    }
}

/// A TCP connection to `to` from the loopback address `source`.
pub async fn tcp_from(source: &str, to: SocketAddr) -> std::io::Result<tokio::net::TcpStream> {
    let s = tokio::net::TcpSocket::new_v4()?;
    s.bind(
        format!("{source}:0")
            .parse::<SocketAddr>()
            .map_err(std::io::Error::other)?,
    )?;
    s.connect(to).await
}

/// A TLS client (no client certificate) that trusts the servers the CA in `ca_file` signed,
/// speaking HTTP/1.1.
pub fn tls_trusting(ca_file: &Path) -> Result<tokio_rustls::TlsConnector> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca_file)? {
        roots.add(c?)?;
    }
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(cfg)))
}

/// A TLS connection from `source` to `to` (whose certificate names `localhost`) with `tls`.
pub async fn tls_from(
    tls: &tokio_rustls::TlsConnector,
    source: &str,
    to: SocketAddr,
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let tcp = tcp_from(source, to).await?;
    let name = rustls::pki_types::ServerName::try_from("localhost")
        .map_err(std::io::Error::other)?
        .to_owned();
    tls.connect(name, tcp).await
}

/// A client of the allocator at `addr` (`host:port`) that connects (lazily, again after each
/// lost connection) from the loopback address `source`, as the caller `creds` names: its
/// client certificate presented, or its token file read once and sent with every call.
pub fn allocator_from(source: &str, addr: &str, creds: &CredentialArgs) -> Result<ClientFrom> {
    Ok(AllocatorClient::new(channel_from(source, addr, creds)?)
        .max_decoding_message_size(512 * 1024 * 1024)
        .max_encoding_message_size(64 * 1024 * 1024))
}

/// A channel to the allocator at `addr` from the loopback address `source`, carrying the
/// caller `creds` names: for calls no generated client makes ([`raw_unary`], [`bodiless`]).
pub fn channel_from(
    source: &str,
    addr: &str,
    creds: &CredentialArgs,
) -> Result<InterceptedService<Channel, Token>> {
    let ca = creds.ca.as_deref().context("no CA in the credentials")?;
    let identity = creds
        .client_cert
        .as_deref()
        .zip(creds.client_key.as_deref());
    let tls = gpuledger_auth::tls::client_config(ca, identity, &[b"h2"])?.current();
    let token = match &creds.token_file {
        Some(f) => {
            let t =
                std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
            Some(format!("Bearer {}", t.trim()).parse()?)
        }
        None => None,
    };
    let to: SocketAddr = addr
        .parse()
        .with_context(|| format!("{addr} is not host:port"))?;
    let source = source.to_string();
    let connector = tower::service_fn(move |_: hyper::Uri| {
        let (tls, source) = (
            tokio_rustls::TlsConnector::from(tls.clone()),
            source.clone(),
        );
        async move {
            let tcp = tcp_from(&source, to).await?;
            tcp.set_nodelay(true)?;
            let name = rustls::pki_types::ServerName::try_from("localhost")
                .map_err(std::io::Error::other)?
                .to_owned();
            Ok::<_, std::io::Error>(TokioIo::new(tls.connect(name, tcp).await?))
        }
    });
    let channel = Endpoint::from_shared(format!("http://{addr}"))?
        .connect_timeout(Duration::from_millis(500))
        .timeout(Duration::from_secs(10))
        .connect_with_connector_lazy(connector);
    Ok(InterceptedService::new(channel, Token(token)))
}

/// A codec that sends bytes as they are as the message of a gRPC call, and drops the answer.
#[derive(Debug, Clone, Copy, Default)]
pub struct Raw;

impl tonic::codec::Encoder for Raw {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        use bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for Raw {
    type Item = ();
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<()>, tonic::Status> {
        use bytes::Buf;
        src.advance(src.remaining());
        Ok(Some(()))
    }
}

impl tonic::codec::Codec for Raw {
    type Encode = Vec<u8>;
    type Decode = ();
    type Encoder = Raw;
    type Decoder = Raw;
    fn encoder(&mut self) -> Raw {
        Raw
    }
    fn decoder(&mut self) -> Raw {
        Raw
    }
}

/// The path of the allocator's RPC `method` (`Status`, `RegisterNode`, …).
fn rpc_path(method: &str) -> Result<tonic::codegen::http::uri::PathAndQuery> {
    Ok(format!("/gpuledger.allocator.v1.Allocator/{method}").parse()?)
}

/// A gRPC client on `ch`, ready to send, and the path of `method`.
async fn ready<T>(
    ch: T,
    method: &str,
) -> Result<
    (
        tonic::client::Grpc<T>,
        tonic::codegen::http::uri::PathAndQuery,
    ),
    tonic::Status,
>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<tonic::codegen::StdError>,
{
    let path = rpc_path(method).map_err(|e| tonic::Status::internal(e.to_string()))?;
    let mut g = tonic::client::Grpc::new(ch);
    g.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.into().to_string()))?;
    Ok((g, path))
}

/// Call `method` with `message` as its encoded request, whatever the bytes are.
pub async fn raw_unary<T>(ch: T, method: &str, message: Vec<u8>) -> Result<(), tonic::Status>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: tonic::codegen::Body<Data = bytes::Bytes> + Send + 'static,
    <T::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    let (mut g, path) = ready(ch, method).await?;
    g.unary(tonic::Request::new(message), path, Raw)
        .await
        .map(drop)
}

/// Call `method` with headers only: its message never comes (the call waits until the server
/// answers or cuts it).
pub async fn bodiless<T>(ch: T, method: &str) -> Result<(), tonic::Status>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: tonic::codegen::Body<Data = bytes::Bytes> + Send + 'static,
    <T::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    let (mut g, path) = ready(ch, method).await?;
    let never = futures::stream::pending::<Vec<u8>>();
    g.client_streaming(tonic::Request::new(never), path, Raw)
        .await
        .map(drop)
}

/// `per_source` idle TCP connections to `to` from each loopback address of `sources`
/// (`127.0.0.<n>`); those the kernel refused are left out.
pub async fn idle_flood(
    sources: std::ops::Range<u8>,
    per_source: usize,
    to: SocketAddr,
) -> Vec<tokio::net::TcpStream> {
    let mut flood = Vec::new();
    for source in sources {
        for _ in 0..per_source {
            if let Ok(s) = tcp_from(&format!("127.0.0.{source}"), to).await {
                flood.push(s);
            }
        }
    }
    flood
}

/// How many of `conns` the server closed (end of stream or reset), waiting up to `wait` for
/// each; what a connection sent before (a TLS session ticket, say) is read and dropped.
pub async fn count_closed(conns: &mut [tokio::net::TcpStream], wait: Duration) -> usize {
    use tokio::io::AsyncReadExt;
    let mut closed = 0;
    for s in conns {
        let mut buf = [0u8; 512];
        let ended = tokio::time::timeout(wait, async {
            while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
        });
        if ended.await.is_ok() {
            closed += 1;
        }
    }
    closed
}

/// A TLS client like [`tls_trusting`]'s that presents the client certificate `cert` (its key
/// `key`): a copy of someone's identity.
pub fn tls_as(ca_file: &Path, cert: &Path, key: &Path) -> Result<tokio_rustls::TlsConnector> {
    let cfg = gpuledger_auth::tls::client_config(ca_file, Some((cert, key)), &[b"http/1.1"])?;
    Ok(tokio_rustls::TlsConnector::from(cfg.current()))
}

/// POST `body` (JSON) to `path` on `s`, asking the server to close the connection after its
/// answer: the answer's status.
pub async fn post_once(
    mut s: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    path: &str,
    body: &[u8],
) -> Result<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await?;
    s.write_all(body).await?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut answer))
        .await
        .context("no answer within 10 s")??;
    let text = String::from_utf8_lossy(&answer);
    text.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("not an HTTP answer: {text:?}"))
}

/// Twelve idle connections from each of twelve addresses to `to`, a plain HTTP port that may
/// hold `max` connections in all: an error unless it closed at once all it may not hold. The
/// connections, for [`ensure_closed_within`].
pub async fn idle_flood_past(to: SocketAddr, max: usize) -> Result<Vec<tokio::net::TcpStream>> {
    let mut flood = idle_flood(2..14, 12, to).await;
    let closed = count_closed(&mut flood, Duration::from_millis(20)).await;
    anyhow::ensure!(
        closed + max >= flood.len(),
        "only {closed} of {} connections closed at once ({max} may stay)",
        flood.len()
    );
    Ok(flood)
}

/// An error unless the server closed every one of `conns` within `wait`.
pub async fn ensure_closed_within(
    conns: &mut [tokio::net::TcpStream],
    wait: Duration,
) -> Result<()> {
    tokio::time::sleep(wait).await;
    let closed = count_closed(conns, Duration::from_millis(500)).await;
    anyhow::ensure!(
        closed == conns.len(),
        "{} idle connections still open after {wait:?}",
        conns.len() - closed
    );
    Ok(())
}

/// The first flight of a TLS client trusting the CA in `ca_file` for `localhost`: a whole
/// ClientHello, for a client that sends it and then stalls the rest of the handshake.
pub fn client_hello(ca_file: &Path) -> Result<Vec<u8>> {
    let cfg = gpuledger_auth::tls::client_config(ca_file, None, &[b"h2"])?.current();
    let name = rustls::pki_types::ServerName::try_from("localhost")?.to_owned();
    let mut conn = rustls::ClientConnection::new(cfg, name)?;
    let mut hello = Vec::new();
    while conn.wants_write() {
        conn.write_tls(&mut hello)?;
    }
    Ok(hello)
}

/// A TLS connection (ALPN `h2`) from `source` to `to` that opens HTTP/2 (the preface and its
/// SETTINGS) and then neither reads nor writes again: a peer that died, as keep-alive sees it.
pub async fn silent_h2(
    ca_file: &Path,
    source: &str,
    to: SocketAddr,
) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    use tokio::io::AsyncWriteExt;
    let cfg = gpuledger_auth::tls::client_config(ca_file, None, &[b"h2"])?.current();
    let mut s = tls_from(&tokio_rustls::TlsConnector::from(cfg), source, to).await?;
    // The connection preface, then an empty SETTINGS frame (length 0, type 4, no flags).
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await?;
    s.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await?;
    s.flush().await?;
    Ok(s)
}
