//! `gpuledger-extender`: the kube-scheduler extender and, with `--webhook-listen`, the
//! admission webhook of gpuledger.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use gpuledger_extender::allocator::Allocators;
use gpuledger_extender::extender::{self, App};
use gpuledger_extender::metrics::Metrics;
use gpuledger_extender::replica::Replica;
use gpuledger_extender::webhook;
use gpuledger_ops::events::Recorder;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::info;

/// How long shutdown waits for the webhook to drain and the work after binds to finish.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(10);

/// gpuledger-extender: kube-scheduler extender (filter, prioritize, bind, preempt) and
/// admission webhook for fractional GPUs.
///
/// Run as many replicas as you like. Filter and prioritize answer from a local replica of
/// the allocator's ledger (streamed from any allocator replica), or from the allocator while
/// that replica is not fresh; bind reserves at the allocator and creates the pod's Binding in
/// the API server.
#[derive(Parser, Debug)]
#[command(name = "gpuledger-extender", version, about, long_about)]
struct Args {
    /// Address of the extender's HTTP server (KubeSchedulerConfiguration urlPrefix points here,
    /// with or without the /gpuledger path).
    #[arg(long, env = "GPULEDGER_LISTEN", default_value = "0.0.0.0:28888")]
    listen: SocketAddr,

    /// Allocator replica addresses (host:port), comma-separated; any replica works.
    #[arg(
        long,
        env = "GPULEDGER_ALLOCATOR",
        value_delimiter = ',',
        required = true
    )]
    allocator: Vec<String>,

    /// Timeout of one allocator call, in milliseconds (kube-scheduler waits 5 s in all).
    #[arg(long, env = "GPULEDGER_ALLOCATOR_TIMEOUT_MS", default_value_t = 3000)]
    allocator_timeout_ms: u64,

    /// How long filter and prioritize may answer from the local replica of the ledger after
    /// last hearing from the allocator (heartbeats come twice a second); past it they ask the
    /// allocator. 0 = no replica: always ask the allocator.
    #[arg(long, env = "GPULEDGER_REPLICA_STALE_MS", default_value_t = 2000)]
    replica_stale_ms: u64,

    /// kubeconfig file; default: the in-cluster service account when running in a pod.
    #[arg(long, env = "GPULEDGER_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,

    /// Address of the admission webhook's HTTPS server (off when not set).
    #[arg(long, env = "GPULEDGER_WEBHOOK_LISTEN", requires_all = ["tls_cert", "tls_key"])]
    webhook_listen: Option<SocketAddr>,

    /// PEM certificate chain of the webhook.
    #[arg(long, env = "GPULEDGER_TLS_CERT")]
    tls_cert: Option<PathBuf>,

    /// PEM private key of the webhook.
    #[arg(long, env = "GPULEDGER_TLS_KEY")]
    tls_key: Option<PathBuf>,

    /// How often the webhook reads --tls-cert and --tls-key again, in milliseconds; a changed
    /// pair (cert-manager renewed it) is served to new connections without a restart.
    #[arg(long, env = "GPULEDGER_TLS_RELOAD_MS", default_value_t = 10_000)]
    tls_reload_ms: u64,

    /// Scheduler name the webhook sets on GPU pods that use the default scheduler (off when
    /// not set).
    #[arg(long, env = "GPULEDGER_SCHEDULER_NAME")]
    scheduler_name: Option<String>,

    /// Log format: "human" or "json".
    #[arg(long, env = "GPULEDGER_LOG_FORMAT", default_value = "human", value_parser = ["human", "json"])]
    log_format: String,

    /// Test only: exit at this point of a bind, as if killed (built with the `test-hooks`
    /// feature only).
    #[cfg(feature = "test-hooks")]
    #[arg(long, env = "GPULEDGER_CRASH_AT", hide = true)]
    crash_at: Option<gpuledger_extender::test_hooks::CrashAt>,
}

async fn run(a: Args) -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    let tasks = TaskTracker::new();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing a SIGTERM handler")?;
    let on_signal = shutdown.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        on_signal.cancel();
    });
    let allocators = Allocators::new(&a.allocator, Duration::from_millis(a.allocator_timeout_ms))?;
    let kube = gpuledger_ops::kube_client::client(a.kubeconfig.as_deref()).await?;
    if kube.is_none() {
        tracing::warn!("no --kubeconfig and not in a cluster: bind will fail");
    }
    let replica =
        (a.replica_stale_ms > 0).then(|| Replica::new(Duration::from_millis(a.replica_stale_ms)));
    let metrics = Arc::new(Metrics::new(|r| {
        if let Some(rep) = &replica {
            rep.register(r);
        }
    }));
    if let Some(rep) = &replica {
        tasks.spawn(rep.clone().follow(allocators.clone(), shutdown.clone()));
    }
    if let Some(addr) = a.webhook_listen {
        let (cert, key) = (
            a.tls_cert
                .clone()
                .context("--tls-cert is required with --webhook-listen")?,
            a.tls_key
                .clone()
                .context("--tls-key is required with --webhook-listen")?,
        );
        let tls = webhook::tls::tls_config(&cert, &key)?;
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("listening on {addr}"))?;
        let app = webhook::router(webhook::Webhook {
            allocators: allocators.clone(),
            scheduler_name: a.scheduler_name.clone(),
        })
        .layer(axum::middleware::from_fn_with_state(
            metrics.clone(),
            gpuledger_extender::metrics::track,
        ));
        info!(%addr, "admission webhook listening (HTTPS)");
        let files = webhook::tls::CertFiles {
            cert,
            key,
            reload_every: Duration::from_millis(a.tls_reload_ms),
        };
        let limits = webhook::tls::Limits::default();
        let stop = shutdown.clone();
        tasks.spawn(async move {
            if let Err(e) = webhook::tls::serve(l, tls, files, limits, app, stop).await {
                tracing::error!("the admission webhook stopped: {e:#}");
            }
        });
    }
    let events = kube
        .clone()
        .map(|k| Recorder::new(k, "gpuledger-extender", None));
    let app = extender::router(App {
        allocators,
        kube,
        #[cfg(feature = "test-hooks")]
        crash_at: a.crash_at,
        events,
        metrics,
        replica,
        tasks: tasks.clone(),
    });
    let l = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| format!("listening on {}", a.listen))?;
    info!(addr = %a.listen, allocators = ?a.allocator, "scheduler extender listening");
    // Answers of thousands of node names span many segments: no Nagle delay.
    let l = axum::serve::ListenerExt::tap_io(l, |tcp: &mut tokio::net::TcpStream| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(l, app)
        .with_graceful_shutdown(shutdown.clone().cancelled_owned())
        .await
        .context("serving the extender")?;
    shutdown.cancel();
    tasks.close();
    if tokio::time::timeout(SHUTDOWN_WAIT, tasks.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            "stopping with work after binds still running (the allocator's reconcile finishes it)"
        );
    }
    Ok(())
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let a = Args::parse();
    gpuledger_ops::logging::init(&a.log_format);
    match run(a).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("gpuledger-extender: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
