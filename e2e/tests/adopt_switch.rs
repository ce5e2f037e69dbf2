//! The switch from HAMi to gpuledger without a drain, as `deploy/README.md` documents it, on
//! the real control plane: HAMi v2.10.0's real scheduler places its pods (on kubelet-less
//! nodes registered as its device plugin registers them, and one on the real kubelet, whose
//! container runs through the whole switch); gpuledger is installed on those nodes (their GPUs
//! registered, `gpuledger.io/gpu` advertised beside HAMi's); `gpuledger adopt` plans, then
//! commits every HAMi pod once; HAMi is removed; a second adopt adopts nothing twice; new pods
//! in HAMi's YAML go through gpuledger and fill exactly the room HAMi's pods left, one more
//! stays Pending; no GPU holds more than it has counting adopted and new pods, the ledger
//! counts the same, the real container never restarted, `verify` is OK, and deleting an
//! adopted pod releases its grant, whose room the Pending pod then gets.
//!
//! `GPULEDGER_E2E_ADOPT_PODS` HAMi pods (default 16; the figure is 50), one of them on
//! the real kubelet; the new pods are the room left on the HAMi nodes' GPUs (33 for 16, 103
//! for 50).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use gpuledger_e2e::cluster::REAL_NODE;
use gpuledger_e2e::gpuledger::{ADMIN_SA, ctl, verify};
use gpuledger_e2e::hami::{self, Hami, NodeShape};
use gpuledger_e2e::real_node::host_network;
use gpuledger_e2e::{E2e, Options, nodes, pods, until};
use gpuledger_proto::allocator::v1 as api;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

const HAMI_NS: &str = "hami";
const NS: &str = "team";
/// Every pod asks a quarter of a 16 GiB GPU: four fill one exactly.
const MEM_MIB: u64 = 4096;
const CORES: u32 = 25;
const GPU_MIB: u64 = 16_384;
/// The HAMi pod on the real kubelet.
const RUNNING: &str = "runs-through";

/// HAMi pods from `GPULEDGER_E2E_ADOPT_PODS` (default 16).
fn hami_pods() -> Result<usize> {
    match std::env::var("GPULEDGER_E2E_ADOPT_PODS") {
        Ok(v) => v
            .parse::<usize>()
            .ok()
            .filter(|n| *n >= 2)
            .with_context(|| format!("GPULEDGER_E2E_ADOPT_PODS={v:?}: a count of 2 or more")),
        Err(_) => Ok(16),
    }
}

/// The last line of `gpuledger adopt`.
fn summary(out: &str) -> &str {
    out.lines()
        .rev()
        .find(|l| l.starts_with("adopt nodes="))
        .unwrap_or("")
}

/// (containerID, startedAt, restartCount) of the pod's container.
fn container_state(p: &Pod) -> Option<(String, String, i32)> {
    let c = p.status.as_ref()?.container_statuses.as_ref()?.first()?;
    let started = c.state.as_ref()?.running.as_ref()?.started_at.as_ref()?;
    Some((
        c.container_id.clone()?,
        started.0.to_string(),
        c.restart_count,
    ))
}

/// (MiB, compute per mille) on each GPU: what HAMi recorded on its live pods plus what the
/// ledger granted gpuledger's pods of `NS`.
fn used_per_gpu(
    hami: &BTreeMap<String, BTreeMap<String, Vec<Vec<hami::Granted>>>>,
    l: &gpuledger_ledger::Ledger,
) -> BTreeMap<String, (u64, u32)> {
    let mut used: BTreeMap<String, (u64, u32)> = BTreeMap::new();
    for g in hami.values().flat_map(BTreeMap::values).flatten().flatten() {
        let u = used.entry(g.uuid.clone()).or_default();
        *u = (u.0 + g.mem_mib, u.1 + g.cores * 10);
    }
    for a in l.allocs().values().filter(|a| a.pod.namespace == NS) {
        for s in &a.shares {
            let u = used.entry(s.gpu_uuid.clone()).or_default();
            *u = (u.0 + s.mem_mib, u.1 + s.core_milli);
        }
    }
    used
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes with a real kubelet and HAMi's scheduler (e2e/peers/build.sh): make test-e2e"]
async fn a_hami_cluster_moves_to_gpuledger_without_a_drain() -> Result<()> {
    let t0 = Instant::now();
    let h_pods = hami_pods()?;
    // The kubelet-less pods and the new ones fill whole GPUs: 4 quarters each, 2 per node.
    let gpus = (3 * h_pods - 1).div_ceil(4).next_multiple_of(2);
    let new_pods = 4 * gpus - (h_pods - 1);
    let shape = NodeShape::default();
    let hami_nodes: Vec<String> = (0..gpus / 2).map(|i| format!("hami-{i}")).collect();

    let e = E2e::start(Options {
        real_node: true,
        ..Options::default()
    })
    .await?;
    let real = e.node.as_ref().context("no real node")?;
    real.wait_advertised(&e.client, 128, Duration::from_secs(60))
        .await
        .with_context(|| e.log_tails(20))?;
    let h = Hami::start(&e).await?;
    h.add_nodes(&e, &hami_nodes, &shape).await?;
    let real_gpus: Vec<String> = real.nvml.gpus.iter().map(|g| g.uuid.clone()).collect();
    h.take_in(REAL_NODE, &real_gpus, &shape).await?;
    h.namespace(&e, HAMI_NS).await?;

    // HAMi places its pods: one on the real kubelet, the rest on its kubelet-less nodes.
    let mut on_kubelet = host_network(hami::pod(RUNNING, 1, MEM_MIB, CORES));
    on_kubelet["spec"]["nodeSelector"] = json!({"kubernetes.io/hostname": REAL_NODE});
    pods::create(&e.client, HAMI_NS, &on_kubelet).await?;
    let mut names = vec![RUNNING.to_string()];
    for i in 1..h_pods {
        let name = format!("vgpu-{i}");
        let mut p = hami::pod(&name, 1, MEM_MIB, CORES);
        p["spec"]["nodeSelector"] = json!({hami::NODE_LABEL.0: hami::NODE_LABEL.1});
        pods::create(&e.client, HAMI_NS, &p).await?;
        names.push(name);
    }
    // HAMi binds about one pod every 3 s here (its client's throttling and node lock:
    // docs/benchmarks.md), so its wait grows with the count.
    let hami_wait = Duration::from_secs(180.max(60 + 6 * h_pods as u64));
    pods::wait_bound(&e.client, HAMI_NS, &names, hami_wait)
        .await
        .with_context(|| h.log_tails(30))?;
    let hami_api: Api<Pod> = Api::namespaced(e.client.clone(), HAMI_NS);
    until(
        "every HAMi pod handed its devices (bind phase success)",
        Duration::from_secs(60),
        || async {
            let list = hami_api.list(&Default::default()).await?;
            let done = list.items.iter().all(|p| {
                p.metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(hami::BIND_PHASE))
                    .is_some_and(|v| v == "success")
            });
            Ok(done.then_some(()))
        },
    )
    .await?;
    let running = until(
        "the HAMi pod on the real kubelet runs",
        Duration::from_secs(90),
        || async { Ok(container_state(&hami_api.get(RUNNING).await?)) },
    )
    .await
    .with_context(|| e.log_tails(20))?;
    let placed = hami::allocations(&e.client, HAMI_NS).await?;
    ensure!(
        placed
            .get(REAL_NODE)
            .is_some_and(|p| p.contains_key(RUNNING)),
        "HAMi did not place {RUNNING} on the real node: {placed:?}"
    );
    let hami_placed = t0.elapsed();

    // gpuledger on HAMi's nodes: the nodes cordoned, each one's GPUs registered by its agent
    // (the same UUIDs NVML gives HAMi's device plugin), `gpuledger.io/gpu` advertised beside
    // HAMi's resources. The real node's agent registered its GPUs at start.
    let k = e.kubectl();
    let selector = format!("--selector={}={}", hami::NODE_LABEL.0, hami::NODE_LABEL.1);
    k.ok(&["cordon", &selector])?;
    k.ok(&["cordon", REAL_NODE])?;
    let node_api: Api<Node> = Api::all(e.client.clone());
    let slots = (shape.gpus * nodes::SLOTS_PER_GPU).to_string();
    for n in &hami_nodes {
        let mut inv = nodes::inventory(
            n,
            &nodes::NodeShape {
                gpus: shape.gpus,
                gpu_mem_mib: u64::from(shape.gpu_mem_mib),
                model: shape.model.clone(),
                ..nodes::NodeShape::default()
            },
        );
        for g in &mut inv.gpus {
            g.uuid = hami::gpu_uuid(n, g.index);
        }
        e.gl.allocs
            .node_agent(0, n)?
            .register_node(api::RegisterNodeRequest {
                inventory: Some(inv),
            })
            .await
            .with_context(|| format!("registering {n} with the allocator"))?;
        node_api
            .patch_status(
                n,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {
                    "capacity": {"gpuledger.io/gpu": slots},
                    "allocatable": {"gpuledger.io/gpu": slots},
                }})),
            )
            .await?;
    }

    // Dry run, then --apply by an admin, reading the pods from the API server.
    let addrs = &e.gl.allocs.addrs;
    let admin = e
        .certs
        .token_flags(&e.cp.pki.request_token(&e.client, ADMIN_SA).await?);
    let kubeconfig = format!("--kubeconfig={}", e.cp.admin_kubeconfig.display());
    let nodes_used = placed.len();
    let out = ctl(addrs, &admin, &["adopt", &kubeconfig])?;
    ensure!(
        summary(&out)
            == format!("adopt nodes={nodes_used} adopt={h_pods} held=0 cannot=0 applied=0"),
        "dry run:\n{out}"
    );
    ensure!(
        e.gl.ledger().await?.allocs().is_empty(),
        "the dry run wrote a grant:\n{out}"
    );
    let out = ctl(addrs, &admin, &["adopt", &kubeconfig, "--apply"])?;
    ensure!(
        summary(&out)
            == format!("adopt nodes={nodes_used} adopt={h_pods} held=0 cannot=0 applied={h_pods}"),
        "apply:\n{out}"
    );
    let l = e.gl.ledger().await?;
    for p in hami_api.list(&Default::default()).await? {
        let name = p.metadata.name.clone().unwrap_or_default();
        let uid = p.metadata.uid.clone().unwrap_or_default();
        let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
        let a = l.allocs_of_pod(&uid);
        ensure!(a.len() == 1, "{name}: {} grants after adopt", a.len());
        let recorded = &placed[node.as_deref().unwrap_or_default()][&name][0][0];
        let s = &a[0].shares;
        ensure!(
            a[0].policy == "adopted-from=hami"
                && Some(&a[0].node) == node.as_ref()
                && s.len() == 1
                && (s[0].gpu_uuid.as_str(), s[0].mem_mib, s[0].core_milli)
                    == (
                        recorded.uuid.as_str(),
                        recorded.mem_mib,
                        recorded.cores * 10
                    ),
            "{name}: HAMi recorded {recorded:?} on {node:?}, the ledger adopted {:?}",
            a[0]
        );
    }

    // HAMi removed: its scheduler, its kube-scheduler and its device plugins. Adopt again
    // (step 6): nothing twice.
    drop(h);
    let out = ctl(addrs, &admin, &["adopt", &kubeconfig, "--apply"])?;
    ensure!(
        summary(&out)
            == format!("adopt nodes={nodes_used} adopt=0 held={h_pods} cannot=0 applied=0"),
        "second apply:\n{out}"
    );
    verify(&e.gl, addrs)?;
    k.ok(&["uncordon", &selector])?;
    k.ok(&["uncordon", REAL_NODE])?;
    let adopted_at = t0.elapsed();

    // New pods in HAMi's YAML (no schedulerName: HAMi's webhook set it) through gpuledger's
    // webhook and extender, on HAMi's former nodes: exactly the room left, and one more.
    e.namespace(NS).await?;
    let new_pod = |name: &str| {
        let mut p = hami::pod(name, 1, MEM_MIB, CORES);
        if let Some(spec) = p["spec"].as_object_mut() {
            spec.remove("schedulerName");
        }
        p["spec"]["nodeSelector"] = json!({hami::NODE_LABEL.0: hami::NODE_LABEL.1});
        p
    };
    let new_names: Vec<String> = (0..new_pods).map(|i| format!("new-{i}")).collect();
    for n in &new_names {
        pods::create(&e.client, NS, &new_pod(n)).await?;
    }
    pods::wait_bound(&e.client, NS, &new_names, Duration::from_secs(240))
        .await
        .with_context(|| e.log_tails(30))?;
    pods::create(&e.client, NS, &new_pod("one-too-many")).await?;
    let why = until(
        "one-too-many is refused a GPU",
        Duration::from_secs(60),
        || async {
            let t = pods::events_text(&e.client, NS, "one-too-many").await?;
            Ok(t.contains("FailedScheduling").then_some(t))
        },
    )
    .await
    .with_context(|| e.log_tails(30))?;
    let team_api: Api<Pod> = Api::namespaced(e.client.clone(), NS);
    let extra = team_api.get("one-too-many").await?;
    ensure!(
        extra
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .is_none(),
        "one pod more than the room HAMi's pods left was placed: {why}"
    );

    // No GPU over its capacity counting adopted and new pods; HAMi's nodes full; the ledger
    // counts exactly that.
    let l = e.gl.ledger().await?;
    let hami_now = hami::allocations(&e.client, HAMI_NS).await?;
    let used = used_per_gpu(&hami_now, &l);
    for (gpu, (mem, core)) in &used {
        ensure!(
            *mem <= GPU_MIB && *core <= 1000,
            "{gpu} is over-committed: {mem} MiB, {core}/1000 compute"
        );
    }
    for n in hami_nodes.iter().map(String::as_str).chain([REAL_NODE]) {
        let node = l
            .node(n)
            .with_context(|| format!("{n} not in the ledger"))?;
        for g in &node.gpus {
            let want = used.get(&g.uuid).copied().unwrap_or_default();
            ensure!(
                (g.mem_used, g.core_used) == want,
                "the ledger counts {} MiB, {}/1000 on {}; adopted and new pods hold {want:?}",
                g.mem_used,
                g.core_used,
                g.uuid
            );
            ensure!(
                n == REAL_NODE || g.mem_used == GPU_MIB,
                "{} of HAMi's node {n} is not full ({} MiB) though one-too-many waits",
                g.uuid,
                g.mem_used
            );
        }
    }

    // The container on the real kubelet ran through the switch: same container, never
    // restarted, one attempt.
    let p = hami_api.get(RUNNING).await?;
    let now = container_state(&p);
    ensure!(
        now.as_ref() == Some(&running) && running.2 == 0,
        "{RUNNING}'s container was {running:?} before the switch and is {now:?} after"
    );
    let uid = p.metadata.uid.clone().unwrap_or_default();
    let attempts = real.container_attempts(HAMI_NS, RUNNING, &uid, "main")?;
    ensure!(
        attempts.iter().all(|(n, _)| *n == 0),
        "{RUNNING}'s container was started again: attempts {attempts:?}"
    );
    verify(&e.gl, addrs)?;

    // An adopted pod deleted: its grant released, and its room goes to the pod that waited.
    let (node, victim, gpu) = hami_now
        .iter()
        .filter(|(n, _)| *n != REAL_NODE)
        .find_map(|(n, ps)| {
            let (pod, c) = ps.iter().next()?;
            Some((n.clone(), pod.clone(), c[0][0].uuid.clone()))
        })
        .context("no adopted pod on a kubelet-less node")?;
    let victim_uid = hami_api
        .get(&victim)
        .await?
        .metadata
        .uid
        .unwrap_or_default();
    pods::force_delete(&e.client, HAMI_NS, &victim).await?;
    let gl = &e.gl;
    until(
        "the deleted adopted pod's grant is released",
        Duration::from_secs(30),
        || async {
            let l = gl.ledger().await?;
            Ok(l.allocs_of_pod(&victim_uid).is_empty().then_some(()))
        },
    )
    .await
    .with_context(|| e.log_tails(30))?;
    let bound = pods::wait_bound(
        &e.client,
        NS,
        &["one-too-many".to_string()],
        Duration::from_secs(60),
    )
    .await
    .with_context(|| e.log_tails(30))?;
    ensure!(
        bound.get("one-too-many") == Some(&node),
        "one-too-many went to {bound:?}, the freed room is on {node}"
    );
    let extra_uid = extra.metadata.uid.clone().unwrap_or_default();
    let l = e.gl.ledger().await?;
    let a = l.allocs_of_pod(&extra_uid);
    ensure!(
        a.len() == 1 && a[0].shares.len() == 1 && a[0].shares[0].gpu_uuid == gpu,
        "one-too-many holds {a:?}; {victim}'s freed room was on {gpu}"
    );
    verify(&e.gl, addrs)?;
    println!(
        "adopt switch: {h_pods} HAMi pods placed at {:.1} s, adopted at {:.1} s, \
         {new_pods} new pods and the release done at {:.1} s",
        hami_placed.as_secs_f64(),
        adopted_at.as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
