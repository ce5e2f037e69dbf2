//! On a stock kubelet (containerd 2 with CDI, runc) with the node agent and the fake NVML: the
//! agent registers and the node advertises `gpuledger.io/gpu`; a GPU pod's container runs with
//! its GPU given as a CDI device, so it has the device node and the variable the node's CDI
//! spec adds for that GPU, and its limits in its environment; the kubelet's PodResources API
//! names the devices the ledger recorded; a kubelet restart makes the agent register again;
//! pods that end or are deleted give their GPUs back.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use gpuledger_e2e::cluster::REAL_NODE;
use gpuledger_e2e::pods;
use gpuledger_e2e::real_node::{CDI_ENV, allocatable_gpu, host_network};
use gpuledger_e2e::{E2e, Options, until};
use gpuledger_proto::podresources::v1 as podres;
use gpuledger_testkit::eventually;
use gpuledger_testkit::kubelet::uds_channel;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams};

fn registrations(log: &str) -> usize {
    log.matches("registered with the kubelet").count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes with a real kubelet, containerd and root: make test-e2e"]
async fn a_gpu_pod_runs_on_a_real_kubelet_and_gives_its_gpu_back() -> Result<()> {
    let mut e = E2e::start(Options {
        real_node: true,
        ..Options::default()
    })
    .await?;
    let nodes: Api<Node> = Api::all(e.client.clone());
    let node = e.node.as_ref().context("no real node")?;
    node.wait_advertised(&e.client, 128, Duration::from_secs(60))
        .await
        .with_context(|| e.log_tails(20))?;

    e.namespace("run").await?;
    let api: Api<Pod> = Api::namespaced(e.client.clone(), "run");
    let t0 = Instant::now();
    let spec = host_network(pods::pod(
        "cuda",
        &[
            ("gpuledger.io/gpu-mem", "2048"),
            ("gpuledger.io/gpu-core", "25"),
        ],
        Some(&[
            "sh",
            "-c",
            "env | sort; ls /dev/ | sed 's|^|dev=|'; sleep 3600",
        ]),
    ));
    let uid = pods::create(&e.client, "run", &spec)
        .await?
        .metadata
        .uid
        .unwrap_or_default();
    let logs = until(
        "the container runs and prints its GPU environment",
        Duration::from_secs(90),
        || async {
            let text = node
                .container_log("run", "cuda", &uid, "main")
                .unwrap_or_default();
            Ok(text.contains("GPULEDGER_ALLOCATION_ID=").then_some(text))
        },
    )
    .await
    .with_context(|| e.log_tails(20))?;
    let started = t0.elapsed();

    let ledger = e.gl.ledger().await?;
    let a = ledger.allocs_of_pod(&uid);
    ensure!(a.len() == 1, "{} allocations for the pod", a.len());
    let a = a[0].clone();
    ensure!(a.node == REAL_NODE, "reserved on {}", a.node);
    ensure!(
        a.state == gpuledger_ledger::state::AllocState::Assigned && !a.device_ids.is_empty(),
        "the kubelet's Allocate did not claim the reservation: {:?}, devices {:?}",
        a.state,
        a.device_ids
    );
    let env = |k: &str| {
        logs.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .map(str::to_string)
    };
    // containerd applied the CDI device the agent named: the spec's variable and device
    // node of the GPU the ledger granted, and of no other.
    let granted = &a.shares[0].gpu_uuid;
    ensure!(
        env(CDI_ENV).as_ref() == Some(granted),
        "the container got CDI device {:?}, the ledger granted {granted}\n{logs}",
        env(CDI_ENV),
    );
    let dev = node
        .cdi_device_node(granted)
        .context("the granted GPU is not one of the node's")?;
    let devs: Vec<&str> = logs
        .lines()
        .filter_map(|l| l.strip_prefix("dev="))
        .filter(|d| d.starts_with("nvidia"))
        .collect();
    ensure!(
        devs == [dev.trim_start_matches("/dev/")],
        "the container has GPU device nodes {devs:?}, the CDI spec gives {dev}\n{logs}"
    );
    ensure!(
        env("GPULEDGER_ALLOCATION_ID") == Some(a.id.to_string()),
        "allocation id in the container: {:?}, ledger {}",
        env("GPULEDGER_ALLOCATION_ID"),
        a.id
    );
    ensure!(
        env("GPULEDGER_GPU_MEM_MIB").as_deref() == Some("2048"),
        "{logs}"
    );

    // The kubelet's own record of who got which devices agrees with the ledger.
    let node = e.node.as_ref().context("no real node")?;
    let ch = uds_channel(&node.pod_resources_socket).await?;
    let list = podres::pod_resources_lister_client::PodResourcesListerClient::new(ch)
        .list(podres::ListPodResourcesRequest {})
        .await?
        .into_inner();
    let devices: Vec<String> = list
        .pod_resources
        .iter()
        .filter(|p| p.namespace == "run" && p.name == "cuda")
        .flat_map(|p| p.containers.iter().filter(|c| c.name == "main"))
        .flat_map(|c| {
            c.devices
                .iter()
                .filter(|d| d.resource_name == "gpuledger.io/gpu")
        })
        .flat_map(|d| d.device_ids.clone())
        .collect();
    ensure!(
        devices == a.device_ids,
        "PodResources says {devices:?}, the ledger {:?}",
        a.device_ids
    );
    ensure!(
        std::fs::read_to_string(node.agent.log_path())?
            .contains("PreStartContainer: identity confirmed"),
        "the agent did not confirm the pod's identity before the start"
    );

    // A kubelet restart: the agent registers again and the node keeps advertising.
    let before = registrations(&std::fs::read_to_string(node.agent.log_path())?);
    e.node.as_mut().context("no real node")?.restart_kubelet()?;
    let node = e.node.as_ref().context("no real node")?;
    eventually(
        "the agent registered again with the restarted kubelet",
        Duration::from_secs(60),
        || async {
            let n = registrations(&std::fs::read_to_string(node.agent.log_path())?);
            Ok(n > before
                && node.agent_readyz().await?.0 == 200
                && allocatable_gpu(&nodes.get(REAL_NODE).await?) == 128)
        },
    )
    .await
    .with_context(|| e.log_tails(20))?;

    // A pod that ends, and the running one deleted: both give their GPU back.
    let once = host_network(pods::pod(
        "once",
        &[("gpuledger.io/gpu-mem", "1024")],
        Some(&["sh", "-c", &format!("test -n \"${CDI_ENV}\"")]),
    ));
    pods::create(&e.client, "run", &once).await?;
    eventually(
        "the short pod succeeded",
        Duration::from_secs(90),
        || async {
            let p = api.get("once").await?;
            Ok(p.status.and_then(|s| s.phase).as_deref() == Some("Succeeded"))
        },
    )
    .await
    .with_context(|| e.log_tails(20))?;
    api.delete("cuda", &DeleteParams::default()).await?;
    let gl = &e.gl;
    eventually(
        "both allocations released",
        Duration::from_secs(60),
        || async { Ok(gl.ledger().await?.allocs().is_empty()) },
    )
    .await
    .with_context(|| e.log_tails(20))?;
    println!(
        "create to container running with its GPU env: {:.2} s",
        started.as_secs_f64()
    );
    Ok(())
}
