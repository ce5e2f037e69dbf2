//! Every integration test of this crate, in one test binary: each file beside this one is a
//! module. One binary per crate links the workspace once instead of once per file, which keeps
//! the build's disk and link time small (`autotests = false` in Cargo.toml).

mod kit;

mod adopt_running_pods;
mod cli_logs_name_the_allocator;
mod kubectl_plugin_inspect;
mod simulate_by_hand;
mod simulate_openb;
mod simulate_rejects_bad_input;
mod simulate_traces;
mod tamper_evident_log;
mod usage_from_the_ledger;
mod verify_audit_replay;
