//! Discovery: the GPUs NVML reports are registered with the allocator, and registered again
//! when NVML shows a different set (a GPU added), with ListAndWatch following; the memory the
//! driver reserves is not registered as capacity; the CUDA compute capability is registered
//! when NVML reports it.

use crate::support;

use std::time::Duration;

use gpuledger_testkit::kubelet::node::FakeGpu;
use support::{Cluster, NODE, Options, SLOTS};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvml_inventory_is_registered_and_reregistered_on_change() -> anyhow::Result<()> {
    let port = gpuledger_testkit::free_port()?;
    let health = format!("--health-listen=127.0.0.1:{port}");
    let mut c = Cluster::start(2, &["--rediscover-interval=200ms", &health]).await?;
    assert!(
        http_get(port, "/readyz")?.starts_with("HTTP/1.1 200"),
        "registered and synced: ready"
    );
    assert!(http_get(port, "/healthz")?.starts_with("HTTP/1.1 200"));
    let s = c.dump().await?;
    let n = s.nodes.iter().find(|n| n.node == NODE).expect("registered");
    let got: Vec<(u32, &str, &str, u64, bool)> = n
        .gpus
        .iter()
        .map(|g| {
            (
                g.index,
                g.uuid.as_str(),
                g.model.as_str(),
                g.memory_mib,
                g.healthy,
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![
            (0, "GPU-gpu-node-1-0", "NVIDIA A100-SXM4-40GB", 40_960, true),
            (1, "GPU-gpu-node-1-1", "NVIDIA A100-SXM4-40GB", 40_960, true),
        ]
    );
    // NVML's CUDA compute capability is registered (the ResourceSlice's cudaComputeCapability).
    assert!(
        n.gpus.iter().all(|g| g.compute_capability == "8.0"),
        "{:?}",
        n.gpus
    );
    c.nvml.gpus.push(FakeGpu {
        uuid: "GPU-hotplug".into(),
        name: "NVIDIA H100".into(),
        memory_mib: 81_920,
        compute_capability: None,
    });
    c.nvml.write()?;
    c.wait_ledger(Duration::from_secs(10), |s| {
        s.nodes.iter().flat_map(|n| n.gpus.iter()).any(|g| {
            g.uuid == "GPU-hotplug"
                    && g.memory_mib == 81_920
                    && g.model == "NVIDIA H100"
                    // A driver that does not report it: registered all the same, without it.
                    && g.compute_capability.is_empty()
        })
    })
    .await?;
    c.kubelet
        .wait_devices(Duration::from_secs(5), |d| {
            d.len() == 3 * SLOTS as usize && d.iter().any(|x| x.id == "GPU-hotplug::0")
        })
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_the_driver_reserves_is_not_registered_as_capacity() -> anyhow::Result<()> {
    // A real H100 80GB HBM3 (driver 580): 81559 MiB in all, 480 MiB reserved by the driver.
    let c = Cluster::start_opts(Options {
        nvml: Some(Box::new(|cfg| {
            cfg.gpus[0].memory_mib = 81_559;
            cfg.gpus[0].reserved_mib = 480;
        })),
        ..Options::default()
    })
    .await?;
    let s = c.dump().await?;
    let n = s.nodes.iter().find(|n| n.node == NODE).expect("registered");
    assert_eq!(n.gpus[0].memory_mib, 81_559 - 480, "what processes can use");
    // No reservation can take what no process will ever get.
    let mut api = c.extender()?;
    let too_big = api
        .reserve(gpuledger_proto::allocator::v1::ReserveRequest {
            request: Some(gpuledger_testkit::workload::pod("big", 81_100, 10)),
            node: NODE.into(),
            ttl_ms: 60_000,
        })
        .await;
    let too_big = too_big.expect_err("81100 MiB fit on a GPU with 81079 usable");
    assert_eq!(
        too_big.code(),
        tonic::Code::FailedPrecondition,
        "{too_big:?}"
    );
    c.reserve("fits", 81_079, None).await?;
    Ok(())
}

fn http_get(port: u16, path: &str) -> anyhow::Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes())?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}
