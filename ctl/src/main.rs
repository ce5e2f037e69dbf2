//! `gpuledger`: the operator's command line.

mod adopt;
mod budget;
mod client;
mod discover;
mod ledger_cmds;
mod simulate;
mod table;
mod usage;
mod when;

use std::io::IsTerminal;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

// The ledger folds and decides with many small allocations; mimalloc makes that ~1.4x faster
// than the system allocator (measured with `gpuledger-bench replay`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// gpuledger: inspect, audit, replay and verify the GPU ledger; simulate placement policies.
///
/// Commands that read the live ledger talk to the allocator's gRPC API (any replica). Point
/// them at it with --allocator (or GPULEDGER_ALLOCATOR); several comma-separated addresses
/// are tried in order.
///
/// As a kubectl plugin (this binary installed or linked as `kubectl-gpuledger` on the PATH,
/// run as `kubectl gpuledger …`) the commands are the same, and without --allocator the
/// allocator is found through the kubeconfig ($KUBECONFIG, --kubeconfig, --context): the port
/// named `grpc` of service gpuledger-allocator in namespace gpuledger-system, port-forwarded
/// to each of its ready pods.
#[derive(Parser)]
#[command(name = "gpuledger", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Role, leader, epoch and seq of every allocator replica given.
    Status(client::Target),
    /// Per node and GPU: allocated/total memory and compute, and the pods holding them.
    Inspect(ledger_cmds::InspectArgs),
    /// The history of one pod: every ledger event that concerns it, in order.
    Audit(ledger_cmds::AuditArgs),
    /// The state of the ledger at a past seq or time, rebuilt from the log.
    Replay(ledger_cmds::ReplayArgs),
    /// Replay the whole log, check every invariant, and compare with each live replica.
    /// Exits non-zero on any difference.
    Verify(ledger_cmds::VerifyArgs),
    /// GPU-MiB-hours and GPU-core-hours per namespace, pod or node over a time window,
    /// integrated exactly from the ledger.
    #[command(long_about = usage::LONG_ABOUT)]
    Usage(usage::UsageArgs),
    /// Replay a production trace through the placement policies (offline, no cluster needed).
    Simulate(simulate::SimulateArgs),
    /// Namespaces' GPU budgets and quotas: where each stands (budget, used, remaining, burn
    /// rate, projected exhaustion), and setting them.
    Budget(Box<budget::BudgetArgs>),
    /// Take over running GPU pods that HAMi, gpushare or gpu-manager placed, without a
    /// restart: a plan per node (dry run), --apply commits it.
    #[command(long_about = adopt::LONG_ABOUT)]
    Adopt(Box<adopt::AdoptArgs>),
}

/// Diagnostics go to stderr, as stdout is the command's output: only warnings by default, and
/// with GPULEDGER_LOG=debug every call to the allocator with its address and the log's seq.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("GPULEDGER_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("gpuledger=warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .without_time()
        .with_target(false)
        .init();
}

fn main() -> std::process::ExitCode {
    init_logging();
    // Installed as `kubectl-gpuledger` (a link to this binary), kubectl runs it as
    // `kubectl gpuledger …`: same commands, but the allocator is found through the kubeconfig.
    let mut cmd = Cli::command();
    if discover::detect_plugin(std::env::args_os().next().as_deref()) {
        cmd = cmd.bin_name("kubectl gpuledger");
    }
    let cli = Cli::from_arg_matches(&cmd.get_matches()).unwrap_or_else(|e| e.exit());
    let res = match cli.command {
        Cmd::Simulate(a) => simulate::run(a),
        other => match tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
        {
            Ok(rt) => rt.block_on(async move {
                match other {
                    Cmd::Status(t) => ledger_cmds::status(t).await,
                    Cmd::Inspect(a) => ledger_cmds::inspect(a).await,
                    Cmd::Audit(a) => ledger_cmds::audit(a).await,
                    Cmd::Replay(a) => ledger_cmds::replay(a).await,
                    Cmd::Verify(a) => ledger_cmds::verify(a).await,
                    Cmd::Usage(a) => usage::usage(a).await,
                    Cmd::Budget(a) => budget::budget(*a).await,
                    Cmd::Adopt(a) => adopt::adopt(*a).await,
                    Cmd::Simulate(_) => unreachable!("handled above"),
                }
            }),
            Err(e) => Err(e.into()),
        },
    };
    match res {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpuledger: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
