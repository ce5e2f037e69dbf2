//! `gpuledger-bench e2e`: the real kube-scheduler (the shipped configuration) placing
//! GPU pods through the extender on kubelet-less nodes, against the same scheduler placing
//! plain CPU pods on the same nodes in the same run; then the time from creating a GPU pod to
//! its container running with its GPU environment on a real kubelet. Needs root (containerd,
//! the kubelet) and the Kubernetes binaries of `e2e/kube/build.sh` (docs/e2e.md).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use futures::{StreamExt, TryStreamExt};
use gpuledger_e2e::cluster::REAL_NODE;
use gpuledger_e2e::gpuledger::counter;
use gpuledger_e2e::nodes::NodeShape;
use gpuledger_e2e::pods;
use gpuledger_e2e::real_node::{CDI_ENV, host_network};
use gpuledger_e2e::{E2e, Options, until};
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::watcher;
use serde_json::{Value, json};

use crate::common::{cpu_seconds, histogram, processes, q_ms, record, title};

/// Flags of `gpuledger-bench e2e`.
#[derive(clap::Args)]
pub struct Args {
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
    /// GPU pods started one after the other on the real kubelet.
    #[arg(long, default_value_t = 10)]
    kubelet_pods: usize,
    /// kube-scheduler's client QPS (binds of plain pods are API calls of the scheduler's own;
    /// GPU pods are bound by the extender). Default: the shipped configuration's (50).
    #[arg(long)]
    scheduler_qps: Option<u32>,
}

/// How one batch of pods went through the scheduler.
struct Batch {
    /// First create to last bound.
    total: Duration,
    /// Pods/s between the 5th and the 95th percentile of bindings.
    steady: f64,
}

/// Only the kubelet-less nodes (the real node runs what is placed there).
fn on_kubelet_less(mut p: Value) -> Value {
    p["spec"]["nodeSelector"] = json!({"gpuledger.io/e2e": "kubelet-less"});
    p
}

/// CPU seconds used so far by this process ("bench") and each of its descendants, summed by
/// the name the kernel gives them (`comm`: kube-apiserver, etcd, gpuledger-alloc, …).
fn cpu_by_process() -> BTreeMap<String, f64> {
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
fn cpu_per_pod(
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
async fn schedule(e: &E2e, ns: &str, specs: Vec<Value>, parallel: usize) -> Result<Batch> {
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
        async move { pods::create(&c, ns, &p).await }
    }))
    .buffer_unordered(parallel)
    .collect::<Vec<_>>()
    .await;
    for c in created {
        c?;
    }
    let bound = tokio::time::timeout(Duration::from_secs(1800), watch)
        .await
        .context("pods not bound within 30 min")???;
    ensure!(bound.len() == n, "{} of {n} pods bound", bound.len());
    let mut at: Vec<Duration> = bound.values().map(|t| t.duration_since(t0)).collect();
    at.sort_unstable();
    let (lo, hi) = (at[n / 20], at[n * 19 / 20]);
    let steady = (n * 9 / 10) as f64 / (hi - lo).as_secs_f64().max(1e-3);
    Ok(Batch {
        total: at[n - 1],
        steady,
    })
}

/// Run the benchmark.
pub async fn run(a: Args) -> Result<()> {
    let version = gpuledger_e2e::bins::KubeBins::get()?.version()?;
    title(&format!(
        "e2e: kube-apiserver + kube-scheduler {}, {} kubelet-less nodes x {} GPUs, {} GPU pods and {} CPU pods; a real kubelet",
        version, a.nodes, a.gpus_per_node, a.pods, a.pods
    ));
    let e = E2e::start(Options {
        real_node: true,
        scheduler_qps: a.scheduler_qps,
        ..Options::default()
    })
    .await?;
    let names: Vec<String> = (0..a.nodes).map(|i| format!("node-{i:05}")).collect();
    let shape = NodeShape {
        gpus: a.gpus_per_node,
        pods: 110,
        ..NodeShape::default()
    };
    let t = Instant::now();
    e.add_nodes(&names, &shape).await?;
    println!(
        "{} nodes created and registered in {:.1} s",
        a.nodes,
        t.elapsed().as_secs_f64()
    );
    e.namespace("bench").await?;

    let cpu: Vec<Value> = (0..a.pods)
        .map(|i| on_kubelet_less(pods::pod(&format!("cpu-{i}"), &[("cpu", "100m")], None)))
        .collect();
    let cpu0 = cpu_by_process();
    let plain = schedule(&e, "bench", cpu, a.parallel).await?;
    let cpu1 = cpu_by_process();
    let before = e.gl.extender_metrics().await?;
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
    let verbs = format!(
        "extender mean answer: filter {:.1} ms, prioritize {:.1} ms, bind {:.1} ms",
        mean_ms("filter"),
        mean_ms("prioritize"),
        mean_ms("bind")
    );

    title(&format!(
        "create to running with its GPU env on the real kubelet ({} pods)",
        a.kubelet_pods
    ));
    let mut h = histogram();
    for i in 0..a.kubelet_pods {
        let mut p = host_network(pods::pod(
            &format!("run-{i}"),
            &[("gpuledger.io/gpu-mem", "1024")],
            Some(&["sh", "-c", "env; sleep 3600"]),
        ));
        p["spec"]["nodeSelector"] = json!({"kubernetes.io/hostname": REAL_NODE});
        let t = Instant::now();
        let uid = pods::create(&e.client, "bench", &p)
            .await?
            .metadata
            .uid
            .unwrap_or_default();
        let name = format!("run-{i}");
        let node = e.node.as_ref().context("no real node")?;
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
        record(&mut h, t.elapsed());
    }

    let ratio = gpus.steady / plain.steady;
    let rejected_pct = 100.0 * rejected / a.pods as f64;
    println!(
        "\n{:<44} {:>10} {:>12} {:>14}",
        format!("pods through kube-scheduler {version}"),
        "pods",
        "total s",
        "steady pods/s"
    );
    println!(
        "{:<44} {:>10} {:>12.1} {:>14.1}",
        "plain CPU pods (no extender)",
        a.pods,
        plain.total.as_secs_f64(),
        plain.steady
    );
    println!(
        "{:<44} {:>10} {:>12.1} {:>14.1}",
        "GPU pods (filter, prioritize, bind: extender)",
        a.pods,
        gpus.total.as_secs_f64(),
        gpus.steady
    );
    println!("{verbs}");
    // The cost model: on a machine whose cores every process shares, pods/s is bounded by
    // the cores divided by the CPU one pod costs the whole cluster.
    let (plain_cpu, gpu_cpu) = (
        cpu_per_pod(&cpu0, &cpu1, a.pods),
        cpu_per_pod(&cpu1, &cpu2, a.pods),
    );
    println!("\nCPU ms per pod, by process        plain      GPU");
    let names: std::collections::BTreeSet<&String> =
        plain_cpu.keys().chain(gpu_cpu.keys()).collect();
    for n in names {
        println!(
            "  {:<28} {:>8.2} {:>8.2}",
            n,
            plain_cpu.get(n).copied().unwrap_or(0.0),
            gpu_cpu.get(n).copied().unwrap_or(0.0)
        );
    }
    let (pt, gt): (f64, f64) = (plain_cpu.values().sum(), gpu_cpu.values().sum());
    println!("  {:<28} {:>8.2} {:>8.2}", "all", pt, gt);
    let qps = a
        .scheduler_qps
        .map_or("50, the default".to_string(), |q| q.to_string());
    println!(
        "kube-scheduler client QPS: {qps} (it bounds the plain pods' binds, not the extender's)"
    );
    println!(
        "GPU/plain = {ratio:.2} (goal >= 0.80); bind calls {binds:.0}, rejected {rejected:.0} = {rejected_pct:.2} % of pods (goal <= 1 %)"
    );
    println!(
        "create to container running with its GPU env: p50 {:.0} ms, max {:.0} ms",
        q_ms(&h, 0.5),
        q_ms(&h, 1.0)
    );
    println!(
        "gpu_pods_per_s={:.1} plain_pods_per_s={:.1} ratio={ratio:.2} bind_rejected_pct={rejected_pct:.2} kubelet_start_p50_ms={:.0} kubelet_start_max_ms={:.0} cpu_ms_per_plain_pod={pt:.2} cpu_ms_per_gpu_pod={gt:.2}",
        gpus.steady,
        plain.steady,
        q_ms(&h, 0.5),
        q_ms(&h, 1.0)
    );
    Ok(())
}
