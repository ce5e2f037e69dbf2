//! What every gpuledger component shares to run in a cluster and be operated: log setup, the
//! Prometheus `/metrics` route, the injected clock, the Kubernetes client, pod Events for
//! users, and Kubernetes resource quantities.

pub mod clock;
pub mod events;
pub mod kube_client;
pub mod logging;
pub mod metrics;
pub mod quantity;
