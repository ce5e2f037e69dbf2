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
    }
}
