//! `gpuledger-extender`: the kube-scheduler extender and, with `--webhook-listen`, the
//! admission webhook of gpuledger.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use gpuledger_auth::limit::Bites;
use gpuledger_extender::allocator::Allocators;
use gpuledger_extender::extender::{self, App};
use gpuledger_extender::metrics::Metrics;
use gpuledger_extender::preemption::Preemption;
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
    /// Address of the extender's HTTPS server for kube-scheduler (the KubeSchedulerConfiguration's
    /// urlPrefix points here, with or without the /gpuledger path, with `enableHTTPS: true` and
    /// a `tlsConfig` whose client certificate --client-ca signed).
    #[arg(long, env = "GPULEDGER_LISTEN", default_value = "0.0.0.0:28888")]
    listen: SocketAddr,

    /// Address of the plain HTTP server of /healthz, /readyz and /metrics (for the kubelet's
    /// probes and Prometheus; nothing there writes).
    #[arg(long, env = "GPULEDGER_HTTP_LISTEN", default_value = "0.0.0.0:28889")]
    http_listen: SocketAddr,

    /// The bounds of --http-listen's port.
    #[command(flatten)]
    http: gpuledger_auth::PlainHttpArgs,

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

    /// Address of the admission webhook's HTTPS server (off when not set); it presents
    /// --tls-cert too, and asks for no client certificate (the API server sends none).
    #[arg(long, env = "GPULEDGER_WEBHOOK_LISTEN")]
    webhook_listen: Option<SocketAddr>,

    /// The serving certificate of both HTTPS servers, and (--client-ca, required) the CA of
    /// kube-scheduler's client certificate.
    #[command(flatten)]
    tls: gpuledger_auth::ServerTlsArgs,

    /// How this extender proves who it is to the allocator.
    #[command(flatten)]
    credentials: gpuledger_auth::CredentialArgs,

    /// How often, per pending pod, filter may ask the allocator leader to preempt for it when
    /// the pod fits on none of the scheduler's nodes for want of GPU room, in milliseconds
    /// (kube-scheduler's own preemption cannot see GPU memory or compute). 0 = never: GPU
    /// slices are then preempted only by a scheduler that calls the `preempt` verb.
    #[arg(long, env = "GPULEDGER_PREEMPT_RETRY_MS", default_value_t = 5000)]
    preempt_retry_ms: u64,

    /// Scheduler name the webhook sets on GPU pods that use the default scheduler (off when
    /// not set).
    #[arg(long, env = "GPULEDGER_SCHEDULER_NAME")]
    scheduler_name: Option<String>,

    /// The path of a GPU pod whose annotation `gpuledger.io/path` and namespace label
    /// `gpuledger.io/path` choose none: "device-plugin" (gpuledger.io/* extended resources,
    /// reserved at bind) or "dra" (the webhook turns the pod's GPU requests into a ResourceClaim
    /// of the gpu.gpuledger.io DeviceClass, through a ResourceClaimTemplate the allocator makes
    /// in the pod's namespace once the pod exists, and certifies). See docs/dra.md.
    #[arg(long, env = "GPULEDGER_POD_PATH", default_value = "device-plugin")]
    pod_path: webhook::PodPath,

    /// How gpuledger's DRA devices state their `cores` capacity: "thousandths" (a GPU is
    /// `cores: 1000`) or "fraction" (a GPU is `cores: 1`, Kubernetes 1.37+). Must equal the
    /// allocator's --dra-cores: the webhook's claim templates are named by what they ask, and
    /// the DRA path's claims are read in it.
    #[arg(
        long = "dra-cores",
        env = "GPULEDGER_DRA_CORES",
        value_name = "UNIT",
        default_value = "thousandths"
    )]
    dra_cores: gpuledger_request::dra::CoresUnit,

    /// Let the namespace label `gpuledger.io/path` (dra or device-plugin) choose the path of a
    /// GPU pod whose annotation does not, read from a watch of the namespaces (RBAC: list and
    /// watch on namespaces). Off: only the pod annotation and --pod-path choose.
    #[arg(long, env = "GPULEDGER_DRA_NAMESPACE_LABEL")]
    dra_namespace_label: bool,

    /// Request shapes /validate asks the allocator about per second, after a burst (whether
    /// any node can ever hold the pod; answers are kept 10 s per shape). Reviews are not
    /// authenticated, so past this a pod is admitted unchecked (kube-scheduler's filter
    /// refuses an impossible pod later) and counted as limit `validate_checks`. 0 = no pace.
    #[arg(long, env = "GPULEDGER_VALIDATE_CHECKS_PER_S", default_value_t = 20)]
    validate_checks_per_s: u32,

    /// The burst of --validate-checks-per-s.
    #[arg(long, env = "GPULEDGER_VALIDATE_CHECK_BURST", default_value_t = 100)]
    validate_check_burst: u32,

    /// The scheduler names whose pods /bind binds (comma-separated); a bind of a pod of any
    /// other scheduler is refused. The allocator's --scheduler-names, which it checks too.
    #[arg(
        long,
        env = "GPULEDGER_SCHEDULER_NAMES",
        value_delimiter = ',',
        default_value = "gpuledger-scheduler,default-scheduler"
    )]
    scheduler_names: Vec<String>,
    /// The identities the scheduler port admits: a client certificate that --client-ca signed
    /// must also name one of these (its subject's common name, a DNS name or a URI SAN),
    /// comma-separated. gpuledger-certs.sh and the cert-manager install issue kube-scheduler's
    /// certificate as `gpuledger-scheduler`; the same CA's other certificates (a viewer's, a
    /// node agent's) are refused in the handshake.
    #[arg(
        long,
        env = "GPULEDGER_SCHEDULER_CLIENT_NAMES",
        value_delimiter = ',',
        default_value = "gpuledger-scheduler"
    )]
    scheduler_client_names: Vec<String>,

    /// Open connections at once on each HTTPS port (webhook, scheduler), handshakes included;
    /// when it is full, a peer holding few takes the slot of an idle connection of the peer
    /// holding the most, else the new connection is closed at once.
    #[arg(long, env = "GPULEDGER_MAX_CONNECTIONS", default_value_t = 1024)]
    max_connections: usize,

    /// Open connections at once on each HTTPS port from one peer address.
    #[arg(
        long,
        env = "GPULEDGER_MAX_CONNECTIONS_PER_PEER",
        default_value_t = 256
    )]
    max_connections_per_peer: usize,

    /// Largest request body, in bytes (413 above it).
    #[arg(long, env = "GPULEDGER_MAX_BODY_BYTES", default_value_t = 2 << 20)]
    max_body_bytes: usize,

    /// Longest time a request's headers, and then its body, may take to arrive, in
    /// milliseconds (a kept-alive connection idle this long is closed too); a body still
    /// arriving then is answered 408.
    #[arg(
        long,
        env = "GPULEDGER_REQUEST_READ_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    request_read_timeout_ms: u64,

    /// `filter` and `prioritize` calls answered per second per peer address, together, after
    /// a burst (kube-scheduler makes one of each per pod it schedules); a turn is taken once a
    /// call's body has arrived, and a call past the rate waits up to a second for its turn,
    /// then is answered 429. Binds are not paced. 0 = no limit.
    #[arg(long, env = "GPULEDGER_SCHEDULING_CALLS_PER_S", default_value_t = 500)]
    scheduling_calls_per_s: u32,

    /// How many filter and prioritize calls one peer address may make at once before
    /// --scheduling-calls-per-s applies.
    #[arg(long, env = "GPULEDGER_SCHEDULING_CALL_BURST", default_value_t = 1000)]
    scheduling_call_burst: u32,

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
    let scheduler_ca = a.tls.client_ca.clone().context(
        "--client-ca is required: the CA that signed kube-scheduler's client certificate \
         (the scheduler configuration's tlsConfig.certFile); the scheduler-facing port refuses \
         callers without one",
    )?;
    let (scheduler_bites, webhook_bites, http_bites) = (Bites::new(), Bites::new(), Bites::new());
    let scheduler_tls = gpuledger_auth::tls::server_config_for_named_clients(
        &a.tls.cert,
        &a.tls.key,
        &scheduler_ca,
        a.scheduler_client_names.clone(),
        scheduler_bites.clone(),
        &[b"http/1.1"],
    )?;
    scheduler_tls.spawn_reloader(a.tls.reload_every(), shutdown.clone());
    let read = Duration::from_millis(a.request_read_timeout_ms.max(100));
    let limits = gpuledger_auth::https::Limits {
        handshake: a.tls.handshake_timeout(),
        header_read: read,
        body_bytes: a.max_body_bytes,
        body_time: read,
        max_connections: a.max_connections,
        max_connections_per_peer: a.max_connections_per_peer,
        ..Default::default()
    };
    let open_files = gpuledger_auth::limit::raise_open_files();
    let fds_needed = (a.max_connections as u64)
        .saturating_mul(2)
        .saturating_add(a.http.max_connections as u64)
        .saturating_add(512);
    if open_files.is_some_and(|n| n < fds_needed) {
        tracing::warn!(
            open_files = ?open_files,
            max_connections = a.max_connections,
            "the open-file limit is below twice --max-connections (webhook and scheduler port) \
             plus --http-max-connections plus room for the allocator and the API server: a flood of connections could \
             exhaust file descriptors before the limit bites; lower --max-connections or raise \
             the limit (ulimit -n)"
        );
    }
    let creds = gpuledger_auth::Credentials::load(&a.credentials)?;
    creds.spawn_reloader(a.tls.reload_every(), shutdown.clone());
    let allocators = Allocators::new(
        &a.allocator,
        Duration::from_millis(a.allocator_timeout_ms),
        &creds,
    )?;
    let replica =
        (a.replica_stale_ms > 0).then(|| Replica::new(Duration::from_millis(a.replica_stale_ms)));
    let limited = gpuledger_extender::metrics::Limited(vec![
        ("scheduler", scheduler_bites.clone()),
        ("webhook", webhook_bites.clone()),
        ("http", http_bites.clone()),
    ]);
    let preemption = Preemption::new(Duration::from_millis(a.preempt_retry_ms));
    let metrics = Arc::new(Metrics::new(|r| {
        if let Some(rep) = &replica {
            rep.register(r);
        }
        r.register_collector(Box::new(limited));
        preemption.register(r);
    }));
    if let Some(rep) = &replica {
        tasks.spawn(rep.clone().follow(allocators.clone(), shutdown.clone()));
    }
    let kube = gpuledger_ops::kube_client::client(a.kubeconfig.as_deref()).await?;
    if kube.is_none() {
        tracing::warn!("no --kubeconfig and not in a cluster: bind will fail");
    }
    if let Some(addr) = a.webhook_listen {
        let tls = gpuledger_auth::tls::server_config(
            &a.tls.cert,
            &a.tls.key,
            gpuledger_auth::tls::ClientCerts::None,
            &[b"http/1.1"],
        )?;
        tls.spawn_reloader(a.tls.reload_every(), shutdown.clone());
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("listening on {addr}"))?;
        let app = webhook::router(webhook::Webhook {
            allocators: allocators.clone(),
            feasible: webhook::Feasibility::new(
                a.validate_checks_per_s,
                a.validate_check_burst,
                webhook_bites.clone(),
            ),
            scheduler_name: a.scheduler_name.clone(),
            replica: replica.clone(),
            namespaces: kube
                .clone()
                .filter(|_| a.dra_namespace_label)
                .map(|k| webhook::NamespaceLabels::start(k, shutdown.clone())),
            pod_path: a.pod_path,
            dra_cores: a.dra_cores,
        })
        .layer(axum::middleware::from_fn_with_state(
            metrics.clone(),
            gpuledger_extender::metrics::track,
        ));
        info!(%addr, "admission webhook listening (HTTPS)");
        let stop = shutdown.clone();
        tasks.spawn(async move {
            if let Err(e) =
                gpuledger_auth::https::serve("webhook", l, tls, limits, webhook_bites, app, stop)
                    .await
            {
                tracing::error!("the admission webhook stopped: {e:#}");
            }
        });
    }
    let events = kube
        .clone()
        .map(|k| Recorder::new(k, "gpuledger-extender", None));
    let app = App {
        allocators,
        kube,
        #[cfg(feature = "test-hooks")]
        crash_at: a.crash_at,
        events,
        metrics,
        replica,
        tasks: tasks.clone(),
        scheduler_names: a.scheduler_names.clone(),
        preemption,
        pace: gpuledger_extender::pace::Pace::new(
            a.scheduling_calls_per_s,
            a.scheduling_call_burst,
            scheduler_bites.clone(),
        ),
        dra_cores: a.dra_cores,
    };
    let probes = tokio::net::TcpListener::bind(a.http_listen)
        .await
        .with_context(|| format!("listening on --http-listen {}", a.http_listen))?;
    let probe_app = extender::probes(app.clone());
    let (stop, probe_limits) = (shutdown.clone(), a.http.limits());
    tasks.spawn(async move {
        if let Err(e) = gpuledger_auth::https::serve_plain(
            "http",
            probes,
            probe_limits,
            http_bites,
            probe_app,
            stop,
        )
        .await
        {
            tracing::error!("the probe endpoint stopped: {e}");
        }
    });
    let l = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| format!("listening on {}", a.listen))?;
    info!(addr = %a.listen, allocators = ?a.allocator, "scheduler extender listening (HTTPS, client certificate required)");
    gpuledger_auth::https::serve(
        "scheduler",
        l,
        scheduler_tls,
        limits,
        scheduler_bites,
        extender::router(app),
        shutdown.clone(),
    )
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
