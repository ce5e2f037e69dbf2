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
    /// The demo: the local cluster with every component a process (etcd x3, allocators,
    /// extenders, fake API server, scheduler emulator, nodes with kubelet emulator, fake NVML
    /// and node agent), pods run end to end, the allocator leader and a node agent SIGKILLed
    /// midway, then the inspect table, placements, failover times, utilization,
    /// `gpuledger verify` and every agent's view against the ledger. Exits non-zero when
    /// verify fails, a view differs or pods are lost.
    Demo(gpuledger_chaos::demo::DemoArgs),
    /// Start the same local cluster and keep it running until Ctrl-C; prints the addresses,
    /// the kubeconfig and the metrics URLs of every component.
    Up(gpuledger_chaos::up::UpArgs),
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
            Cmd::Up(a) => gpuledger_chaos::up::run(a).await,
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
