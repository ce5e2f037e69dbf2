//! Every integration test of this crate, in one test binary: each file beside this one is a
//! module. One binary per crate links the workspace once instead of once per file, which keeps
//! the build's disk and link time small (`autotests = false` in Cargo.toml).

mod support;

mod api_basics;
mod budgets_from_kubernetes;
mod caller_limits;
mod dra_certification;
mod etcd_out_of_space;
mod etcd_tls;
mod fgd_live;
mod fuzz_grpc;
mod graceful_handover;
mod grpc_listener_bounds;
mod hostile_clients;
mod hostile_load;
mod hostile_tokens;
mod http_endpoints;
mod kube_fake_apiserver;
mod kube_lifecycle;
mod leader_fencing;
mod log_archive;
mod log_reads;
mod log_scans;
mod metrics_cover_the_ledger;
mod no_lost_grant;
mod rewritten_head;
mod rpc_spans;
mod slow_etcd;
mod snapshots_and_compaction;
mod ui_api;
mod ui_browser;
