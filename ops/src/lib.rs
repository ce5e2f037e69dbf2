//! What every gpuledger binary shares to be operated: log setup, the Kubernetes client, pod
//! Events for users, the Prometheus `/metrics` route, and the reader of the openb trace files
//! the simulator and the chaos workloads share, and the ledger's audit archive, and the
//! `GPUBudget` custom resource, and what a pod asks of gpuledger (its GPU request).

pub mod archive;
pub mod budget_crd;
pub mod clock;
pub mod events;
pub mod gpu_request;
pub mod kube_client;
pub mod logging;
pub mod metrics;
pub mod quantity;
pub mod trace;
