//! The server side: every request is authenticated before anything reads or writes, by its
//! client certificate or its bearer token, in one tower layer in front of the service.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use http::{HeaderMap, HeaderValue, Request, Response};
use rustls::pki_types::CertificateDer;
use tonic::body::Body;
use tonic::transport::server::TlsConnectInfo;
use tracing::warn;

use crate::identity::{Caller, Holder, Role, from_spiffe_id, short_digest};
use crate::limit::{Bites, Brake, ConnInfo, Slot, Slots, peer_key};

mod forwarding;
use crate::token::{TokenAuthenticator, TokenError, Unreviewed};
use forwarding::decode_on_behalf_of;
pub use forwarding::{FORWARDED_AUTHORIZATION, ON_BEHALF_OF, on_behalf_of, on_behalf_of_holder};

/// The limit name of the in-flight refusals of [`CallerLimits::max_in_flight`].
pub const BITE_IN_FLIGHT: &str = "in_flight_per_identity";

/// The limit name under which [`CallerLimits::pause`] counts the connections it paused.
pub const BITE_PAUSED: &str = "connection_paused";

/// The limit name of requests whose message did not arrive within
/// [`CallerLimits::body_timeout`].
pub const BITE_BODY_TIMEOUT: &str = "request_body_timeout";

/// The limit name of requests whose body was larger than [`CallerLimits::max_body`].
pub const BITE_BODY_BYTES: &str = "request_body_bytes";

/// What one caller may hold of a server, and what being over a limit costs it.
#[derive(Debug, Clone, Copy)]
pub struct CallerLimits {
    /// Requests of one caller being answered at once (0 = no bound).
    pub max_in_flight: usize,
    /// How long nothing more is read from a connection after a call it carried was refused
    /// for being over a limit (`RESOURCE_EXHAUSTED`: in flight, streams, rates, budgets), when
    /// the caller sent it itself. A connection others share is never paused: forwarded calls,
    /// allocators and the extender ([`Authenticated::shares_connection`]). Zero: never paused.
    pub pause: std::time::Duration,
    /// How long a request's message may take to arrive after its headers; a request holds no
    /// slot in flight until it has. Zero: no bound.
    pub body_timeout: std::time::Duration,
    /// Largest request body read (the service's largest message and its frame header).
    pub max_body: usize,
}

/// A request's verified identity, in its extensions for the handlers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Authenticated {
    /// Whose request it is (for a forwarded write: the original caller).
    pub caller: Caller,
    /// Which of the caller's holders sent it (see [`Holder`]): per-caller limits count it.
    pub instance: String,
    /// The allocator replica that forwarded it, if one did.
    pub forwarded_by: Option<String>,
    /// The token that proved `caller`, when a token did (a follower forwards it, so that the
    /// leader checks the caller itself).
    pub token: Option<BearerToken>,
}

impl Authenticated {
    /// Whom the per-caller limits count this request against: the original caller's holder,
    /// also for a forwarded call.
    pub fn holder(&self) -> Holder {
        Holder {
            caller: self.caller.clone(),
            instance: self.instance.clone(),
        }
    }

    /// Whether the connection this request came on carries others' calls too, so that no
    /// brake may land on it: a follower's one connection to the leader carries every write it
    /// forwards, and the extender's carries the scheduling of every pod. Its calls are still
    /// counted against their original callers and refused past their limits.
    pub fn shares_connection(&self) -> bool {
        self.forwarded_by.is_some() || matches!(self.caller.role, Role::Allocator | Role::Extender)
    }
}

/// An `authorization: Bearer …` value that proved a caller; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct BearerToken(pub HeaderValue);

impl std::fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BearerToken(…)")
    }
}

/// Why a request was refused before it reached the service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// No or bad credentials.
    Unauthenticated(String),
    /// Valid credentials that carry no gpuledger role.
    PermissionDenied(String),
    /// The API server could not check the token: try again.
    Unavailable(String),
    /// The caller (or its address) is over a limit: try again later.
    Throttled(String),
}

impl Refusal {
    /// As a gRPC status.
    pub fn status(&self) -> tonic::Status {
        match self {
            Refusal::Unauthenticated(m) => tonic::Status::unauthenticated(m.clone()),
            Refusal::PermissionDenied(m) => tonic::Status::permission_denied(m.clone()),
            Refusal::Unavailable(m) => tonic::Status::unavailable(m.clone()),
            Refusal::Throttled(m) => tonic::Status::resource_exhausted(m.clone()),
        }
    }

    /// The answer that refuses a request: a gRPC status, or plain text with an HTTP status.
    fn answer(&self, grpc: bool) -> Response<Body> {
        if grpc {
            return self.status().into_http::<Body>();
        }
        let text = match self {
            Refusal::Unauthenticated(m)
            | Refusal::PermissionDenied(m)
            | Refusal::Unavailable(m)
            | Refusal::Throttled(m) => format!("{m}\n"),
        };
        let mut r = Response::new(Body::new(http_body_util::Full::new(bytes::Bytes::from(
            text,
        ))));
        *r.status_mut() = self.http_status();
        r
    }

    fn http_status(&self) -> http::StatusCode {
        match self {
            Refusal::Unauthenticated(_) => http::StatusCode::UNAUTHORIZED,
            Refusal::PermissionDenied(_) => http::StatusCode::FORBIDDEN,
            Refusal::Unavailable(_) => http::StatusCode::SERVICE_UNAVAILABLE,
            Refusal::Throttled(_) => http::StatusCode::TOO_MANY_REQUESTS,
        }
    }

    /// Short name for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Refusal::Unauthenticated(_) => "unauthenticated",
            Refusal::PermissionDenied(_) => "permission_denied",
            Refusal::Unavailable(_) => "unavailable",
            Refusal::Throttled(_) => "throttled",
        }
    }
}

/// What a client certificate names: no gpuledger identity, a malformed one, or a caller.
type CertIdentity = Option<Result<Caller, String>>;

/// Turns a request's credentials into a [`Caller`].
pub struct Authenticator {
    tokens: Option<Arc<TokenAuthenticator>>,
    /// What each client certificate (DER) names, so that a connection's certificate is parsed
    /// once, not on every call it carries.
    certs: std::sync::RwLock<std::collections::HashMap<Box<[u8]>, CertIdentity>>,
    forged: AtomicU64,
    refused: AtomicU64,
    in_flight: Option<Arc<Slots<Holder>>>,
    pause: std::time::Duration,
    body_timeout: std::time::Duration,
    max_body: usize,
    bites: Option<Arc<Bites>>,
}

/// How a request's sender proved who it is.
enum Proof {
    Certificate,
    Token,
}

/// The identity a client certificate's URI SAN names (None: the certificate names none).
pub fn caller_of_cert(cert: &CertificateDer<'_>) -> Option<Result<Caller, String>> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    let san = parsed.subject_alternative_name().ok().flatten()?;
    let uri = san.value.general_names.iter().find_map(|n| match n {
        x509_parser::extensions::GeneralName::URI(u) if u.starts_with("spiffe://") => Some(*u),
        _ => None,
    })?;
    Some(from_spiffe_id(uri).map_err(|e| e.to_string()))
}

impl Authenticator {
    /// Certificates only (`tokens` None), or tokens too.
    pub fn new(tokens: Option<Arc<TokenAuthenticator>>) -> Arc<Self> {
        Arc::new(Authenticator {
            tokens,
            certs: Default::default(),
            forged: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            in_flight: None,
            pause: std::time::Duration::ZERO,
            body_timeout: std::time::Duration::ZERO,
            max_body: usize::MAX,
            bites: None,
        })
    }

    /// Certificates only (`tokens` None), or tokens too; each caller held to `limits`,
    /// refusals and pauses counted in `bites`.
    pub fn with_limits(
        tokens: Option<Arc<TokenAuthenticator>>,
        limits: CallerLimits,
        bites: Arc<Bites>,
    ) -> Arc<Self> {
        if !limits.pause.is_zero() {
            bites.declare(BITE_PAUSED);
        }
        if !limits.body_timeout.is_zero() {
            bites.declare(BITE_BODY_TIMEOUT);
        }
        bites.declare(BITE_BODY_BYTES);
        Arc::new(Authenticator {
            tokens,
            certs: Default::default(),
            forged: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            in_flight: Some(Slots::new(
                ("in_flight", BITE_IN_FLIGHT),
                0,
                limits.max_in_flight,
                bites.clone(),
            )),
            pause: limits.pause,
            body_timeout: limits.body_timeout,
            max_body: limits.max_body,
            bites: Some(bites),
        })
    }

    /// Hold `brake` (the connection of a call refused for being over a limit), unless others
    /// share that connection (`shared`, see [`Authenticated::shares_connection`]): a brake
    /// never lands on a connection shared by others.
    fn slow_down(&self, brake: Option<&Arc<Brake>>, shared: bool) {
        let (Some(brake), false, false) = (brake, self.pause.is_zero(), shared) else {
            return;
        };
        if brake.held_until().is_none()
            && let Some(b) = &self.bites
        {
            b.bite(BITE_PAUSED);
        }
        brake.hold(self.pause);
    }

    /// A slot of `caller`'s in-flight requests, held while its request runs.
    fn in_flight(&self, a: &Authenticated) -> Result<Option<Slot<Holder>>, Refusal> {
        let Some(slots) = &self.in_flight else {
            return Ok(None);
        };
        let holder = a.holder();
        slots.try_acquire(holder.clone()).map(Some).map_err(|_| {
            Refusal::Throttled(format!(
                "{holder} has too many requests in flight (--max-in-flight-per-identity); retry"
            ))
        })
    }

    /// The token authenticator, when tokens are accepted.
    pub fn tokens(&self) -> Option<&Arc<TokenAuthenticator>> {
        self.tokens.as_ref()
    }

    /// Forwarding headers dropped because the sender was not an allocator.
    pub fn forged(&self) -> u64 {
        self.forged.load(Ordering::Relaxed)
    }

    /// Requests refused so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Who sent a request with these headers over a connection with these client certificates,
    /// from `peer`.
    pub async fn authenticate(
        &self,
        headers: &HeaderMap,
        peer_certs: Option<&[CertificateDer<'static>]>,
        peer: Option<IpAddr>,
    ) -> Result<Authenticated, Refusal> {
        self.identify(headers, peer_certs, peer)
            .await
            .map_err(|(refusal, _)| refusal)
    }

    /// [`Authenticator::authenticate`]; a refusal says too whether its connection is shared by
    /// others (its sender is an allocator that forwards others' calls).
    async fn identify(
        &self,
        headers: &HeaderMap,
        peer_certs: Option<&[CertificateDer<'static>]>,
        peer: Option<IpAddr>,
    ) -> Result<Authenticated, (Refusal, bool)> {
        let r = self.direct(headers, peer_certs, peer).await;
        let (own, proof) = match r {
            Ok(c) => c,
            Err(e) => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                return Err((e, false));
            }
        };
        let Holder { caller, instance } = own;
        let own_token = match proof {
            Proof::Token => headers
                .get(http::header::AUTHORIZATION)
                .cloned()
                .map(BearerToken),
            Proof::Certificate => None,
        };
        let token = headers.get(FORWARDED_AUTHORIZATION);
        let claim = headers.get(ON_BEHALF_OF);
        if token.is_none() && claim.is_none() {
            return Ok(Authenticated {
                caller,
                instance,
                forwarded_by: None,
                token: own_token,
            });
        }
        if caller.role != Role::Allocator {
            self.forged.fetch_add(1, Ordering::Relaxed);
            warn!(caller = %caller, "a forwarding header from a caller that is no allocator; ignored");
            return Ok(Authenticated {
                caller,
                instance,
                forwarded_by: None,
                token: own_token,
            });
        }
        let original = if let Some(t) = token {
            // The caller's own token: reviewed here, whoever forwards it.
            self.bearer(t, peer).await
        } else {
            // A certificate identity: only the allocator's own key vouches for it (a stolen
            // allocator token does not).
            match proof {
                Proof::Certificate => claim.and_then(decode_on_behalf_of).ok_or_else(|| {
                    Refusal::Unauthenticated(format!(
                        "malformed {ON_BEHALF_OF} header from {caller}"
                    ))
                }),
                Proof::Token => {
                    self.forged.fetch_add(1, Ordering::Relaxed);
                    warn!(caller = %caller, "a forwarded identity claim from an allocator that sent a token, not a certificate; refused");
                    Err(Refusal::Unauthenticated(format!(
                        "{caller} forwards an identity claim ({ON_BEHALF_OF}) but authenticated \
                         with a token: only an allocator with a client certificate may vouch for \
                         a caller; a token caller's own token is forwarded \
                         ({FORWARDED_AUTHORIZATION})"
                    )))
                }
            }
        };
        match original {
            Ok(original) => Ok(Authenticated {
                caller: original.caller,
                instance: original.instance,
                forwarded_by: Some(caller.subject),
                token: token.cloned().map(BearerToken),
            }),
            Err(e) => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                Err((e, true))
            }
        }
    }

    /// [`caller_of_cert`], remembered per certificate (the verified chain makes the bytes the
    /// identity; a few thousand distinct client certificates at most, else it starts over).
    fn caller_of_cert_cached(&self, leaf: &CertificateDer<'_>) -> CertIdentity {
        const MAX: usize = 4096;
        if let Some(c) = self
            .certs
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(leaf.as_ref())
        {
            return c.clone();
        }
        let c = caller_of_cert(leaf);
        let mut map = self.certs.write().unwrap_or_else(|p| p.into_inner());
        if map.len() >= MAX {
            map.clear();
        }
        map.insert(leaf.as_ref().into(), c.clone());
        c
    }

    async fn direct(
        &self,
        headers: &HeaderMap,
        peer_certs: Option<&[CertificateDer<'static>]>,
        peer: Option<IpAddr>,
    ) -> Result<(Holder, Proof), Refusal> {
        if let Some(leaf) = peer_certs.and_then(|c| c.first()) {
            return match self.caller_of_cert_cached(leaf) {
                Some(Ok(caller)) => {
                    use sha2::Digest;
                    let instance = short_digest("cert:", &sha2::Sha256::digest(leaf.as_ref()));
                    Ok((Holder { caller, instance }, Proof::Certificate))
                }
                Some(Err(e)) => Err(Refusal::Unauthenticated(format!("client certificate: {e}"))),
                None => Err(Refusal::Unauthenticated(
                    "the client certificate names no gpuledger identity (a spiffe://gpuledger/… URI SAN)"
                        .into(),
                )),
            };
        }
        let Some(auth) = headers.get(http::header::AUTHORIZATION) else {
            return Err(Refusal::Unauthenticated(
                "no credentials: send a ServiceAccount token for audience gpuledger \
                 (authorization: Bearer …) or a client certificate"
                    .into(),
            ));
        };
        Ok((self.bearer(auth, peer).await?, Proof::Token))
    }

    /// The caller an `authorization: Bearer …` value names, and which of its holders it is.
    async fn bearer(&self, auth: &HeaderValue, peer: Option<IpAddr>) -> Result<Holder, Refusal> {
        let token = auth
            .to_str()
            .ok()
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| Refusal::Unauthenticated("malformed authorization header".into()))?;
        let Some(tokens) = &self.tokens else {
            return Err(Refusal::Unauthenticated(
                "this allocator accepts client certificates only (it has no Kubernetes API to \
                 review tokens with)"
                    .into(),
            ));
        };
        match tokens.holder_from(token, peer).await {
            Ok(Ok(c)) => Ok(c),
            Ok(Err(e @ TokenError::NoRole(..))) => Err(Refusal::PermissionDenied(e.to_string())),
            Ok(Err(e)) => Err(Refusal::Unauthenticated(e.to_string())),
            Err(e @ Unreviewed::Throttled(_)) => Err(Refusal::Throttled(e.to_string())),
            Err(Unreviewed::Unavailable(e)) => Err(Refusal::Unavailable(e.to_string())),
        }
    }
}

/// The tower layer that authenticates every request before the service sees it.
#[derive(Clone)]
pub struct AuthLayer(pub Arc<Authenticator>);

impl<S> tower::Layer<S> for AuthLayer {
    type Service = AuthService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        AuthService {
            auth: self.0.clone(),
            inner,
        }
    }
}

/// See [`AuthLayer`].
#[derive(Clone)]
pub struct AuthService<S> {
    auth: Arc<Authenticator>,
    inner: S,
}

fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/grpc"))
}

/// Why a request's body was not read.
enum Unread {
    /// It did not arrive within the time bound.
    Late,
    /// It was larger than the bound.
    TooLarge,
    /// The stream broke (the client reset it).
    Broken(String),
    /// It is not one gRPC message (a frame header and as many bytes as it announces).
    Malformed(String),
}

/// Why `body` (of a gRPC request, compressed when `compressed`) is not exactly one message:
/// each RPC's request is one message, and tonic would answer anything else with INTERNAL.
fn malformed_frame(body: &[u8], compressed: bool) -> Option<String> {
    let Some((header, message)) = body.split_first_chunk::<5>() else {
        return Some(format!(
            "a request of {} bytes holds no gRPC message (5 bytes of header, then the message)",
            body.len()
        ));
    };
    let [flag, len @ ..] = header;
    match (flag, compressed) {
        (0, _) | (1, true) => {}
        (1, false) => {
            return Some("a message flagged compressed without a grpc-encoding header".to_string());
        }
        (f, _) => return Some(format!("a message with the compression flag {f} (0 or 1)")),
    }
    let announced = u32::from_be_bytes(*len) as usize;
    (announced != message.len()).then(|| {
        format!(
            "a gRPC message announced as {announced} bytes in a request body of {} bytes after \
             its header (each RPC takes exactly one message)",
            message.len()
        )
    })
}

impl Authenticator {
    /// `req` with its whole body read, within [`CallerLimits::body_timeout`] and
    /// [`CallerLimits::max_body`] (no RPC streams its request: each is one message).
    async fn arrived(&self, req: Request<Body>) -> Result<Request<Body>, Unread> {
        use http_body_util::BodyExt;
        let (parts, body) = req.into_parts();
        let read = http_body_util::Limited::new(body, self.max_body).collect();
        let read = if self.body_timeout.is_zero() {
            read.await
        } else {
            tokio::time::timeout(self.body_timeout, read)
                .await
                .map_err(|_| Unread::Late)?
        };
        let body = read.map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                Unread::TooLarge
            } else {
                Unread::Broken(e.to_string())
            }
        })?;
        let body = body.to_bytes();
        if is_grpc(&parts.headers)
            && let Some(why) = malformed_frame(&body, parts.headers.contains_key("grpc-encoding"))
        {
            return Err(Unread::Malformed(why));
        }
        Ok(Request::from_parts(
            parts,
            Body::new(http_body_util::Full::new(body)),
        ))
    }

    /// The answer to a request whose body was not read (counted).
    fn unread(&self, why: Unread) -> Response<Body> {
        let bite = |limit| {
            if let Some(b) = &self.bites {
                b.bite(limit);
            }
        };
        match why {
            Unread::Late => {
                bite(BITE_BODY_TIMEOUT);
                tonic::Status::deadline_exceeded(format!(
                    "the request's message did not arrive within {} ms of its headers \
                     (--request-body-timeout-ms)",
                    self.body_timeout.as_millis()
                ))
            }
            Unread::TooLarge => {
                bite(BITE_BODY_BYTES);
                tonic::Status::out_of_range(format!(
                    "the request is larger than {} bytes",
                    self.max_body
                ))
            }
            Unread::Broken(e) => tonic::Status::cancelled(format!("reading the request: {e}")),
            Unread::Malformed(why) => tonic::Status::invalid_argument(why),
        }
        .into_http()
    }
}

impl<S> tower::Service<Request<Body>> for AuthService<S>
where
    S: tower::Service<Request<Body>, Response = Response<Body>> + Clone + Send + 'static,
    S::Future: Send,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Response<Body>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        // The clone is the ready one: take it and leave a fresh clone behind.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let auth = self.auth.clone();
        Box::pin(async move {
            let info = req.extensions().get::<TlsConnectInfo<ConnInfo>>();
            let certs = info.and_then(|i| i.peer_certs());
            let peer = info
                .and_then(|i| i.get_ref().tcp.remote_addr)
                .map(|a| peer_key(&a));
            let brake = info.map(|i| i.get_ref().brake.clone());
            // The connection is busy (not to be evicted for a newcomer) from the request's
            // arrival until its answer, streams included, has been sent.
            let busy = info
                .and_then(|i| i.get_ref().held.as_ref())
                .map(|h| h.busy());
            let grpc = is_grpc(req.headers());
            let a = match auth
                .identify(req.headers(), certs.as_deref().map(|v| &v[..]), peer)
                .await
            {
                Ok(a) => a,
                Err((refusal, shared)) => {
                    if matches!(refusal, Refusal::Throttled(_)) {
                        auth.slow_down(brake.as_ref(), shared);
                    }
                    return Ok(refusal.answer(grpc));
                }
            };
            // A slot in flight only once the request has arrived: a request whose body never
            // comes holds none, and waits at most the body's time bound.
            let mut req = match auth.arrived(req).await {
                Ok(req) => req,
                Err(why) => return Ok(auth.unread(why)),
            };
            // The slot is the original caller's, also for a forwarded call; a refusal brakes
            // the connection only when nobody else's calls travel on it.
            let _slot = match auth.in_flight(&a) {
                Ok(slot) => slot,
                Err(refusal) => {
                    auth.slow_down(brake.as_ref(), a.shares_connection());
                    return Ok(refusal.answer(grpc));
                }
            };
            req.extensions_mut().insert(a.clone());
            let res = the_callers_fault(inner.call(req).await?);
            if over_a_limit(&res) {
                auth.slow_down(brake.as_ref(), a.shares_connection());
            }
            // The guard lives as long as the answer's body being sent.
            Ok(res.map(|b| {
                Body::new(http_body_util::BodyExt::map_err(b, move |e| {
                    let _busy = &busy;
                    e
                }))
            }))
        })
    }
}

/// The metadata key that marks a refusal by a limit (its value names the limit): such an
/// answer pauses the caller's connection ([`CallerLimits::pause`]). A refusal for want of GPU
/// room is `RESOURCE_EXHAUSTED` too, and pauses nothing.
pub const OVER_LIMIT: &str = "x-gpuledger-limit";

/// `status`, marked as a refusal by `limit` (see [`OVER_LIMIT`]).
pub fn over_limit(mut status: tonic::Status, limit: &'static str) -> tonic::Status {
    status.metadata_mut().insert(
        OVER_LIMIT,
        tonic::metadata::MetadataValue::from_static(limit),
    );
    status
}

/// The answer, INVALID_ARGUMENT where tonic answered a message that does not decode with
/// INTERNAL (prost's decode error, which tonic maps so): the caller's malformed message is no
/// failure of the server. The framing was checked before ([`malformed_frame`]).
fn the_callers_fault(mut res: Response<Body>) -> Response<Body> {
    const UNDECODABLE: &str = "failed to decode Protobuf message";
    let h = res.headers();
    let internal = h.get("grpc-status").is_some_and(|v| v == "13");
    let undecodable = h
        .get("grpc-message")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|m| {
            m.starts_with(UNDECODABLE) || m.starts_with(&UNDECODABLE.replace(' ', "%20"))
        });
    if internal && undecodable {
        res.headers_mut()
            .insert("grpc-status", HeaderValue::from_static("3"));
    }
    res
}

/// Whether an answer refuses its call for being over a limit.
fn over_a_limit(res: &Response<Body>) -> bool {
    res.headers().contains_key(OVER_LIMIT)
}
