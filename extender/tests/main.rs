//! Every integration test of this crate, in one test binary: each file beside this one is a
//! module. One binary per crate links the workspace once instead of once per file, which keeps
//! the build's disk and link time small (`autotests = false` in Cargo.toml).

mod kit;

mod bad_input;
mod binds_in_flight;
mod budget_demotion;
mod crash_recovery;
mod dra_extender;
mod dra_webhook;
mod fuzz_inputs;
mod golden_fixtures;
mod gpu_preemption_on_a_stock_scheduler;
mod hostile_listeners;
mod hostile_requests;
mod peer_pods_unchanged;
mod preemption;
mod replica_answers;
mod scheduler_port_slow_clients;
mod webhook_tls;
