//! What every gpuledger binary shares to be operated: log setup, the Kubernetes client, pod
//! Events for users, and the Prometheus `/metrics` route.

pub mod events;
pub mod kube_client;
pub mod logging;
pub mod metrics;
pub mod quantity;
