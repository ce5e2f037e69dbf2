//! `gpuledger-allocator`: a thin shell around `gpuledger_allocator::run`.

use clap::Parser;
use gpuledger_allocator::Config;

// The ledger folds and decides with many small allocations; mimalloc makes that ~1.4x faster
// than the system allocator (measured with `gpuledger-bench replay`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cfg = Config::parse();
    gpuledger_ops::logging::init(&cfg.log_format);
    match gpuledger_allocator::run(cfg).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // The error and each of its causes, on one line.
            let e = anyhow::Error::from(e);
            tracing::error!("{e:#}");
            eprintln!("gpuledger-allocator: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
