//! Every integration test of this crate, in one test binary: each file beside this one is a
//! module. One binary per crate links the workspace once instead of once per file, which keeps
//! the build's disk and link time small (`autotests = false` in Cargo.toml).

mod support;

mod bad_input;
mod cdi_allocate;
mod cuda_context;
mod dmem_isolation;
mod dra_device_health;
mod dra_plugin;
mod dra_socket_bounds;
mod enforcement;
mod events_and_metrics;
mod fake_pod_cgroup;
mod forged_allocation_id;
mod host_pid_namespace;
mod identity_correction;
mod inventory;
mod lost_answer;
mod mps_isolation;
mod pid_reuse;
mod private_cgroup_namespace;
mod restarts;
mod reused_devices;
mod scheduler_skipped;
mod subscription_failover;
mod xid_health;
