//! Regression (issue 18, "GPUs are granted by an environment variable only"): on nodes hardened
//! the way NVIDIA recommends a gpuledger pod got no GPU, and on the others the variable was the
//! only grant. Allocate now names exactly the granted GPUs as CDI devices; the answer the
//! kubelet receives over the real gRPC socket is compared with a golden message that protoc
//! encodes from the device-plugin proto, whose field numbers are pinned to upstream's.

use crate::support;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, ensure};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::deviceplugin::v1beta1 as dp;
use prost::Message;
use support::{Cluster, Options};

const MESSAGE: &str = "v1beta1.ContainerAllocateResponse";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Run protoc with `args`, `input` on stdin.
fn protoc(args: &[String], input: &[u8]) -> Result<Vec<u8>> {
    let mut child = Command::new("protoc")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running protoc (Debian package protobuf-compiler: `make deps` installs it)")?;
    child
        .stdin
        .take()
        .context("protoc's stdin")?
        .write_all(input)?;
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "protoc {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(out.stdout)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_names_exactly_the_granted_gpus_as_cdi_devices() -> Result<()> {
    let c = Cluster::start_opts(Options {
        gpus: 3,
        flags: vec!["--device-list-strategy=cdi-cri".into()],
        ..Options::default()
    })
    .await?;
    let (g0, g2) = (c.gpu(0), c.gpu(2));
    let mut req = gpuledger_testkit::workload::pod("uid-two", 8_192, 10);
    req.containers[0].slices = 2;
    req.placement = Some(api::Placement {
        gpu_uuids: vec![g0.clone(), g2.clone()],
        ..Default::default()
    });
    let a = c.reserve_request(req).await?;
    let got = c.kubelet.admit("default", "pod-uid-two", "main", 2).await?;

    let golden =
        std::fs::read_to_string(repo().join("node-agent/tests/golden/allocate-cdi-cri.txtpb"))?
            .replace("{ALLOCATION_ID}", &a.id.to_string());
    // Encoded from the repository's device-plugin proto, as the kubelet's.
    let encode = [
        format!("--proto_path={}", repo().join("proto/proto").display()),
        format!("--encode={MESSAGE}"),
        "k8s/deviceplugin/v1beta1/api.proto".into(),
    ];
    let bytes = protoc(&encode, golden.as_bytes())?;
    let want = dp::ContainerAllocateResponse::decode(bytes.as_slice())?;
    assert_eq!(
        got.response, want,
        "the kubelet got another answer than the golden one"
    );

    // The wire numbers as the kubelet has them: cdi_devices is field 5, CDIDevice.name 1.
    let raw = protoc(&["--decode_raw".into()], &got.response.encode_to_vec())?;
    let raw = String::from_utf8(raw)?;
    for gpu in [&g0, &g2] {
        let entry = format!("5 {{\n  1: \"nvidia.com/gpu={gpu}\"\n}}");
        assert!(raw.contains(&entry), "{entry} not in\n{raw}");
    }
    assert_eq!(
        raw.matches("\n5 {").count() + usize::from(raw.starts_with("5 {")),
        2
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_the_gpus_are_named_in_the_cdi_field_and_annotation_not_the_environment()
-> Result<()> {
    let c = Cluster::start(2, &[]).await?;
    let g1 = c.gpu(1);
    let a = c.reserve("uid-a", 4_096, Some(&g1)).await?;
    let got = c.kubelet.admit("default", "pod-uid-a", "main", 1).await?;
    let r = &got.response;
    let cdi = format!("nvidia.com/gpu={g1}");
    assert_eq!(
        r.cdi_devices,
        [dp::CdiDevice { name: cdi.clone() }],
        "exactly the granted GPU"
    );
    assert_eq!(
        r.annotations
            .get(&format!("cdi.k8s.io/gpuledger.gpu_{}", a.id)),
        Some(&cdi)
    );
    assert!(
        !r.envs.contains_key("NVIDIA_VISIBLE_DEVICES"),
        "the variable grants nothing on hardened nodes, and is not a grant here"
    );
    assert_eq!(r.envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "4096m");
    // --device-list-strategy=envvar keeps the old answer for runtimes without CDI.
    drop(c);
    let c = Cluster::start(
        1,
        &[
            "--device-list-strategy=envvar",
            "--cdi-kind=example.com/gpu",
        ],
    )
    .await?;
    let g0 = c.gpu(0);
    c.reserve("uid-b", 4_096, None).await?;
    let got = c.kubelet.admit("default", "pod-uid-b", "main", 1).await?;
    assert_eq!(got.response.envs["NVIDIA_VISIBLE_DEVICES"], g0);
    assert!(got.response.cdi_devices.is_empty());
    Ok(())
}
