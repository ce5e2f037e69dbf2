//! Every integration test of this crate, in one test binary: each file beside this one is a
//! module. One binary per crate links the workspace once instead of once per file, which keeps
//! the build's disk and link time small (`autotests = false` in Cargo.toml).

mod absurd_commands;
mod claims_and_pods;
mod placement_props;
mod replay_equals_live;
