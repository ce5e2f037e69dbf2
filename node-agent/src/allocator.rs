//! The agent's connections to the allocator replicas: the one client ([`gpuledger_client`])
//! for calls, and connections of their own for the long-lived subscription stream.

use std::future::Future;
use std::time::Duration;

use gpuledger_auth::Credentials;
use gpuledger_client::{Allocators, Client, ClientError, Options};
use tonic::Status;

/// The allocator replicas this agent may talk to.
pub struct Pool {
    calls: Allocators,
    /// Separate connections for the subscription stream: no time limit, pinged while idle.
    streams: Allocators,
}

impl Pool {
    /// Lazy connections to `addrs` (host:port), over TLS, as the caller `creds` names.
    pub fn new(addrs: &[String], creds: &Credentials) -> Result<Pool, ClientError> {
        let opts = Options {
            keepalive: Duration::from_secs(5),
            keepalive_timeout: Duration::from_secs(5),
            keepalive_while_idle: true,
            ..Options::default()
        };
        let calls = Allocators::new(addrs, creds, &opts)?;
        let streams = Allocators::new(
            addrs,
            creds,
            &Options {
                timeout: None,
                ..opts
            },
        )?;
        Ok(Pool { calls, streams })
    }

    /// Number of addresses.
    pub fn len(&self) -> usize {
        self.calls.len()
    }

    /// Whether there are no addresses (never: `new` refuses that).
    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// The subscription client and address at position `i` (modulo the count).
    pub fn stream_at(&self, i: usize) -> (String, Client) {
        let (addr, c) = self.streams.client(i);
        (addr.to_string(), c)
    }

    /// Call `f` (the allocator RPC `rpc`) on a replica, moving on while they cannot answer,
    /// until `budget` has passed.
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
        self.calls.call(rpc, budget, f).await
    }
}
