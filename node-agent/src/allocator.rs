//! Clients to the allocator replicas: any replica serves (followers forward writes), so a call
//! that fails with a transport error moves on to the next address.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use backon::{ExponentialBuilder, Retryable};
use gpuledger_proto::allocator::v1::allocator_client::AllocatorClient;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};
use tracing::{Instrument, info_span};

/// The allocator replicas this agent may talk to.
pub struct Pool {
    clients: Vec<(String, AllocatorClient<Channel>)>,
    /// Separate connections for the long-lived subscription stream.
    streams: Vec<AllocatorClient<Channel>>,
    next: AtomicUsize,
}

/// Whether a failure may succeed on retry (possibly at another replica).
pub fn retryable(s: &Status) -> bool {
    matches!(
        s.code(),
        Code::Unavailable
            | Code::DeadlineExceeded
            | Code::Cancelled
            | Code::Unknown
            | Code::Aborted
    )
}

impl Pool {
    /// Lazy clients to `addrs` (host:port).
    pub fn new(addrs: &[String]) -> anyhow::Result<Pool> {
        anyhow::ensure!(
            !addrs.is_empty(),
            "no allocator address given (--allocator)"
        );
        let mut clients = Vec::new();
        let mut streams = Vec::new();
        for a in addrs {
            let url = if a.contains("://") {
                a.clone()
            } else {
                format!("http://{a}")
            };
            let ep = Endpoint::from_shared(url)?
                .connect_timeout(Duration::from_millis(500))
                .tcp_nodelay(true)
                .http2_keep_alive_interval(Duration::from_secs(5))
                .keep_alive_timeout(Duration::from_secs(5))
                .keep_alive_while_idle(true);
            clients.push((
                a.clone(),
                AllocatorClient::new(ep.clone().timeout(Duration::from_secs(10)).connect_lazy()),
            ));
            streams.push(AllocatorClient::new(ep.connect_lazy()));
        }
        Ok(Pool {
            clients,
            streams,
            next: AtomicUsize::new(0),
        })
    }

    /// Number of addresses.
    pub fn len(&self) -> usize {
        self.clients.len()
    }

    /// Whether there are no addresses (never: `new` refuses that).
    pub fn is_empty(&self) -> bool {
        self.clients.is_empty()
    }

    /// The client and address at position `i` (modulo the count).
    pub fn at(&self, i: usize) -> (String, AllocatorClient<Channel>) {
        let (a, c) = &self.clients[i % self.clients.len()];
        (a.clone(), c.clone())
    }

    /// The subscription client and address at position `i` (modulo the count).
    pub fn stream_at(&self, i: usize) -> (String, AllocatorClient<Channel>) {
        let n = i % self.clients.len();
        (self.clients[n].0.clone(), self.streams[n].clone())
    }

    /// Call `f` (the allocator RPC `rpc`) on a replica, moving to the next one on retryable
    /// errors and pausing between rounds (backon's exponential backoff) until `budget` has
    /// passed; each attempt runs in an `allocator` span naming the RPC and the replica. The
    /// replica that answered stays the first choice for the next call.
    pub async fn call<T, F, Fut>(
        &self,
        rpc: &'static str,
        budget: Duration,
        f: F,
    ) -> Result<T, Status>
    where
        F: Fn(AllocatorClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let deadline = Instant::now() + budget;
        let in_time = |s: &Status| retryable(s) && Instant::now() < deadline;
        let start = self.next.load(Ordering::Relaxed);
        // One round tries every replica once, from the one that answered last.
        let round = || async {
            let mut last = Status::unavailable("no allocator address");
            for k in 0..self.clients.len() {
                let i = (start + k) % self.clients.len();
                let (addr, c) = self.at(i);
                let span = info_span!("allocator", rpc, replica = %addr);
                match f(c).instrument(span).await {
                    Ok(r) => {
                        self.next.store(i, Ordering::Relaxed);
                        return Ok(r.into_inner());
                    }
                    Err(s) if in_time(&s) => {
                        tracing::debug!(%addr, "allocator call failed, trying the next replica: {s}");
                        last = s;
                    }
                    Err(s) => return Err(s),
                }
            }
            Err(last)
        };
        // Between rounds: 20 ms, doubling to 500 ms, until the budget is spent.
        round
            .retry(
                ExponentialBuilder::new()
                    .with_min_delay(Duration::from_millis(20))
                    .with_max_delay(Duration::from_millis(500))
                    .without_max_times(),
            )
            .when(in_time)
            .await
    }
}
