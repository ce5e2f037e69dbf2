//! Fake kube-apiserver and kube-scheduler emulator (being built).
