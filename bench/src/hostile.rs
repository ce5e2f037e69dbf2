//! `gpuledger-bench hostile`: honest load (binds through the extender, reservations with the
//! node agents' Assign, admission reviews) measured without an attack and then under each
//! attack of the hostile-load list, one at a time, at full strength from this machine. Every
//! attack is plain client calls over real TLS with real identities. Per attack: the honest p99
//! and success rate against the quiet run's, who used the CPU, what the attacker did and what
//! the servers refused; at the end, leader lease losses, process exits and `gpuledger verify`.
//!
//! The honest clients behave as the real ones do: kube-scheduler and the API server keep their
//! HTTPS connections to the extender and its webhook alive, the extender and the node agents
//! keep their gRPC channels. They connect from 127.0.0.1; each attack from eight addresses of
//! its own (127.0.N.2 to .9), as other pods would, on their own tokio runtime whose CPU is measured and held to
//! `--attacker-cpu` cores: on one machine every cycle an attacker burns is taken from the stack
//! it attacks, which an attacker on its own machine would not take. A control phase burns that
//! budget without calling anything, to show what losing it costs the machine by itself.
//!
//! Other work on a shared machine moves every latency: each attack (and the control) is
//! preceded by a quiet phase of the same length, and its p99 is also compared with that one
//! (`p99/before`), besides the run's first quiet phase (`p99/quiet`).

mod attacks;
mod cpu;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use gpuledger_auth::identity::Role;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::allocators::{Client, connect};
use gpuledger_testkit::kube::{ExtenderClient, ExtenderConfig, KubeStack, StackOptions};
use gpuledger_testkit::pki::{Identities, credential_flags};
use gpuledger_testkit::workload::inventory;
use hdrhistogram::Histogram;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::common::{cpu_seconds, histogram, q_ms, record, title};
use attacks::{ATTACKS, CPU_BURN, Tally};
use cpu::{Governor, Threads, children_cpu};

/// Flags.
#[derive(clap::Args, Clone)]
pub struct Args {
    /// Seconds of honest load per phase (quiet, then each attack).
    #[arg(long, default_value_t = 8)]
    seconds: u64,
    /// Honest clients, each one request at a time.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Allocator replicas.
    #[arg(long, default_value_t = 2)]
    allocators: usize,
    /// GPU nodes (8 GPUs of 80 GB each).
    #[arg(long, default_value_t = 4)]
    nodes: usize,
    /// Slow-body connections to the webhook (attack 1).
    #[arg(long, default_value_t = 4000)]
    slow_connections: usize,
    /// Idle TCP connections to each allocator (attack 2).
    #[arg(long, default_value_t = 1100)]
    idle_connections: usize,
    /// Subscribe streams a viewer opens, 5,000 per connection (attack 3).
    #[arg(long, default_value_t = 15000)]
    streams: usize,
    /// CPU the attackers may use, in cores (their threads' CPU time, averaged over 100 ms;
    /// 0 = no bound). An attacker on its own machine takes none of the victim's CPU; on this
    /// one, whatever it burns is taken from the stack, so the bound is part of a fair run.
    #[arg(long, default_value_t = 0.5)]
    attacker_cpu: f64,
    /// Run only the attacks whose name contains this (the quiet and control phases always run).
    #[arg(long, default_value = "")]
    only: String,
}

/// What every client, honest or not, needs to reach the stack.
pub struct Ctx {
    store: Arc<gpuledger_testkit::kube::store::Store>,
    addrs: Vec<String>,
    ids: Identities,
    hook_port: u16,
    ext_url: String,
    /// The plain HTTP ports (probes, /metrics) of the allocators and the extender.
    plain: Vec<std::net::SocketAddr>,
    nodes: Vec<String>,
    seq: AtomicU64,
}

/// The honest clients, made once and kept, as the real ones are.
struct Honest {
    scheduler: ExtenderClient,
    api_server: ExtenderClient,
    extender: Client,
    admin: Client,
    agents: Vec<Client>,
}

const NS: &str = "bench";

fn gpu_pod(name: &str, scheduler: &str) -> Value {
    json!({"metadata": {"name": name, "namespace": NS},
           "spec": {"schedulerName": scheduler, "containers": [{"name": "c", "image": "x",
              "resources": {"limits": {"gpuledger.io/gpu": "1", "gpuledger.io/gpu-mem": "1000", "gpuledger.io/gpu-core": "10"},
                            "requests": {"gpuledger.io/gpu": "1", "gpuledger.io/gpu-mem": "1000", "gpuledger.io/gpu-core": "10"}}}]}})
}

/// What the extender asks the allocator for `gpu_pod`.
fn pod_request(uid: &str, name: &str, mem_mib: u64, mem_percent: u32) -> api::PodRequest {
    api::PodRequest {
        pod: Some(pb::PodRef {
            uid: uid.into(),
            namespace: NS.into(),
            name: name.into(),
        }),
        containers: vec![api::ContainerRequest {
            name: "c".into(),
            slices: 1,
            mem_mib,
            mem_percent,
            core_milli: 100,
        }],
        ..Default::default()
    }
}

impl Ctx {
    fn next(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Create `pod` in the API server; its UID.
    fn add_pod(&self, pod: Value) -> Result<String> {
        let p = self
            .store
            .create("v1", "pods", NS, pod)
            .map_err(|e| anyhow::anyhow!("{}", e.message()))?;
        Ok(p["metadata"]["uid"].as_str().unwrap_or("").to_string())
    }
}

/// One admission review of a GPU pod, as the API server sends it (on a kept-alive connection).
async fn admit(honest: &Honest, i: u64) -> Result<()> {
    let review = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": format!("r-{i}"), "kind": {"group": "", "version": "v1", "kind": "Pod"},
                    "resource": {"group": "", "version": "v1", "resource": "pods"},
                    "operation": "CREATE", "namespace": NS, "userInfo": {"username": "bench"},
                    "object": gpu_pod(&format!("admit-{i}"), "default-scheduler")}});
    let r = honest.api_server.post("mutate", &review).await?;
    anyhow::ensure!(
        r["response"]["allowed"] == true,
        "webhook answered {}",
        r.to_string().chars().take(200).collect::<String>()
    );
    Ok(())
}

/// One honest operation: a bind through the extender, a reservation and its node agent's
/// Assign, or an admission review; its kind (0 bind, 1 reserve, 2 admit) and the UID of the pod
/// that now holds GPU, if any.
async fn honest(ctx: &Ctx, honest: &Honest) -> (usize, Result<Option<String>>) {
    let i = ctx.next();
    let node = &ctx.nodes[i as usize % ctx.nodes.len()];
    let kind = (i % 3) as usize;
    let r = async {
        match kind {
            0 => {
                let name = format!("bind-{i}");
                let uid = ctx.add_pod(gpu_pod(&name, "gpuledger-scheduler"))?;
                let r = honest
                    .scheduler
                    .post(
                        "bind",
                        &json!({"PodName": name, "PodNamespace": NS, "PodUID": uid, "Node": node}),
                    )
                    .await?;
                anyhow::ensure!(r["Error"] == "", "bind: {r}");
                Ok(Some(uid))
            }
            1 => {
                let name = format!("reserve-{i}");
                let uid = ctx.add_pod(gpu_pod(&name, "gpuledger-scheduler"))?;
                let r = honest
                    .extender
                    .clone()
                    .reserve(api::ReserveRequest {
                        request: Some(pod_request(&uid, &name, 1000, 0)),
                        node: node.clone(),
                        ttl_ms: 0,
                    })
                    .await?
                    .into_inner();
                let id = r.allocations.first().context("no allocation")?.id;
                let agent = i as usize % ctx.nodes.len();
                honest.agents[agent]
                    .clone()
                    .assign(api::AssignRequest {
                        node: node.clone(),
                        allocation_id: id,
                        device_ids: vec![format!("dev-{i}")],
                    })
                    .await?;
                Ok(Some(uid))
            }
            _ => admit(honest, i).await.map(|()| None),
        }
    };
    (kind, r.await)
}

/// Honest load for `d`: latencies (all, and by kind), successes and attempts, the first error.
async fn measure(
    ctx: &Arc<Ctx>,
    h: &Arc<Honest>,
    d: Duration,
    concurrency: usize,
) -> Result<Phase> {
    let end = Instant::now() + d;
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..concurrency.max(1) {
        let (ctx, h) = (ctx.clone(), h.clone());
        workers.spawn(async move {
            let mut p = Phase::new();
            while Instant::now() < end {
                let t = Instant::now();
                let (kind, r) = tokio::time::timeout(Duration::from_secs(10), honest(&ctx, &h))
                    .await
                    .unwrap_or_else(|_| (0, Err(anyhow::anyhow!("no answer within 10 s"))));
                let took = t.elapsed();
                record(&mut p.latency, took);
                record(&mut p.by_kind[kind], took);
                p.total += 1;
                match r {
                    Ok(held) => {
                        p.ok += 1;
                        // Untimed: give the GPU back, so that every phase finds the same room.
                        if let Some(uid) = held {
                            let _ = h
                                .admin
                                .clone()
                                .release(api::ReleaseRequest {
                                    pod_uid: uid,
                                    reason: "bench".into(),
                                    ..Default::default()
                                })
                                .await;
                        }
                    }
                    Err(e) => {
                        if p.error.is_none() {
                            p.error = Some(format!("{e:#}"));
                        }
                    }
                }
            }
            p
        });
    }
    let mut all = Phase::new();
    while let Some(p) = workers.join_next().await {
        let p = p?;
        let merge = |into: &mut Histogram<u64>, from: &Histogram<u64>| {
            into.add(from)
                .map_err(|e| anyhow::anyhow!("merging histograms: {e:?}"))
        };
        merge(&mut all.latency, &p.latency)?;
        for (into, from) in all.by_kind.iter_mut().zip(&p.by_kind) {
            merge(into, from)?;
        }
        all.ok += p.ok;
        all.total += p.total;
        all.error = all.error.or(p.error);
    }
    Ok(all)
}

struct Phase {
    latency: Histogram<u64>,
    by_kind: [Histogram<u64>; 3],
    ok: u64,
    total: u64,
    error: Option<String>,
}

impl Phase {
    fn new() -> Self {
        Phase {
            latency: histogram(),
            by_kind: [histogram(), histogram(), histogram()],
            ok: 0,
            total: 0,
            error: None,
        }
    }

    fn success(&self) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            self.ok as f64 / self.total as f64
        }
    }

    /// p99 of each kind, in ms, as `bind/reserve/admit`.
    fn kinds_p99(&self) -> String {
        self.by_kind
            .iter()
            .map(|h| format!("{:.0}", q_ms(h, 0.99)))
            .collect::<Vec<_>>()
            .join("/")
    }
}

/// CPU seconds used so far: the stack's processes by name, the attackers' runtime, and this
/// process's other threads (the honest clients and the fake API server).
struct Usage {
    at: Instant,
    stack: BTreeMap<String, f64>,
    attackers: f64,
    honest: f64,
}

impl Usage {
    fn now(attackers: &Threads) -> Self {
        let attackers = attackers.cpu().as_secs_f64();
        Usage {
            at: Instant::now(),
            stack: children_cpu(),
            attackers,
            honest: cpu_seconds(std::process::id()) - attackers,
        }
    }

    /// Cores each part used since `before`: the stack (allocators, extender, etcd), the honest
    /// side, the attackers.
    fn cores_since(&self, before: &Usage) -> (f64, f64, f64) {
        let secs = (self.at - before.at).as_secs_f64().max(0.001);
        let stack: f64 = self
            .stack
            .iter()
            .map(|(k, v)| v - before.stack.get(k).copied().unwrap_or(0.0))
            .sum();
        (
            stack / secs,
            (self.honest - before.honest) / secs,
            (self.attackers - before.attackers) / secs,
        )
    }
}

/// Every refusal counter of the stack (allocators' limits, denied calls and refused writes,
/// the extender's limits by listener), summed over replicas.
async fn refusals(http: &[String]) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for h in http {
        let url = if h.starts_with("http") {
            format!("{h}/metrics")
        } else {
            format!("http://{h}/metrics")
        };
        if let Ok((_, text)) = gpuledger_testkit::http::get(&url).await {
            for (series, v) in gpuledger_testkit::promtext::samples(&text) {
                let short = series
                    .strip_prefix("gpuledger_")
                    .unwrap_or(&series)
                    .replace("_total{", "{");
                if [
                    "_limited_total",
                    "_calls_denied_total",
                    "_writes_refused_total",
                ]
                .iter()
                .any(|c| series.contains(c))
                {
                    *out.entry(short).or_insert(0.0) += v;
                }
            }
        }
    }
    out
}

/// The counters that grew from `before` to `after`, in words.
fn grew(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>) -> String {
    let parts: Vec<String> = after
        .iter()
        .filter_map(|(k, v)| {
            let d = v - before.get(k).copied().unwrap_or(0.0);
            (d > 0.0).then(|| format!("{k} +{d:.0}"))
        })
        .collect();
    if parts.is_empty() {
        "nothing".into()
    } else {
        parts.join(", ")
    }
}

/// `gpuledger_allocator_leaderships_total` summed over the replicas that answer.
async fn leaderships(http: &[String]) -> u64 {
    let mut n = 0;
    for h in http {
        if let Ok((_, text)) = gpuledger_testkit::http::get(&format!("http://{h}/metrics")).await {
            n += text
                .lines()
                .find_map(|l| l.strip_prefix("gpuledger_allocator_leaderships_total "))
                .and_then(|v| v.trim().parse::<f64>().ok())
                .unwrap_or(0.0) as u64;
        }
    }
    n
}

/// The attackers' runtime, shut down without waiting when dropped (a runtime dropped the
/// ordinary way inside another would panic).
struct AttackerRuntime(Option<tokio::runtime::Runtime>);

impl AttackerRuntime {
    fn handle(&self) -> &tokio::runtime::Handle {
        self.0.as_ref().expect("present until dropped").handle()
    }
}

impl Drop for AttackerRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// One line of the table: `p` against the run's quiet p99 and against the quiet phase just
/// before it (`before_p99`, ms).
fn row(name: &str, p: &Phase, quiet_p99: f64, before_p99: f64, cores: (f64, f64, f64)) -> String {
    let p99 = q_ms(&p.latency, 0.99);
    format!(
        "{name:<24} {:>9.4} {:>8.1} {:>9.2} {:>9.1} {:>10.2} {:>6} {:>15} {:>5.2} {:>6.2} {:>6.2}",
        p.success(),
        p99,
        p99 / quiet_p99,
        before_p99,
        p99 / before_p99,
        p.total,
        p.kinds_p99(),
        cores.0,
        cores.1,
        cores.2,
    )
}

/// Run the benchmark.
pub async fn run(a: Args) -> Result<()> {
    let open_files = gpuledger_auth::limit::raise_open_files();
    title(&format!(
        "hostile: {} s of honest load per phase ({} clients), {} allocators, {} nodes; \
         attackers held to {} cores; open files {open_files:?}",
        a.seconds,
        a.concurrency,
        a.allocators,
        a.nodes,
        if a.attacker_cpu > 0.0 {
            format!("{:.2}", a.attacker_cpu)
        } else {
            "unbounded".into()
        }
    ));
    let hook_port = gpuledger_testkit::free_port()?;
    let mut stack = KubeStack::start(StackOptions {
        etcd_members: 1,
        allocators: a.allocators,
        allocator_flags: vec![],
        extender_flags: Some(vec![format!("--webhook-listen=127.0.0.1:{hook_port}")]),
    })
    .await?;
    gpuledger_testkit::kube::stack::wait_http(hook_port, Duration::from_secs(20)).await?;
    let nodes: Vec<String> = (0..a.nodes).map(|i| format!("gpu-{i}")).collect();
    let mut agents = Vec::new();
    for n in &nodes {
        stack.api.add_node(n, 64 * 8)?;
        let mut c = connect(
            &stack.allocs.addrs[0],
            &stack
                .ids
                .credentials(&Role::NodeAgent { node: n.clone() })?,
        )?;
        c.register_node(api::RegisterNodeRequest {
            inventory: Some(inventory(n, 8, 80_000, "NVIDIA A100-SXM4-80GB")),
        })
        .await?;
        agents.push(c);
    }
    let ctx = Arc::new(Ctx {
        store: stack.api.store.clone(),
        addrs: stack.allocs.addrs.clone(),
        ids: stack.ids.clone(),
        hook_port,
        ext_url: stack.extender_url.clone(),
        plain: stack
            .allocs
            .http
            .iter()
            .map(String::as_str)
            .chain([stack.extender_http_url.trim_start_matches("http://")])
            .map(str::parse)
            .collect::<Result<_, _>>()?,
        nodes,
        seq: AtomicU64::new(0),
    });
    // The API server calls the webhook with the CA of its webhook configuration and keeps the
    // connection alive; it presents no client certificate the webhook would ask for.
    let mut webhook = ExtenderConfig::gpuledger(
        &format!("https://127.0.0.1:{hook_port}"),
        Some(gpuledger_testkit::kube::stack::scheduler_tls(
            &stack.ids.pki,
        )?),
    );
    webhook.timeout = Duration::from_secs(10);
    let honest_clients = Arc::new(Honest {
        scheduler: ExtenderClient::new(stack.extender_config()?)?,
        api_server: ExtenderClient::new(webhook)?,
        extender: connect(
            &stack.allocs.addrs[0],
            &stack.ids.credentials(&Role::Extender)?,
        )?,
        admin: connect(
            &stack.allocs.addrs[0],
            &stack.ids.credentials(&Role::Admin)?,
        )?,
        agents,
    });
    // The attackers' own runtime, its threads counted and held to their budget.
    let threads = Arc::new(Threads::default());
    let attacker_rt = AttackerRuntime({
        let t = threads.clone();
        Some(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("attacker")
                .enable_all()
                .on_thread_start(move || t.enter())
                .build()?,
        )
    });
    let governing = CancellationToken::new();
    let gov = Governor::start(a.attacker_cpu, threads.clone(), governing.clone());
    let mut metrics_urls = stack.allocs.http.clone();
    metrics_urls.push(stack.extender_http_url.clone());

    let d = Duration::from_secs(a.seconds.max(1));
    // Warm up connections and caches.
    measure(&ctx, &honest_clients, Duration::from_secs(2), a.concurrency).await?;
    let before = Usage::now(&threads);
    let quiet = measure(&ctx, &honest_clients, d, a.concurrency).await?;
    let quiet_cores = Usage::now(&threads).cores_since(&before);
    let quiet_p99 = q_ms(&quiet.latency, 0.99).max(0.001);
    let leaderships_before = leaderships(&stack.allocs.http).await;
    println!(
        "\n{:<24} {:>9} {:>8} {:>9} {:>9} {:>10} {:>6} {:>15} {:>5} {:>6} {:>6}",
        "phase",
        "honest ok",
        "p99 ms",
        "p99/quiet",
        "before ms",
        "p99/before",
        "ops",
        "p99 b/r/a ms",
        "stack",
        "honest",
        "attack"
    );
    println!(
        "{}",
        row("quiet", &quiet, quiet_p99, quiet_p99, quiet_cores)
    );
    let (mut attacks, mut success_min, mut ratio_max) = (0, f64::INFINITY, 0.0f64);
    let (mut before_ratio_max, mut burn_ratio, mut burn_before_ratio) = (0.0f64, 0.0, 0.0);
    let mut attacker_cores_max = 0.0f64;
    let mut errors = Vec::new();
    // Attacks that could not run: the figures would say nothing of them.
    let mut broken = Vec::new();
    let phases = std::iter::once((
        CPU_BURN,
        "control: no attack, the attackers' CPU budget burnt in a loop",
    ))
    .chain(
        ATTACKS
            .into_iter()
            .filter(|(name, _)| name.contains(a.only.as_str())),
    );
    for (name, what) in phases {
        let calm = measure(&ctx, &honest_clients, d, a.concurrency).await?;
        let before_p99 = q_ms(&calm.latency, 0.99).max(0.001);
        let stop = CancellationToken::new();
        let tally = Arc::new(Tally::default());
        let refused_before = refusals(&metrics_urls).await;
        let started = Instant::now();
        let running = attacker_rt.handle().spawn({
            let (ctx, stop, name, a, gov, tally) = (
                ctx.clone(),
                stop.clone(),
                name.to_string(),
                a.clone(),
                gov.clone(),
                tally.clone(),
            );
            async move { attacks::run(&name, ctx, &a, gov, tally, stop).await }
        });
        // Full strength before measuring.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let before = Usage::now(&threads);
        let under = measure(&ctx, &honest_clients, d, a.concurrency).await?;
        let cores = Usage::now(&threads).cores_since(&before);
        stop.cancel();
        let failed = running.await?.err().map(|e| {
            broken.push(format!("{name}: {e:#}"));
            format!("; the attack failed: {e:#}")
        });
        let secs = started.elapsed().as_secs_f64();
        let refused_after = refusals(&metrics_urls).await;
        let p99 = q_ms(&under.latency, 0.99);
        let (ratio, before_ratio) = (p99 / quiet_p99, p99 / before_p99);
        let label = if name == CPU_BURN {
            format!("({name})")
        } else {
            name.to_string()
        };
        println!("{}", row(&label, &under, quiet_p99, before_p99, cores));
        println!(
            "    {what}: {}{}; refused by the stack: {}",
            tally.describe(name, secs),
            failed.unwrap_or_default(),
            grew(&refused_before, &refused_after)
        );
        if name == CPU_BURN {
            (burn_ratio, burn_before_ratio) = (ratio, before_ratio);
        } else {
            attacks += 1;
            success_min = success_min.min(under.success());
            ratio_max = ratio_max.max(ratio);
            before_ratio_max = before_ratio_max.max(before_ratio);
            attacker_cores_max = attacker_cores_max.max(cores.2);
        }
        if let Some(e) = under.error {
            errors.push(format!("{name}: {e}"));
        }
        if let Some(e) = calm.error {
            errors.push(format!("the quiet phase before {name}: {e}"));
        }
        // Let the attack's connections drain before the next one.
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    governing.cancel();
    drop(attacker_rt);
    println!(
        "\np99/quiet: against the run's first quiet phase; before ms, p99/before: the quiet \
         phase just before, and against it; p99 b/r/a: honest p99 of binds, reservations \
         (with Assign), admission reviews; stack, honest, attack: cores used by allocators + \
         extender + etcd, by the honest clients + fake API server, by the attackers"
    );
    for e in &errors {
        println!("first honest error under {e}");
    }
    let lease_losses = leaderships(&stack.allocs.http)
        .await
        .saturating_sub(leaderships_before);
    let mut exits = 0;
    for p in stack
        .allocs
        .procs
        .iter_mut()
        .chain(stack.extender.iter_mut())
    {
        if let Some(st) = p.exited() {
            exits += 1;
            println!("{} exited ({st}):\n{}", p.name, p.log_tail(10));
        }
    }
    let bin = gpuledger_testkit::bin_path("gpuledger")?;
    let mut args = vec![
        "verify".to_string(),
        format!("--allocator={}", stack.allocs.addrs.join(",")),
    ];
    args.extend(credential_flags(&stack.ids.credentials(&Role::Viewer)?));
    let out = tokio::process::Command::new(&bin)
        .args(&args)
        .output()
        .await
        .with_context(|| format!("running {}", bin.display()))?;
    let verified = out.status.success();
    if !verified {
        println!(
            "gpuledger verify failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    if success_min.is_infinite() {
        success_min = quiet.success();
    }
    println!(
        "attacks={attacks} honest_success_min={success_min:.4} p99_ratio_max={ratio_max:.2} \
         p99_ratio_before_max={before_ratio_max:.2} quiet_p99_ms={:.1} quiet_success={:.4} \
         cpu_burn_p99_ratio={burn_ratio:.2} cpu_burn_p99_ratio_before={burn_before_ratio:.2} \
         attacker_cpu_cap={} attacker_cpu_max={attacker_cores_max:.2} lease_losses={lease_losses} \
         process_exits={exits} verify={} attacks_failed={}",
        q_ms(&quiet.latency, 0.99),
        quiet.success(),
        a.attacker_cpu,
        if verified { "ok" } else { "failed" },
        broken.len()
    );
    anyhow::ensure!(
        broken.is_empty(),
        "{} attack(s) could not run, so the figures say nothing of them: {}",
        broken.len(),
        broken.join("; ")
    );
    Ok(())
}
