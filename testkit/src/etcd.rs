//! Real etcd clusters (1 or 3 members) on free loopback ports in a temporary directory, as the
//! bundled etcd runs in a cluster: TLS on the client and peer ports, and only clients with a
//! certificate from the cluster's own CA get in.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::pki::Pki;
use crate::process::{Proc, free_port};

/// Install hint printed when the `etcd` binary is missing.
pub const INSTALL_HINT: &str = "etcd is not installed: run `apt-get update && apt-get install -y etcd-server` (or `make deps`)";

struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    data_dir: PathBuf,
    proc: Option<Proc>,
}

/// A running etcd cluster. Dropping it kills every member; the directory goes with it unless
/// it was given by the caller.
pub struct EtcdCluster {
    members: Vec<Member>,
    dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
    etcd: PathBuf,
    initial_cluster: String,
    /// Loopback addresses the members also serve clients on, besides 127.0.0.1.
    alias_hosts: Vec<String>,
    /// More flags for every member (e.g. a small `--quota-backend-bytes`).
    extra_flags: Vec<String>,
    /// The etcd CA, the members' certificate, and the client certificate allocators use.
    pki: std::sync::Arc<Pki>,
    member_cert: (PathBuf, PathBuf),
    client_cert: (PathBuf, PathBuf),
}

/// The etcd binary (PATH, then /usr/bin, /usr/local/bin), or an error with the install hint.
pub fn find_etcd() -> Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    for d in std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/local/bin")])
    {
        let p = d.join("etcd");
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!(INSTALL_HINT)
}

impl EtcdCluster {
    /// Start `n` members in a new temporary directory and wait until the cluster answers.
    pub async fn start(n: usize) -> Result<EtcdCluster> {
        let tmp = tempfile::Builder::new()
            .prefix("gpuledger-etcd-")
            .tempdir()
            .context("creating a temp dir for etcd")?;
        let dir = tmp.path().to_path_buf();
        let mut c = Self::start_in(&dir, n).await?;
        c._tmp = Some(tmp);
        Ok(c)
    }

    /// Start `n` members with data and logs under `dir`.
    pub async fn start_in(dir: &Path, n: usize) -> Result<EtcdCluster> {
        Self::start_with_aliases(dir, n, &[]).await
    }

    /// Like [`EtcdCluster::start_in`] with the `etcd` binary at `etcd` instead of the one on
    /// PATH (the real-Kubernetes tier runs its API server on the etcd it builds).
    pub async fn start_in_with(dir: &Path, n: usize, etcd: &Path) -> Result<EtcdCluster> {
        Self::launch(dir, n, &[], etcd.to_path_buf(), &[]).await
    }

    /// [`EtcdCluster::start`] with more flags for every member.
    pub async fn start_with_flags(n: usize, flags: &[&str]) -> Result<EtcdCluster> {
        let tmp = tempfile::Builder::new()
            .prefix("gpuledger-etcd-")
            .tempdir()
            .context("creating a temp dir for etcd")?;
        let mut c = Self::launch(tmp.path(), n, &[], find_etcd()?, flags).await?;
        c._tmp = Some(tmp);
        Ok(c)
    }

    /// Like [`EtcdCluster::start_in`], every member also serving clients on the same port of
    /// each loopback address in `aliases` (e.g. `127.0.1.1`). A client that reaches etcd only
    /// through its own alias can be cut off from etcd by an iptables rule on that address
    /// while every other client and the members' peer traffic go on.
    pub async fn start_with_aliases(
        dir: &Path,
        n: usize,
        aliases: &[String],
    ) -> Result<EtcdCluster> {
        Self::launch(dir, n, aliases, find_etcd()?, &[]).await
    }

    async fn launch(
        dir: &Path,
        n: usize,
        aliases: &[String],
        etcd: PathBuf,
        flags: &[&str],
    ) -> Result<EtcdCluster> {
        std::fs::create_dir_all(dir)?;
        let pki = Pki::new(dir)?;
        let member_cert = pki.peer("etcd-member")?;
        let client_cert = pki.peer("etcd-client")?;
        let mut members = Vec::new();
        for i in 0..n {
            members.push(Member {
                name: format!("etcd{i}"),
                client_port: free_port()?,
                peer_port: free_port()?,
                data_dir: dir.join(format!("etcd{i}.data")),
                proc: None,
            });
        }
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}=https://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        let mut c = EtcdCluster {
            members,
            dir: dir.to_path_buf(),
            _tmp: None,
            etcd,
            initial_cluster,
            alias_hosts: aliases.to_vec(),
            extra_flags: flags.iter().map(|f| f.to_string()).collect(),
            pki,
            member_cert,
            client_cert,
        };
        for i in 0..n {
            c.spawn_member(i, "new")?;
        }
        c.wait_ready(Duration::from_secs(20)).await?;
        Ok(c)
    }

    fn spawn_member(&mut self, i: usize, state: &str) -> Result<()> {
        let m = &self.members[i];
        let client = format!("https://127.0.0.1:{}", m.client_port);
        let peer = format!("https://127.0.0.1:{}", m.peer_port);
        let listen: Vec<String> = std::iter::once(client.clone())
            .chain(
                self.alias_hosts
                    .iter()
                    .map(|h| format!("https://{h}:{}", m.client_port)),
            )
            .collect();
        let (ca, (cert, key)) = (self.pki.ca_file(), &self.member_cert);
        let mut args = vec![
            format!("--cert-file={}", cert.display()),
            format!("--key-file={}", key.display()),
            format!("--trusted-ca-file={}", ca.display()),
            "--client-cert-auth".into(),
            format!("--peer-cert-file={}", cert.display()),
            format!("--peer-key-file={}", key.display()),
            format!("--peer-trusted-ca-file={}", ca.display()),
            "--peer-client-cert-auth".into(),
            format!("--name={}", m.name),
            format!("--data-dir={}", m.data_dir.display()),
            format!("--listen-client-urls={}", listen.join(",")),
            format!("--advertise-client-urls={client}"),
            format!("--listen-peer-urls={peer}"),
            format!("--initial-advertise-peer-urls={peer}"),
            format!("--initial-cluster={}", self.initial_cluster),
            format!("--initial-cluster-state={state}"),
            "--initial-cluster-token=gpuledger-test".into(),
            "--heartbeat-interval=50".into(),
            "--election-timeout=500".into(),
            "--log-level=warn".into(),
            "--logger=zap".into(),
        ];
        args.extend(self.extra_flags.iter().cloned());
        let p = Proc::spawn(&self.dir, &m.name, &self.etcd, args, Vec::new())?;
        self.members[i].proc = Some(p);
        Ok(())
    }

    /// Client endpoints of all members (`https://127.0.0.1:port`).
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("https://127.0.0.1:{}", m.client_port))
            .collect()
    }

    /// The allocator's flags to reach this etcd: its CA and a client certificate.
    pub fn tls_flags(&self) -> Vec<String> {
        vec![
            format!("--etcd-ca={}", self.pki.ca_file().display()),
            format!("--etcd-cert={}", self.client_cert.0.display()),
            format!("--etcd-key={}", self.client_cert.1.display()),
        ]
    }

    /// The etcd CA, and the client certificate and key the allocators reach the members with.
    pub fn client_tls_files(&self) -> (PathBuf, (PathBuf, PathBuf)) {
        (self.pki.ca_file().to_path_buf(), self.client_cert.clone())
    }

    /// TLS options with the CA and the client certificate, for an etcd client of a test.
    pub fn tls_options(&self) -> Result<etcd_client::TlsOptions> {
        let read = |p: &Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
        Ok(etcd_client::TlsOptions::new()
            .ca_certificate(etcd_client::Certificate::from_pem(read(
                self.pki.ca_file(),
            )?))
            .identity(etcd_client::Identity::from_pem(
                read(&self.client_cert.0)?,
                read(&self.client_cert.1)?,
            )))
    }

    /// The CA file of this etcd (for a test that brings its own client).
    pub fn ca_file(&self) -> &Path {
        self.pki.ca_file()
    }

    /// Endpoints as one comma-separated flag value.
    pub fn endpoints_flag(&self) -> String {
        self.endpoints().join(",")
    }

    /// Endpoints of all members through loopback address `host` (one of the aliases given
    /// to [`EtcdCluster::start_with_aliases`]), as one comma-separated flag value.
    pub fn endpoints_flag_via(&self, host: &str) -> String {
        self.members
            .iter()
            .map(|m| format!("https://{host}:{}", m.client_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether the cluster has no members.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The directory holding data and logs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A client connected to every member.
    pub async fn client(&self) -> Result<etcd_client::Client> {
        let opts = etcd_client::ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(Duration::from_secs(5))
            .with_tls(self.tls_options()?);
        etcd_client::Client::connect(self.endpoints(), Some(opts))
            .await
            .context("connecting to etcd")
    }

    /// Compact all history up to now: a watcher that slept through it cannot replay it.
    pub async fn compact_all(&self) -> Result<()> {
        let mut c = self.client().await?;
        let rev = c
            .get("compact-probe", None)
            .await?
            .header()
            .context("etcd answered without a header")?
            .revision();
        c.compact(rev, None).await.context("compacting etcd")?;
        Ok(())
    }

    /// Wait until a linearizable read succeeds (the cluster has a leader and quorum).
    pub async fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut last = String::new();
        while Instant::now() < deadline {
            match self.client().await {
                Ok(mut c) => match c.get("/gpuledger-test-ready", None).await {
                    Ok(_) => return Ok(()),
                    Err(e) => last = e.to_string(),
                },
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let logs: Vec<String> = self
            .members
            .iter()
            .filter_map(|m| {
                m.proc
                    .as_ref()
                    .map(|p| format!("{}:\n{}", m.name, p.log_tail(10)))
            })
            .collect();
        bail!(
            "etcd did not become ready in {timeout:?}: {last}\n{}",
            logs.join("\n")
        )
    }

    /// SIGKILL one member.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut p) = self.members[i].proc.take() {
            p.kill();
        }
    }

    /// Restart a killed member with its data.
    pub fn restart(&mut self, i: usize) -> Result<()> {
        self.kill(i);
        self.spawn_member(i, "existing")
    }

    /// The member process (for SIGSTOP/SIGCONT).
    pub fn member(&self, i: usize) -> Option<&Proc> {
        self.members[i].proc.as_ref()
    }
}
