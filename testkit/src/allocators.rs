//! Allocator replicas as processes, and clients to them: TLS and authentication on, as in a
//! cluster (each caller in a test names the role it calls as).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpuledger_auth::identity::Role;
use gpuledger_auth::{CredentialArgs, Credentials};
use gpuledger_client::Options;
use gpuledger_proto::allocator::v1 as api;

use crate::bins::bin_path;
use crate::etcd::EtcdCluster;
use crate::pki::{Identities, NAMESPACE, Pki};
use crate::process::{Proc, free_port};

/// A client of the allocator API, carrying its caller's credentials.
pub type Client = gpuledger_client::Client;

/// How the test kit's connections behave: whole dumps and logs, 10 s per call.
fn options() -> Options {
    Options {
        max_decoding: 512 * 1024 * 1024,
        max_encoding: 64 * 1024 * 1024,
        ..Options::default()
    }
}

/// The one client to `addrs` as the caller `creds` names (connects lazily).
pub fn pool(addrs: &[String], creds: &CredentialArgs) -> Result<gpuledger_client::Allocators> {
    let creds = Credentials::load(creds).context("loading test credentials")?;
    Ok(gpuledger_client::Allocators::new(
        addrs,
        &creds,
        &options(),
    )?)
}

/// A client to one allocator address as the caller `creds` names (connects lazily).
pub fn connect(addr: &str, creds: &CredentialArgs) -> Result<Client> {
    Ok(pool(&[addr.to_string()], creds)?.client(0).1)
}

/// A set of allocator replicas sharing one etcd and ledger.
pub struct Allocators {
    /// The replica processes.
    pub procs: Vec<Proc>,
    /// Their gRPC addresses.
    pub addrs: Vec<String>,
    /// Their HTTP (metrics, health) addresses.
    pub http: Vec<String>,
    /// How callers of this run prove who they are.
    pub ids: Identities,
    dir: PathBuf,
}

impl Allocators {
    /// Start `n` replicas on free ports with logs in `dir`, callers identified by client
    /// certificates of a new CA. `extra` flags go to every replica.
    pub fn start(
        dir: &Path,
        etcd: &EtcdCluster,
        n: usize,
        cluster: &str,
        extra: &[&str],
    ) -> Result<Allocators> {
        let ids = Identities::certs(Pki::new(dir)?);
        Self::start_each(
            dir,
            etcd,
            &vec![etcd.endpoints_flag(); n],
            cluster,
            extra,
            ids,
        )
    }

    /// Start one replica per entry of `endpoints`, replica `i` reaching `etcd` through
    /// `endpoints[i]` (its own `--etcd-endpoints`), callers identified by `ids`.
    pub fn start_each(
        dir: &Path,
        etcd: &EtcdCluster,
        endpoints: &[String],
        cluster: &str,
        extra: &[&str],
        ids: Identities,
    ) -> Result<Allocators> {
        let bin = bin_path("gpuledger-allocator")?;
        std::fs::create_dir_all(dir)?;
        let (cert, key) = ids.pki.server("allocator")?;
        let mut common = vec![
            format!("--tls-cert={}", cert.display()),
            format!("--tls-key={}", key.display()),
            format!("--client-ca={}", ids.pki.ca_file().display()),
            format!("--auth-namespace={NAMESPACE}"),
        ];
        common.extend(ids.flags(&Role::Allocator)?);
        common.extend(etcd.tls_flags());
        let mut procs = Vec::new();
        let mut addrs = Vec::new();
        let mut http = Vec::new();
        for (i, etcd) in endpoints.iter().enumerate() {
            let port = free_port()?;
            let addr = format!("127.0.0.1:{port}");
            let http_addr = format!("127.0.0.1:{}", free_port()?);
            let mut args = vec![
                format!("--http-listen={http_addr}"),
                format!("--etcd-endpoints={etcd}"),
                format!("--cluster={cluster}"),
                format!("--listen={addr}"),
                format!("--replica=alloc{i}"),
            ];
            args.extend(common.iter().cloned());
            args.extend(extra.iter().map(|s| (*s).to_string()));
            procs.push(Proc::spawn(
                dir,
                &format!("alloc{i}"),
                &bin,
                args,
                // GPULEDGER_ALLOCATOR_LOG overrides the level (e.g. to see the leader's per-batch
                // timings at debug) without the test's own GPULEDGER_LOG leaking in.
                vec![(
                    "GPULEDGER_LOG".into(),
                    std::env::var("GPULEDGER_ALLOCATOR_LOG").unwrap_or_else(|_| "info".into()),
                )],
            )?);
            addrs.push(addr);
            http.push(http_addr);
        }
        Ok(Allocators {
            procs,
            addrs,
            http,
            ids,
            dir: dir.to_path_buf(),
        })
    }

    /// The run directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Status of replica `i`, if it answers.
    pub async fn status(&self, i: usize) -> Option<api::StatusResponse> {
        let mut c = self.viewer(i).ok()?;
        let fut = c.status(api::StatusRequest {});
        match tokio::time::timeout(Duration::from_millis(500), fut).await {
            Ok(Ok(r)) => Some(r.into_inner()),
            _ => None,
        }
    }

    /// Wait until some replica reports itself leader and ready; returns its index.
    pub async fn wait_leader(&self, timeout: Duration) -> Result<usize> {
        self.wait_leader_except(timeout, None).await
    }

    /// Like [`Allocators::wait_leader`], ignoring replica `except`.
    pub async fn wait_leader_except(
        &self,
        timeout: Duration,
        except: Option<usize>,
    ) -> Result<usize> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            // A deposed leader may still call itself leader for a moment: the newest epoch wins.
            let mut best: Option<(u64, usize)> = None;
            for i in 0..self.addrs.len() {
                if Some(i) == except {
                    continue;
                }
                if let Some(s) = self.status(i).await
                    && s.role == "leader"
                    && s.ready
                    && best.is_none_or(|(e, _)| s.epoch > e)
                {
                    best = Some((s.epoch, i));
                }
            }
            if let Some((_, i)) = best {
                return Ok(i);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let tails: Vec<String> = self
            .procs
            .iter()
            .map(|p| format!("--- {}:\n{}", p.name, p.log_tail(15)))
            .collect();
        bail!(
            "no allocator leader within {timeout:?}\n{}",
            tails.join("\n")
        )
    }

    /// Wait until every running replica has applied at least `seq`.
    pub async fn wait_seq(&self, seq: u64, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        'outer: while Instant::now() < deadline {
            for i in 0..self.addrs.len() {
                if self.procs[i].pid().is_none() {
                    continue;
                }
                match self.status(i).await {
                    Some(s) if s.seq >= seq => {}
                    _ => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue 'outer;
                    }
                }
            }
            return Ok(());
        }
        bail!("replicas did not reach seq {seq} within {timeout:?}")
    }

    /// Wait for a leader, then until every running replica has applied the leader's seq.
    pub async fn wait_caught_up(&self, timeout: Duration) -> Result<()> {
        let leader = self.wait_leader(timeout).await?;
        if let Some(s) = self.status(leader).await {
            self.wait_seq(s.seq, timeout).await?;
        }
        Ok(())
    }

    /// The one client to every replica, calling as `role`.
    pub fn pool_as(&self, role: &Role) -> Result<gpuledger_client::Allocators> {
        pool(&self.addrs, &self.ids.credentials(role)?).context("allocator client")
    }

    /// A client to replica `i` calling as `role`.
    pub fn client_as(&self, i: usize, role: &Role) -> Result<Client> {
        connect(&self.addrs[i], &self.ids.credentials(role)?).context("allocator client")
    }

    /// A client to replica `i` as the scheduler extender (filter, score, reserve, confirm).
    pub fn extender(&self, i: usize) -> Result<Client> {
        self.client_as(i, &Role::Extender)
    }

    /// A client to replica `i` as the node agent of `node`.
    pub fn node_agent(&self, i: usize, node: &str) -> Result<Client> {
        self.client_as(
            i,
            &Role::NodeAgent {
                node: node.to_string(),
            },
        )
    }

    /// A client to replica `i` as an operator who may only read.
    pub fn viewer(&self, i: usize) -> Result<Client> {
        self.client_as(i, &Role::Viewer)
    }

    /// A client to replica `i` as an operator who may write (register and remove nodes,
    /// release allocations).
    pub fn admin(&self, i: usize) -> Result<Client> {
        self.client_as(i, &Role::Admin)
    }

    /// Every event in the log, as replica `i` reads it.
    pub async fn events(&self, i: usize) -> Result<Vec<gpuledger_ledger::pb::Event>> {
        let mut s = self
            .viewer(i)?
            .read_log(api::ReadLogRequest {
                from_seq: 1,
                to_seq: 0,
            })
            .await?
            .into_inner();
        let mut out = Vec::new();
        while let Some(b) = s.message().await? {
            out.extend(b.events);
        }
        Ok(out)
    }

    /// Replica `i`'s folded state, from its dump.
    pub async fn ledger(&self, i: usize) -> Result<gpuledger_ledger::Ledger> {
        let d = self
            .viewer(i)?
            .dump(api::DumpRequest {})
            .await?
            .into_inner();
        let snap = d.snapshot.context("the dump holds no snapshot")?;
        gpuledger_ledger::Ledger::from_snapshot(&snap).map_err(anyhow::Error::msg)
    }
}
