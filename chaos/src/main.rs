//! `gpuledger-chaos`: the local cluster harness and demo.

use clap::{Parser, Subcommand};

/// gpuledger-chaos: run gpuledger as a local cluster of real processes on this machine.
#[derive(Parser)]
#[command(name = "gpuledger-chaos", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The demo: 3-member etcd, allocator replicas, a workload, a leader kill midway, then the
    /// inspect table, placements, failover times, utilization and `gpuledger verify`.
    Demo(gpuledger_chaos::demo::DemoArgs),
    /// A workload while faults chosen by --seed hit the allocator replicas and etcd, then a
    /// quiet phase and a history check. Exits non-zero on any violation.
    Run(gpuledger_chaos::run::RunArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("gpuledger-chaos: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let res = rt.block_on(async move {
        match cli.command {
            Cmd::Demo(a) => gpuledger_chaos::demo::run(a).await,
            Cmd::Run(a) => gpuledger_chaos::run::run(a).await,
        }
    });
    match res {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpuledger-chaos: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
