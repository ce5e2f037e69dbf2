//! Reaching the allocator (any of several replica addresses) and reading its log and state.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use gpuledger_auth::{CredentialArgs, Credentials};
use gpuledger_client::{Allocators, Options};
use gpuledger_ledger::pb;
use gpuledger_proto::allocator::v1 as api;
use tokio::sync::OnceCell;
use tonic::Status;
use tracing::debug;

use crate::discover;

/// Where the allocator is.
#[derive(clap::Args, Debug, Clone)]
pub struct Target {
    /// Allocator gRPC address(es), host:port, comma-separated; the first that answers is used.
    /// Given, it always wins. Not given: `gpuledger` uses 127.0.0.1:7420, and `kubectl
    /// gpuledger` (or `gpuledger` with --kubeconfig/--context) finds the allocator in the
    /// cluster and port-forwards to it.
    #[arg(long, env = "GPULEDGER_ALLOCATOR", value_delimiter = ',')]
    pub allocator: Vec<String>,
    #[command(flatten)]
    pub kube: discover::KubeArgs,
    /// Who this operator is to the allocator: a token of the `gpuledger-viewer` (read) or
    /// `gpuledger-admin` (write) ServiceAccount, or a client certificate. Through the
    /// kubeconfig (`kubectl gpuledger`) both are found when not given: a short token is
    /// requested for `gpuledger-viewer` and the CA is read from the ConfigMap `gpuledger-ca`.
    #[command(flatten)]
    pub credentials: CredentialArgs,
    /// The addresses once resolved: a command that connects several times sets up its
    /// port-forwards once.
    #[arg(skip)]
    resolved: Arc<OnceCell<Vec<String>>>,
}

/// The address `gpuledger` uses when told nothing else.
pub const DEFAULT_ALLOCATOR: &str = "127.0.0.1:7420";

impl Target {
    /// The replica addresses to use: explicit ones, or local port-forwards into the cluster,
    /// or the default.
    pub async fn addrs(&self) -> Result<Vec<String>> {
        self.resolved
            .get_or_try_init(|| self.resolve())
            .await
            .cloned()
    }

    async fn resolve(&self) -> Result<Vec<String>> {
        let given: Vec<String> = self
            .allocator
            .iter()
            .map(|a| a.trim().to_string())
            .filter(|a| !a.is_empty())
            .collect();
        if !given.is_empty() {
            return Ok(given);
        }
        if discover::is_plugin() || self.kube.given() {
            return discover::forward_allocators(&self.kube)
                .await
                .context("finding the allocator through the kubeconfig's cluster");
        }
        Ok(vec![DEFAULT_ALLOCATOR.to_string()])
    }
}

/// A client of the allocator API, carrying the operator's credentials.
pub type Client = gpuledger_client::Client;

impl Target {
    /// The operator's credentials: as given, or (through the kubeconfig) a fresh viewer
    /// token and the cluster's CA.
    pub async fn credentials(&self) -> Result<Credentials> {
        let mut args = self.credentials.clone();
        if (args.ca.is_none() || (args.token_file.is_none() && args.client_cert.is_none()))
            && self.allocator.is_empty()
            && (discover::is_plugin() || self.kube.given())
        {
            discover::fill_credentials(&self.kube, &mut args)
                .await
                .context("getting credentials through the kubeconfig")?;
        }
        Credentials::load(&args).context(
            "the allocator demands TLS and an identity: --allocator-ca with --token-file \
             (e.g. kubectl create token gpuledger-viewer -n gpuledger-system --audience \
             gpuledger) or --client-cert/--client-key",
        )
    }
}

/// How the CLI's connections behave: whole dumps and logs, a minute per call.
fn options() -> Options {
    Options {
        connect_timeout: Duration::from_secs(2),
        timeout: Some(Duration::from_secs(60)),
        max_decoding: 512 * 1024 * 1024,
        max_encoding: 64 * 1024 * 1024,
        ..Options::default()
    }
}

/// A client to the first of `a`'s replicas that answers a status call.
async fn answering(a: &Allocators) -> Result<Client, Status> {
    a.call("Status", Duration::ZERO, |mut c| async move {
        let r = c.status(api::StatusRequest {}).await;
        r.map(|_| tonic::Response::new(c))
    })
    .await
}

/// A gRPC client to one address (checks that it answers).
pub async fn connect_one(addr: &str, creds: &Credentials) -> Result<Client> {
    let a = Allocators::new(&[addr.to_string()], creds, &options())?;
    answering(&a)
        .await
        .map_err(|s| anyhow::anyhow!("{}", s.message()))
        .with_context(|| format!("cannot reach the allocator at {addr}"))
}

/// The first replica that answers.
pub async fn connect(t: &Target) -> Result<Client> {
    let creds = t.credentials().await?;
    let a = Allocators::new(&t.addrs().await?, &creds, &options())?;
    let c = answering(&a).await.map_err(|s| {
        // The client says which replica said what; the operator is told where to look.
        let m = s.message();
        let said = m
            .find(NO_ANSWER)
            .map_or_else(|| format!("{NO_ANSWER} ({m})"), |i| m[i..].to_string());
        anyhow::anyhow!("{said}; set --allocator or GPULEDGER_ALLOCATOR")
    })?;
    debug!("connected");
    Ok(c)
}

/// How the error of a call no replica answered begins.
const NO_ANSWER: &str = "no allocator replica answered";

/// One replica's name and its whole state.
pub async fn dump_of(c: &mut Client) -> Result<(String, pb::Snapshot)> {
    let d = c
        .dump(api::DumpRequest {})
        .await
        .map_err(|s| anyhow::anyhow!("dump failed: {}", s.message()))?
        .into_inner();
    Ok((d.replica, d.snapshot.context("dump without a snapshot")?))
}

/// Read the log from seq 1 to `to` (0 = the end), handing each event to `f` (false = stop).
#[tracing::instrument(name = "read_log", skip_all, fields(from_seq = 1, to_seq = to))]
pub async fn read_log(
    t: &Target,
    to: u64,
    mut f: impl FnMut(&pb::Event) -> Result<bool>,
) -> Result<()> {
    read_batches(t, to, |b| {
        for e in &b.events {
            if to > 0 && e.seq > to || !f(e)? {
                debug!(seq = e.seq, "stopped at this event");
                return Ok(false);
            }
        }
        Ok(true)
    })
    .await
}

/// The log from seq 1 to `to` (0: the end) batch by batch, as ReadLog streams it (each with
/// where it is stored and its hash), until `f` returns false.
pub async fn read_batches(
    t: &Target,
    to: u64,
    mut f: impl FnMut(&pb::EventBatch) -> Result<bool>,
) -> Result<()> {
    let mut c = connect(t).await?;
    let mut stream = c
        .read_log(api::ReadLogRequest {
            from_seq: 1,
            to_seq: to,
        })
        .await
        .map_err(|s| anyhow::anyhow!("reading the log: {}", s.message()))?
        .into_inner();
    let mut last = 0;
    while let Some(b) = stream
        .message()
        .await
        .map_err(|s| anyhow::anyhow!("reading the log: {}", s.message()))?
    {
        if !f(&b)? {
            return Ok(());
        }
        last = b.events.last().map_or(last, |e| e.seq);
    }
    debug!(seq = last, "read to the end of the log");
    Ok(())
}
