//! The phases of `gpuledger-bench allocator` that run this build beside `--baseline-allocator`
//! (a binary built from an earlier commit), alternating in one run: reservation latency while
//! the GPU map is polled, and what TLS and authentication cost.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpuledger_auth::identity::Role;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::pki::{Identities, Pki};
use gpuledger_testkit::{EtcdCluster, Proc, bin_path, free_port};
use hdrhistogram::Histogram;

use super::{Args, Target, register, reserve_at_rate, reserve_load};
use crate::common::{histogram, q_ms, rss_mib, title};

/// One allocator replica started from a given binary.
struct Replica {
    proc: Proc,
    target: Target,
    http: String,
}

impl Replica {
    /// Start `bin` as the single replica of `cluster` on `etcd` (the flags `Allocators` gives:
    /// TLS and client certificates of `ids`, unless the binary predates them).
    fn start(
        dir: &Path,
        bin: &Path,
        etcd: &EtcdCluster,
        ids: &Identities,
        cluster: &str,
        name: &str,
    ) -> Result<Replica> {
        let addr = format!("127.0.0.1:{}", free_port()?);
        let http = format!("127.0.0.1:{}", free_port()?);
        let mut args = vec![
            format!("--http-listen={http}"),
            format!("--etcd-endpoints={}", etcd.endpoints_flag()),
            format!("--cluster={cluster}"),
            format!("--listen={addr}"),
            format!("--replica={name}"),
        ];
        args.extend(etcd.tls_flags());
        let authenticated = speaks_tls(bin)?;
        if authenticated {
            let (cert, key) = ids.pki.server("allocator")?;
            args.extend([
                format!("--tls-cert={}", cert.display()),
                format!("--tls-key={}", key.display()),
                format!("--client-ca={}", ids.pki.ca_file().display()),
                // The /ui phase polls the GPU map's JSON.
                "--http-state-api".to_string(),
            ]);
            args.extend(ids.flags(&Role::Allocator)?);
        }
        let proc = Proc::spawn(
            dir,
            name,
            bin,
            args,
            vec![("GPULEDGER_LOG".into(), "info".into())],
        )?;
        let target = Target {
            addr,
            ids: authenticated.then(|| ids.clone()),
        };
        Ok(Replica { proc, target, http })
    }

    /// Wait until the replica leads and is ready.
    async fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut c = self.target.client(&Role::Viewer)?;
        while Instant::now() < deadline {
            if let Ok(Ok(s)) =
                tokio::time::timeout(Duration::from_millis(500), c.status(api::StatusRequest {}))
                    .await
            {
                let s = s.into_inner();
                if s.role == "leader" && s.ready {
                    return Ok(());
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!(
            "{} did not lead within {timeout:?}:\n{}",
            self.proc.name,
            self.proc.log_tail(15)
        )
    }
}

/// Whether the allocator binary `bin` serves its API over TLS (every build since the API was
/// authenticated; a baseline built before speaks plain gRPC).
pub(super) fn speaks_tls(bin: &Path) -> Result<bool> {
    let out = std::process::Command::new(bin)
        .arg("--help")
        .output()
        .with_context(|| format!("running {} --help", bin.display()))?;
    Ok(String::from_utf8_lossy(&out.stdout).contains("--tls-cert"))
}

/// This build against `--baseline-allocator`, each measured twice alternately (ABBA) in this run:
/// reservations/s at --clients and the single-client latency. A baseline built before the API
/// was authenticated runs plain gRPC, so the difference is what TLS and authentication cost;
/// a later one runs with them too, so it is what the commits between cost.
/// Returns ((rps, 1-client latencies) of this build, (the same) of the baseline).
pub(super) async fn ab_phase(
    a: &Args,
    dir: &Path,
    etcd: &EtcdCluster,
    baseline: &Path,
) -> Result<((f64, Histogram<u64>), (f64, Histogram<u64>))> {
    let plain = !speaks_tls(baseline)?;
    title(&format!(
        "this build against {}{}, alternating",
        baseline.display(),
        if plain {
            " (plain gRPC): what TLS and authentication cost"
        } else {
            " (both with TLS + identities)"
        }
    ));
    let (a_name, b_name) = if plain {
        ("with auth", "without")
    } else {
        ("this build", "baseline")
    };
    let this = bin_path("gpuledger-allocator")?;
    let ids = Identities::certs(Pki::new(&dir.join("auth-pki"))?);
    let mut res = [(0.0, histogram()), (0.0, histogram())];
    for round in 0..4 {
        let which = if round % 3 == 0 { 0 } else { 1 };
        let bin = if which == 0 {
            &this
        } else {
            &baseline.to_path_buf()
        };
        let cluster = format!("auth{round}");
        let rep = Replica::start(dir, bin, etcd, &ids, &cluster, &format!("auth-{round}"))?;
        rep.wait_ready(Duration::from_secs(60)).await?;
        let prefix = format!("a{round}n");
        register(&rep.target, a.nodes, &prefix).await?;
        let (rps, _, _) = reserve_load(
            &rep.target,
            a.clients,
            Duration::from_secs(a.seconds),
            usize::MAX,
            a.nodes,
            &prefix,
            "auth",
        )
        .await?;
        let (_, h1, _) = reserve_load(
            &rep.target,
            1,
            Duration::from_secs(3),
            usize::MAX,
            a.nodes,
            &prefix,
            "auth1",
        )
        .await?;
        println!(
            "  {:<10} {:>9.0} reservations/s at {} clients; 1 client p50 {:.2} ms, p99 {:.2} ms",
            if which == 0 { a_name } else { b_name },
            rps,
            a.clients,
            q_ms(&h1, 0.5),
            q_ms(&h1, 0.99)
        );
        res[which].0 += rps / 2.0;
        res[which].1.add(&h1).ok();
    }
    let [with, without] = res;
    println!(
        "{a_name}/{b_name}: {:.2}x reservations/s; 1-client p50 {:+.2} ms",
        with.0 / without.0.max(1e-9),
        q_ms(&with.1, 0.5) - q_ms(&without.1, 0.5)
    );
    Ok((with, without))
}

/// What one allocator did in the /ui phase, all rounds together.
pub(super) struct UiResult {
    name: String,
    /// Latencies while /ui is polled.
    pub(super) hist: Histogram<u64>,
    /// Latencies of the same replica right after, not polled (the control).
    quiet: Histogram<u64>,
    reservations: usize,
    seconds: f64,
    polls: usize,
    rss_mib: f64,
}

/// Reserve while a poller reads `/api/v1/state` of a large ledger without pause, for this
/// build and, alternating in the same run, `--baseline-allocator`. Returns each one's result.
pub(super) async fn ui_phase(a: &Args, dir: &Path, etcd: &EtcdCluster) -> Result<Vec<UiResult>> {
    let this = bin_path("gpuledger-allocator")?;
    let mut cands = vec![("this build".to_string(), this.clone())];
    if let Some(b) = &a.baseline_allocator {
        cands.push(("baseline".to_string(), b.clone()));
    }
    title(&format!(
        "{} reservations/s while a poller reads /ui's state twice a second: {} nodes x 8 GPUs, {} allocations; {}",
        a.ui_rate,
        a.ui_nodes,
        a.ui_allocs,
        match &a.baseline_allocator {
            Some(b) => format!(
                "this build and the baseline {} alternating (ABBA)",
                b.display()
            ),
            None => "this build only (no --baseline-allocator)".to_string(),
        }
    ));
    let ids = Identities::certs(Pki::new(&dir.join("ui-pki"))?);
    let seed = Replica::start(dir, &this, etcd, &ids, "ui", "ui-seed")?;
    seed.wait_ready(Duration::from_secs(30)).await?;
    register(&seed.target, a.ui_nodes, "ui").await?;
    reserve_load(
        &seed.target,
        a.clients,
        Duration::from_secs(600),
        a.ui_allocs,
        a.ui_nodes,
        "ui",
        "seed",
    )
    .await?;
    drop(seed);
    let mut results: Vec<UiResult> = cands
        .iter()
        .map(|(n, _)| UiResult {
            name: n.clone(),
            hist: histogram(),
            quiet: histogram(),
            reservations: 0,
            seconds: 0.0,
            polls: 0,
            rss_mib: 0.0,
        })
        .collect();
    for round in 0..a.ui_rounds {
        let order: Vec<usize> = if round % 2 == 0 {
            (0..cands.len()).collect()
        } else {
            (0..cands.len()).rev().collect()
        };
        for i in order {
            let (name, bin) = &cands[i];
            let rep = Replica::start(dir, bin, etcd, &ids, "ui", &format!("ui-{i}-{round}"))?;
            rep.wait_ready(Duration::from_secs(60)).await?;
            let stop = Arc::new(AtomicBool::new(false));
            let polls = Arc::new(AtomicUsize::new(0));
            // Two browsers on the GPU map (the page polls every 2 s each, the replica builds
            // the JSON at most once a second).
            let poller = {
                let (stop, polls) = (stop.clone(), polls.clone());
                let url = format!("http://{}/api/v1/state", rep.http);
                tokio::spawn(async move {
                    let mut every = tokio::time::interval(Duration::from_millis(500));
                    while !stop.load(Ordering::Relaxed) {
                        every.tick().await;
                        if matches!(gpuledger_testkit::http::get(&url).await, Ok((200, _))) {
                            polls.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            };
            tokio::time::sleep(Duration::from_secs(1)).await;
            let t = Instant::now();
            let (h, made) = reserve_at_rate(
                &rep.target,
                a.ui_rate,
                Duration::from_secs(a.ui_seconds),
                a.ui_nodes,
                &format!("r{round}c{i}"),
            )
            .await?;
            let secs = t.elapsed().as_secs_f64();
            stop.store(true, Ordering::Relaxed);
            let _ = poller.await;
            tokio::time::sleep(Duration::from_secs(1)).await;
            let (quiet, _) = reserve_at_rate(
                &rep.target,
                a.ui_rate,
                Duration::from_secs(a.ui_seconds),
                a.ui_nodes,
                &format!("r{round}c{i}q"),
            )
            .await?;
            let r = &mut results[i];
            r.hist.add(&h).ok();
            r.quiet.add(&quiet).ok();
            r.reservations += made;
            r.seconds += secs;
            r.polls += polls.load(Ordering::Relaxed);
            r.rss_mib = r
                .rss_mib
                .max(rep.proc.pid().map(rss_mib).transpose()?.unwrap_or(0.0));
            println!(
                "round {round}, {name}: p99 {:.2} ms polled ({made} reservations, {} polls), {:.2} ms not polled",
                q_ms(&h, 0.99),
                polls.load(Ordering::Relaxed),
                q_ms(&quiet, 0.99)
            );
        }
    }
    println!();
    println!(
        "{:<24} {:>10} {:>9} {:>9} {:>9} {:>9} {:>7} {:>9}",
        "allocator", "reserve/s", "p50 ms", "p99 ms", "p99.9 ms", "max ms", "polls", "RSS MiB"
    );
    for r in &results {
        for (what, h, polls) in [
            ("/ui polled", &r.hist, r.polls),
            ("not polled", &r.quiet, 0),
        ] {
            println!(
                "{:<24} {:>10.0} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>7} {:>9.1}",
                format!("{}, {what}", r.name),
                r.reservations as f64 / r.seconds.max(1e-9),
                q_ms(h, 0.5),
                q_ms(h, 0.99),
                q_ms(h, 0.999),
                h.max() as f64 / 1000.0,
                polls,
                r.rss_mib
            );
        }
    }
    if let [this, base] = results.as_slice() {
        println!(
            "reservation p99 under the /ui poller: baseline/this build = {:.2}x",
            q_ms(&base.hist, 0.99) / q_ms(&this.hist, 0.99).max(1e-9)
        );
    }
    Ok(results)
}
