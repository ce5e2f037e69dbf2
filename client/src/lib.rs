//! The one client of the allocator API.
//!
//! Every caller of the allocator (the extender, the node agent, the CLI, the test kit and the
//! benchmarks) reaches its replicas through [`Allocators`]. Any replica answers reads and
//! forwards writes to the leader, so a call that fails in a way [`is_retryable`] allows moves
//! on to the next replica; once every replica failed, the round starts again after a pause
//! (backon's exponential backoff, 20 ms doubling to 500 ms) until the caller's budget is spent.
//! The replica that answered last is tried first by the next call.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use gpuledger_auth::{AuthChannel, Credentials};
use gpuledger_proto::allocator::v1::allocator_client::AllocatorClient;
use tokio::time::Instant;
use tonic::{Code, Status};
use tracing::{Instrument, debug, info_span};

/// A client of the allocator API on one replica, carrying the caller's credentials.
pub type Client = AllocatorClient<AuthChannel>;

/// Whether a call that failed so may succeed when tried again, at this replica or another:
/// the replica is unreachable, slow or going away (`Unavailable`, `DeadlineExceeded`,
/// `Cancelled`, `Unknown`: a transport failure) or asks to be tried again (`Aborted`). Every
/// other code is the allocator's answer, and the same at every replica.
pub fn is_retryable(s: &Status) -> bool {
    matches!(
        s.code(),
        Code::Unavailable
            | Code::DeadlineExceeded
            | Code::Cancelled
            | Code::Unknown
            | Code::Aborted
    )
}

/// The pauses between rounds: 20 ms, doubling to 500 ms.
fn backoff() -> ExponentialBuilder {
    ExponentialBuilder::new()
        .with_min_delay(Duration::from_millis(20))
        .with_max_delay(Duration::from_millis(500))
        .without_max_times()
}

/// Why the client could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No allocator address was given (not retryable: a configuration error).
    #[error("no allocator address given (--allocator)")]
    NoAddress,
    /// An address is neither `host:port` nor a URL (not retryable: a configuration error).
    #[error("bad allocator address {addr:?}: {source}")]
    Address {
        /// The address as given.
        addr: String,
        /// What is wrong with it.
        source: tonic::transport::Error,
    },
}

/// How the connections to the replicas behave.
#[derive(Debug, Clone)]
pub struct Options {
    /// How long opening a connection may take.
    pub connect_timeout: Duration,
    /// How long one attempt may take (None: no limit, for long-lived streams).
    pub timeout: Option<Duration>,
    /// HTTP/2 keepalive pings every this long.
    pub keepalive: Duration,
    /// How long a keepalive ping may go unanswered before the connection is dropped.
    pub keepalive_timeout: Duration,
    /// Ping also while no call is open (a connection that must notice a dead peer at once).
    pub keepalive_while_idle: bool,
    /// The largest message the client decodes.
    pub max_decoding: usize,
    /// The largest message the client encodes.
    pub max_encoding: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            connect_timeout: Duration::from_millis(500),
            timeout: Some(Duration::from_secs(10)),
            keepalive: Duration::from_secs(10),
            keepalive_timeout: Duration::from_secs(20),
            keepalive_while_idle: false,
            max_decoding: 64 * 1024 * 1024,
            max_encoding: usize::MAX,
        }
    }
}

/// Lazy connections to every allocator replica, and which one answered last.
#[derive(Clone)]
pub struct Allocators {
    replicas: Arc<[(String, AuthChannel)]>,
    next: Arc<AtomicUsize>,
    max_decoding: usize,
    max_encoding: usize,
}

impl Allocators {
    /// Lazy connections to `addrs` (`host:port` or URLs), over TLS, as the caller `creds`.
    pub fn new(
        addrs: &[String],
        creds: &Credentials,
        opts: &Options,
    ) -> Result<Allocators, ClientError> {
        if addrs.is_empty() {
            return Err(ClientError::NoAddress);
        }
        let mut replicas = Vec::with_capacity(addrs.len());
        for a in addrs {
            let mut ep = gpuledger_auth::endpoint(a)
                .map_err(|source| ClientError::Address {
                    addr: a.clone(),
                    source,
                })?
                .connect_timeout(opts.connect_timeout)
                .tcp_nodelay(true)
                .http2_keep_alive_interval(opts.keepalive)
                .keep_alive_timeout(opts.keepalive_timeout)
                .keep_alive_while_idle(opts.keepalive_while_idle);
            if let Some(t) = opts.timeout {
                ep = ep.timeout(t);
            }
            replicas.push((a.clone(), creds.channel(ep)));
        }
        Ok(Allocators {
            replicas: replicas.into(),
            next: Arc::new(AtomicUsize::new(0)),
            max_decoding: opts.max_decoding,
            max_encoding: opts.max_encoding,
        })
    }

    /// These connections, tried first from replica `i` (modulo the count) by this handle
    /// and its clones.
    pub fn starting_at(&self, i: usize) -> Allocators {
        Allocators {
            next: Arc::new(AtomicUsize::new(i % self.replicas.len())),
            ..self.clone()
        }
    }

    /// The replicas' addresses.
    pub fn addrs(&self) -> impl Iterator<Item = &str> {
        self.replicas.iter().map(|(a, _)| a.as_str())
    }

    /// How many replicas there are (at least one).
    pub fn len(&self) -> usize {
        self.replicas.len()
    }

    /// Whether there are none (never: [`Allocators::new`] refuses that).
    pub fn is_empty(&self) -> bool {
        self.replicas.is_empty()
    }

    /// The address of replica `i` (modulo the count) and a client to it, for a call the
    /// caller keeps open itself (a stream).
    pub fn client(&self, i: usize) -> (&str, Client) {
        let (addr, ch) = &self.replicas[i % self.replicas.len()];
        let c = AllocatorClient::new(ch.clone())
            .max_decoding_message_size(self.max_decoding)
            .max_encoding_message_size(self.max_encoding);
        (addr, c)
    }

    /// Run `f` (the allocator RPC `rpc`) on a replica, moving on to the next one while the
    /// error [`is_retryable`], and trying every replica again after a pause until `budget`
    /// has passed (zero: one round). Each attempt runs in an `allocator` span naming the RPC
    /// and the replica. When no replica answered, the error says "ledger unavailable" and
    /// what each replica said last.
    pub async fn call<T, F, Fut>(
        &self,
        rpc: &'static str,
        budget: Duration,
        f: F,
    ) -> Result<T, Status>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let deadline = Instant::now() + budget;
        let n = self.replicas.len();
        let start = self.next.load(Ordering::Relaxed);
        let mut pauses = backoff().build();
        let mut said: Vec<Option<String>> = vec![None; n];
        loop {
            for k in 0..n {
                let i = (start + k) % n;
                let (addr, client) = self.client(i);
                let span = info_span!("allocator", rpc, replica = %addr);
                match f(client).instrument(span.clone()).await {
                    Ok(r) => {
                        self.next.store(i, Ordering::Relaxed);
                        return Ok(r.into_inner());
                    }
                    Err(s) if is_retryable(&s) => {
                        span.in_scope(|| debug!("no answer, trying the next replica: {s}"));
                        said[i] = Some(format!("{addr}: {}", s.message()));
                    }
                    Err(s) => return Err(s),
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let pause = pauses.next().unwrap_or(Duration::from_millis(500));
            tokio::time::sleep(pause.min(left)).await;
        }
        self.next.store((start + 1) % n, Ordering::Relaxed);
        let detail = said.into_iter().flatten().collect::<Vec<_>>().join("; ");
        Err(Status::unavailable(
            if detail.contains("ledger unavailable") {
                format!("gpuledger {detail}")
            } else {
                format!("gpuledger ledger unavailable: no allocator replica answered ({detail})")
            },
        ))
    }
}

#[cfg(test)]
mod tests;
