//! gpuledger's Kubernetes front door: the kube-scheduler extender (filter, prioritize, bind,
//! preempt) and the admission webhook (mutate, validate). No state of its own: filter and
//! prioritize read a replica of the allocator's ledger, every write is the allocator's.

pub mod allocator;
pub mod assume;
pub mod budget_admission;
pub mod extender;
pub mod metrics;
pub mod pace;
pub mod parallel;
pub mod preemption;
pub mod replica;
pub use gpuledger_request as resources;
pub mod scheduler_text;
#[cfg(feature = "test-hooks")]
pub mod test_hooks;
pub mod webhook;
