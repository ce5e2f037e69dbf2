//! One allocator replica: serve the API, load and follow the ledger, campaign, lead.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use backon::Retryable;
use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, info, info_span, warn};

use crate::config::{Config, EtcdTls};
use crate::election::{self, Session};
use crate::leader::{BatchLimits, Leader, StepDown};
use crate::log::{EtcdLog, Fence, LogError};
use crate::retry::forever;
use crate::service::Placement;
use crate::service::Service;
use crate::shared::{Role, Shared};
use crate::tail;
use crate::workload::Learned;

/// Connect to etcd (lazily: the connection is made by the first request).
pub async fn connect(endpoints: &[String], tls: Option<&EtcdTls>) -> anyhow::Result<Client> {
    let mut opts = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(1))
        .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
        .with_require_leader(true);
    if let Some(t) = tls {
        if let Some(plain) = endpoints.iter().find(|e| e.starts_with("http://")) {
            anyhow::bail!("etcd TLS is configured but endpoint {plain} is http://; use https://");
        }
        let read = |p: &std::path::Path, what: &str| {
            std::fs::read(p).with_context(|| format!("reading the etcd {what} {}", p.display()))
        };
        let mut o = TlsOptions::new();
        if let Some(ca) = &t.ca {
            o = o.ca_certificate(Certificate::from_pem(read(ca, "CA")?));
        }
        if let Some((cert, key)) = &t.identity {
            o = o.identity(Identity::from_pem(
                read(cert, "client certificate")?,
                read(key, "client key")?,
            ));
        }
        opts = opts.with_tls(o);
    }
    Client::connect(endpoints, Some(opts))
        .await
        .with_context(|| format!("connecting to etcd at {}", endpoints.join(",")))
}

/// Run a replica until SIGTERM or SIGINT.
pub async fn run(cfg: Config) -> anyhow::Result<()> {
    let stop = CancellationToken::new();
    let on_signal = stop.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        on_signal.cancel();
    });
    run_until(cfg, stop).await
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        futures::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => info!("SIGTERM: shutting down"),
        _ = int.recv() => info!("SIGINT: shutting down"),
    }
}

/// Run a replica until `stop` is cancelled.
pub async fn run_until(cfg: Config, stop: CancellationToken) -> anyhow::Result<()> {
    let shared = Shared::new(cfg.replica(), cfg.advertise());
    let client = connect(&cfg.etcd_endpoints, cfg.etcd_tls().as_ref()).await?;
    let log = EtcdLog::new(
        &client,
        &cfg.cluster,
        Duration::from_millis(cfg.etcd_timeout_ms),
    );
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("listening on {}", cfg.listen))?;
    info!(
        listen = %cfg.listen,
        advertise = %shared.address,
        replica = %shared.replica,
        cluster = %cfg.cluster,
        "gpuledger-allocator starting"
    );
    let archive = match &cfg.archive_dir {
        Some(dir) => Some(
            crate::archive::Archive::open(dir)
                .with_context(|| format!("opening --archive-dir {}", dir.display()))?,
        ),
        None => {
            warn!(
                "no --archive-dir: the ledger's whole log stays in etcd and grows with every event"
            );
            None
        }
    };
    let security = security(&cfg, &stop).await?;
    let peers = gpuledger_auth::Credentials::load(&cfg.peer)
        .context("this replica's credentials for calling the other replicas (--allocator-ca and --token-file or --client-cert/--client-key)")?;
    peers.spawn_reloader(cfg.tls.reload_every(), stop.clone());
    let kube = crate::kube_watch::enabled(&cfg.kube);
    let authz = Arc::new(crate::authz::Authz::new(kube, cfg.scheduler_names.clone()));
    let learned = Learned::new(cfg.fgd_window, cfg.fgd_min_samples);
    let preemption = crate::preemption::Preemption::new(&cfg.preempt, &shared.metrics);
    let service = Service::new(
        shared.clone(),
        client.clone(),
        log.clone(),
        Duration::from_secs(cfg.reserve_ttl),
        Placement {
            default_policy: cfg.default_policy,
            learned: learned.clone(),
        },
        authz,
        peers,
    )
    .with_archive(archive.clone())
    .with_preemption(preemption);
    let http = tokio::net::TcpListener::bind(cfg.http_listen)
        .await
        .with_context(|| format!("listening on --http-listen {}", cfg.http_listen))?;

    // Every task of the replica ends when `stop` is cancelled.
    let tasks = TaskTracker::new();
    tasks.spawn(
        stop.clone()
            .run_until_cancelled_owned(crate::workload::follow(shared.clone(), learned)),
    );
    let views = shared.clone();
    tasks.spawn(
        stop.clone()
            .run_until_cancelled_owned(async move { views.maintain_views().await }),
    );
    let router = crate::http::router(shared.clone(), cfg.http_state_api);
    let http_stop = stop.clone();
    tasks.spawn(async move {
        let served = axum::serve(http, router)
            .with_graceful_shutdown(http_stop.cancelled_owned())
            .await;
        if let Err(e) = served {
            warn!(error = %e, "the HTTP endpoint stopped");
        }
    });
    crate::kube_watch::spawn(service.clone(), &cfg.kube, &tasks, &stop);
    crate::preemption::spawn(
        service.clone(),
        Duration::from_millis(cfg.kube.reconcile_interval_ms.max(1)),
        &tasks,
        &stop,
    );
    tasks.spawn(crate::grpc::serve(
        service,
        listener,
        security,
        stop.clone(),
    ));
    tasks.spawn(stop.clone().run_until_cancelled_owned(health_loop(
        shared.clone(),
        client.clone(),
        log.clone(),
    )));

    let result = lifecycle(&cfg, &shared, &client, &log, archive, &stop).await;
    stop.cancel();
    tasks.close();
    // Give in-flight RPCs a moment, then stop serving.
    let _ = tokio::time::timeout(Duration::from_secs(2), tasks.wait()).await;
    result
}

/// The gRPC endpoint's certificate and authenticator: client certificates from --client-ca,
/// and ServiceAccount tokens reviewed by the API server when this replica has one.
async fn security(cfg: &Config, stop: &CancellationToken) -> anyhow::Result<crate::grpc::Security> {
    use gpuledger_auth::token::{KubeApi, ServiceAccounts, TokenAuthenticator};
    let tls = cfg
        .tls
        .load(&[b"h2"])
        .context("loading the gRPC API's certificate (--tls-cert, --tls-key, --client-ca)")?;
    tls.spawn_reloader(cfg.tls.reload_every(), stop.clone());
    let tokens = if crate::kube_watch::enabled(&cfg.kube) {
        let client = gpuledger_ops::kube_client::client(cfg.kube.kubeconfig.as_deref())
            .await
            .context("the Kubernetes client that reviews callers' tokens")?;
        client.map(|c| {
            let api = Arc::new(KubeApi(c));
            Arc::new(TokenAuthenticator::new(
                api.clone(),
                api,
                ServiceAccounts::in_namespace(&cfg.auth_namespace),
                Duration::from_secs(cfg.token_cache_max_s.max(1)),
            ))
        })
    } else {
        None
    };
    if tokens.is_none() {
        if cfg.tls.client_ca.is_none() {
            anyhow::bail!(
                "no way to tell callers apart: without a Kubernetes API to review tokens, set --client-ca (client certificates)"
            );
        }
        warn!(
            "no Kubernetes API: callers authenticate with client certificates only, and the extender's pods cannot be checked"
        );
    }
    Ok(crate::grpc::Security {
        tls,
        handshake_timeout: cfg.tls.handshake_timeout(),
        authenticator: gpuledger_auth::Authenticator::new(tokens),
    })
}

/// `scheme://host:port` without the scheme and a trailing slash, to compare etcd URLs.
fn bare_url(u: &str) -> &str {
    let u = u.trim_end_matches('/');
    u.split_once("://").map_or(u, |(_, rest)| rest)
}

/// A connection to the etcd member that is raft leader now, for the ledger's commits, when
/// that member is one of the configured endpoints (behind a load balancer or a DNS name there
/// is nothing to pick: `None`, and commits go through the shared connection). Looked up once
/// per leadership: if etcd's leader moves later, the commits still succeed through the old
/// member (forwarded), and a failed commit ends the leadership anyway.
async fn etcd_leader_client(cfg: &Config, client: &Client) -> Option<Client> {
    if cfg.etcd_endpoints.len() < 2 {
        return None;
    }
    let mut c = client.clone();
    let find = async {
        let leader = c.status().await.ok()?.leader();
        let members = c.member_list().await.ok()?;
        let m = members.members().iter().find(|m| m.id() == leader)?;
        cfg.etcd_endpoints
            .iter()
            .find(|e| m.client_urls().iter().any(|u| bare_url(u) == bare_url(e)))
            .cloned()
    };
    let timeout = Duration::from_millis(cfg.etcd_timeout_ms);
    let endpoint = tokio::time::timeout(timeout, find).await.ok().flatten()?;
    match connect(std::slice::from_ref(&endpoint), cfg.etcd_tls().as_ref()).await {
        Ok(w) => {
            info!(%endpoint, "ledger commits go to the etcd leader member");
            Some(w)
        }
        Err(e) => {
            warn!(%endpoint, error = %format!("{e:#}"), "no connection to the etcd leader member; committing through any member");
            None
        }
    }
}

async fn lifecycle(
    cfg: &Config,
    shared: &Arc<Shared>,
    client: &Client,
    log: &EtcdLog,
    archive: Option<crate::archive::Archive>,
    stop: &CancellationToken,
) -> anyhow::Result<()> {
    // Load the ledger (retry until etcd answers; a corrupt log is not retried).
    let load = (|| tail::load(shared, log, !cfg.ignore_snapshots, archive.as_ref()))
        .retry(forever(Duration::from_millis(500)))
        .when(|e| !matches!(e, LogError::Corrupt { .. }))
        .notify(|e, _| warn!(error = %e, "loading the ledger failed; retrying"));
    match stop.run_until_cancelled(load).await {
        None => return Ok(()),
        Some(Ok(())) => {}
        Some(Err(e)) => {
            shared
                .health
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .broken = Some(e.to_string());
            warn!(error = %e, "the ledger does not load; serving status only");
            stop.cancelled().await;
            return Ok(());
        }
    }
    let epoch = shared.view().await.epoch();
    shared.set_role(Role::Follower, epoch, String::new());
    let limits = BatchLimits {
        max_events: cfg.max_txn_ops.max(1),
        max_bytes: cfg.max_batch_bytes.clamp(4096, crate::log::MAX_VALUE_BYTES),
        confirm_linger: Duration::from_millis(cfg.confirm_linger_ms),
        load_linger: Duration::from_micros(cfg.commit_linger_us),
    };
    loop {
        if stop.is_cancelled() {
            return Ok(());
        }
        // Follow the log while campaigning.
        let following = stop.child_token();
        let follower = tokio::spawn(
            following.clone().run_until_cancelled_owned(
                tail::follow(
                    shared.clone(),
                    client.clone(),
                    log.clone(),
                    cfg.snapshot_every,
                    archive.clone(),
                )
                .instrument(info_span!("follow")),
            ),
        );
        let session = (|| Session::start(client, cfg.lease_ttl()))
            .retry(forever(Duration::from_millis(500)))
            .notify(|e, _| warn!(error = %e, "cannot get an etcd lease; following only"));
        let session = stop.run_until_cancelled(session).await;
        let won = match &session {
            Some(Ok(session)) => {
                let election_name = log.election_name();
                tokio::select! {
                    r = election::campaign(client, &election_name, &shared.address, session.lease_id) => Some(r),
                    _ = session.lost() => None,
                    _ = stop.cancelled() => None,
                }
            }
            _ => None,
        };
        following.cancel();
        let _ = follower.await;
        let Some(Ok(session)) = session else {
            return Ok(());
        };
        let key = match won {
            Some(Ok(k)) => k,
            Some(Err(e)) => {
                warn!(error = %e, "campaign failed; retrying");
                session.revoke(client).await;
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            None => {
                session.revoke(client).await;
                continue;
            }
        };
        info!(epoch = key.rev(), "elected");
        let writer = etcd_leader_client(cfg, client).await;
        let leader_log = writer
            .as_ref()
            .map_or_else(|| log.clone(), |w| log.with_writer(w));
        // While leading: move what etcd no longer needs to the archive.
        let trimming = stop.child_token();
        let trimmer = archive.clone().map(|a| {
            tokio::spawn(
                trimming
                    .clone()
                    .run_until_cancelled_owned(crate::archive::trim_loop(
                        a,
                        leader_log.clone(),
                        key.key().to_vec(),
                        key.rev(),
                        shared.clone(),
                        crate::archive::TrimPolicy {
                            retain_events: cfg.log_retain_events,
                            interval: Duration::from_millis(cfg.archive_interval_ms.max(10)),
                        },
                    ))
                    .in_current_span(),
            )
        });
        let leader = Leader {
            shared: shared.clone(),
            log: leader_log,
            fence: Fence::from(&key),
            limits,
            snapshot_every: cfg.snapshot_every,
            archive: archive.clone(),
        };
        let why = leader
            .run(session.lease(), stop.clone())
            .instrument(info_span!("lead", epoch = key.rev()))
            .await;
        trimming.cancel();
        if let Some(t) = trimmer {
            let _ = t.await;
        }
        let epoch = shared.role_info().epoch;
        shared.set_role(Role::Follower, epoch, String::new());
        // Resign by revoking the lease: the election key goes at once, so a follower takes
        // over without waiting for the TTL.
        session.revoke(client).await;
        if let StepDown::Bug(b) = &why {
            warn!(bug = %b, "reloading the ledger from etcd after an internal error");
            let _ = tail::load(shared, log, !cfg.ignore_snapshots, archive.as_ref()).await;
        }
        if matches!(why, StepDown::Shutdown) {
            return Ok(());
        }
        // Let another replica win before campaigning again.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every second: confirm etcd answers (a linearizable read needs quorum) and learn the
/// current leader. This is what makes reads fail closed when etcd is gone.
async fn health_loop(shared: Arc<Shared>, client: Client, log: EtcdLog) {
    loop {
        let head = log.head().await;
        let leader = election::current_leader(&client, &log.election_name()).await;
        {
            let mut h = shared.health.lock().unwrap_or_else(|p| p.into_inner());
            match &head {
                Ok(hd) => {
                    if !h.etcd_ok {
                        info!("etcd reachable");
                    }
                    h.etcd_ok = true;
                    h.reason.clear();
                    h.head_seq = hd.seq;
                }
                Err(e) => {
                    if h.etcd_ok {
                        warn!(error = %e, "etcd unreachable: granting nothing until it is back");
                    }
                    h.etcd_ok = false;
                    h.reason = format!("etcd unreachable: {e}");
                }
            }
        }
        let info = shared.role_info();
        if info.role == Role::Follower {
            let (addr, epoch) = leader.map_or((String::new(), info.epoch), |(a, e)| (a, e as u64));
            if addr != info.leader || epoch != info.epoch {
                shared.set_role(Role::Follower, epoch, addr);
            }
        }
        tokio::time::sleep(Duration::from_millis(if head.is_ok() { 1000 } else { 250 })).await;
    }
}
