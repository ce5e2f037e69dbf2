//! Kubelet emulator: device-plugin Registration server and PodResources (being built).
