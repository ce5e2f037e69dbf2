//! The extender's connections to the allocator replicas: the one client
//! ([`gpuledger_client`]), each call one round over the replicas (the scheduler retries).

use std::time::Duration;

use gpuledger_auth::Credentials;
use gpuledger_client::{Client, ClientError, Options};
use tonic::Status;

/// Connections to every configured allocator replica.
#[derive(Clone)]
pub struct Allocators(gpuledger_client::Allocators);

impl Allocators {
    /// Lazy connections to `addrs` (`host:port` or URLs), over TLS, as the caller `creds`;
    /// each attempt may take `timeout`.
    pub fn new(
        addrs: &[String],
        timeout: Duration,
        creds: &Credentials,
    ) -> Result<Allocators, ClientError> {
        let opts = Options {
            timeout: Some(timeout),
            ..Options::default()
        };
        gpuledger_client::Allocators::new(addrs, creds, &opts).map(Allocators)
    }

    /// Run `f` (the allocator RPC `rpc`) against a replica, moving on to the others while they
    /// cannot answer; the final error of an unreachable ledger says so ("ledger
    /// unavailable").
    pub async fn call<T, F, Fut>(&self, rpc: &'static str, f: F) -> Result<T, Status>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, Status>>,
    {
        self.0.call(rpc, Duration::ZERO, f).await
    }
}
