//! `gpuledger-node-agent`: the DaemonSet that makes the ledger real on a GPU node.

use clap::Parser;
use gpuledger_node_agent::Config;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> std::process::ExitCode {
    let cfg = Config::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_env("GPULEDGER_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    if cfg.log_format == "json" {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .json()
            .init();
    } else {
        tracing_subscriber::fmt().with_env_filter(filter).init();
    }
    match gpuledger_node_agent::run(cfg).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("gpuledger-node-agent: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
