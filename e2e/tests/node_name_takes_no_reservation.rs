//! A pod that sets its own `spec.nodeName` skips the scheduler and holds no reservation; on a
//! stock kubelet it must not take the pending reservation of a pod the scheduler placed. The
//! intruder goes to the real node first, so the kubelet is admitting it (its `Allocate` waiting
//! for a reservation) when the rightful pod is reserved and bound: the agent confirms through
//! PodResources that the pod being admitted is not the reservation's, passes it over and refuses
//! the intruder, which fails admission saying it was not placed by the gpuledger scheduler; the
//! rightful pod is then admitted with its grant. Fails without the node agent's PodResources
//! check (be09077): the intruder's `Allocate` claims the pending reservation.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use gpuledger_e2e::cluster::REAL_NODE;
use gpuledger_e2e::pods;
use gpuledger_e2e::real_node::host_network;
use gpuledger_e2e::{E2e, Options, until};
use gpuledger_ledger::state::AllocState;
use gpuledger_proto::podresources::v1 as podres;
use gpuledger_testkit::kubelet::uds_channel;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;

const SLICES: [(&str, &str); 2] = [
    ("gpuledger.io/gpu-mem", "2048"),
    ("gpuledger.io/gpu-core", "25"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes with a real kubelet, containerd and root: make test-e2e"]
async fn a_pod_that_sets_its_node_name_takes_no_other_pods_reservation() -> Result<()> {
    let e = E2e::start(Options {
        real_node: true,
        // The owner's reservation must arrive while the intruder's Allocate waits: room for a
        // busy machine's scheduling.
        agent_allocate_wait: Some(Duration::from_secs(40)),
        ..Options::default()
    })
    .await?;
    let node = e.node.as_ref().context("no real node")?;
    node.wait_advertised(&e.client, 128, Duration::from_secs(60))
        .await
        .with_context(|| e.log_tails(20))?;
    e.namespace("steal").await?;
    let api: Api<Pod> = Api::namespaced(e.client.clone(), "steal");

    // The intruder first: the kubelet adds it to its pod manager, then admits it, and its
    // Allocate waits (the agent's --allocate-wait, 40 s here) for a pending reservation of its size.
    let mut intruder = host_network(pods::pod("intruder", &SLICES, None));
    intruder["spec"]["nodeName"] = REAL_NODE.into();
    let intruder_uid = pods::create(&e.client, "steal", &intruder)
        .await?
        .metadata
        .uid
        .unwrap_or_default();
    let ch = uds_channel(&node.pod_resources_socket).await?;
    let lister = podres::pod_resources_lister_client::PodResourcesListerClient::new(ch);
    until(
        "the kubelet lists the intruder (it is admitting it)",
        Duration::from_secs(60),
        || {
            let mut lister = lister.clone();
            async move {
                let list = lister
                    .list(podres::ListPodResourcesRequest {})
                    .await?
                    .into_inner();
                Ok(list
                    .pod_resources
                    .iter()
                    .any(|p| p.namespace == "steal" && p.name == "intruder")
                    .then_some(()))
            }
        },
    )
    .await
    .with_context(|| e.log_tails(20))?;

    // The rightful pod, through kube-scheduler and the extender: reserved while the intruder's
    // Allocate is still waiting.
    let owner = host_network(pods::pod(
        "owner",
        &SLICES,
        Some(&["sh", "-c", "env | sort; sleep 3600"]),
    ));
    let owner_uid = pods::create(&e.client, "steal", &owner)
        .await?
        .metadata
        .uid
        .unwrap_or_default();

    let (phase, reason, message) = until(
        "the kubelet refuses the intruder",
        Duration::from_secs(90),
        || async {
            let s = api.get("intruder").await?.status.unwrap_or_default();
            Ok((s.phase.as_deref() == Some("Failed")).then(|| {
                (
                    s.phase.unwrap_or_default(),
                    s.reason.unwrap_or_default(),
                    s.message.unwrap_or_default(),
                )
            }))
        },
    )
    .await
    .with_context(|| e.log_tails(30))?;
    println!("intruder: phase {phase}, reason {reason}, message {message}");
    ensure!(
        message.contains("not placed by the gpuledger scheduler"),
        "the intruder failed for another reason ({reason}): {message}\nevents:\n{}",
        pods::events_text(&e.client, "steal", "intruder").await?
    );
    ensure!(
        reason == "UnexpectedAdmissionError",
        "the intruder's status reason: {reason}"
    );

    let logs = until(
        "the owner runs with its grant",
        Duration::from_secs(90),
        || async {
            let text = node
                .container_log("steal", "owner", &owner_uid, "main")
                .unwrap_or_default();
            Ok(text.contains("GPULEDGER_ALLOCATION_ID=").then_some(text))
        },
    )
    .await
    .with_context(|| e.log_tails(30))?;

    let ledger = e.gl.ledger().await?;
    ensure!(
        ledger.allocs_of_pod(&intruder_uid).is_empty(),
        "the ledger holds allocations for the intruder: {:?}",
        ledger.allocs_of_pod(&intruder_uid)
    );
    let mine = ledger.allocs_of_pod(&owner_uid);
    ensure!(mine.len() == 1, "{} allocations for the owner", mine.len());
    let a = mine[0];
    ensure!(
        a.node == REAL_NODE && a.state == AllocState::Assigned && !a.device_ids.is_empty(),
        "the owner's allocation: {a:?}"
    );
    ensure!(
        logs.contains(&format!("GPULEDGER_ALLOCATION_ID={}", a.id))
            && logs.contains("GPULEDGER_GPU_MEM_MIB=2048"),
        "the owner's container environment does not name its grant {}:\n{logs}",
        a.id
    );
    // The reservation was pending while the intruder was admitted, and passed over for it.
    let agent_log = std::fs::read_to_string(node.agent.log_path())?;
    ensure!(
        agent_log.contains("passed over: the kubelet is not admitting its pod"),
        "the agent never passed over the owner's reservation"
    );
    Ok(())
}
