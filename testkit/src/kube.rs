//! A small fake kube-apiserver and a kube-scheduler emulator.
//!
//! The fake API server speaks HTTPS on 127.0.0.1 and serves the parts of the Kubernetes
//! REST API that gpuledger and kube-rs use: create/get/list/watch/patch/delete of any
//! resource (pods, nodes, events, leases…), `resourceVersion` semantics, field selectors such
//! as `spec.nodeName` and `spec.schedulerName`, label selectors, JSON merge patch, and pod
//! bindings (409 on a second bind). Components reach it through an ordinary kubeconfig file.
//! [`store`] holds the objects; [`apiserver`] serves them over HTTP and says where it differs
//! from a real kube-apiserver; [`portforward`] adds `pods/{name}/portforward`.

pub mod apiserver;
pub mod portforward;
pub mod scheduler;
pub mod stack;
pub mod store;

pub use apiserver::FakeApiServer;
pub use scheduler::{ExtenderClient, ExtenderConfig, ExtenderTls, Preemption, SchedulerEmulator};
pub use stack::{KubeStack, StackOptions};
