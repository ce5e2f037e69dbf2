//! Pods written for the peers run with no YAML change: gpushare's `aliyun.com/gpu-mem`,
//! HAMi's `nvidia.com/gpu` with `nvidia.com/gpumem`, `gpumem-percentage` or `gpucores`, and
//! gpu-manager's `tencent.com/vcuda-core` and `vcuda-memory` are rewritten by the webhook so
//! that nothing a node does not advertise is left, then placed by the real scheduler. The
//! webhook sees only what the shipped configuration sends it: pods that ask for a GPU
//! (`matchConditions`), outside the namespaces it leaves out.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use gpuledger_e2e::gpuledger::counter;
use gpuledger_e2e::pods;
use gpuledger_e2e::{E2e, Options};
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;

/// Resource names no node advertises: none may be left in a stored pod.
const PEER_NAMES: [&str; 7] = [
    "aliyun.com/gpu-mem",
    "nvidia.com/gpu",
    "nvidia.com/gpumem",
    "nvidia.com/gpumem-percentage",
    "nvidia.com/gpucores",
    "tencent.com/vcuda-core",
    "tencent.com/vcuda-memory",
];

/// A pod as the peer's users write it, and what the ledger must grant: GPUs, MiB per GPU
/// (0: not checked), compute per mille.
struct Case {
    name: &'static str,
    limits: Vec<(&'static str, &'static str)>,
    grant: (usize, u64, u32),
}

fn resource_names(p: &Pod) -> Vec<String> {
    let c = &p
        .spec
        .as_ref()
        .map(|s| s.containers.clone())
        .unwrap_or_default()[0];
    let r = c.resources.clone().unwrap_or_default();
    r.limits
        .unwrap_or_default()
        .into_keys()
        .chain(r.requests.unwrap_or_default().into_keys())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes (kube-apiserver, kube-scheduler): make test-e2e"]
async fn peer_pods_are_scheduled_without_a_yaml_change() -> Result<()> {
    let (e, _) = E2e::with_gpu_nodes(Options::default(), 3, 4, "peers").await?;

    let case = |name, limits, grant| Case {
        name,
        limits,
        grant,
    };
    let cases = [
        case("gpushare", vec![("aliyun.com/gpu-mem", "3")], (1, 3072, 0)),
        case(
            "hami-mem",
            vec![("nvidia.com/gpu", "1"), ("nvidia.com/gpumem", "4096")],
            (1, 4096, 0),
        ),
        case(
            "hami-two",
            vec![
                ("nvidia.com/gpu", "2"),
                ("nvidia.com/gpumem-percentage", "25"),
                ("nvidia.com/gpucores", "30"),
            ],
            (2, 4096, 300),
        ),
        case(
            "hami-cores",
            vec![("nvidia.com/gpu", "1"), ("nvidia.com/gpucores", "50")],
            (1, 0, 500),
        ),
        // kubernetes-gpusharing's example: 50 % of a GPU and 15 × 256 MiB.
        case(
            "gpu-manager",
            vec![
                ("tencent.com/vcuda-core", "50"),
                ("tencent.com/vcuda-memory", "15"),
            ],
            (1, 3840, 500),
        ),
        case(
            "gpu-manager-whole",
            vec![("tencent.com/vcuda-core", "200")],
            (2, 16_384, 1000),
        ),
    ];
    for Case { name, limits, .. } in &cases {
        let stored = pods::create(&e.client, "peers", &pods::pod(name, limits, None)).await?;
        let left: Vec<String> = resource_names(&stored)
            .into_iter()
            .filter(|r| PEER_NAMES.contains(&r.as_str()))
            .collect();
        ensure!(
            left.is_empty(),
            "{name}: the webhook left {left:?}, which no node advertises"
        );
    }
    let names: Vec<String> = cases.iter().map(|c| c.name.to_string()).collect();
    let bound = pods::wait_bound(&e.client, "peers", &names, Duration::from_secs(90))
        .await
        .with_context(|| e.log_tails(15))?;
    let ledger = e.gl.ledger().await?;
    let api: Api<Pod> = Api::namespaced(e.client.clone(), "peers");
    for Case {
        name,
        grant: (gpus, mem, core),
        ..
    } in &cases
    {
        let uid = api.get(name).await?.metadata.uid.unwrap_or_default();
        let a = ledger.allocs_of_pod(&uid);
        ensure!(
            a.len() == 1,
            "{name}: {} allocations in the ledger",
            a.len()
        );
        let a = a[0];
        ensure!(
            a.node == bound[*name],
            "{name}: bound to {}, reserved on {}",
            bound[*name],
            a.node
        );
        ensure!(
            a.shares.len() == *gpus,
            "{name}: {} GPUs, wanted {gpus}",
            a.shares.len()
        );
        let distinct: BTreeMap<&str, ()> =
            a.shares.iter().map(|s| (s.gpu_uuid.as_str(), ())).collect();
        ensure!(
            distinct.len() == *gpus,
            "{name}: slices share a GPU: {:?}",
            a.shares
        );
        for s in &a.shares {
            ensure!(
                *mem == 0 || s.mem_mib == *mem,
                "{name}: {} MiB per GPU, wanted {mem}",
                s.mem_mib
            );
            ensure!(
                s.core_milli == *core,
                "{name}: {} per mille compute, wanted {core}",
                s.core_milli
            );
        }
    }

    // What the shipped webhook configuration keeps away from the webhook: a pod that asks
    // for no GPU (matchConditions), and GPU pods of the namespaces it leaves out.
    let before = counter(
        &e.gl.extender_metrics().await?,
        "gpuledger_extender_requests_total",
        &[("verb", "mutate")],
    );
    pods::namespace(&e.client, "plain", &[]).await?;
    let mut sent = vec![(
        "plain".to_string(),
        pods::pod("cpu-only", &[("cpu", "100m")], None),
    )];
    ensure!(
        !e.installed.webhook_excluded.is_empty(),
        "the shipped webhooks leave no namespace out"
    );
    for ns in &e.installed.webhook_excluded {
        sent.push((
            ns.clone(),
            pods::pod(
                "peer",
                &[("nvidia.com/gpu", "1"), ("nvidia.com/gpumem", "1024")],
                None,
            ),
        ));
    }
    for (ns, pod) in &sent {
        pods::create(&e.client, ns, pod).await?;
    }
    let after = counter(
        &e.gl.extender_metrics().await?,
        "gpuledger_extender_requests_total",
        &[("verb", "mutate")],
    );
    ensure!(
        after == before,
        "the webhook was called for {} pod(s) the shipped configuration keeps from it ({:?})",
        after - before,
        sent.iter().map(|(ns, _)| ns).collect::<Vec<_>>()
    );
    Ok(())
}
