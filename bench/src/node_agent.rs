//! `gpuledger-bench node-agent`: device-plugin Allocate latency through a real node agent
//! (the claim committed through the allocator included), against two baselines measured
//! interleaved on the same etcd: the bare Assign RPC, and the raw fenced etcd transaction the
//! allocator's commit is made of (no allocator at all); and the agent's RSS and idle CPU.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use gpuledger_allocator::log::{Commit, EtcdLog};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::kubelet::Kubelet;
use gpuledger_testkit::kubelet::node::{FakeNvml, MpsReaper, NodeAgent, mps_stand_in};
use gpuledger_testkit::workload::pod;
use gpuledger_testkit::{Allocators, EtcdCluster};

use crate::common::{histogram, q_ms, record, rss_mib, run_dir, title};

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
    /// The agent's --isolation, with what the mode needs made here: a placeholder
    /// `libvgpu.so` (hami-core: no container starts, so it is never loaded), the stand-in MPS
    /// control program of the tests (mps: one daemon per GPU), a cgroup v2 tree with a dmem
    /// region per GPU and driver 615 (dmem).
    #[arg(long, default_value = "nvml", value_parser = ["nvml", "hami-core", "mps", "dmem"])]
    isolation: String,
    /// More flags for the agent, one per use (e.g. `--agent-flag=--grace=1s`).
    #[arg(long = "agent-flag", allow_hyphen_values = true)]
    agent_flags: Vec<String>,
}

const NODE: &str = "bench-node";

/// utime + stime of a process in clock ticks (USER_HZ, 100 on Linux).
fn cpu_ticks(pid: u32) -> Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let rest = s.rsplit_once(')').context("malformed stat")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the command: state is field 3, utime 14, stime 15 (1-based in proc(5)).
    let ut: u64 = f.get(11).context("utime")?.parse()?;
    let st: u64 = f.get(12).context("stime")?.parse()?;
    Ok(ut + st)
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

/// The client URL of the etcd member that is raft leader now.
/// TLS to the bench's etcd as an allocator has it.
fn allocator_tls(etcd: &EtcdCluster) -> gpuledger_allocator::config::EtcdTls {
    let (ca, identity) = etcd.client_tls_files();
    gpuledger_allocator::config::EtcdTls {
        ca: Some(ca),
        identity: Some(identity),
    }
}

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

/// Refuse sizes the run could not finish, before anything starts: every admitted pod keeps one
/// replica device and, with its baseline, 2 × 100 MiB until the end.
fn check_sizes(a: &Args) -> Result<()> {
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
    Ok(())
}

/// Run the benchmark.
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

pub async fn run(a: Args) -> Result<()> {
    check_sizes(&a)?;
    let dir = run_dir("node-agent")?;
    title("starting a 3-member etcd, an allocator, the kubelet emulator and the node agent");
    let etcd = EtcdCluster::start_in(&dir.path().join("etcd"), 3).await?;
    let allocs = Allocators::start(&dir.path().join("alloc"), &etcd, 1, "bench", &["--no-kube"])?;
    allocs.wait_leader(Duration::from_secs(30)).await?;
    let kubelet = Kubelet::start(&dir.path().join("kubelet")).await?;
    let nvml = FakeNvml::new(dir.path(), NODE, a.gpus, GPU_MIB)?;
    let mut flags = vec![
        format!("--slots-per-gpu={}", a.slots),
        "--enforce-interval=1s".to_string(),
    ];
    flags.extend(isolation_flags(&a.isolation, dir.path(), &nvml)?);
    let _daemons = MpsReaper(dir.path().join("mps"));
    flags.extend(a.agent_flags.iter().cloned());
    flags.extend(
        allocs
            .ids
            .flags(&gpuledger_auth::identity::Role::NodeAgent { node: NODE.into() })?,
    );
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let agent = NodeAgent::start(dir.path(), NODE, &allocs.addrs, &nvml, &kubelet, &flags)?;
    kubelet
        .wait_registrations(1, Duration::from_secs(30))
        .await
        .with_context(|| agent.proc.log_tail(30))?;
    let want = (u64::from(a.gpus) * u64::from(a.slots)) as usize;
    kubelet
        .wait_devices(Duration::from_secs(10), |d| d.len() == want)
        .await?;
    let mut c = allocs.viewer(0)?;
    // The extender reserves and confirms; the node's agent assigns (the baseline's claim).
    let mut ext = allocs.extender(0)?;
    let mut own = allocs.node_agent(0, NODE)?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while c
        .dump(api::DumpRequest {})
        .await?
        .into_inner()
        .snapshot
        .is_none_or(|s| s.nodes.is_empty())
    {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the agent did not register its GPUs"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    title(&format!(
        "admitting {} pods through the agent, interleaved with the baseline: the bare Assign RPC \
         (the claim alone, no device plugin)",
        a.pods
    ));
    let mut raw = RawCommit::new(&etcd, &etcd.endpoints(), "any").await?;
    let leader_url = etcd_leader_url(&etcd).await?;
    let mut raw_leader = RawCommit::new(&etcd, std::slice::from_ref(&leader_url), "leader").await?;
    let mut h_alloc = histogram();
    let mut h_assign = histogram();
    let mut h_raw = histogram();
    let mut h_raw_leader = histogram();
    for i in 0..a.pods {
        let t = Instant::now();
        raw.commit(i).await?;
        record(&mut h_raw, t.elapsed());
        let t = Instant::now();
        raw_leader.commit(i).await?;
        record(&mut h_raw_leader, t.elapsed());

        // Baseline first, so that when the kubelet admits the pod its reservation is the only
        // pending one; interleaving exposes both to the same etcd and machine noise.
        let base = format!("base-{i}");
        let r = ext
            .reserve(api::ReserveRequest {
                request: Some(pod(&base, POD_MIB, 1)),
                node: NODE.into(),
                ttl_ms: 600_000,
            })
            .await?
            .into_inner();
        let id = r.allocations.first().context("no allocation")?.id;
        let t = Instant::now();
        own.assign(api::AssignRequest {
            node: NODE.into(),
            allocation_id: id,
            device_ids: vec![format!("baseline-{i}")],
        })
        .await?;
        record(&mut h_assign, t.elapsed());

        let uid = format!("uid-{i}");
        ext.reserve(api::ReserveRequest {
            request: Some(pod(&uid, POD_MIB, 1)),
            node: NODE.into(),
            ttl_ms: 600_000,
        })
        .await?;
        ext.confirm_bound(api::ConfirmBoundRequest {
            pod_uid: uid.clone(),
            node: NODE.into(),
        })
        .await?;
        let got = kubelet
            .admit("default", &format!("pod-{uid}"), "main", 1)
            .await?;
        record(&mut h_alloc, got.elapsed);
    }

    title(&format!(
        "agent idle for {} s ({} GPUs, 1 s enforce interval, --isolation={})",
        a.idle_secs, a.gpus, a.isolation
    ));
    let pid = agent.proc.pid().context("the agent is not running")?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let t0 = cpu_ticks(pid)?;
    let w0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(a.idle_secs)).await;
    let ticks = cpu_ticks(pid)? - t0;
    let cpu_pct = ticks as f64 / 100.0 / w0.elapsed().as_secs_f64() * 100.0;
    let rss = rss_mib(pid)?;

    println!(
        "\n{:<34} {:>8} {:>8} {:>8}",
        "what", "p50 ms", "p99 ms", "max ms"
    );
    for (name, h) in [
        ("Allocate via the agent", &h_alloc),
        ("baseline: bare Assign RPC", &h_assign),
        ("baseline: raw etcd commit txn", &h_raw),
        ("  the same, to the etcd leader", &h_raw_leader),
    ] {
        println!(
            "{:<34} {:>8.2} {:>8.2} {:>8.2}",
            name,
            q_ms(h, 0.5),
            q_ms(h, 0.99),
            h.max() as f64 / 1000.0
        );
    }
    println!("agent RSS {rss:.1} MiB, idle CPU {cpu_pct:.2} % of a core");
    println!(
        "agent_rss_mib={rss:.1} agent_idle_cpu_pct={cpu_pct:.2} assign_baseline_p99_ms={:.2} \
         raw_etcd_commit_p50_ms={:.2} raw_etcd_commit_p99_ms={:.2} \
         raw_etcd_leader_commit_p50_ms={:.2} raw_etcd_leader_commit_p99_ms={:.2}",
        q_ms(&h_assign, 0.99),
        q_ms(&h_raw, 0.5),
        q_ms(&h_raw, 0.99),
        q_ms(&h_raw_leader, 0.5),
        q_ms(&h_raw_leader, 0.99)
    );
    println!(
        "allocate_p50_ms={:.2} allocate_p99_ms={:.2} isolation={}",
        q_ms(&h_alloc, 0.5),
        q_ms(&h_alloc, 0.99),
        a.isolation
    );
    if std::env::var_os("GPULEDGER_BENCH_AGENT_LOG").is_some() {
        println!("{}", agent.proc.log_tail(20));
    }
    drop(agent);
    Ok(())
}
