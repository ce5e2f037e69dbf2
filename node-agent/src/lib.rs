//! gpuledger's node agent: NVML discovery, the kubelet device plugin, the node's ledger
//! subscription, memory-limit enforcement and GPU health.
//!
//! The decisions (which reservation an Allocate is for, what env a container gets, who is over
//! a limit) are pure functions in [`view`] and [`enforce`]; the rest are thin shells around
//! NVML, the kubelet's unix sockets and the allocator's gRPC API.

pub mod agent;
pub mod allocator;
pub mod config;
pub mod device_plugin;
pub mod enforce;
pub mod health;
pub mod kubelet;
pub mod metrics;
pub mod nvml;
pub mod subscribe;
pub mod uds;
pub mod view;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::Context;
use tokio::signal::unix::{SignalKind, signal};
use tracing::{info, warn};

pub use config::Config;

/// Run the agent until SIGTERM or SIGINT. Running containers are left untouched on exit.
pub async fn run(cfg: Config) -> anyhow::Result<()> {
    anyhow::ensure!(
        !cfg.node_name.is_empty(),
        "--node-name (NODE_NAME) is empty"
    );
    anyhow::ensure!(cfg.slots_per_gpu > 0, "--slots-per-gpu must be at least 1");
    let nvml = nvml::NvmlBackend::open(cfg.nvml_lib.as_deref())?;
    let agent = agent::Agent::new(cfg, nvml).context("starting the agent")?;
    match gpuledger_ops::kube_client::client(agent.cfg.kubeconfig.as_deref()).await {
        Ok(Some(client)) => {
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

    let (xid_tx, xid_rx) = tokio::sync::mpsc::channel(64);
    let stop = Arc::new(AtomicBool::new(false));
    let xid_thread = agent.nvml.watch_xids(xid_tx, stop.clone());

    let mut tasks = vec![
        tokio::spawn(subscribe::follow(agent.clone())),
        tokio::spawn(agent.clone().keep_registered()),
        tokio::spawn(agent.clone().watch_health(xid_rx)),
        tokio::spawn(enforce::run(agent.clone())),
        tokio::spawn(kubelet::serve_and_register(agent.clone())),
    ];

    if let Some(addr) = agent.cfg.health_listen {
        tasks.push(tokio::spawn(health::serve(agent.clone(), addr)));
    }
    tokio::select! {
        _ = term.recv() => info!("SIGTERM: stopping; running containers keep their GPUs"),
        _ = int.recv() => info!("SIGINT: stopping; running containers keep their GPUs"),
    }
    for t in &tasks {
        t.abort();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    kubelet::remove_socket(&agent);
    let _ = tokio::task::spawn_blocking(move || xid_thread.join()).await;
    Ok(())
}
