//! `gpuledger-chaos up`: the local cluster of `demo`, left running until Ctrl-C, with what it
//! takes to point the tools at it.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};

use gpuledger_auth::Role;
use gpuledger_testkit::cluster::{ClusterOptions, LocalCluster, SCHEDULER_NAME};

/// Flags of `gpuledger-chaos up`.
#[derive(clap::Args, Debug, Clone)]
pub struct UpArgs {
    /// Simulated GPU nodes (each: kubelet emulator, fake NVML, a node agent process).
    #[arg(long, default_value_t = 4)]
    pub nodes: usize,
    /// GPUs per node (even nodes: A100 40 GB, odd nodes: T4 15 GB).
    #[arg(long, default_value_t = 2)]
    pub gpus: u32,
    /// Allocator replicas.
    #[arg(long, default_value_t = 3)]
    pub replicas: usize,
    /// Extender replicas.
    #[arg(long, default_value_t = 2)]
    pub extenders: usize,
    /// Run directory (logs, kubeconfig, node state); kept after exit. Default: a new
    /// directory under the system's temp dir, deleted on exit.
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// Start the cluster, print how to reach it, wait for Ctrl-C (or SIGTERM).
pub async fn run(a: UpArgs) -> Result<()> {
    let tmp = match &a.dir {
        Some(_) => None,
        None => Some(
            tempfile::Builder::new()
                .prefix("gpuledger-up-")
                .tempdir()
                .context("creating a run directory")?,
        ),
    };
    let dir = a
        .dir
        .clone()
        .or_else(|| tmp.as_ref().map(|t| t.path().to_path_buf()))
        .context("no run directory")?;
    println!(
        "starting etcd x3, {} allocators, {} extenders, {} nodes x {} GPUs in {}…",
        a.replicas,
        a.extenders,
        a.nodes,
        a.gpus,
        dir.display()
    );
    let mut c = LocalCluster::start(ClusterOptions {
        nodes: a.nodes,
        gpus: a.gpus,
        allocators: a.replicas,
        extenders: a.extenders,
        dir: Some(dir.clone()),
        ..Default::default()
    })
    .await?;
    let alloc = c.allocs.addrs.join(",");
    // The allocators demand TLS and an identity: a viewer's, and an admin's for writes.
    let viewer = c.ids.credentials(&Role::Viewer)?;
    let admin = c.ids.credentials(&Role::Admin)?;
    println!("\ngpuledger local cluster is up. Point the tools at it, as a viewer:\n");
    println!("  export GPULEDGER_ALLOCATOR={alloc}");
    for (var, path) in [
        ("GPULEDGER_ALLOCATOR_CA", &viewer.ca),
        ("GPULEDGER_TOKEN_FILE", &viewer.token_file),
        ("GPULEDGER_CLIENT_CERT", &viewer.client_cert),
        ("GPULEDGER_CLIENT_KEY", &viewer.client_key),
    ] {
        if let Some(p) = path {
            println!("  export {var}={}", p.display());
        }
    }
    println!("  gpuledger status");
    println!("  gpuledger inspect");
    println!("  gpuledger verify");
    if let Some(t) = admin.token_file.as_ref().or(admin.client_cert.as_ref()) {
        println!(
            "\n  an admin's credential (remove a node, release): {}",
            t.display()
        );
    }
    println!(
        "\n  kubeconfig (fake kube-apiserver {}): {}",
        c.api.url(),
        c.kubeconfig().display()
    );
    println!(
        "  pods with spec.schedulerName={SCHEDULER_NAME} and gpuledger.io/* limits are scheduled and run;"
    );
    println!(
        "  e.g. curl -XPOST -H 'content-type: application/json' {}/api/v1/namespaces/default/pods -d @pod.json",
        c.api.url()
    );
    println!("\n  etcd: {}", c.etcd_endpoints().join(","));
    println!("\n  allocators (gRPC, then HTTP /metrics /healthz /readyz /ui):");
    for (i, (g, h)) in c.allocs.addrs.iter().zip(&c.allocs.http).enumerate() {
        println!("    alloc{i}: {g}   http://{h}/metrics   http://{h}/ui");
    }
    println!("  extenders (scheduler extender urlPrefix, /metrics /healthz /readyz):");
    for i in 0..c.extenders.len() {
        let (u, h) = (c.extender_url(i), c.extender_http(i));
        println!("    extender{i}: {u}/gpuledger (HTTPS, scheduler certificate)   {h}/metrics");
    }
    println!("  node agents (/metrics /healthz /readyz):");
    for n in &c.nodes {
        println!(
            "    {} ({} x {}): {}/metrics",
            n.name,
            a.gpus,
            n.model,
            n.health_url()
        );
    }
    println!("\n  logs: {}/*.log", dir.display());
    println!("\nCtrl-C stops everything.");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    let mut reported = false;
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
            _ = tick.tick() => {
                if let Err(e) = c.check_processes()
                    && !reported
                {
                    eprintln!("warning: {e:#}");
                    reported = true;
                }
            }
        }
    }
    println!("stopping…");
    drop(c);
    drop(tmp);
    Ok(())
}
