//! `gpuledger-extender` (being built).
fn main() {}
