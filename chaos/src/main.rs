//! `gpuledger-chaos`: the local cluster as a program — the demo, `up`, and the chaos run with
//! its fault schedule and history check. What it starts and drives comes from
//! `gpuledger-testkit`, which every crate's integration tests use too.

mod demo;
mod run;
mod up;
mod workload;

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
    /// The demo: the local cluster, pods run end to end, an allocator leader and a node agent
    /// SIGKILLed midway, then what an operator would look at.
    ///
    /// Every component is a process on 127.0.0.1: etcd x3, allocators, extenders, and per node
    /// a node agent against a kubelet emulator and a fake NVML; the fake API server and the
    /// kube-scheduler emulator run in this process. Prints the inspect table, placements,
    /// failover times, utilization, `gpuledger verify` and every agent's view against the
    /// ledger. Exits non-zero when verify fails, a view differs or pods are lost.
    Demo(demo::DemoArgs),
    /// Start the demo's local cluster and keep it running until Ctrl-C.
    ///
    /// Prints the allocator addresses for `gpuledger status|inspect|verify`, the kubeconfig of
    /// the fake API server, and the /metrics URLs of every component.
    Up(up::UpArgs),
    /// The local cluster runs pods end to end while faults chosen by --seed hit it, then a
    /// quiet phase and a history check. Exits non-zero on any violation.
    ///
    /// Faults: SIGKILL of the allocator leader, a follower, an extender, a node agent, an etcd
    /// member; SIGSTOP of the leader past its lease; and, as root, a partition of the leader
    /// from etcd (iptables, inside a network namespace the run creates and deletes). The last
    /// line is `violations=N lost_grants=N double_grants=N replay_equal=B converged_s=X`.
    Run(run::RunArgs),
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
            Cmd::Demo(a) => demo::run(a).await,
            Cmd::Up(a) => up::run(a).await,
            Cmd::Run(a) => run::run(a).await,
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
