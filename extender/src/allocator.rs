//! gRPC clients to the allocator replicas: any replica answers reads and forwards writes, so
//! a call moves on to the next replica when one is unreachable.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use gpuledger_proto::allocator::v1::allocator_client::AllocatorClient;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};
use tracing::{Instrument, info_span};

/// Connections to every configured allocator replica.
#[derive(Clone)]
pub struct Allocators {
    replicas: std::sync::Arc<Vec<(String, Channel)>>,
    next: std::sync::Arc<AtomicUsize>,
}

/// Whether trying another replica may help.
fn retry_elsewhere(s: &Status) -> bool {
    matches!(
        s.code(),
        Code::Unavailable | Code::DeadlineExceeded | Code::Unknown
    )
}

impl Allocators {
    /// Lazy connections to `addrs` (`host:port` or URLs).
    pub fn new(addrs: &[String], timeout: Duration) -> anyhow::Result<Allocators> {
        anyhow::ensure!(
            !addrs.is_empty(),
            "no allocator address given (--allocator)"
        );
        let mut replicas = Vec::new();
        for a in addrs {
            let url = if a.contains("://") {
                a.clone()
            } else {
                format!("http://{a}")
            };
            let ch = Endpoint::from_shared(url.clone())?
                .connect_timeout(Duration::from_millis(500))
                .timeout(timeout)
                .tcp_nodelay(true)
                .http2_keep_alive_interval(Duration::from_secs(10))
                .connect_lazy();
            replicas.push((a.clone(), ch));
        }
        Ok(Allocators {
            replicas: std::sync::Arc::new(replicas),
            next: std::sync::Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Run `f` (the allocator RPC `rpc`) against a replica, moving on to the others while they
    /// are unreachable; each attempt runs in an `allocator` span naming the RPC and the
    /// replica. The final error of an unreachable ledger says so ("ledger unavailable").
    pub async fn call<T, F, Fut>(&self, rpc: &'static str, f: F) -> Result<T, Status>
    where
        F: Fn(AllocatorClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let n = self.replicas.len();
        let start = self.next.load(Ordering::Relaxed);
        let mut errors = Vec::new();
        for k in 0..n {
            let i = (start + k) % n;
            let (addr, ch) = &self.replicas[i];
            let client =
                AllocatorClient::new(ch.clone()).max_decoding_message_size(64 * 1024 * 1024);
            let span = info_span!("allocator", rpc, replica = %addr);
            match f(client).instrument(span).await {
                Ok(r) => {
                    if k > 0 {
                        self.next.store(i, Ordering::Relaxed);
                    }
                    return Ok(r.into_inner());
                }
                Err(s) if retry_elsewhere(&s) => errors.push(format!("{addr}: {}", s.message())),
                Err(s) => return Err(s),
            }
        }
        self.next.store((start + 1) % n, Ordering::Relaxed);
        let detail = errors.join("; ");
        let msg = if detail.contains("ledger unavailable") {
            format!("gpuledger {detail}")
        } else {
            format!("gpuledger ledger unavailable: no allocator replica answered ({detail})")
        };
        Err(Status::unavailable(msg))
    }
}
