//! `gpuledger-node-agent` (being built).
fn main() {}
