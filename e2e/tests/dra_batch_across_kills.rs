//! 200 GPU pods through the real kube-scheduler on the DRA path (the webhook turns them into
//! claims, the scheduler allocates shares of ResourceSlices, the allocator certifies them in
//! the ledger), with the allocator leader SIGKILLed mid-batch and the real node's kubelet
//! restarted while its claim pods start: every claim's allocation is exactly one ledger grant
//! and every grant is a claim's allocation, no GPU holds more than its capacity in either the
//! ledger or the scheduler's allocations, every pod is bound where its claim is allocated, the
//! real node's pods each run their program once, and `gpuledger verify` finds the survivors equal to the log.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use futures::StreamExt;
use gpuledger_e2e::cluster::REAL_NODE;
use gpuledger_e2e::gpuledger::verify;
use gpuledger_e2e::nodes::NodeShape;
use gpuledger_e2e::pods;
use gpuledger_e2e::real_node::host_network;
use gpuledger_e2e::{E2e, Options, until};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, ListParams};
use serde_json::json;

const NS: &str = "dra-batch";
/// Pods on the kubelet-less DRA nodes.
const BATCH: usize = 200;
/// Pods on the real node (every 20th pod created).
const REAL: usize = 10;
/// Kubelet-less DRA nodes × GPUs of 16,384 MiB: 48 GPUs of 5 pods each (memory and compute
/// both full at 5), 240 places for 200 pods.
const NODES: usize = 12;
const GPUS: u32 = 4;
const GPU_MIB: u64 = 16_384;

/// Parse a Quantity of MiB ("3000Mi", "16Gi") or a plain integer (cores).
fn amount(q: &str) -> Result<u64> {
    let (n, mul) = match q {
        q if q.ends_with("Mi") => (&q[..q.len() - 2], 1),
        q if q.ends_with("Gi") => (&q[..q.len() - 2], 1024),
        q => (q, 1),
    };
    Ok(n.parse::<u64>().with_context(|| format!("quantity {q}"))? * mul)
}

/// The count of `names` bound so far, and of those with a running container.
async fn progress(api: &Api<Pod>) -> Result<(usize, usize)> {
    let list = api.list(&ListParams::default()).await?.items;
    let bound = list
        .iter()
        .filter(|p| p.spec.as_ref().is_some_and(|s| s.node_name.is_some()))
        .count();
    let running = list
        .iter()
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .count();
    Ok((bound, running))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes with a real kubelet, containerd and root: make test-e2e"]
async fn claims_stay_granted_once_across_a_leader_kill_and_a_kubelet_restart() -> Result<()> {
    let mut e = E2e::start(Options {
        allocators: 3,
        real_node: true,
        dra: true,
        ..Options::default()
    })
    .await?;
    let names: Vec<String> = (0..NODES).map(|i| format!("dra-{i:02}")).collect();
    let shape = NodeShape {
        gpus: GPUS,
        gpu_mem_mib: GPU_MIB,
        dra: true,
        ..NodeShape::default()
    };
    e.add_nodes(&names, &shape).await?;
    e.namespace(NS).await?;

    let specs: Vec<(String, serde_json::Value)> = (0..BATCH + REAL)
        .map(|i| {
            if i % 21 == 20 {
                let name = format!("run-{}", i / 21);
                let mut p = host_network(pods::pod(
                    &name,
                    &[("gpuledger.io/gpu-mem", "2048")],
                    Some(&["sh", "-c", "env; sleep 3600"]),
                ));
                p["spec"]["nodeSelector"] = json!({"kubernetes.io/hostname": REAL_NODE});
                (name, p)
            } else {
                let name = format!("job-{i}");
                let mut p = pods::pod(
                    &name,
                    &[
                        ("gpuledger.io/gpu-mem", "3000"),
                        ("gpuledger.io/gpu-core", "20"),
                    ],
                    None,
                );
                p["spec"]["nodeSelector"] = json!({"gpuledger.io/e2e": "kubelet-less"});
                (name, p)
            }
        })
        .collect();
    ensure!(
        specs.iter().filter(|(n, _)| n.starts_with("run-")).count() == REAL,
        "the batch has not {REAL} real-node pods"
    );
    let all: Vec<String> = specs.iter().map(|(n, _)| n.clone()).collect();
    let client = e.client.clone();
    let creating = tokio::spawn(async move {
        futures::stream::iter(specs.into_iter().map(|(_, p)| {
            let c = client.clone();
            async move { pods::create(&c, NS, &p).await }
        }))
        .buffer_unordered(8)
        .collect::<Vec<_>>()
        .await
    });

    // Kill the leader once 40 pods are bound; restart the kubelet once 2 real-node pods run.
    let api: Api<Pod> = Api::namespaced(e.client.clone(), NS);
    let deadline = Instant::now() + Duration::from_secs(240);
    let mut killed = None;
    let mut restarted = false;
    while killed.is_none() || !restarted {
        let (bound, running) = progress(&api).await?;
        if killed.is_none() && bound >= 40 {
            let leader = e.gl.allocs.wait_leader(Duration::from_secs(5)).await?;
            e.gl.allocs.procs[leader].kill();
            eprintln!("allocator leader {leader} killed with {bound} pods bound");
            killed = Some(leader);
        }
        if !restarted && running >= 2 {
            e.node.as_mut().context("no real node")?.restart_kubelet()?;
            eprintln!("kubelet restarted with {running} real-node pods running, {bound} bound");
            restarted = true;
        }
        if Instant::now() > deadline {
            bail!(
                "{bound} pods bound and {running} running after 240 s (leader killed: {killed:?}, kubelet restarted: {restarted})\n{}",
                e.log_tails(30)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let leader = killed.context("no leader killed")?;
    for c in creating.await? {
        c?;
    }
    let bound = pods::wait_bound(&e.client, NS, &all, Duration::from_secs(300))
        .await
        .with_context(|| e.log_tails(30))?;
    until(
        "every real-node pod runs",
        Duration::from_secs(180),
        || async {
            let (_, running) = progress(&api).await?;
            Ok((running == REAL).then_some(()))
        },
    )
    .await
    .with_context(|| e.log_tails(30))?;

    let new_leader =
        e.gl.allocs
            .wait_leader_except(Duration::from_secs(30), Some(leader))
            .await?;
    let ledger = e.gl.allocs.ledger(new_leader).await?;

    // Every claim's allocation is exactly one ledger grant, with the same device, share and
    // amounts, and its pod is bound to the node the allocation is on.
    let claims: Api<ResourceClaim> = Api::namespaced(e.client.clone(), NS);
    let claims = claims.list(&ListParams::default()).await?.items;
    ensure!(
        claims.len() == all.len(),
        "{} claims for {} pods",
        claims.len(),
        all.len()
    );
    let pod_of_uid: HashMap<String, String> = api
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|p| {
            (
                p.metadata.uid.unwrap_or_default(),
                p.metadata.name.unwrap_or_default(),
            )
        })
        .collect();
    // (pool, device) -> (MiB, core_milli) as the scheduler allocated it.
    let mut scheduler_load: BTreeMap<(String, String), (u64, u64)> = BTreeMap::new();
    let mut results = 0usize;
    for c in &claims {
        let name = c.metadata.name.clone().unwrap_or_default();
        let uid = c.metadata.uid.clone().unwrap_or_default();
        let status = c.status.as_ref().context("claim without status")?;
        let alloc = status
            .allocation
            .as_ref()
            .with_context(|| format!("claim {name} is not allocated"))?;
        let consumers = status.reserved_for.as_deref().unwrap_or_default();
        ensure!(
            consumers.len() == 1,
            "claim {name} is reserved for {} pods",
            consumers.len()
        );
        let pod = pod_of_uid
            .get(&consumers[0].uid)
            .with_context(|| format!("claim {name} is reserved for an unknown pod"))?;
        let grants = ledger.allocs_of_pod(&uid);
        let devices = alloc.devices.as_ref().and_then(|d| d.results.as_ref());
        for r in devices.into_iter().flatten() {
            results += 1;
            ensure!(
                bound[pod] == r.pool,
                "pod {pod} is bound to {}, its claim {name} is allocated on {}",
                bound[pod],
                r.pool
            );
            let cap = r.consumed_capacity.clone().unwrap_or_default();
            let mib = amount(&cap.get("memory").context("no memory consumed")?.0)?;
            let cores = amount(&cap.get("cores").context("no cores consumed")?.0)?;
            let load = scheduler_load
                .entry((r.pool.clone(), r.device.clone()))
                .or_default();
            load.0 += mib;
            load.1 += cores;
            let matching: Vec<_> = grants
                .iter()
                .filter(|a| {
                    a.claim.as_ref().is_some_and(|g| {
                        g.request == r.request
                            && g.pool == r.pool
                            && g.device == r.device
                            && Some(&g.share_id) == r.share_id.as_ref()
                    })
                })
                .collect();
            ensure!(
                matching.len() == 1,
                "claim {name} result {}/{}: {} ledger grants match (grants of the claim: {grants:?})",
                r.device,
                r.share_id.as_deref().unwrap_or(""),
                matching.len()
            );
            let s = &matching[0].shares[0];
            ensure!(
                s.mem_mib == mib && u64::from(s.core_milli) == cores,
                "claim {name}: the scheduler allocated {mib} MiB and {cores}/1000, the ledger granted {} MiB and {}/1000",
                s.mem_mib,
                s.core_milli
            );
        }
    }
    let claim_grants = ledger
        .allocs()
        .values()
        .filter(|a| a.claim.is_some())
        .count();
    ensure!(
        claim_grants == results && results == all.len(),
        "{claim_grants} ledger grants for {results} allocation results of {} pods",
        all.len()
    );
    // No GPU over capacity, as the scheduler allocated and as the ledger holds.
    for ((pool, device), (mib, cores)) in &scheduler_load {
        ensure!(
            *mib <= GPU_MIB && *cores <= 1000,
            "the scheduler's allocations on {pool}/{device}: {mib} MiB and {cores}/1000"
        );
    }
    let mut ledger_load: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for a in ledger.allocs().values() {
        for s in &a.shares {
            let l = ledger_load.entry(&s.gpu_uuid).or_default();
            l.0 += s.mem_mib;
            l.1 += u64::from(s.core_milli);
        }
    }
    for (gpu, (mib, cores)) in &ledger_load {
        ensure!(
            *mib <= GPU_MIB && *cores <= 1000,
            "the ledger holds {mib} MiB and {cores}/1000 of {gpu}"
        );
    }

    // The real node's pods each run once, prepared once.
    for p in api.list(&ListParams::default()).await?.items {
        let name = p.metadata.name.clone().unwrap_or_default();
        if !name.starts_with("run-") {
            continue;
        }
        let st = p
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|c| c.first())
            .with_context(|| format!("{name} has no container status"))?;
        ensure!(
            st.state.as_ref().is_some_and(|s| s.running.is_some()),
            "{name} does not run: {st:?}"
        );
        // Its program ran once, in the container that runs now, and saw its grant. The
        // restart count alone cannot say so: a container the kubelet created but had not yet
        // started when it was stopped is counted as an attempt by the restarted kubelet,
        // which creates another (an attempt whose log is empty); a container killed after it
        // ran (by the agent's enforcement, say) leaves a log behind.
        let uid = p.metadata.uid.clone().unwrap_or_default();
        let node = e.node.as_ref().context("no real node")?;
        let current = u32::try_from(st.restart_count).context("negative restart count")?;
        let attempts = until(
            &format!("{name}'s output reaches its log"),
            Duration::from_secs(20),
            || async {
                let attempts = node.container_attempts(NS, &name, &uid, "main")?;
                let printed = attempts
                    .iter()
                    .any(|(n, text)| *n == current && text.contains("GPULEDGER_"));
                Ok(printed.then_some(attempts))
            },
        )
        .await?;
        let ran: Vec<u32> = attempts
            .iter()
            .filter(|(_, text)| !text.trim().is_empty())
            .map(|(n, _)| *n)
            .collect();
        ensure!(
            ran == [current],
            "{name}: the program ran in attempts {ran:?}, the running container is attempt {current} ({st:?})"
        );
        let printed = &attempts
            .iter()
            .find(|(n, _)| *n == current)
            .context("no log")?
            .1;
        ensure!(
            printed.contains("GPULEDGER_GPU_MEM_MIB=2048"),
            "{name} ran without its grant's environment:\n{printed}"
        );
        let prepared = pods::grants_consumed_by(&ledger, &uid)
            .into_iter()
            .filter(|a| a.claim.as_ref().is_some_and(|g| g.prepared))
            .count();
        ensure!(prepared == 1, "{name}: {prepared} prepared grants");
    }

    let survivors: Vec<String> = (0..e.gl.allocs.addrs.len())
        .filter(|i| *i != leader)
        .map(|i| e.gl.allocs.addrs[i].clone())
        .collect();
    let gl = &e.gl;
    until(
        "gpuledger verify finds the survivors equal to the log",
        Duration::from_secs(30),
        || async { Ok(verify(gl, &survivors).ok()) },
    )
    .await?;
    Ok(())
}
