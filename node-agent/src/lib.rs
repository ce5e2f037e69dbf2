//! gpuledger's node agent: NVML discovery, the kubelet device plugin or DRA plugin, the node's
//! ledger subscription, memory-limit enforcement and GPU health.
//!
//! The decisions (which reservation an Allocate is for, what a container gets, which pod a
//! process is in, who is over a limit) are pure functions in [`view`], [`cgroup`] and
//! [`enforce`]; the rest are thin shells around NVML, /proc and pidfds ([`procs`]), the
//! kubelet's unix sockets and the allocator's gRPC API.

pub mod agent;
pub mod allocator;
pub mod cgroup;
pub mod config;
pub mod device_plugin;
pub mod dmem;
pub mod dra;
pub mod enforce;
pub mod health;
pub mod isolation;
pub mod kubelet;
pub mod metrics;
pub mod mps;
pub mod nvml;
pub mod procs;
pub mod subscribe;
pub mod uds;
pub mod view;

use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

pub use config::Config;

/// How long shutdown waits for the agent's tasks to stop.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(5);

/// Run `fut` on `tasks` until `stop` is cancelled; it is then dropped at its next await.
fn spawn_until(tasks: &TaskTracker, stop: &CancellationToken, fut: BoxFuture<'static, ()>) {
    tasks.spawn(stop.clone().run_until_cancelled_owned(fut));
}

/// Why the agent could not run. Not retryable: the node or the flags must change.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A flag is missing or out of range.
    #[error("{0}")]
    Flag(&'static str),
    /// NVML could not be loaded.
    #[error(transparent)]
    Nvml(#[from] nvml::Error),
    /// The node cannot serve the --isolation asked for: what is missing.
    #[error("isolation refused: {0}")]
    Isolation(String),
    /// The agent's credentials for the allocator could not be read.
    #[error("the agent's credentials for the allocator: {0}")]
    Credentials(#[from] gpuledger_auth::client::CredentialError),
    /// The agent could not start.
    #[error("starting the agent: {0}")]
    Agent(#[from] agent::AgentError),
    /// The signal handlers could not be installed.
    #[error("installing the signal handlers: {0}")]
    Signals(#[from] std::io::Error),
}

/// Run the agent until SIGTERM or SIGINT. Running containers are left untouched on exit.
pub async fn run(cfg: Config) -> Result<(), RunError> {
    if cfg.node_name.is_empty() {
        return Err(RunError::Flag("--node-name (NODE_NAME) is empty"));
    }
    if cfg.slots_per_gpu == 0 {
        return Err(RunError::Flag("--slots-per-gpu must be at least 1"));
    }
    if cfg.prepare_grant_wait >= dra::KUBELET_CALL_TIMEOUT {
        return Err(RunError::Flag(
            "--prepare-grant-wait must be shorter than the kubelet's 45 s per DRA call",
        ));
    }
    let nvml = nvml::NvmlBackend::open(cfg.nvml_lib.as_deref())?;
    let wanted = cfg.isolation_wanted();
    if wanted.isolation != isolation::Isolation::Nvml {
        let facts = isolation::NodeFacts {
            driver_version: nvml.driver_version()?,
            mig_on: nvml.mig_on()?,
            cgroup2_controllers: isolation::cgroup2_controllers(&wanted.cgroup_root),
        };
        isolation::check(&wanted, &facts).map_err(RunError::Isolation)?;
    }
    if wanted.isolation == isolation::Isolation::Mps {
        if cfg.mps {
            return Err(RunError::Flag(
                "--mps is for an MPS daemon the node runs; --isolation=mps runs the agent's own: choose one",
            ));
        }
        // EXCLUSIVE_PROCESS before any daemon: no context but the MPS server's.
        for g in nvml.gpus()? {
            nvml.set_exclusive_process(&g.uuid, true).map_err(|e| {
                RunError::Isolation(format!(
                    "--isolation=mps: cannot put {} in EXCLUSIVE_PROCESS compute mode: {e}",
                    g.uuid
                ))
            })?;
        }
    }
    let dmem_limits = match wanted.isolation {
        isolation::Isolation::Dmem => {
            let capacity = wanted.cgroup_root.join("dmem.capacity");
            let text = std::fs::read_to_string(&capacity).map_err(|e| {
                RunError::Isolation(format!(
                    "--isolation=dmem: reading {}: {e}",
                    capacity.display()
                ))
            })?;
            let regions = dmem::regions(&text, &nvml.bus_ids()?)
                .map_err(|e| RunError::Isolation(format!("--isolation=dmem: {e}")))?;
            Some(std::sync::Arc::new(dmem::limits::Dmem {
                root: wanted.cgroup_root.clone(),
                regions,
            }))
        }
        _ => None,
    };
    info!(
        isolation = wanted.isolation.as_str(),
        "isolation: {} first, NVML sampling with a kill behind it",
        wanted.isolation.as_str()
    );
    let creds = gpuledger_auth::Credentials::load(&cfg.credentials)?;
    let agent = agent::Agent::new(cfg, nvml, &creds)?;
    match gpuledger_ops::kube_client::client(agent.cfg.kubeconfig.as_deref()).await {
        Ok(Some(client)) => {
            let _ = agent.kube.set(client.clone());
            let rec = gpuledger_ops::events::Recorder::new(
                client,
                "gpuledger-node-agent",
                Some(agent.cfg.node_name.clone()),
            );
            let _ = agent.events.set(rec);
        }
        Ok(None) => info!("no --kubeconfig and not in a cluster: no pod Events"),
        Err(e) => warn!("no pod Events: {e:#}"),
    }
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;

    let shutdown = CancellationToken::new();
    // A rotated projected token or certificate is read again without a restart.
    creds.spawn_reloader(std::time::Duration::from_secs(10), shutdown.clone());
    let tasks = TaskTracker::new();
    let (xid_tx, xid_rx) = tokio::sync::mpsc::channel(64);
    let (nvml, stop) = (agent.nvml.clone(), shutdown.clone());
    tasks.spawn_blocking(move || nvml.watch_xids(xid_tx, &stop));
    let until_shutdown = |fut| spawn_until(&tasks, &shutdown, fut);
    until_shutdown(subscribe::follow(agent.clone()).boxed());
    until_shutdown(agent.clone().keep_registered().boxed());
    until_shutdown(agent.clone().watch_health(xid_rx).boxed());
    until_shutdown(agent.clone().probe_lost().boxed());
    until_shutdown(enforce::run(agent.clone()).boxed());
    match agent.cfg.mode {
        config::Mode::DevicePlugin => {
            until_shutdown(kubelet::serve_and_register(agent.clone(), shutdown.clone()).boxed());
        }
        config::Mode::Dra => {
            until_shutdown(dra::serve(agent.clone(), shutdown.clone()).boxed());
            until_shutdown(dra::slice::publish(agent.clone()).boxed());
        }
    }
    let mps = (agent.cfg.isolation == isolation::Isolation::Mps).then(|| {
        std::sync::Arc::new(mps::daemon::Daemons {
            control: agent.cfg.mps_control.clone(),
            dir: agent.cfg.mps_dir.clone(),
        })
    });
    if let Some(d) = &mps {
        until_shutdown(mps::daemon::supervise(agent.clone(), d.clone()).boxed());
    }
    if let Some(d) = dmem_limits {
        until_shutdown(dmem::limits::run(agent.clone(), d).boxed());
    }
    if let Some(addr) = agent.cfg.health_listen {
        until_shutdown(health::serve(agent.clone(), addr, shutdown.clone()).boxed());
    }
    tasks.close();
    tokio::select! {
        _ = term.recv() => info!("SIGTERM: stopping; running containers keep their GPUs"),
        _ = int.recv() => info!("SIGINT: stopping; running containers keep their GPUs"),
    }
    // The loops stop at their next await; the Xid watch within its 500 ms event wait.
    shutdown.cancel();
    if tokio::time::timeout(SHUTDOWN_WAIT, tasks.wait())
        .await
        .is_err()
    {
        warn!("stopping with tasks still running");
    }
    if let Some(d) = &mps {
        mps::daemon::stop(&agent, d).await;
    }
    match agent.cfg.mode {
        config::Mode::DevicePlugin => kubelet::remove_socket(&agent),
        config::Mode::Dra => dra::remove_sockets(&agent),
    }
    Ok(())
}
