//! Reaching the allocator: any of several replica addresses.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use gpuledger_proto::allocator::v1::allocator_client::AllocatorClient;
use tonic::transport::{Channel, Endpoint};

/// Where the allocator is.
#[derive(clap::Args, Debug, Clone)]
pub struct Target {
    /// Allocator gRPC address(es), host:port, comma-separated; the first that answers is used.
    #[arg(
        long,
        env = "GPULEDGER_ALLOCATOR",
        value_delimiter = ',',
        default_value = "127.0.0.1:7420"
    )]
    pub allocator: Vec<String>,
}

/// A gRPC client to one address.
pub async fn connect_one(addr: &str) -> Result<AllocatorClient<Channel>> {
    let url = if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    };
    let ch = Endpoint::from_shared(url)
        .with_context(|| format!("bad allocator address {addr:?}"))?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(60))
        .connect()
        .await
        .with_context(|| format!("cannot reach the allocator at {addr}"))?;
    Ok(AllocatorClient::new(ch)
        .max_decoding_message_size(512 * 1024 * 1024)
        .max_encoding_message_size(64 * 1024 * 1024))
}

/// The first replica that answers.
pub async fn connect(t: &Target) -> Result<AllocatorClient<Channel>> {
    let mut errs = Vec::new();
    for a in &t.allocator {
        match connect_one(a).await {
            Ok(c) => return Ok(c),
            Err(e) => errs.push(format!("{e:#}")),
        }
    }
    bail!(
        "no allocator replica answered ({}); set --allocator or GPULEDGER_ALLOCATOR",
        errs.join("; ")
    )
}
