//! gpuledger's Kubernetes front door: the kube-scheduler extender (filter, prioritize, bind,
//! preempt) and the admission webhook (mutate, validate). Stateless; every decision is the
//! allocator's, reached over gRPC.

pub mod allocator;
pub mod extender;
pub mod metrics;
pub mod resources;
pub mod webhook;
