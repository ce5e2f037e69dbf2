//! `gpuledger-bench e2e`: the real kube-scheduler placing GPU pods on kubelet-less nodes
//! against the same scheduler placing plain CPU pods on the same nodes in the same run, for
//! each of gpuledger's two paths, one cluster after the other:
//!
//! - `extender`: the shipped default-scheduler configuration; the extender filters,
//!   prioritizes and binds GPU pods, which the allocator reserves;
//! - `dra`: the `dra` overlay; the webhook turns GPU pods into ResourceClaims, the second
//!   scheduler (`gpuledger-scheduler`, DynamicResources) allocates them from the nodes'
//!   ResourceSlices, the allocator certifies each allocation in the ledger (binding
//!   conditions), the extender chooses the node and binds.
//!
//! Then, on each path's real kubelet, GPU pods one at a time: create to the container running
//! with its GPU environment, and on the DRA path the time of the kubelet's
//! `NodePrepareResources` call to the node agent. Needs root (containerd, the kubelet) and the
//! Kubernetes binaries of `e2e/kube/build.sh` (docs/e2e.md).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use futures::{StreamExt, TryStreamExt};
use gpuledger_e2e::cluster::REAL_NODE;
use gpuledger_e2e::gpuledger::counter;
use gpuledger_e2e::nodes::NodeShape;
use gpuledger_e2e::pods;
use gpuledger_e2e::real_node::{CDI_ENV, RealNode, host_network};
use gpuledger_e2e::{E2e, Options, until};
use hdrhistogram::Histogram;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams};
use kube::runtime::watcher;
use serde_json::{Value, json};

use crate::common::{cpu_seconds, histogram, processes, q_ms, record, title};

/// How GPU pods reach their GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Route {
    /// Device plugin + scheduler extender (the default-scheduler profile).
    Extender,
    /// Dynamic Resource Allocation (the `dra` overlay and its scheduler).
    Dra,
}

impl Route {
    fn name(self) -> &'static str {
        match self {
            Route::Extender => "extender",
            Route::Dra => "dra",
        }
    }
}

/// Flags of `gpuledger-bench e2e`.
#[derive(clap::Args)]
pub struct Args {
    /// The paths to measure, each on a cluster of its own, one after the other.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Route::Extender, Route::Dra])]
    paths: Vec<Route>,
    /// Kubelet-less nodes.
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
    /// GPUs per node.
    #[arg(long, default_value_t = 8)]
    gpus_per_node: u32,
    /// GPU pods, and as many plain CPU pods.
    #[arg(long, default_value_t = 2000)]
    pods: usize,
    /// Pod creations in flight.
    #[arg(long, default_value_t = 32)]
    parallel: usize,
    /// GPU pods started one after the other on the real kubelet (each deleted once running);
    /// on the DRA path each one's NodePrepareResources is timed.
    #[arg(long, default_value_t = 50)]
    kubelet_pods: usize,
    /// GPU memory of each of those pods, MiB (the real node has 2 GPUs of 16 GiB).
    #[arg(long, default_value_t = 256)]
    kubelet_pod_mib: u64,
    /// kube-scheduler's client QPS (binds of plain pods are API calls of the scheduler's own;
    /// GPU pods are bound by the extender). Default: the shipped configuration's (50).
    #[arg(long)]
    scheduler_qps: Option<u32>,
    /// kube-controller-manager's client QPS, per controller (burst twice that). Its
    /// resource-claim controller creates each claim pod's ResourceClaim and records it in the
    /// pod's status: two calls per DRA pod. Default: kube-controller-manager's (20).
    #[arg(long)]
    controller_manager_qps: Option<u32>,
}

/// How one batch of pods went through the scheduler.
pub(crate) struct Batch {
    /// First create to last bound.
    pub(crate) total: Duration,
    /// Pods/s between the 5th and the 95th percentile of bindings.
    pub(crate) steady: f64,
    /// Each pod's create call to its binding, as the watch saw it.
    pub(crate) bound: Histogram<u64>,
}

/// What one path measured.
struct Measured {
    route: Route,
    plain: Batch,
    gpus: Batch,
    /// CPU ms per pod by process, plain and GPU batch.
    plain_cpu: BTreeMap<String, f64>,
    gpu_cpu: BTreeMap<String, f64>,
    /// Mean extender answer per verb (filter, prioritize, bind), ms.
    verbs: [f64; 3],
    binds: f64,
    rejected: f64,
    /// Claim results the allocator certified in the GPU batch: granted, refused.
    certified: (f64, f64),
    /// Create to the container running with its GPU environment on the real kubelet.
    start: Histogram<u64>,
    /// The real kubelet's NodePrepareResources calls (DRA only).
    prepare: Option<Prepare>,
}

/// NodePrepareResources on the real node, one pod at a time.
struct Prepare {
    /// Per pod: the kubelet's time in its NodePrepareResources calls (histogram sum delta).
    kubelet: Histogram<u64>,
    /// Per pod: the agent's time preparing the pod's claim (its histogram's sum delta).
    agent: Histogram<u64>,
    /// NodePrepareResources calls the kubelet made for the pods (one each when none failed).
    calls: f64,
    /// Prepares the agent answered with an error.
    errors: f64,
}

/// Only the kubelet-less nodes (the real node runs what is placed there).
fn on_kubelet_less(mut p: Value) -> Value {
    p["spec"]["nodeSelector"] = json!({"gpuledger.io/e2e": "kubelet-less"});
    p
}

/// CPU seconds used so far by this process ("bench") and each of its descendants, summed by
/// the name the kernel gives them (`comm`: kube-apiserver, etcd, gpuledger-alloc, …).
pub(crate) fn cpu_by_process() -> BTreeMap<String, f64> {
    let all = processes();
    let me = std::process::id();
    let ours = |mut p: u32| {
        for _ in 0..64 {
            if p == me {
                return true;
            }
            match all.get(&p) {
                Some((parent, _)) if *parent != 0 => p = *parent,
                _ => return false,
            }
        }
        false
    };
    let mut out = BTreeMap::new();
    for (pid, (_, name)) in &all {
        if ours(*pid) {
            let name = if *pid == me { "bench" } else { name.as_str() };
            *out.entry(name.to_string()).or_insert(0.0) += cpu_seconds(*pid);
        }
    }
    out
}

/// Milliseconds of CPU per pod, by process, between two [`cpu_by_process`] readings.
pub(crate) fn cpu_per_pod(
    before: &BTreeMap<String, f64>,
    after: &BTreeMap<String, f64>,
    pods: usize,
) -> BTreeMap<String, f64> {
    after
        .iter()
        .map(|(k, v)| {
            let d = v - before.get(k).copied().unwrap_or(0.0);
            (k.clone(), 1e3 * d.max(0.0) / pods as f64)
        })
        .filter(|(_, ms)| *ms >= 0.05)
        .collect()
}

/// Create `specs` in `ns` (`parallel` at a time) and time until every one is bound.
pub(crate) async fn schedule(
    e: &E2e,
    ns: &str,
    specs: Vec<Value>,
    parallel: usize,
) -> Result<Batch> {
    let n = specs.len();
    let names: std::collections::HashSet<String> = specs
        .iter()
        .filter_map(|p| p["metadata"]["name"].as_str().map(String::from))
        .collect();
    let api: Api<Pod> = Api::namespaced(e.client.clone(), ns);
    let watch = tokio::spawn({
        let api = api.clone();
        async move {
            let mut bound: HashMap<String, Instant> = HashMap::new();
            let mut s = watcher(api, watcher::Config::default()).boxed();
            while bound.len() < n {
                let Some(ev) = s.try_next().await? else { break };
                let pods: Vec<Pod> = match ev {
                    watcher::Event::Apply(p) | watcher::Event::InitApply(p) => vec![p],
                    _ => continue,
                };
                for p in pods {
                    let name = p.metadata.name.unwrap_or_default();
                    if names.contains(&name)
                        && p.spec.as_ref().is_some_and(|s| s.node_name.is_some())
                    {
                        bound.entry(name).or_insert_with(Instant::now);
                    }
                }
            }
            anyhow::Ok(bound)
        }
    });
    let t0 = Instant::now();
    let created = futures::stream::iter(specs.into_iter().map(|p| {
        let c = e.client.clone();
        async move {
            let at = Instant::now();
            let name = p["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            pods::create(&c, ns, &p).await.map(|_| (name, at))
        }
    }))
    .buffer_unordered(parallel)
    .collect::<Vec<_>>()
    .await;
    let created = created
        .into_iter()
        .collect::<Result<HashMap<String, Instant>>>()?;
    let bound = tokio::time::timeout(Duration::from_secs(1800), watch)
        .await
        .context("pods not bound within 30 min")???;
    ensure!(bound.len() == n, "{} of {n} pods bound", bound.len());
    let mut at: Vec<Duration> = bound.values().map(|t| t.duration_since(t0)).collect();
    at.sort_unstable();
    let (lo, hi) = (at[n / 20], at[n * 19 / 20]);
    let steady = (n * 9 / 10) as f64 / (hi - lo).as_secs_f64().max(1e-3);
    // Up to an hour: a peer's pods may wait minutes, beyond [`histogram`]'s 60 s.
    let mut latency =
        Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("static bounds are valid");
    for (name, t) in &bound {
        if let Some(c) = created.get(name) {
            record(&mut latency, t.saturating_duration_since(*c));
        }
    }
    Ok(Batch {
        total: at[n - 1],
        steady,
        bound: latency,
    })
}

/// The kubelet's NodePrepareResources calls to gpuledger's plugin: (count, seconds) of
/// the kubelet's `dra_grpc_operations_duration_seconds` (Kubernetes 1.37).
fn kubelet_prepares(metrics: &str) -> (f64, f64) {
    let labels = [
        ("driver_name", "gpu.gpuledger.io"),
        (
            "method_name",
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
        ),
    ];
    let name = "dra_grpc_operations_duration_seconds";
    (
        counter(metrics, &format!("{name}_count"), &labels),
        counter(metrics, &format!("{name}_sum"), &labels),
    )
}

/// The agent's prepares: (count, seconds, errors) of
/// `gpuledger_node_agent_dra_prepare_duration_seconds`.
fn agent_prepares(metrics: &str) -> (f64, f64, f64) {
    let name = "gpuledger_node_agent_dra_prepare_duration_seconds";
    (
        counter(metrics, &format!("{name}_count"), &[]),
        counter(metrics, &format!("{name}_sum"), &[]),
        counter(metrics, &format!("{name}_count"), &[("outcome", "error")]),
    )
}

/// The real node's kubelet and agent metrics as one text.
async fn node_metrics(kubelet: &kube::Client, node: &RealNode) -> Result<String> {
    let agent = format!("http://{}/metrics", node.agent_http);
    let (code, body) = gpuledger_testkit::http::get(&agent).await?;
    ensure!(code == 200, "node agent /metrics answered {code}");
    Ok(RealNode::kubelet_metrics(kubelet).await? + &body)
}

/// GPU pods one at a time on the real kubelet: create to the container printing its GPU
/// environment; each is deleted once running. On the DRA path, the kubelet's and the agent's
/// prepare histograms are read around each pod: one pod's prepare is their sums' difference.
async fn on_the_kubelet(e: &E2e, a: &Args, dra: bool) -> Result<(Histogram<u64>, Option<Prepare>)> {
    let node = e.node.as_ref().context("no real node")?;
    let kubelet = node
        .kubelet_client(&e.client, &e.cp.admin_kubeconfig)
        .await?;
    if dra {
        let ready = || async { Ok((node.agent_readyz().await?.0 == 200).then_some(())) };
        until("the node agent is ready", Duration::from_secs(60), ready)
            .await
            .with_context(|| e.log_tails(20))?;
    }
    let api: Api<Pod> = Api::namespaced(e.client.clone(), "bench");
    let mut start = histogram();
    let (mut kubelet_h, mut agent_h) = (histogram(), histogram());
    let (mut calls, mut errors) = (0.0, 0.0);
    let mib = a.kubelet_pod_mib.to_string();
    for i in 0..a.kubelet_pods {
        let name = format!("run-{i}");
        let mut p = host_network(pods::pod(
            &name,
            &[("gpuledger.io/gpu-mem", mib.as_str())],
            Some(&["sh", "-c", "env; sleep 3600"]),
        ));
        p["spec"]["nodeSelector"] = json!({"kubernetes.io/hostname": REAL_NODE});
        let before = match dra {
            true => Some(node_metrics(&kubelet, node).await?),
            false => None,
        };
        let t = Instant::now();
        let uid = pods::create(&e.client, "bench", &p)
            .await?
            .metadata
            .uid
            .unwrap_or_default();
        let seen = format!("{CDI_ENV}=GPU-");
        until(
            "the container prints its GPU environment",
            Duration::from_secs(120),
            || async {
                let log = node
                    .container_log("bench", &name, &uid, "main")
                    .unwrap_or_default();
                Ok(log.contains(&seen).then_some(()))
            },
        )
        .await
        .with_context(|| e.log_tails(20))?;
        record(&mut start, t.elapsed());
        if let Some(before) = before {
            let after = node_metrics(&kubelet, node).await?;
            let ((kc0, ks0), (kc1, ks1)) = (kubelet_prepares(&before), kubelet_prepares(&after));
            let ((ac0, as0, ae0), (ac1, as1, ae1)) =
                (agent_prepares(&before), agent_prepares(&after));
            let seen: Vec<&str> = after
                .lines()
                .filter(|l| !l.starts_with('#') && l.contains("NodePrepareResources"))
                .collect();
            ensure!(
                kc1 > kc0 && ac1 > ac0,
                "pod {name} ran without a NodePrepareResources call the kubelet or the agent counted (kubelet {kc0} -> {kc1}, agent {ac0} -> {ac1}); the kubelet's samples naming it:\n{}",
                seen.join("\n")
            );
            calls += kc1 - kc0;
            errors += ae1 - ae0;
            record(&mut kubelet_h, Duration::from_secs_f64(ks1 - ks0));
            record(&mut agent_h, Duration::from_secs_f64(as1 - as0));
        }
        api.delete(&name, &DeleteParams::default()).await?;
    }
    let prepare = dra.then_some(Prepare {
        kubelet: kubelet_h,
        agent: agent_h,
        calls,
        errors,
    });
    Ok((start, prepare))
}

/// One path on a cluster of its own: the plain batch, the GPU batch, the real kubelet.
async fn measure(a: &Args, route: Route) -> Result<Measured> {
    let dra = route == Route::Dra;
    title(&format!("path {}: starting the cluster", route.name()));
    let e = E2e::start(Options {
        real_node: true,
        scheduler_qps: a.scheduler_qps,
        controller_manager_qps: a.controller_manager_qps,
        dra,
        ..Options::default()
    })
    .await?;
    let names: Vec<String> = (0..a.nodes).map(|i| format!("node-{i:05}")).collect();
    let shape = NodeShape {
        gpus: a.gpus_per_node,
        pods: 110,
        dra,
        ..NodeShape::default()
    };
    let t = Instant::now();
    e.add_nodes(&names, &shape).await?;
    println!(
        "{} nodes created and registered{} in {:.1} s",
        a.nodes,
        if dra {
            " with their ResourceSlices"
        } else {
            ""
        },
        t.elapsed().as_secs_f64()
    );
    e.namespace("bench").await?;

    // Plain pods go to the scheduler that GPU pods go to: on the DRA path the webhook sends
    // GPU pods to the dra overlay's scheduler, which is the only one running.
    let cpu: Vec<Value> = (0..a.pods)
        .map(|i| {
            let mut p = on_kubelet_less(pods::pod(&format!("cpu-{i}"), &[("cpu", "100m")], None));
            if dra {
                p["spec"]["schedulerName"] = json!("gpuledger-scheduler");
            }
            p
        })
        .collect();
    let cpu0 = cpu_by_process();
    let plain = schedule(&e, "bench", cpu, a.parallel).await?;
    let cpu1 = cpu_by_process();
    let before = e.gl.extender_metrics().await?;
    let alloc_before = e.gl.allocator_metrics().await?;
    let gpu: Vec<Value> = (0..a.pods)
        .map(|i| {
            on_kubelet_less(pods::pod(
                &format!("gpu-{i}"),
                &[("gpuledger.io/gpu-mem", "4096")],
                None,
            ))
        })
        .collect();
    let gpus = schedule(&e, "bench", gpu, a.parallel).await?;
    let cpu2 = cpu_by_process();
    // A bind is counted when its answer is sent, just after the Binding the watch saw.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = e.gl.extender_metrics().await?;
    let alloc_after = e.gl.allocator_metrics().await?;
    let bind_calls = |m: &str, outcome: &[(&str, &str)]| {
        let mut l = vec![("verb", "bind")];
        l.extend_from_slice(outcome);
        counter(m, "gpuledger_extender_requests_total", &l)
    };
    let binds = bind_calls(&after, &[]) - bind_calls(&before, &[]);
    let rejected =
        bind_calls(&after, &[("outcome", "error")]) - bind_calls(&before, &[("outcome", "error")]);
    // Where a GPU pod's time goes in the extender: mean answer time per verb in this batch.
    let mean_ms = |verb: &str| {
        let v = [("verb", verb)];
        let d = |name: &str| counter(&after, name, &v) - counter(&before, name, &v);
        1e3 * d("gpuledger_extender_request_duration_seconds_sum")
            / d("gpuledger_extender_request_duration_seconds_count").max(1.0)
    };
    let certified = |outcome: &str| {
        let c = |m: &str| {
            counter(
                m,
                "gpuledger_allocator_claims_certified_total",
                &[("outcome", outcome)],
            )
        };
        c(&alloc_after) - c(&alloc_before)
    };

    title(&format!(
        "path {}: create to running with its GPU env on the real kubelet ({} pods of {} MiB)",
        route.name(),
        a.kubelet_pods,
        a.kubelet_pod_mib
    ));
    let (start, prepare) = on_the_kubelet(&e, a, dra).await?;
    Ok(Measured {
        route,
        plain,
        gpus,
        plain_cpu: cpu_per_pod(&cpu0, &cpu1, a.pods),
        gpu_cpu: cpu_per_pod(&cpu1, &cpu2, a.pods),
        verbs: [mean_ms("filter"), mean_ms("prioritize"), mean_ms("bind")],
        binds,
        rejected,
        certified: (certified("granted"), certified("refused")),
        start,
        prepare,
    })
}

/// Run the benchmark.
pub async fn run(a: Args) -> Result<()> {
    let version = gpuledger_e2e::bins::KubeBins::get()?.version()?;
    let mut routes = a.paths.clone();
    routes.sort_unstable();
    routes.dedup();
    ensure!(!routes.is_empty(), "--paths names no path");
    title(&format!(
        "e2e: kube-apiserver + kube-scheduler {}, {} kubelet-less nodes x {} GPUs, {} GPU pods and {} CPU pods per path ({}); a real kubelet",
        version,
        a.nodes,
        a.gpus_per_node,
        a.pods,
        a.pods,
        routes
            .iter()
            .map(|r| r.name())
            .collect::<Vec<_>>()
            .join(", ")
    ));
    let mut runs = Vec::new();
    for r in routes {
        runs.push(measure(&a, r).await?);
    }
    report(&a, &version, &runs);
    Ok(())
}

/// The tables and the key line.
fn report(a: &Args, version: &str, runs: &[Measured]) {
    println!(
        "\npods through kube-scheduler {version}, steady pods/s (5th to 95th percentile of bindings)"
    );
    println!(
        "{:<10} {:>7} {:>15} {:>13} {:>11} {:>10} {:>13}",
        "path", "pods", "plain pods/s", "GPU pods/s", "GPU/plain", "plain s", "GPU s"
    );
    for m in runs {
        println!(
            "{:<10} {:>7} {:>15.1} {:>13.1} {:>11.2} {:>10.1} {:>13.1}",
            m.route.name(),
            a.pods,
            m.plain.steady,
            m.gpus.steady,
            m.gpus.steady / m.plain.steady,
            m.plain.total.as_secs_f64(),
            m.gpus.total.as_secs_f64()
        );
    }
    let by = |r: Route| runs.iter().find(|m| m.route == r);
    let dra_vs_extender = by(Route::Dra)
        .zip(by(Route::Extender))
        .map(|(d, x)| d.gpus.steady / x.gpus.steady);
    if let Some(x) = dra_vs_extender {
        println!("DRA GPU pods/s / extender GPU pods/s = {x:.2}");
    }
    for m in runs {
        let [f, p, b] = m.verbs;
        print!(
            "{}: extender mean answer filter {f:.1} ms, prioritize {p:.1} ms, bind {b:.1} ms; bind calls {:.0}, rejected {:.0}",
            m.route.name(),
            m.binds,
            m.rejected
        );
        match m.route {
            Route::Dra => println!(
                "; claim results certified: {:.0} granted, {:.0} refused",
                m.certified.0, m.certified.1
            ),
            Route::Extender => println!(),
        }
    }

    // The cost model: on a machine whose cores every process shares, pods/s is bounded by
    // the cores divided by the CPU one pod costs the whole cluster.
    print!("\nCPU ms per pod, by process   ");
    for m in runs {
        let n = m.route.name();
        print!(" {:>13} {:>13}", format!("{n} plain"), format!("{n} GPU"));
    }
    println!();
    let names: BTreeSet<&String> = runs
        .iter()
        .flat_map(|m| m.plain_cpu.keys().chain(m.gpu_cpu.keys()))
        .collect();
    let cell = |t: &BTreeMap<String, f64>, n: &str| t.get(n).copied().unwrap_or(0.0);
    for n in names {
        print!("  {n:<27}");
        for m in runs {
            print!(
                " {:>13.2} {:>13.2}",
                cell(&m.plain_cpu, n),
                cell(&m.gpu_cpu, n)
            );
        }
        println!();
    }
    let sum = |t: &BTreeMap<String, f64>| t.values().sum::<f64>();
    print!("  {:<27}", "all");
    for m in runs {
        print!(" {:>13.2} {:>13.2}", sum(&m.plain_cpu), sum(&m.gpu_cpu));
    }
    println!();
    let qps = a
        .scheduler_qps
        .map_or("50, the default".to_string(), |q| q.to_string());
    println!(
        "kube-scheduler client QPS: {qps} (it bounds the plain pods' binds, not the extender's)"
    );
    let kcm = a
        .controller_manager_qps
        .map_or("20, the default".to_string(), |q| q.to_string());
    println!(
        "kube-controller-manager client QPS per controller: {kcm} (its resource-claim controller makes 2 calls per DRA pod)"
    );

    println!(
        "\ncreate to container running with its GPU env on the real kubelet ({} pods, one at a time):",
        a.kubelet_pods
    );
    for m in runs {
        println!(
            "  {:<10} p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms",
            m.route.name(),
            q_ms(&m.start, 0.5),
            q_ms(&m.start, 0.99),
            q_ms(&m.start, 1.0)
        );
    }
    if let Some(p) = runs.iter().find_map(|m| m.prepare.as_ref()) {
        println!(
            "NodePrepareResources on the DRA node, per pod ({} calls for {} pods, {} refused by the agent):",
            p.calls, a.kubelet_pods, p.errors
        );
        for (who, h) in [
            ("as the kubelet times it", &p.kubelet),
            ("in the agent", &p.agent),
        ] {
            println!(
                "  {who:<24} p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms (goal p99 <= 20 ms)",
                q_ms(h, 0.5),
                q_ms(h, 0.99),
                q_ms(h, 1.0)
            );
        }
    }

    let mut key = Vec::new();
    for m in runs {
        let n = m.route.name();
        key.push(format!("{n}_gpu_pods_per_s={:.1}", m.gpus.steady));
        key.push(format!("{n}_plain_pods_per_s={:.1}", m.plain.steady));
        key.push(format!("{n}_ratio={:.2}", m.gpus.steady / m.plain.steady));
        key.push(format!("{n}_cpu_ms_per_plain_pod={:.2}", sum(&m.plain_cpu)));
        key.push(format!("{n}_cpu_ms_per_gpu_pod={:.2}", sum(&m.gpu_cpu)));
        key.push(format!(
            "{n}_bind_rejected_pct={:.2}",
            100.0 * m.rejected / a.pods as f64
        ));
        key.push(format!(
            "{n}_kubelet_start_p50_ms={:.0}",
            q_ms(&m.start, 0.5)
        ));
        key.push(format!(
            "{n}_kubelet_start_max_ms={:.0}",
            q_ms(&m.start, 1.0)
        ));
    }
    if let Some(x) = dra_vs_extender {
        key.push(format!("dra_vs_extender={x:.2}"));
    }
    if let Some(p) = runs.iter().find_map(|m| m.prepare.as_ref()) {
        key.push(format!("prepare_p50_ms={:.1}", q_ms(&p.kubelet, 0.5)));
        key.push(format!("prepare_p99_ms={:.1}", q_ms(&p.kubelet, 0.99)));
        key.push(format!("agent_prepare_p99_ms={:.1}", q_ms(&p.agent, 0.99)));
    }
    println!("{}", key.join(" "));
}
