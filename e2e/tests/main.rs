//! Every integration test of this crate, in one test binary: each file beside this one is a
//! module. One binary per crate links the workspace once instead of once per file, which keeps
//! the build's disk and link time small (`autotests = false` in Cargo.toml).

mod adopt_switch;
mod binds_in_flight;
mod dra_batch_across_kills;
mod dra_claims;
mod dra_cores_fraction;
mod dra_device_health;
mod dra_first_available;
mod dra_preempts_for_gpu;
mod dra_refusals;
mod hami_core_isolation;
mod hami_places_its_pods;
mod kubelet_that_cannot_reach_the_plugin;
mod leader_killed_mid_batch;
mod node_name_takes_no_reservation;
mod peer_pods_unchanged;
mod pending_pod_requeued;
mod placed_through_the_extender;
mod preempts_for_gpu_slices;
mod reasons_users_can_read;
mod runs_on_a_real_kubelet;
mod versus_bench_runs;
