//! gpuledger's processes against the real API server: a ledger etcd of its own, allocator
//! replicas and the extender (scheduler extender + admission webhook), each with the kubeconfig
//! of its shipped ServiceAccount so that the shipped RBAC is what authorizes it. Every gRPC
//! call is TLS and authenticated: the extender and `gpuledger verify` send ServiceAccount
//! tokens the API server issued (audience `gpuledger`), which the allocator has the API server
//! review; the allocator replicas and the node agents present client certificates of the
//! shipped CA. The serving certificates and kube-scheduler's client certificate, which the
//! extender's scheduler-facing port demands, are the ones `deploy/scripts/gpuledger-certs.sh`
//! installed.

use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use gpuledger_testkit::kube::stack::wait_http;
use gpuledger_testkit::{Allocators, EtcdCluster, Proc, bin_path, free_port};

use crate::certs::Shipped;
use crate::pki::{Identity, Pki};

/// ServiceAccount (shipped name) of the allocator.
pub const ALLOCATOR_SA: &str = "gpuledger-allocator";
/// ServiceAccount of the extender.
pub const EXTENDER_SA: &str = "gpuledger-extender";
/// ServiceAccount of the node agent.
pub const NODE_AGENT_SA: &str = "gpuledger-node-agent";
/// ServiceAccount whose tokens operators read the ledger with.
pub const VIEWER_SA: &str = "gpuledger-viewer";
/// ServiceAccount whose tokens operators write budgets and quotas with.
pub const ADMIN_SA: &str = "gpuledger-admin";

/// The ledger's cluster prefix in etcd.
pub const CLUSTER: &str = "e2e";

/// The running gpuledger side. Dropping it stops every process.
pub struct Gpuledger {
    /// Allocator replicas.
    pub allocs: Allocators,
    /// The extender process.
    pub extender: Proc,
    /// `https://127.0.0.1:<port>/gpuledger`: what kube-scheduler calls.
    pub extender_url: String,
    /// `http://127.0.0.1:<port>`: the extender's /metrics and probes (plain HTTP).
    pub extender_http: String,
    /// Port of the admission webhook (HTTPS).
    pub webhook_port: u16,
    /// The ledger's etcd.
    pub etcd: EtcdCluster,
    /// Flags of an operator's read-only CLI: the CA and a `gpuledger-viewer` token.
    pub viewer_flags: Vec<String>,
}

impl Gpuledger {
    /// Start the ledger etcd, `allocators` replicas (leader elected) and the extender with its
    /// webhook on `webhook_port`; `extra` flags go to the allocators and to the extender;
    /// `dra`: the allocators certify ResourceClaims. `client` (an admin) asks
    /// the API server for the ServiceAccount tokens.
    pub async fn start(
        dir: &Path,
        (pki, certs): (&Pki, &Shipped),
        (server, client): (&str, &kube::Client),
        (allocators, webhook_port): (usize, u16),
        (allocator_extra, extra): (&[String], &[String]),
        dra: bool,
    ) -> Result<Gpuledger> {
        let etcd = EtcdCluster::start_in(&dir.join("ledger-etcd"), 1).await?;
        let kc = pki.kubeconfig(server, &Identity::ServiceAccount(ALLOCATOR_SA.into()))?;
        let mut flags = vec![format!("--kubeconfig={}", kc.display())];
        if dra {
            // As the dra overlay's allocators run.
            flags.push("--claim-watch".into());
        }
        flags.extend(allocator_extra.iter().cloned());
        let refs: Vec<&str> = flags.iter().map(String::as_str).collect();
        let allocs = Allocators::start_each(
            dir,
            &etcd,
            &vec![etcd.endpoints_flag(); allocators.max(1)],
            CLUSTER,
            &refs,
            certs.identities(),
        )?;
        allocs.wait_leader(Duration::from_secs(30)).await?;
        let (port, http_port) = (free_port()?, free_port()?);
        let kc = pki.kubeconfig(server, &Identity::ServiceAccount(EXTENDER_SA.into()))?;
        let mut args = vec![
            format!("--listen=127.0.0.1:{port}"),
            format!("--http-listen=127.0.0.1:{http_port}"),
            format!("--allocator={}", allocs.addrs.join(",")),
            format!("--kubeconfig={}", kc.display()),
            format!("--webhook-listen=127.0.0.1:{webhook_port}"),
            format!("--tls-cert={}", certs.extender.cert.display()),
            format!("--tls-key={}", certs.extender.key.display()),
            format!("--client-ca={}", certs.ca_file.display()),
        ];
        args.extend(certs.token_flags(&pki.request_token(client, EXTENDER_SA).await?));
        args.extend(extra.iter().cloned());
        let extender = Proc::spawn(
            dir,
            "extender",
            &bin_path("gpuledger-extender")?,
            args,
            // GPULEDGER_EXTENDER_LOG overrides the level (e.g. debug, to see every filter's
            // answer) without the test's own GPULEDGER_LOG leaking in.
            vec![(
                "GPULEDGER_LOG".into(),
                std::env::var("GPULEDGER_EXTENDER_LOG").unwrap_or_else(|_| "info".into()),
            )],
        )?;
        for p in [http_port, webhook_port, port] {
            wait_http(p, Duration::from_secs(20)).await?;
        }
        Ok(Gpuledger {
            allocs,
            extender,
            extender_url: format!("https://127.0.0.1:{port}/gpuledger"),
            extender_http: format!("http://127.0.0.1:{http_port}"),
            webhook_port,
            etcd,
            viewer_flags: certs.token_flags(&pki.request_token(client, VIEWER_SA).await?),
        })
    }

    /// The extender's /metrics text.
    pub async fn extender_metrics(&self) -> Result<String> {
        let (code, body) =
            gpuledger_testkit::http::get(&format!("{}/metrics", self.extender_http)).await?;
        anyhow::ensure!(code == 200, "extender /metrics answered {code}");
        Ok(body)
    }

    /// Every allocator replica's /metrics text, one after the other.
    pub async fn allocator_metrics(&self) -> Result<String> {
        let mut out = String::new();
        for h in &self.allocs.http {
            let (code, body) = gpuledger_testkit::http::get(&format!("http://{h}/metrics")).await?;
            anyhow::ensure!(code == 200, "allocator {h} /metrics answered {code}");
            out.push_str(&body);
        }
        Ok(out)
    }

    /// The leader's folded ledger, after every replica caught up.
    pub async fn ledger(&self) -> Result<gpuledger_ledger::Ledger> {
        self.allocs.wait_caught_up(Duration::from_secs(20)).await?;
        let i = self.allocs.wait_leader(Duration::from_secs(20)).await?;
        self.allocs.ledger(i).await
    }
}

/// The sum of a counter's samples in Prometheus text whose labels contain every `labels` pair.
pub fn counter(metrics: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    metrics
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (head, value) = l.rsplit_once(' ')?;
            let (n, rest) = head.split_once('{').unwrap_or((head, ""));
            let ok = n == name
                && labels
                    .iter()
                    .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
            if ok { value.parse::<f64>().ok() } else { None }
        })
        .sum()
}

/// `gpuledger <args>` against the replicas at `addrs`, as the operator `credentials` name
/// (`Pki::token_flags`): its standard output and error, or why it failed.
pub fn ctl(addrs: &[String], credentials: &[String], args: &[&str]) -> Result<String> {
    let out = std::process::Command::new(bin_path("gpuledger")?)
        .args(args)
        .arg(format!("--allocator={}", addrs.join(",")))
        .args(credentials)
        .output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    anyhow::ensure!(
        out.status.success(),
        "gpuledger {} failed:\n{text}",
        args.join(" ")
    );
    Ok(text)
}

/// `gpuledger verify`, as the operator `gl.viewer_flags` name, against the replicas at
/// `addrs`: its output, or why it failed.
pub fn verify(gl: &Gpuledger, addrs: &[String]) -> Result<String> {
    let text = ctl(addrs, &gl.viewer_flags, &["verify"])?;
    anyhow::ensure!(
        text.contains("verify: OK"),
        "gpuledger verify failed:\n{text}"
    );
    Ok(text)
}
