//! One allocator replica: serve the API, load and follow the ledger, campaign, lead.

mod setup;

use std::sync::Arc;
use std::time::Duration;

use backon::Retryable;
use etcd_client::{AlarmAction, AlarmType, Client};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, info, info_span, warn};

pub use self::setup::{StartError, connect};
use self::setup::{etcd_leader_client, security};
use crate::config::Config;
use crate::election::{self, Session};
use crate::leader::{BatchLimits, Leader, StepDown};
use crate::log::{EtcdLog, Fence, LogError};
use crate::retry::forever;
use crate::service::{Leaders, Placement, Service};
use crate::shared::{Role, Shared};
use crate::tail;
use crate::workload::Learned;
use crate::writer::{self, Inbox};

/// Run a replica until SIGTERM or SIGINT.
pub async fn run(cfg: Config) -> Result<(), StartError> {
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
pub async fn run_until(cfg: Config, stop: CancellationToken) -> Result<(), StartError> {
    let shared = Shared::new(cfg.replica(), cfg.advertise());
    let client = connect(&cfg.etcd_endpoints, cfg.etcd_tls().as_ref()).await?;
    let log = EtcdLog::new(
        &client,
        &cfg.cluster,
        Duration::from_millis(cfg.etcd_timeout_ms),
    );
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|source| StartError::Listen {
            flag: "",
            addr: cfg.listen,
            source,
        })?;
    info!(
        listen = %cfg.listen,
        advertise = %shared.address,
        replica = %shared.replica,
        cluster = %cfg.cluster,
        "gpuledger-allocator starting"
    );
    let archive = match &cfg.archive_dir {
        Some(dir) => {
            Some(
                crate::archive::Archive::open(dir).map_err(|source| StartError::Archive {
                    dir: dir.clone(),
                    source,
                })?,
            )
        }
        None => {
            warn!(
                "no --archive-dir: the ledger's whole log stays in etcd and grows with every event"
            );
            None
        }
    };
    let security = security(&cfg, &shared, &stop).await?;
    let peers = gpuledger_auth::Credentials::load(&cfg.peer).map_err(StartError::Peers)?;
    peers.spawn_reloader(cfg.tls.reload_every(), stop.clone());
    let kube = crate::kube_watch::enabled(&cfg.kube);
    let authz = Arc::new(crate::authz::Authz::new(kube, cfg.scheduler_names.clone()));
    let learned = Learned::new(cfg.fgd_window, cfg.fgd_min_samples);
    let preemption = crate::preemption::Preemption::new(&cfg.preempt, &shared.metrics);
    let (writer, inbox) = writer::channel(shared.actor());
    let service = Service::new(
        shared.clone(),
        writer.clone(),
        Leaders::new(client.clone(), log.election_name(), peers),
        log.clone(),
        Duration::from_secs(cfg.reserve_ttl),
        Placement {
            default_policy: cfg.default_policy,
            learned: learned.clone(),
        },
        authz.clone(),
    )
    .with_archive(archive.clone())
    .with_write_limits(crate::write_limits::WriteLimits::new(
        cfg.write_limits.clone(),
    ))
    .with_limits(
        cfg.limits.max_streams_per_identity,
        cfg.limits.heavy_read_threads,
    )
    .with_log_scans(crate::log_scans::ScanBounds {
        max: cfg.limits.max_log_scans,
        per_holder: cfg.limits.max_log_scans_per_holder,
        events_per_s: cfg.limits.log_scan_events_per_s,
        total_events_per_s: cfg.limits.log_scan_events_total_per_s,
    })
    .with_read_limits(crate::read_limits::ReadLimits::new(
        cfg.limits.heavy_reads_per_identity_per_s,
        cfg.limits.heavy_read_burst,
        shared.metrics.bites.clone(),
    ))
    .with_preemption(preemption.clone())
    .with_dra_cores(cfg.kube.claims.dra_cores);
    let http = tokio::net::TcpListener::bind(cfg.http_listen)
        .await
        .map_err(|source| StartError::Listen {
            flag: "--http-listen ",
            addr: cfg.http_listen,
            source,
        })?;

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
    let router = crate::http::router(shared.clone(), cfg.http_state_api, cfg.metrics_namespaces);
    let (http_stop, http_limits) = (stop.clone(), cfg.http.limits());
    let http_bites = shared.metrics.bites.clone();
    tasks.spawn(async move {
        let served = gpuledger_auth::https::serve_plain(
            "http",
            http,
            http_limits,
            http_bites,
            router,
            http_stop,
        )
        .await;
        if let Err(e) = served {
            warn!(error = %e, "the HTTP endpoint stopped");
        }
    });
    crate::kube_watch::spawn(
        crate::kube_watch::Ties {
            shared: shared.clone(),
            writer: writer.clone(),
            authz: authz.clone(),
            budget_guard: service.budget_guard_slot().clone(),
            preemption: preemption.clone(),
        },
        &cfg.kube,
        &tasks,
        &stop,
    );
    crate::preemption::spawn(
        crate::preemption::Sweep {
            preemption,
            shared: shared.clone(),
            writer,
            authz,
        },
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

    lifecycle(&cfg, &shared, &inbox, &client, &log, archive, &stop).await;
    stop.cancel();
    tasks.close();
    // Give in-flight RPCs a moment, then stop serving.
    let _ = tokio::time::timeout(Duration::from_secs(2), tasks.wait()).await;
    Ok(())
}

async fn lifecycle(
    cfg: &Config,
    shared: &Arc<Shared>,
    inbox: &Inbox,
    client: &Client,
    log: &EtcdLog,
    archive: Option<crate::archive::Archive>,
    stop: &CancellationToken,
) {
    // Load the ledger (retry until etcd answers; a corrupt log is not retried).
    let load = (|| tail::load(shared, log, !cfg.ignore_snapshots, archive.as_ref()))
        .retry(forever(Duration::from_millis(500)))
        .when(|e| !matches!(e, LogError::Corrupt { .. }))
        .notify(|e, _| warn!(error = %e, "loading the ledger failed; retrying"));
    match stop.run_until_cancelled(load).await {
        None => return,
        Some(Ok(())) => {}
        Some(Err(e)) => {
            shared
                .health
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .broken = Some(e.to_string());
            warn!(error = %e, "the ledger does not load; serving status only");
            stop.cancelled().await;
            return;
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
    let mut takeovers = TakeoverBackoff::default();
    loop {
        if stop.is_cancelled() {
            return;
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
            .notify(|e, _| {
                // Under etcd's NOSPACE alarm no lease can be granted; the health loop says
                // so once, not twice a second.
                if shared.nospace().is_none() {
                    warn!(error = %e, "cannot get an etcd lease; following only")
                }
            });
        let session = stop.run_until_cancelled(session).await;
        let won = match &session {
            Some(Ok(session)) => {
                let election_name = log.election_name();
                election::revoke_earlier_selves(
                    client,
                    &election_name,
                    &shared.address,
                    session.lease_id,
                )
                .await;
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
            return;
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
            inbox: inbox.clone(),
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
        // `Leader::run` announces the role only once its first event is written.
        let took_over = shared.role_info().role == Role::Leader;
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
            return;
        }
        // Let another replica win before campaigning again; after a takeover that failed
        // before writing anything (a `head` that does not match the log, etcd refusing),
        // longer each time, so a replica that cannot lead does not re-run elections many
        // times a second.
        let pause = match &why {
            // etcd refuses writes until an operator makes room: try again soon after.
            StepDown::Etcd(e) if e.is_no_space() => Duration::from_secs(1),
            _ => takeovers.after(took_over),
        };
        if !pause.is_zero() && pause >= TakeoverBackoff::LOUD {
            warn!(
                pause_ms = pause.as_millis() as u64,
                "the last takeovers failed before writing anything; waiting before campaigning again"
            );
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(100) + pause) => {}
            _ = stop.cancelled() => return,
        }
    }
}

/// How long a replica waits before campaigning again after takeovers that failed before
/// their first write: nothing after a real leadership, then doubling from 200 ms to 30 s.
#[derive(Debug, Default)]
struct TakeoverBackoff {
    failed: u32,
}

impl TakeoverBackoff {
    const FIRST: Duration = Duration::from_millis(200);
    const MAX: Duration = Duration::from_secs(30);
    /// From this pause on, each one is logged.
    const LOUD: Duration = Duration::from_secs(1);

    /// The pause after a leadership that took over (`took_over`) or failed to.
    fn after(&mut self, took_over: bool) -> Duration {
        if took_over {
            self.failed = 0;
            return Duration::ZERO;
        }
        let pause = Self::FIRST
            .saturating_mul(1 << self.failed.min(16))
            .min(Self::MAX);
        self.failed = self.failed.saturating_add(1);
        pause
    }
}

/// Every second: confirm etcd answers (a linearizable read needs quorum) and learn the
/// current leader. This is what makes reads fail closed when etcd is gone.
async fn health_loop(shared: Arc<Shared>, client: Client, log: EtcdLog) {
    loop {
        let head = log.head().await;
        if head.is_ok() {
            // Reads work under the NOSPACE alarm; only the alarm list says writes do not.
            let mut c = client.clone();
            let alarms = tokio::time::timeout(
                Duration::from_secs(1),
                c.alarm(AlarmAction::Get, AlarmType::None, None),
            )
            .await;
            if let Ok(Ok(a)) = alarms {
                let members: Vec<String> = a
                    .alarms()
                    .iter()
                    .filter(|m| m.alarm() == AlarmType::Nospace)
                    .map(|m| format!("{:x}", m.member_id()))
                    .collect();
                shared.set_nospace((!members.is_empty()).then(|| members.join(",")));
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_takeovers_back_off_and_a_real_leadership_resets() {
        let mut b = TakeoverBackoff::default();
        let pauses: Vec<u128> = (0..10).map(|_| b.after(false).as_millis()).collect();
        assert_eq!(
            pauses,
            [200, 400, 800, 1600, 3200, 6400, 12800, 25600, 30000, 30000]
        );
        assert_eq!(b.after(true), Duration::ZERO);
        assert_eq!(b.after(false), Duration::from_millis(200));
    }
}
