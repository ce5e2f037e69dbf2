//! `gpuledger-node-agent`: the DaemonSet that makes the ledger real on a GPU node.

use clap::Parser;
use gpuledger_node_agent::Config;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> std::process::ExitCode {
    let cfg = Config::parse();
    gpuledger_ops::logging::init(&cfg.log_format);
    match gpuledger_node_agent::run(cfg).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("gpuledger-node-agent: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
