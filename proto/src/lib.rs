//! Generated protobuf code for gpuledger: the ledger's events and the allocator's gRPC API.

#![allow(missing_docs, clippy::all, clippy::pedantic)]

/// Ledger events, batches and snapshots (`gpuledger.ledger.v1`).
pub mod ledger {
    /// Version 1 of the ledger format.
    pub mod v1 {
        include!(concat!(env!("OUT_DIR"), "/gpuledger.ledger.v1.rs"));
    }
}

/// The allocator's gRPC API (`gpuledger.allocator.v1`).
#[cfg(feature = "grpc")]
pub mod allocator {
    /// Version 1 of the allocator API.
    pub mod v1 {
        include!(concat!(env!("OUT_DIR"), "/gpuledger.allocator.v1.rs"));
        // Defined in the ledger package (wire-compatible move); named here as they always were.
        pub use crate::ledger::v1::{ContainerRequest, Placement, PodRequest};
    }
}

/// The kubelet device plugin API (`v1beta1`, upstream package name and field numbers).
#[cfg(feature = "grpc")]
pub mod deviceplugin {
    /// Version v1beta1, the one every kubelet since 1.10 speaks.
    pub mod v1beta1 {
        include!(concat!(env!("OUT_DIR"), "/v1beta1.rs"));
    }
}

/// The kubelet PodResources API (`v1`, upstream package name and field numbers).
#[cfg(feature = "grpc")]
pub mod podresources {
    /// Version v1.
    pub mod v1 {
        include!(concat!(env!("OUT_DIR"), "/v1.rs"));
    }
}
