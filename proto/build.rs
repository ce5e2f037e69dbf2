//! Compiles the protobuf files into Rust with prost (messages) and tonic (services).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "proto/gpuledger/ledger/v1/ledger.proto",
        "proto/gpuledger/allocator/v1/allocator.proto",
        "proto/k8s/deviceplugin/v1beta1/api.proto",
        "proto/k8s/podresources/v1/api.proto",
        "proto/k8s/pluginregistration/v1/api.proto",
        "proto/k8s/dra/v1/api.proto",
        "proto/k8s/drahealth/v1alpha1/api.proto",
    ];
    for p in &protos {
        println!("cargo:rerun-if-changed={p}");
    }
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // Only claim grants carry it: boxed, so every pod allocation stays small.
        .boxed(".gpuledger.ledger.v1.Allocation.claim")
        .compile_protos(&protos, &["proto"])?;
    // Its package, `v1`, is also the pod-resources API's: compiled apart, into a module of its
    // own.
    let health = "proto/k8s/drahealth/v1/api.proto";
    println!("cargo:rerun-if-changed={health}");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("drahealth");
    std::fs::create_dir_all(&out)?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .out_dir(&out)
        .compile_protos(&[health], &["proto"])?;
    Ok(())
}
