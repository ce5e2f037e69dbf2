//! Generated protobuf code for gpuledger: the ledger's events, the allocator's gRPC API and the
//! kubelet APIs the node agent speaks (device plugin, PodResources, plugin registration, DRA and its
//! health stream).

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

/// The kubelet plugin-registration API (upstream package `pluginregistration`, versionless): how a
/// DRA driver announces itself in the kubelet's plugin registry.
#[cfg(feature = "grpc")]
pub mod pluginregistration {
    /// Version v1 (upstream's directory; the wire package carries no version).
    pub mod v1 {
        include!(concat!(env!("OUT_DIR"), "/pluginregistration.rs"));
    }
}

/// The kubelet DRA plugin API (`k8s.io.kubelet.pkg.apis.dra`, upstream package name and field numbers).
#[cfg(feature = "grpc")]
pub mod dra {
    /// Version v1, advertised as `v1.DRAPlugin`.
    pub mod v1 {
        include!(concat!(
            env!("OUT_DIR"),
            "/k8s.io.kubelet.pkg.apis.dra.v1.rs"
        ));
    }
}

/// The kubelet DRA resource-health API (KEP-4680): one stream in two versions, which Kubernetes
/// 1.37 both speaks (the newest a plugin lists).
#[cfg(feature = "grpc")]
pub mod drahealth {
    /// Version v1alpha1, advertised as `v1alpha1.DRAResourceHealth`.
    pub mod v1alpha1 {
        include!(concat!(env!("OUT_DIR"), "/v1alpha1.rs"));
    }
    /// Version v1, advertised as `v1.DRAResourceHealth`.
    pub mod v1 {
        include!(concat!(env!("OUT_DIR"), "/drahealth/v1.rs"));
    }
}
