//! The allocator's Kubernetes side (being built): pod and node watchers that release
//! allocations, and the reconcile of expired reservations. Only the leader writes.

use crate::service::Service;

/// Flags of the Kubernetes watchers.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct KubeArgs {}

/// Start the watchers, if configured.
pub fn spawn(_service: Service, _args: &KubeArgs) {}
