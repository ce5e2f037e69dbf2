//! ServiceAccount tokens: verified by the API server's TokenReview, mapped to a role, cached.
//!
//! Each component runs under its own ServiceAccount and sends a projected token with the
//! audience `gpuledger`. The API server says whether the token is valid for that audience and
//! whose it is; a node agent's token is bound to its pod, and the pod's `spec.nodeName` is the
//! node it may touch. Answers are cached until the token expires (capped), so a token costs
//! one review per cache lifetime however many calls it makes.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use futures::future::BoxFuture;
use sha2::{Digest, Sha256};

use crate::identity::{Caller, Holder, Role, short_digest};
use crate::limit::Bites;

/// The audience gpuledger's tokens are requested for.
pub const AUDIENCE: &str = "gpuledger";

/// TokenReview's extra key for the pod a bound token belongs to.
pub const POD_NAME_KEY: &str = "authentication.kubernetes.io/pod-name";
/// TokenReview's extra key for that pod's UID.
pub const POD_UID_KEY: &str = "authentication.kubernetes.io/pod-uid";

/// What the API server said of a token.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Review {
    /// Whether the token is valid (for one of the requested audiences).
    pub authenticated: bool,
    /// Whose it is (`system:serviceaccount:<ns>:<name>` for a ServiceAccount).
    pub username: String,
    /// Extra attributes (the pod of a bound token).
    pub extra: BTreeMap<String, Vec<String>>,
    /// The requested audiences the token is valid for.
    pub audiences: Vec<String>,
    /// The API server's reason when not authenticated.
    pub error: String,
}

/// The API server could not answer (retry later; nothing is cached).
#[derive(Debug, Clone, thiserror::Error)]
#[error("the Kubernetes API server could not check the credentials: {0}")]
pub struct Unavailable(pub String);

/// Asks the API server about a token (TokenReview).
pub trait TokenReviewer: Send + Sync {
    /// Review `token` for `audience`.
    fn review<'a>(
        &'a self,
        token: &'a str,
        audience: &'a str,
    ) -> BoxFuture<'a, Result<Review, Unavailable>>;
}

/// Finds the node a pod runs on.
pub trait PodNodes: Send + Sync {
    /// The `spec.nodeName` of pod `namespace/name` if its UID is `uid` (None: no such pod,
    /// another pod of that name, or not scheduled yet).
    fn node_of<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        uid: &'a str,
    ) -> BoxFuture<'a, Result<Option<String>, Unavailable>>;
}

/// The ServiceAccounts gpuledger's roles run as, in one namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceAccounts {
    /// The namespace gpuledger is installed in.
    pub namespace: String,
    /// The allocator replicas'.
    pub allocator: String,
    /// The extender's.
    pub extender: String,
    /// The node agents'.
    pub node_agent: String,
    /// Read-only operators' (tokens made with `kubectl create token`).
    pub viewer: String,
    /// Operators who may write.
    pub admin: String,
}

impl ServiceAccounts {
    /// gpuledger's default account names in `namespace`.
    pub fn in_namespace(namespace: &str) -> Self {
        ServiceAccounts {
            namespace: namespace.to_string(),
            allocator: "gpuledger-allocator".into(),
            extender: "gpuledger-extender".into(),
            node_agent: "gpuledger-node-agent".into(),
            viewer: "gpuledger-viewer".into(),
            admin: "gpuledger-admin".into(),
        }
    }

    fn account_of<'u>(&self, username: &'u str) -> Option<&'u str> {
        username
            .strip_prefix("system:serviceaccount:")?
            .strip_prefix(self.namespace.as_str())?
            .strip_prefix(':')
    }
}

/// Why a token does not authenticate a caller.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// The API server does not accept the token for this audience (bad, expired, revoked, or
    /// issued for another audience).
    #[error("the token is not valid for audience {AUDIENCE:?}: {0}")]
    Invalid(String),
    /// A valid token of an account that has no gpuledger role.
    #[error("{0} has no gpuledger role (expected one of the ServiceAccounts {1})")]
    NoRole(String, String),
    /// A node agent's token that is not bound to a running pod on a node.
    #[error("the node agent's token is not bound to a scheduled pod ({0})")]
    Unbound(String),
}

type Verdict = Result<Caller, TokenError>;

#[derive(Clone)]
struct Cached {
    verdict: Verdict,
    /// The UID of the pod the token is bound to, if it is.
    pod_uid: Option<String>,
    ttl: Duration,
}

struct Expiry;

impl moka::Expiry<[u8; 32], Cached> for Expiry {
    fn expire_after_create(
        &self,
        _key: &[u8; 32],
        value: &Cached,
        _created_at: std::time::Instant,
    ) -> Option<Duration> {
        Some(value.ttl)
    }
}

/// Turns bearer tokens into callers: TokenReview, the role mapping, the pod's node, a cache.
pub struct TokenAuthenticator {
    reviewer: Arc<dyn TokenReviewer>,
    pods: Arc<dyn PodNodes>,
    accounts: ServiceAccounts,
    cache: moka::future::Cache<[u8; 32], Cached>,
    max_ttl: Duration,
    reviews: AtomicU64,
    /// Reviews that refused the token, per peer address, in the current window.
    failures: moka::future::Cache<IpAddr, Arc<AtomicU64>>,
    max_failures_per_peer: u64,
    bites: Arc<Bites>,
}

/// Why a token was not reviewed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Unreviewed {
    /// The API server could not answer (retry later; nothing is cached).
    #[error(transparent)]
    Unavailable(#[from] Unavailable),
    /// The caller's address sent too many tokens that the API server refused, lately: new
    /// tokens from it are not reviewed until the window passes (retry later).
    #[error(
        "too many refused tokens from {0} in the last {FAILURE_WINDOW:?}: new tokens from it are \
         not reviewed for now (--max-failed-token-reviews-per-peer); retry later"
    )]
    Throttled(IpAddr),
}

/// The limit name refused reviews are counted under.
pub const BITE_FAILED_REVIEWS: &str = "token_reviews_failed_per_peer";
/// The window over which a peer's refused reviews are counted.
pub const FAILURE_WINDOW: Duration = Duration::from_secs(60);
/// How far a token's expiry may lie in the past (clock skew with the API server) before it
/// is refused without a review.
const EXPIRY_SKEW_S: u64 = 300;

/// How long a refusal is remembered (so a client retrying a bad token costs few reviews).
const REFUSAL_TTL: Duration = Duration::from_secs(10);
/// How long a verdict is kept when the token carries no readable expiry.
const UNKNOWN_EXPIRY_TTL: Duration = Duration::from_secs(60);

impl TokenAuthenticator {
    /// Verify tokens with `reviewer`, find nodes with `pods`; keep a verdict at most `max_ttl`.
    pub fn new(
        reviewer: Arc<dyn TokenReviewer>,
        pods: Arc<dyn PodNodes>,
        accounts: ServiceAccounts,
        max_ttl: Duration,
    ) -> Self {
        TokenAuthenticator {
            reviewer,
            pods,
            accounts,
            cache: moka::future::Cache::builder()
                .max_capacity(100_000)
                .expire_after(Expiry)
                .build(),
            max_ttl,
            reviews: AtomicU64::new(0),
            failures: moka::future::Cache::builder()
                .max_capacity(100_000)
                .time_to_live(FAILURE_WINDOW)
                .build(),
            max_failures_per_peer: u64::MAX,
            bites: Bites::new(),
        }
    }

    /// Review at most `max` refused tokens per peer address per [`FAILURE_WINDOW`] (0 = no
    /// bound), counting what is throttled in `bites`.
    pub fn with_failure_limit(mut self, max: u64, bites: Arc<Bites>) -> Self {
        bites.declare(BITE_FAILED_REVIEWS);
        self.max_failures_per_peer = if max == 0 { u64::MAX } else { max };
        self.bites = bites;
        self
    }

    /// TokenReviews sent so far.
    pub fn reviews(&self) -> u64 {
        self.reviews.load(Ordering::Relaxed)
    }

    /// The caller `token` authenticates. Concurrent calls with the same token share one review.
    pub async fn authenticate(&self, token: &str) -> Result<Verdict, Unavailable> {
        match self.authenticate_from(token, None).await {
            Ok(v) => Ok(v),
            Err(Unreviewed::Unavailable(u)) => Err(u),
            // Without a peer nothing is throttled; were it, the token would be refused.
            Err(e @ Unreviewed::Throttled(_)) => Ok(Err(TokenError::Invalid(e.to_string()))),
        }
    }

    /// [`TokenAuthenticator::authenticate`] for a caller at `peer`: a token that is not even
    /// shaped like one of the API server's (a JWT for audience gpuledger that has not expired)
    /// is refused without a review, and a peer whose tokens the API server keeps refusing
    /// gets no more reviews for a while.
    pub async fn authenticate_from(
        &self,
        token: &str,
        peer: Option<IpAddr>,
    ) -> Result<Verdict, Unreviewed> {
        Ok(self.holder_from(token, peer).await?.map(|h| h.caller))
    }

    /// [`TokenAuthenticator::authenticate_from`], naming which of the caller's holders sent
    /// the token: the pod a projected token is bound to, else the token itself (a digest).
    pub async fn holder_from(
        &self,
        token: &str,
        peer: Option<IpAddr>,
    ) -> Result<Result<Holder, TokenError>, Unreviewed> {
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let holder = |c: Cached| {
            c.verdict.map(|caller| Holder {
                caller,
                instance: match c.pod_uid {
                    Some(uid) => format!("pod:{uid}"),
                    None => short_digest("token:", &key),
                },
            })
        };
        if let Some(c) = self.cache.get(&key).await {
            return Ok(holder(c));
        }
        if let Err(why) = plausible(token, now_unix()) {
            return Ok(Err(TokenError::Invalid(why)));
        }
        let failures = match peer {
            Some(p) => {
                let n = self
                    .failures
                    .get_with(p, async { Arc::new(AtomicU64::new(0)) })
                    .await;
                if n.load(Ordering::Relaxed) >= self.max_failures_per_peer {
                    self.bites.bite(BITE_FAILED_REVIEWS);
                    return Err(Unreviewed::Throttled(p));
                }
                Some(n)
            }
            None => None,
        };
        let cached = self
            .cache
            .try_get_with(key, async {
                self.reviews.fetch_add(1, Ordering::Relaxed);
                let (verdict, pod_uid) = self.verify(token).await?;
                let ttl = match &verdict {
                    Ok(_) => ttl_until_expiry(token, now_unix()).map_or(UNKNOWN_EXPIRY_TTL, |t| t),
                    Err(_) => {
                        if let Some(n) = &failures {
                            n.fetch_add(1, Ordering::Relaxed);
                        }
                        REFUSAL_TTL
                    }
                }
                .min(self.max_ttl);
                Ok::<_, Unavailable>(Cached {
                    verdict,
                    pod_uid,
                    ttl,
                })
            })
            .await
            .map_err(|e: Arc<Unavailable>| (*e).clone())?;
        Ok(holder(cached))
    }

    /// The verdict on `token`, and the UID of the pod it is bound to, if it is.
    async fn verify(&self, token: &str) -> Result<(Verdict, Option<String>), Unavailable> {
        let r = self.reviewer.review(token, AUDIENCE).await?;
        let pod_uid = r
            .extra
            .get(POD_UID_KEY)
            .and_then(|v| v.first())
            .filter(|_| r.authenticated)
            .cloned();
        Ok((self.judge(r).await?, pod_uid))
    }

    async fn judge(&self, r: Review) -> Result<Verdict, Unavailable> {
        if !r.authenticated {
            let why = if r.error.is_empty() {
                "not authenticated".to_string()
            } else {
                r.error
            };
            return Ok(Err(TokenError::Invalid(why)));
        }
        if !r.audiences.iter().any(|a| a == AUDIENCE) {
            return Ok(Err(TokenError::Invalid(format!(
                "issued for {:?}",
                r.audiences
            ))));
        }
        let a = &self.accounts;
        let no_role = || {
            TokenError::NoRole(
                r.username.clone(),
                format!(
                    "{ns}/{{{},{},{},{},{}}}",
                    a.allocator,
                    a.extender,
                    a.node_agent,
                    a.viewer,
                    a.admin,
                    ns = a.namespace
                ),
            )
        };
        let Some(account) = a.account_of(&r.username) else {
            return Ok(Err(no_role()));
        };
        let role = if account == a.allocator {
            Role::Allocator
        } else if account == a.extender {
            Role::Extender
        } else if account == a.viewer {
            Role::Viewer
        } else if account == a.admin {
            Role::Admin
        } else if account == a.node_agent {
            let one = |k: &str| r.extra.get(k).and_then(|v| v.first()).cloned();
            let (Some(pod), Some(uid)) = (one(POD_NAME_KEY), one(POD_UID_KEY)) else {
                return Ok(Err(TokenError::Unbound(
                    "no pod in the token: use a projected ServiceAccount token".into(),
                )));
            };
            match self.pods.node_of(&a.namespace, &pod, &uid).await? {
                Some(node) => Role::NodeAgent { node },
                None => {
                    return Ok(Err(TokenError::Unbound(format!(
                        "pod {}/{pod} (uid {uid}) does not exist or is not scheduled",
                        a.namespace
                    ))));
                }
            }
        } else {
            return Ok(Err(no_role()));
        };
        Ok(Ok(Caller {
            role,
            subject: r.username,
        }))
    }
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Whether `token` can be a ServiceAccount token for gpuledger at all: a JWT whose claims name
/// the audience `gpuledger` and an expiry not long past. Read without checking the signature:
/// it only spares the API server reviews of what it would refuse anyway.
pub fn plausible(token: &str, now_unix: u64) -> Result<(), String> {
    let claims = token
        .split('.')
        .nth(1)
        .filter(|_| token.split('.').count() == 3)
        .and_then(|p| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(p.trim_end_matches('='))
                .ok()
        })
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .ok_or_else(|| "not a ServiceAccount token (a JWT)".to_string())?;
    let aud = match claims.get("aud") {
        Some(serde_json::Value::String(a)) => a == AUDIENCE,
        Some(serde_json::Value::Array(a)) => a.iter().any(|a| a.as_str() == Some(AUDIENCE)),
        _ => false,
    };
    if !aud {
        return Err(format!("the token is not issued for audience {AUDIENCE:?}"));
    }
    match claims.get("exp").and_then(serde_json::Value::as_u64) {
        Some(exp) if exp.saturating_add(EXPIRY_SKEW_S) >= now_unix => Ok(()),
        Some(_) => Err("the token has expired".into()),
        None => Err("the token carries no expiry".into()),
    }
}

/// How long until the JWT `token` expires (its `exp` claim), read without checking the
/// signature: only ever used to bound how long the API server's verdict is kept.
pub fn ttl_until_expiry(token: &str, now_unix: u64) -> Option<Duration> {
    let payload = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let exp = claims.get("exp")?.as_u64()?;
    Some(Duration::from_secs(exp.saturating_sub(now_unix)))
}

/// The API server as the token reviewer and pod lookup.
#[derive(Clone)]
pub struct KubeApi(pub kube::Client);

impl TokenReviewer for KubeApi {
    fn review<'a>(
        &'a self,
        token: &'a str,
        audience: &'a str,
    ) -> BoxFuture<'a, Result<Review, Unavailable>> {
        use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
        Box::pin(async move {
            let api: kube::Api<TokenReview> = kube::Api::all(self.0.clone());
            let req = TokenReview {
                spec: TokenReviewSpec {
                    token: Some(token.to_string()),
                    audiences: Some(vec![audience.to_string()]),
                },
                ..TokenReview::default()
            };
            let answer = api
                .create(&kube::api::PostParams::default(), &req)
                .await
                .map_err(|e| Unavailable(format!("TokenReview: {e}")))?;
            let status = answer.status.unwrap_or_default();
            let user = status.user.unwrap_or_default();
            Ok(Review {
                authenticated: status.authenticated.unwrap_or(false),
                username: user.username.unwrap_or_default(),
                extra: user.extra.unwrap_or_default().into_iter().collect(),
                audiences: status.audiences.unwrap_or_default(),
                error: status.error.unwrap_or_default(),
            })
        })
    }
}

impl PodNodes for KubeApi {
    fn node_of<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        uid: &'a str,
    ) -> BoxFuture<'a, Result<Option<String>, Unavailable>> {
        use k8s_openapi::api::core::v1::Pod;
        Box::pin(async move {
            let api: kube::Api<Pod> = kube::Api::namespaced(self.0.clone(), namespace);
            let pod = api
                .get_opt(name)
                .await
                .map_err(|e| Unavailable(format!("reading pod {namespace}/{name}: {e}")))?;
            Ok(pod
                .filter(|p| p.metadata.uid.as_deref() == Some(uid))
                .and_then(|p| p.spec?.node_name))
        })
    }
}

#[cfg(test)]
mod tests;
