//! `gpuledger-bench node-agent`: device-plugin Allocate latency through a real node agent
//! (the claim committed through the allocator included), against two baselines measured
//! interleaved on the same etcd: the bare Assign RPC, and the raw fenced etcd transaction the
//! allocator's commit is made of (no allocator at all); and the agent's RSS and idle CPU.
//! DRA `NodePrepareResources` through a second agent (`--mode=dra`), called as the kubelet
//! calls it, on claims read from the fake API server and granted by an admin's GrantClaim
//! (the bare GrantClaim RPC is its baseline). With several `--isolation` modes (`all`), each
//! mode gets its own pair of agents in turn, nvml first, and one table compares them.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use gpuledger_allocator::log::{Commit, EtcdLog};
use gpuledger_auth::identity::Role;
use gpuledger_ledger::state::dra_device_name;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::dra::v1 as dra;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::kube::FakeApiServer;
use gpuledger_testkit::kubelet::Kubelet;
use gpuledger_testkit::kubelet::dra::DraKubelet;
use gpuledger_testkit::kubelet::node::{FakeNvml, MpsReaper, NodeAgent, mps_stand_in};
use gpuledger_testkit::workload::pod;
use gpuledger_testkit::{Allocators, EtcdCluster, free_port};
use hdrhistogram::Histogram;
use serde_json::json;

use crate::common::{
    cpu_seconds, histogram, machine_reference_ms, q_ms, record, rss_mib, run_dir, title,
};

/// Flags of `gpuledger-bench node-agent`.
#[derive(clap::Args)]
pub struct Args {
    /// Pods admitted through the agent (and as many Assign calls for the baseline).
    #[arg(long, default_value_t = 200)]
    pods: usize,
    /// GPUs on the fake node.
    #[arg(long, default_value_t = 8)]
    gpus: u32,
    /// Replica devices per GPU.
    #[arg(long, default_value_t = 64)]
    slots: u32,
    /// Seconds of idling over which the agent's CPU use is measured.
    #[arg(long, default_value_t = 10)]
    idle_secs: u64,
    /// Claims prepared through the DRA agent (NodePrepareResources), one per call; 0: no DRA
    /// agent.
    #[arg(long, default_value_t = 200)]
    claims: usize,
    /// The agents' --isolation: one mode, a comma-separated list, or `all` (nvml, hami-core,
    /// mps, dmem), measured in turn, nvml first (the baseline of the others; added when a list
    /// leaves it out). What a mode needs is made here: a placeholder `libvgpu.so` (hami-core:
    /// no container starts, so it is never loaded), the stand-in MPS control program of the
    /// tests (mps: one daemon per GPU), a cgroup v2 tree with a dmem region per GPU and driver
    /// 615 (dmem).
    #[arg(long, default_value = "nvml")]
    isolation: String,
    /// More flags for the agent, one per use (e.g. `--agent-flag=--grace=1s`).
    #[arg(long = "agent-flag", allow_hyphen_values = true)]
    agent_flags: Vec<String>,
}

const NODE: &str = "bench-node";

/// The isolation modes, in the order a run of several measures them (nvml, the baseline, first).
const MODES: [&str; 4] = ["nvml", "hami-core", "mps", "dmem"];

/// The modes `--isolation` names (one, a comma-separated list, or `all`), nvml first; a run
/// of several always has nvml, the baseline its ratios are of.
fn modes(s: &str) -> Result<Vec<&'static str>> {
    let mut named = Vec::new();
    for m in s.split(',').map(str::trim) {
        if m == "all" {
            named.extend(MODES);
            continue;
        }
        let Some(known) = MODES.iter().find(|k| **k == m) else {
            anyhow::bail!(
                "--isolation={s}: {m:?} is not a mode; give one of {}, a comma-separated list of them, or all",
                MODES.join(", ")
            );
        };
        named.push(*known);
    }
    if named.len() > 1 {
        named.push("nvml");
    }
    Ok(MODES.into_iter().filter(|m| named.contains(m)).collect())
}

/// The baseline: the ledger's own commit transaction (fenced on a fence key's create_revision
/// and on `head`'s mod_revision, putting a batch and `head`) written straight to etcd through
/// a client made like the allocator's, one Assigned-sized event per batch.
struct RawCommit {
    log: EtcdLog,
    fence: Vec<u8>,
    epoch: i64,
    head_rev: i64,
    seq: u64,
}

impl RawCommit {
    async fn new(etcd: &EtcdCluster, endpoints: &[String], tag: &str) -> Result<RawCommit> {
        let mut client =
            gpuledger_allocator::replica::connect(endpoints, Some(&allocator_tls(etcd))).await?;
        let fence = format!("/bench/raw-commit-{tag}/fence").into_bytes();
        let put = client.put(fence.clone(), "x", None).await?;
        let epoch = put.header().context("no header")?.revision();
        let log = EtcdLog::new(
            &client,
            &format!("bench-raw-commit-{tag}"),
            Duration::from_secs(10),
        );
        Ok(RawCommit {
            log,
            fence,
            epoch,
            head_rev: 0,
            seq: 0,
        })
    }

    async fn commit(&mut self, i: usize) -> Result<()> {
        self.seq += 1;
        let batch = pb::EventBatch {
            version: 1,
            first_seq: self.seq,
            epoch: self.epoch as u64,
            events: vec![pb::Event {
                seq: self.seq,
                epoch: self.epoch as u64,
                time_ms: 0,
                body: Some(pb::event::Body::Assigned(pb::Assigned {
                    allocation_id: self.seq,
                    device_ids: vec![format!(
                        "GPU-00000000-0000-0000-0000-00000000000{}::{i}",
                        i % 8
                    )],
                    node: NODE.into(),
                })),
                ..Default::default()
            }],
            ..Default::default()
        };
        match self
            .log
            .commit(&self.fence, self.epoch, self.head_rev, &batch)
            .await?
        {
            Commit::Done { head_rev } => self.head_rev = head_rev,
            Commit::Fenced => anyhow::bail!("raw commit fenced unexpectedly"),
        }
        Ok(())
    }
}

/// TLS to the bench's etcd as an allocator has it.
fn allocator_tls(etcd: &EtcdCluster) -> gpuledger_allocator::config::EtcdTls {
    let (ca, identity) = etcd.client_tls_files();
    gpuledger_allocator::config::EtcdTls {
        ca: Some(ca),
        identity: Some(identity),
    }
}

/// The client URL of the etcd member that is raft leader now.
async fn etcd_leader_url(etcd: &EtcdCluster) -> Result<String> {
    let endpoints = etcd.endpoints();
    let mut c =
        gpuledger_allocator::replica::connect(&endpoints, Some(&allocator_tls(etcd))).await?;
    let leader = c.status().await?.leader();
    let members = c.member_list().await?;
    let m = members
        .members()
        .iter()
        .find(|m| m.id() == leader)
        .context("the etcd leader is not in the member list")?;
    m.client_urls()
        .first()
        .cloned()
        .context("the etcd leader has no client URL")
}

/// GPU memory of each fake GPU, in MiB.
const GPU_MIB: u64 = 40_960;
/// MiB each admitted pod reserves, and as much again for its baseline reservation.
const POD_MIB: u64 = 100;
/// Compute each claim's share holds (1 % of a GPU, as each admitted pod's).
const CLAIM_CORE_MILLI: u64 = 10;

/// Refuse sizes the run could not finish, before anything starts: every admitted pod keeps one
/// replica device and, with its baseline, 2 × 100 MiB until the end; every claim 100 MiB of
/// the DRA node.
fn check_sizes(a: &Args) -> Result<()> {
    modes(&a.isolation)?;
    anyhow::ensure!(
        a.gpus >= 1 && a.slots >= 1 && a.pods >= 1,
        "--gpus, --slots and --pods must each be at least 1"
    );
    let devices = u64::from(a.gpus) * u64::from(a.slots);
    anyhow::ensure!(
        a.pods as u64 <= devices,
        "--pods={} needs as many replica devices, and --gpus={} x --slots={} is {devices}: raise --slots",
        a.pods,
        a.gpus,
        a.slots
    );
    let room = u64::from(a.gpus) * GPU_MIB / (2 * POD_MIB);
    anyhow::ensure!(
        a.pods as u64 <= room,
        "--pods={} reserve {} MiB each (pod and baseline), and --gpus={} of {GPU_MIB} MiB hold {room} such pods: raise --gpus",
        a.pods,
        2 * POD_MIB,
        a.gpus
    );
    let claim_room = u64::from(a.gpus) * (GPU_MIB / POD_MIB).min(1000 / CLAIM_CORE_MILLI);
    anyhow::ensure!(
        a.claims as u64 <= claim_room,
        "--claims={} reserve {POD_MIB} MiB and {CLAIM_CORE_MILLI} core-milli each, and --gpus={} of {GPU_MIB} MiB and 1000 hold {claim_room}: raise --gpus",
        a.claims,
        a.gpus
    );
    Ok(())
}

/// The flags of `--isolation=<mode>` and what they name, made under `dir`.
fn isolation_flags(mode: &str, dir: &Path, nvml: &FakeNvml) -> Result<Vec<String>> {
    let mut flags = vec![format!("--isolation={mode}")];
    match mode {
        "hami-core" => {
            std::fs::write(dir.join("libvgpu.so"), b"\x7fELF")?;
            flags.push(format!(
                "--hami-core-lib={}",
                dir.join("libvgpu.so").display()
            ));
            flags.push(format!("--hami-core-dir={}", dir.join("hami").display()));
        }
        "mps" => {
            let control = mps_stand_in(&dir.join("mps-bin"))?;
            flags.push(format!("--mps-control={}", control.display()));
            flags.push(format!("--mps-dir={}", dir.join("mps").display()));
        }
        "dmem" => {
            let root = dir.join("cgroup");
            std::fs::create_dir_all(root.join("kubepods.slice"))?;
            std::fs::write(root.join("cgroup.controllers"), "cpu memory dmem\n")?;
            let regions: String = (0..nvml.gpus.len())
                .map(|i| format!("nvidia/0000:{:02x}:00.0/vidmem 42949672960\n", i + 1))
                .collect();
            std::fs::write(root.join("dmem.capacity"), regions)?;
            let mut state: serde_json::Value =
                serde_json::from_slice(&std::fs::read(nvml.path())?)?;
            state["driver_version"] = "615.20.01".into();
            std::fs::write(nvml.path(), serde_json::to_vec(&state)?)?;
            flags.push(format!("--cgroup-root={}", root.display()));
        }
        _ => {}
    }
    Ok(flags)
}

/// What the run shares across modes: etcd, the allocator, the API server the DRA agents read
/// claims from, and the baselines' histograms.
struct Shared {
    _etcd: EtcdCluster,
    allocs: Allocators,
    api: Option<FakeApiServer>,
    raw: RawCommit,
    raw_leader: RawCommit,
    h_assign: Histogram<u64>,
    h_raw: Histogram<u64>,
    h_raw_leader: Histogram<u64>,
    h_grant: Histogram<u64>,
}

/// One mode's figures.
struct Measured {
    mode: &'static str,
    alloc: Histogram<u64>,
    prepare: Option<Histogram<u64>>,
    /// Mean ms of each prepare step, as the DRA agent's own histogram has them.
    steps: Vec<(String, f64)>,
    rss: f64,
    dra_rss: Option<f64>,
    cpu_pct: f64,
}

/// One mode's device-plugin node: its kubelet emulator and agent.
struct PluginNode {
    node: String,
    kubelet: Kubelet,
    agent: NodeAgent,
    _mps: MpsReaper,
}

/// One mode's DRA node: its kubelet emulators (plugin registry, and the device-plugin dir the
/// agent is given) and agent, with /metrics on `health`.
struct DraNode {
    node: String,
    nvml: FakeNvml,
    dra: DraKubelet,
    agent: NodeAgent,
    health: String,
    _kubelet: Kubelet,
    _mps: MpsReaper,
}

/// Start `node`'s agent in `mode` with files under `dir` and `extra` flags; its fake NVML.
fn start_agent(
    s: &Shared,
    dir: &Path,
    node: &str,
    mode: &str,
    a: &Args,
    kubelet: &Kubelet,
    extra: Vec<String>,
) -> Result<(NodeAgent, FakeNvml)> {
    std::fs::create_dir_all(dir)?;
    let nvml = FakeNvml::new(dir, node, a.gpus, GPU_MIB)?;
    let mut flags = vec![
        format!("--slots-per-gpu={}", a.slots),
        "--enforce-interval=1s".to_string(),
    ];
    flags.extend(isolation_flags(mode, dir, &nvml)?);
    flags.extend(extra);
    flags.extend(a.agent_flags.iter().cloned());
    flags.extend(s.allocs.ids.flags(&Role::NodeAgent { node: node.into() })?);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let agent = NodeAgent::start(dir, node, &s.allocs.addrs, &nvml, kubelet, &flags)?;
    Ok((agent, nvml))
}

async fn start_plugin_node(s: &Shared, dir: &Path, mode: &str, a: &Args) -> Result<PluginNode> {
    let node = format!("bench-{mode}");
    let kubelet = Kubelet::start(&dir.join("kubelet")).await?;
    let mps = MpsReaper(dir.join("mps"));
    let (agent, _) = start_agent(s, dir, &node, mode, a, &kubelet, Vec::new())?;
    kubelet
        .wait_registrations(1, Duration::from_secs(30))
        .await
        .with_context(|| agent.proc.log_tail(30))?;
    let want = (u64::from(a.gpus) * u64::from(a.slots)) as usize;
    kubelet
        .wait_devices(Duration::from_secs(10), |d| d.len() == want)
        .await?;
    Ok(PluginNode {
        node,
        kubelet,
        agent,
        _mps: mps,
    })
}

async fn start_dra_node(
    s: &Shared,
    api: &FakeApiServer,
    dir: &Path,
    mode: &str,
    a: &Args,
) -> Result<DraNode> {
    let node = format!("bench-dra-{mode}");
    api.store
        .create(
            "v1",
            "nodes",
            "",
            json!({"metadata": {"name": node, "uid": format!("uid-{node}")}}),
        )
        .map_err(|e| anyhow::anyhow!("{}", e.message()))?;
    let kubelet = Kubelet::start(&dir.join("kubelet")).await?;
    let dra = DraKubelet::start(&dir.join("dra")).await?;
    let mps = MpsReaper(dir.join("mps"));
    let health = format!("127.0.0.1:{}", free_port()?);
    let extra = vec![
        "--mode=dra".to_string(),
        format!("--dra-registry-dir={}", dra.registry_dir().display()),
        format!("--dra-plugin-dir={}", dra.plugins_dir().display()),
        format!("--cdi-spec-dir={}", dir.join("cdi").display()),
        format!("--kubeconfig={}", api.kubeconfig().display()),
        format!("--health-listen={health}"),
    ];
    let (agent, nvml) = start_agent(s, dir, &node, mode, a, &kubelet, extra)?;
    dra.wait_registered(1, Duration::from_secs(30))
        .await
        .with_context(|| agent.proc.log_tail(30))?;
    Ok(DraNode {
        node,
        nvml,
        dra,
        agent,
        health,
        _kubelet: kubelet,
        _mps: mps,
    })
}

/// Wait until the ledger holds every one of `nodes`.
async fn wait_nodes(s: &Shared, nodes: &[&str]) -> Result<()> {
    let mut c = s.allocs.viewer(0)?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let snap = c.dump(api::DumpRequest {}).await?.into_inner().snapshot;
        let have: Vec<String> = snap
            .map(|s| s.nodes.into_iter().map(|n| n.node).collect())
            .unwrap_or_default();
        if nodes.iter().all(|n| have.iter().any(|h| h == n)) {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the agents did not register their GPUs: the ledger has {have:?}, not all of {nodes:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Claim `i` of `mode`'s DRA node: written to the API server as the scheduler allocates it (on
/// GPU `i % gpus`, its own share id) and granted in the ledger by an admin's GrantClaim (timed
/// into `h_grant`).
async fn grant_claim(s: &mut Shared, d: &DraNode, mode: &str, i: usize) -> Result<dra::Claim> {
    let api = s.api.as_ref().context("no API server")?;
    let (uid, name, share) = (
        format!("{mode}-claim-{i}"),
        format!("{mode}-c{i}"),
        format!("share-{i}"),
    );
    let gpu = &d.nvml.gpus[i % d.nvml.gpus.len()].uuid;
    let device = dra_device_name(gpu);
    api.store
        .create(
            "resource.k8s.io/v1",
            "resourceclaims",
            "bench",
            json!({
                "metadata": {"name": name, "namespace": "bench", "uid": uid},
                "spec": {"devices": {"requests": [
                    {"name": "c0", "exactly": {"deviceClassName": "gpu.gpuledger.io"}}
                ]}},
                "status": {"allocation": {"devices": {"results": [{
                    "request": "c0", "driver": "gpu.gpuledger.io", "pool": d.node,
                    "device": device, "shareID": share,
                    "consumedCapacity": {"memory": format!("{POD_MIB}Mi"), "cores": CLAIM_CORE_MILLI.to_string()},
                }]}}},
            }),
        )
        .map_err(|e| anyhow::anyhow!("{}", e.message()))?;
    let claim = dra::Claim {
        namespace: "bench".into(),
        uid,
        name,
    };
    let grant = pb::ClaimGranted {
        allocation_id: 0,
        claim: Some(pb::ClaimRef {
            uid: claim.uid.clone(),
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
        }),
        request: "c0".into(),
        node: d.node.clone(),
        pool: d.node.clone(),
        device,
        share_id: share,
        share: Some(pb::GpuShare {
            gpu_uuid: gpu.clone(),
            mem_mib: POD_MIB,
            core_milli: CLAIM_CORE_MILLI as u32,
        }),
        consumers: Vec::new(),
        source: "claim".into(),
        priority: 0,
    };
    let mut admin = s.allocs.admin(0)?;
    let t = Instant::now();
    admin
        .grant_claim(api::GrantClaimRequest { grant: Some(grant) })
        .await?;
    record(&mut s.h_grant, t.elapsed());
    Ok(claim)
}

/// The mean of each step of the DRA agent's prepares, from its
/// `gpuledger_node_agent_dra_prepare_step_duration_seconds` histogram, in ms.
async fn prepare_steps(health: &str) -> Result<Vec<(String, f64)>> {
    let (_, text) = gpuledger_testkit::http::get(&format!("http://{health}/metrics")).await?;
    let name = "gpuledger_node_agent_dra_prepare_step_duration_seconds";
    let mut sums: Vec<(String, f64, f64)> = Vec::new();
    for line in text.lines() {
        let (is_sum, rest) = if let Some(r) = line.strip_prefix(&format!("{name}_sum{{")) {
            (true, r)
        } else if let Some(r) = line.strip_prefix(&format!("{name}_count{{")) {
            (false, r)
        } else {
            continue;
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let step = labels
            .trim_start_matches("step=\"")
            .trim_end_matches('"')
            .to_string();
        let v: f64 = value.trim().parse().unwrap_or(0.0);
        let e = match sums.iter_mut().find(|(s, _, _)| *s == step) {
            Some(e) => e,
            None => {
                sums.push((step, 0.0, 0.0));
                sums.last_mut().expect("just pushed")
            }
        };
        if is_sum { e.1 += v } else { e.2 += v }
    }
    // In the order the agent takes them; any other after.
    let order = ["claim_read", "grant_wait", "cdi_write", "commit"];
    sums.sort_by_key(|(step, _, _)| order.iter().position(|o| o == step).unwrap_or(order.len()));
    Ok(sums
        .into_iter()
        .filter(|(_, _, n)| *n > 0.0)
        .map(|(step, sum, n)| (step, sum / n * 1000.0))
        .collect())
}

/// Admit `a.pods` pods through `mode`'s device-plugin agent and prepare `a.claims` claims
/// through its DRA agent, interleaved with the baselines, then measure the idle agent.
async fn measure(s: &mut Shared, root: &Path, mode: &'static str, a: &Args) -> Result<Measured> {
    let dir = root.join(mode);
    title(&format!(
        "--isolation={mode}: starting a device-plugin agent{}",
        if a.claims > 0 { " and a DRA agent" } else { "" }
    ));
    let p = start_plugin_node(s, &dir.join("plugin"), mode, a).await?;
    let d = match &s.api {
        Some(api) if a.claims > 0 => Some(start_dra_node(s, api, &dir.join("dra"), mode, a).await?),
        _ => None,
    };
    let mut nodes = vec![p.node.as_str()];
    nodes.extend(d.iter().map(|d| d.node.as_str()));
    wait_nodes(s, &nodes).await?;
    // The extender reserves and confirms; the node's agent assigns (the baseline's claim).
    let mut ext = s.allocs.extender(0)?;
    let mut own = s.allocs.node_agent(0, &p.node)?;

    title(&format!(
        "--isolation={mode}: admitting {} pods through the agent and preparing {} claims, \
         interleaved with the baselines: the bare Assign RPC (the claim alone, no device plugin), \
         a raw etcd commit, the bare GrantClaim RPC",
        a.pods, a.claims
    ));
    let mut h_alloc = histogram();
    let mut h_prepare = histogram();
    let mut next = match &d {
        Some(d) => Some(grant_claim(s, d, mode, 0).await?),
        None => None,
    };
    for i in 0..a.pods.max(a.claims) {
        if i < a.pods {
            let t = Instant::now();
            s.raw.commit(i).await?;
            record(&mut s.h_raw, t.elapsed());
            let t = Instant::now();
            s.raw_leader.commit(i).await?;
            record(&mut s.h_raw_leader, t.elapsed());

            // Baseline first, so that when the kubelet admits the pod its reservation is the
            // only pending one; interleaving exposes both to the same etcd and machine noise.
            let base = format!("{mode}-base-{i}");
            let r = ext
                .reserve(api::ReserveRequest {
                    request: Some(pod(&base, POD_MIB, 1)),
                    node: p.node.clone(),
                    ttl_ms: 600_000,
                })
                .await?
                .into_inner();
            let id = r.allocations.first().context("no allocation")?.id;
            let t = Instant::now();
            own.assign(api::AssignRequest {
                node: p.node.clone(),
                allocation_id: id,
                device_ids: vec![format!("baseline-{i}")],
            })
            .await?;
            record(&mut s.h_assign, t.elapsed());

            let uid = format!("{mode}-uid-{i}");
            ext.reserve(api::ReserveRequest {
                request: Some(pod(&uid, POD_MIB, 1)),
                node: p.node.clone(),
                ttl_ms: 600_000,
            })
            .await?;
            ext.confirm_bound(api::ConfirmBoundRequest {
                pod_uid: uid.clone(),
                node: p.node.clone(),
            })
            .await?;
            let got = p
                .kubelet
                .admit("default", &format!("pod-{uid}"), "main", 1)
                .await?;
            record(&mut h_alloc, got.elapsed);
        }
        if let (Some(d), Some(claim)) = (&d, next.take()) {
            // The next claim is granted one call ahead, as the scheduler's allocation is
            // certified before the pod reaches the kubelet.
            if i + 1 < a.claims {
                next = Some(grant_claim(s, d, mode, i + 1).await?);
            }
            let t = Instant::now();
            let r = d.dra.prepare(std::slice::from_ref(&claim)).await?;
            record(&mut h_prepare, t.elapsed());
            let answer = r
                .claims
                .get(&claim.uid)
                .context("no answer for the claim")?;
            anyhow::ensure!(
                answer.error.is_empty() && !answer.devices.is_empty(),
                "NodePrepareResources of {}: {:?}\n{}",
                claim.uid,
                answer.error,
                d.agent.proc.log_tail(30)
            );
        }
    }

    title(&format!(
        "--isolation={mode}: agent idle for {} s ({} GPUs, 1 s enforce interval)",
        a.idle_secs, a.gpus
    ));
    let pid = p.agent.proc.pid().context("the agent is not running")?;
    tokio::time::sleep(Duration::from_secs(a.idle_secs.min(2))).await;
    let c0 = cpu_seconds(pid);
    let w0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(a.idle_secs)).await;
    let cpu_pct = (cpu_seconds(pid) - c0) / w0.elapsed().as_secs_f64() * 100.0;
    let rss = rss_mib(pid)?;
    let (steps, dra_rss) = match &d {
        Some(d) => (
            prepare_steps(&d.health).await?,
            Some(rss_mib(
                d.agent.proc.pid().context("the DRA agent is not running")?,
            )?),
        ),
        None => (Vec::new(), None),
    };
    if std::env::var_os("GPULEDGER_BENCH_AGENT_LOG").is_some() {
        println!("{}", p.agent.proc.log_tail(20));
    }
    Ok(Measured {
        mode,
        alloc: h_alloc,
        prepare: d.is_some().then_some(h_prepare),
        steps,
        rss,
        dra_rss,
        cpu_pct,
    })
}

/// `x / base` as `1.23x`, or `-` without a base.
fn ratio(x: f64, base: Option<f64>) -> String {
    base.filter(|b| *b > 0.0)
        .map_or_else(|| "-".to_string(), |b| format!("{:.2}x", x / b))
}

/// Run the benchmark.
pub async fn run(a: Args) -> Result<()> {
    check_sizes(&a)?;
    let modes = modes(&a.isolation)?;
    let dir = run_dir("node-agent")?;
    title(&format!(
        "starting a 3-member etcd, an allocator{}; modes {}",
        if a.claims > 0 {
            " and a fake API server"
        } else {
            ""
        },
        modes.join(", ")
    ));
    let reference_before = machine_reference_ms();
    let etcd = EtcdCluster::start_in(&dir.path().join("etcd"), 3).await?;
    let allocs = Allocators::start(&dir.path().join("alloc"), &etcd, 1, "bench", &["--no-kube"])?;
    allocs.wait_leader(Duration::from_secs(30)).await?;
    let api = match a.claims {
        0 => None,
        _ => Some(FakeApiServer::start(&dir.path().join("api")).await?),
    };
    let raw = RawCommit::new(&etcd, &etcd.endpoints(), "any").await?;
    let leader_url = etcd_leader_url(&etcd).await?;
    let raw_leader = RawCommit::new(&etcd, std::slice::from_ref(&leader_url), "leader").await?;
    let mut s = Shared {
        _etcd: etcd,
        allocs,
        api,
        raw,
        raw_leader,
        h_assign: histogram(),
        h_raw: histogram(),
        h_raw_leader: histogram(),
        h_grant: histogram(),
    };
    let mut runs = Vec::new();
    for mode in modes.iter().copied() {
        runs.push(measure(&mut s, dir.path(), mode, &a).await?);
    }
    let reference_after = machine_reference_ms();

    let base = runs.iter().find(|m| m.mode == "nvml");
    let base_alloc = base.map(|m| q_ms(&m.alloc, 0.99));
    let base_prepare = base.and_then(|m| m.prepare.as_ref()).map(|h| q_ms(h, 0.99));
    println!(
        "\n{:<10} {:>26} {:>8} {:>28} {:>8} {:>9} {:>9}",
        "", "Allocate (device plugin)", "", "NodePrepareResources (DRA)", "", "agent", ""
    );
    println!(
        "{:<10} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>10} {:>9} {:>9}",
        "mode",
        "p50 ms",
        "p99 ms",
        "max ms",
        "p99/nvml",
        "p50 ms",
        "p99 ms",
        "max ms",
        "p99/nvml",
        "RSS MiB",
        "idle CPU"
    );
    for m in &runs {
        let (pp50, pp99, pmax, pratio) = match &m.prepare {
            Some(h) => (
                format!("{:.2}", q_ms(h, 0.5)),
                format!("{:.2}", q_ms(h, 0.99)),
                format!("{:.2}", h.max() as f64 / 1000.0),
                ratio(q_ms(h, 0.99), base_prepare),
            ),
            None => ("-".into(), "-".into(), "-".into(), "-".into()),
        };
        println!(
            "{:<10} {:>8.2} {:>8.2} {:>8.2} {:>8} {:>8} {:>8} {:>8} {:>10} {:>9.1} {:>8.2}%",
            m.mode,
            q_ms(&m.alloc, 0.5),
            q_ms(&m.alloc, 0.99),
            m.alloc.max() as f64 / 1000.0,
            ratio(q_ms(&m.alloc, 0.99), base_alloc),
            pp50,
            pp99,
            pmax,
            pratio,
            m.rss,
            m.cpu_pct
        );
    }
    println!(
        "({} Allocate and {} NodePrepareResources calls per mode; RSS and idle CPU of the \
         device-plugin agent{})",
        a.pods,
        a.claims,
        if runs.iter().any(|m| m.dra_rss.is_some()) {
            format!(
                "; the DRA agent's RSS: {}",
                runs.iter()
                    .filter_map(|m| m.dra_rss.map(|r| format!("{} {r:.1} MiB", m.mode)))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        } else {
            String::new()
        }
    );
    if runs.iter().any(|m| !m.steps.is_empty()) {
        println!("\nNodePrepareResources steps, mean ms as the DRA agent times them:");
        for m in &runs {
            let steps: Vec<String> = m
                .steps
                .iter()
                .map(|(step, ms)| format!("{step} {ms:.2}"))
                .collect();
            println!("  {:<10} {}", m.mode, steps.join(", "));
        }
    }

    println!(
        "\n{:<34} {:>8} {:>8} {:>8}",
        "baselines (all modes)", "p50 ms", "p99 ms", "max ms"
    );
    let mut baselines = vec![
        ("bare Assign RPC", &s.h_assign),
        ("raw etcd commit txn", &s.h_raw),
        ("  the same, to the etcd leader", &s.h_raw_leader),
    ];
    if !s.h_grant.is_empty() {
        baselines.push(("bare GrantClaim RPC", &s.h_grant));
    }
    for (name, h) in baselines {
        println!(
            "{:<34} {:>8.2} {:>8.2} {:>8.2}",
            name,
            q_ms(h, 0.5),
            q_ms(h, 0.99),
            h.max() as f64 / 1000.0
        );
    }
    println!(
        "machine reference loop: {reference_before:.0} ms before, {reference_after:.0} ms after"
    );
    println!(
        "assign_baseline_p99_ms={:.2} raw_etcd_commit_p50_ms={:.2} raw_etcd_commit_p99_ms={:.2} \
         raw_etcd_leader_commit_p50_ms={:.2} raw_etcd_leader_commit_p99_ms={:.2}",
        q_ms(&s.h_assign, 0.99),
        q_ms(&s.h_raw, 0.5),
        q_ms(&s.h_raw, 0.99),
        q_ms(&s.h_raw_leader, 0.5),
        q_ms(&s.h_raw_leader, 0.99)
    );
    for m in &runs {
        let mut line = format!(
            "allocate_p50_ms={:.2} allocate_p99_ms={:.2}",
            q_ms(&m.alloc, 0.5),
            q_ms(&m.alloc, 0.99)
        );
        if let Some(b) = base_alloc.filter(|_| runs.len() > 1) {
            line += &format!(" allocate_p99_vs_nvml={:.2}", q_ms(&m.alloc, 0.99) / b);
        }
        if let Some(h) = &m.prepare {
            line += &format!(
                " prepare_p50_ms={:.2} prepare_p99_ms={:.2}",
                q_ms(h, 0.5),
                q_ms(h, 0.99)
            );
            if let Some(b) = base_prepare.filter(|_| runs.len() > 1) {
                line += &format!(" prepare_p99_vs_nvml={:.2}", q_ms(h, 0.99) / b);
            }
        }
        line += &format!(
            " agent_rss_mib={:.1} agent_idle_cpu_pct={:.2} isolation={}",
            m.rss, m.cpu_pct, m.mode
        );
        println!("{line}");
    }
    Ok(())
}
