//! The pure core of gpuledger.
//!
//! Events (protobuf, from `gpuledger-proto`) fold into a [`Ledger`]; every apply checks the
//! invariants. Commands are decided against the state by [`Ledger::execute`], which returns the
//! events to append. Placement policies choose GPUs. Nothing here does IO or reads a clock:
//! callers pass the epoch and the time in.

pub mod capacity;
pub mod chain;
pub mod command;
pub mod follower;
pub mod placement;
pub mod state;

pub use command::{Command, CommandError, Reply};
pub use follower::{FollowError, Followed, Follower};
pub use gpuledger_proto::ledger::v1 as pb;
pub use placement::{ContainerRequest, Fit, PodRequest, Policy, Selector};
pub use state::{Alloc, AllocState, ApplyError, GpuState, Ledger, NodeState};

/// Compute units per GPU: shares are in thousandths of a GPU.
pub const CORE_MILLI_PER_GPU: u32 = 1000;
