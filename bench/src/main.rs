//! `gpuledger-bench`: benchmarks that print a table and a final `key=value` line, always with a
//! baseline measured in the same run. Build everything in release mode first
//! (`cargo build --release --workspace`, or `make bench`).

mod allocator;
mod common;
mod e2e;
mod extender;
mod failover;
mod hostile;
mod node_agent;
mod replay;
mod scrape;
mod verify;
mod versus;

use clap::{Parser, Subcommand};

// The ledger folds and decides with many small allocations; mimalloc makes that ~1.4x faster
// than the system allocator (measured with `gpuledger-bench replay`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// gpuledger benchmarks (release build; each starts its own 3-member etcd on loopback).
#[derive(Parser)]
#[command(name = "gpuledger-bench", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Reservations/s through the gRPC API vs raw etcd txn/s at the same concurrency; latency;
    /// allocator RSS with a large ledger.
    Allocator(allocator::Args),
    /// SIGKILL the leader while clients reserve; time until a reservation succeeds again.
    Failover(failover::Args),
    /// Fold speed of the ledger, and cold start of a replica from etcd.
    Replay(replay::Args),
    /// Device-plugin Allocate latency through a node agent, and the agent's RSS and CPU.
    NodeAgent(node_agent::Args),
    /// Extender filter/prioritize/bind latency with many nodes, and pods/s end to end.
    Extender(extender::Args),
    /// Latency and bytes of one /metrics scrape of an allocator holding a large cluster.
    Scrape(scrape::Args),
    /// The real kube-scheduler's pods/s, GPU pods vs plain pods; pod start on a real kubelet.
    E2e(e2e::Args),
    /// `gpuledger verify` end to end over a long hash-chained log, archive + etcd.
    Verify(verify::Args),
    /// Honest binds, reservations and admission reviews, quiet and under each hostile-load
    /// attack (slow bodies, idle sockets, stream floods, forged identities, …): success and p99.
    Hostile(hostile::Args),
    /// HAMi and gpuledger on one control plane, the same pods in HAMi's YAML: pods/s,
    /// create-to-bound, CPU per pod; under churn and kills: over-commit, stranded grants, and
    /// how soon a deleted pod's room is usable again.
    Versus(versus::Args),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("gpuledger-bench: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let res = rt.block_on(async move {
        match cli.command {
            Cmd::Allocator(a) => allocator::run(a).await,
            Cmd::Failover(a) => failover::run(a).await,
            Cmd::Replay(a) => replay::run(a).await,
            Cmd::NodeAgent(a) => node_agent::run(a).await,
            Cmd::Extender(a) => extender::run(a).await,
            Cmd::Scrape(a) => scrape::run(a).await,
            Cmd::E2e(a) => e2e::run(a).await,
            Cmd::Verify(a) => verify::run(a).await,
            Cmd::Hostile(a) => hostile::run(a).await,
            Cmd::Versus(a) => versus::run(a).await,
        }
    });
    match res {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpuledger-bench: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
