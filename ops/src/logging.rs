//! Log setup: human-readable by default, JSON for clusters; the level comes from `GPULEDGER_LOG`
//! (an `EnvFilter` directive such as `info` or `gpuledger_allocator=debug`).

/// Install the global subscriber. `format` is "human" or "json" (the `--log-format` flag).
pub fn init(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("GPULEDGER_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    if format == "json" {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .json()
            .init();
    } else {
        tracing_subscriber::fmt().with_env_filter(filter).init();
    }
}
