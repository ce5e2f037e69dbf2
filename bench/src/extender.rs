//! `gpuledger-bench extender` (being built).

/// Flags.
#[derive(clap::Args)]
pub struct Args {}

/// Run the benchmark.
pub async fn run(_a: Args) -> anyhow::Result<()> {
    anyhow::bail!("not built yet")
}
