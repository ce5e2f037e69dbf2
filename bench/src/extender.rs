//! `gpuledger-bench extender`: filter and prioritize latency with thousands of `NodeNames`,
//! bind latency through the allocator and the (fake) API server, and pods/s end to end through
//! the scheduler emulator. Baseline: the allocator's own gRPC Filter/Score on the same nodes,
//! so the extender's HTTP + JSON cost is visible.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::EtcdCluster;
use gpuledger_testkit::kube::stack::scheduler_tls;
use gpuledger_testkit::kube::{
    ExtenderClient, ExtenderConfig, KubeStack, SchedulerEmulator, StackOptions,
};
use gpuledger_testkit::workload::inventory;
use serde_json::{Value, json};

use crate::common::{histogram, machine_reference_ms, q_ms, record, title};

/// Flags.
#[derive(clap::Args)]
pub struct Args {
    /// Nodes registered in the ledger and the API server, all sent in every filter.
    #[arg(long, default_value_t = 5000)]
    nodes: usize,
    /// GPUs per node.
    #[arg(long, default_value_t = 8)]
    gpus_per_node: u32,
    /// Filter/prioritize/bind samples (sequential).
    #[arg(long, default_value_t = 300)]
    samples: usize,
    /// Pods scheduled end to end through the scheduler emulator.
    #[arg(long, default_value_t = 2000)]
    pods: usize,
    /// Binds the scheduler emulator has in flight at once (it filters and prioritizes one pod
    /// at a time, as kube-scheduler does).
    #[arg(long, default_value_t = 32)]
    parallel: usize,
    /// kube-scheduler's percentageOfNodesToScore for the end-to-end run (0 = its adaptive
    /// default: 10% of 5,000 nodes reach the extender; 100 = all).
    #[arg(long, default_value_t = 0)]
    percentage_of_nodes_to_score: u32,
    /// etcd members.
    #[arg(long, default_value_t = 3)]
    etcd_members: usize,
    /// Placement policy of every pod (annotation `gpuledger.io/policy`; empty = the allocator's
    /// default), e.g. fgd-strand to check the cost of its look-ahead.
    #[arg(long, default_value = "")]
    policy: String,
    /// Admission webhook samples (mutate + validate of one GPU pod), ABBA between a namespace
    /// without a budget and one whose budget is spent (policy demote); 0 = skip.
    #[arg(long, default_value_t = 2000)]
    webhook_samples: usize,
}

fn gpu_pod(name: &str, scheduler: &str, policy: &str) -> Value {
    json!({"metadata": {"name": name, "namespace": "bench",
                        "annotations": {"gpuledger.io/policy": policy}},
           "spec": {"schedulerName": scheduler, "containers": [{"name": "c", "image": "x",
              "resources": {"limits": {"gpuledger.io/gpu": "1", "gpuledger.io/gpu-mem": "1000", "gpuledger.io/gpu-core": "10"},
                            "requests": {"gpuledger.io/gpu": "1", "gpuledger.io/gpu-mem": "1000", "gpuledger.io/gpu-core": "10"}}}]}})
}

fn api_pod(uid: &str, policy: &str) -> api::PodRequest {
    api::PodRequest {
        pod: Some(pb::PodRef {
            uid: uid.into(),
            namespace: "bench".into(),
            name: "probe".into(),
        }),
        containers: vec![api::ContainerRequest {
            name: "c".into(),
            slices: 1,
            mem_mib: 1000,
            mem_percent: 0,
            core_milli: 100,
        }],
        placement: Some(pb::Placement {
            policy: policy.into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Wait until the leader's seq has not moved for a second; the seq then.
async fn settle(allocs: &gpuledger_testkit::Allocators, timeout: Duration) -> Result<u64> {
    let deadline = Instant::now() + timeout;
    let (mut last, mut since) = (u64::MAX, Instant::now());
    loop {
        let seq = allocs.status(0).await.map_or(u64::MAX, |s| s.seq);
        if seq != last {
            (last, since) = (seq, Instant::now());
        } else if since.elapsed() >= Duration::from_secs(1) {
            return Ok(seq);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the ledger kept changing for {timeout:?} after setup (seq {seq})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Ledger batches (etcd transactions) whose first seq is after `seq`.
async fn log_batches_after(etcd: &EtcdCluster, seq: u64) -> Result<usize> {
    let mut kv = etcd.client().await?;
    let r = kv
        .get(
            "/",
            Some(
                etcd_client::GetOptions::new()
                    .with_from_key()
                    .with_keys_only(),
            ),
        )
        .await?;
    Ok(r.kvs()
        .iter()
        .filter_map(|kv| {
            let k = kv.key_str().ok()?;
            let (_, first) = k.rsplit_once("/log/")?;
            first.parse::<u64>().ok()
        })
        .filter(|first| *first > seq)
        .count())
}

/// Run the benchmark.
pub async fn run(a: Args) -> Result<()> {
    title(&format!(
        "extender: {} nodes x {} GPUs, {} samples, {} pods end to end ({} binds in flight)",
        a.nodes, a.gpus_per_node, a.samples, a.pods, a.parallel
    ));
    let reference_before = machine_reference_ms();
    let webhook_port = gpuledger_testkit::free_port()?;
    let mut stack = KubeStack::start(StackOptions {
        etcd_members: a.etcd_members,
        allocators: 1,
        allocator_flags: vec![],
        // Latency, not admission: filter and prioritize back to back, unpaced.
        extender_flags: Some(vec![
            format!("--webhook-listen=127.0.0.1:{webhook_port}"),
            "--scheduling-calls-per-s=0".into(),
        ]),
    })
    .await?;
    let names: Vec<String> = (0..a.nodes).map(|i| format!("node-{i:05}")).collect();
    let t = Instant::now();
    let allocs = &stack.allocs;
    let regs = futures::stream::iter(names.iter().cloned().map(|n| {
        let gpus = a.gpus_per_node;
        async move {
            // As the node's agent registers it.
            let mut c = allocs.node_agent(0, &n)?;
            c.register_node(api::RegisterNodeRequest {
                inventory: Some(inventory(&n, gpus, 24_000, "NVIDIA A10")),
            })
            .await?;
            anyhow::Ok(())
        }
    }))
    .buffer_unordered(64)
    .collect::<Vec<_>>()
    .await;
    for r in regs {
        r.context("registering nodes")?;
    }
    for n in &names {
        stack.api.add_node(n, 64 * a.gpus_per_node)?;
    }
    println!(
        "setup: {} nodes registered in {:.1} s",
        a.nodes,
        t.elapsed().as_secs_f64()
    );
    // The allocator now copies each node's allocatable CPU and memory from the API server
    // into the ledger; measure after that, not while it runs.
    let t = Instant::now();
    let seq = settle(&stack.allocs, Duration::from_secs(120)).await?;
    println!(
        "setup: ledger settled at seq {seq} in {:.1} s (node CPU and memory from the API server)",
        t.elapsed().as_secs_f64()
    );

    let webhook = if a.webhook_samples > 0 {
        Some(webhook_budgets(&stack, &names[0], webhook_port, a.webhook_samples).await?)
    } else {
        None
    };

    let ext = ExtenderClient::new(stack.extender_config()?)?;
    let probe = stack.api.add_pod(gpu_pod("probe", "nobody", &a.policy))?;
    let uid = probe["metadata"]["uid"].as_str().unwrap_or("").to_string();
    let body = json!({"Pod": probe, "Nodes": null, "NodeNames": names});
    let body_bytes = serde_json::to_vec(&body)?;

    // Warm up connections and caches, both verbs: the first prioritize answers (~180 KB each)
    // came from freshly mapped memory until glibc's mmap threshold adapted, 5-7 ms each.
    for _ in 0..10 {
        ext.post_raw("filter", body_bytes.clone()).await?;
        ext.post_raw("prioritize", body_bytes.clone()).await?;
    }
    println!(
        "measuring: {} x filter + prioritize with {} NodeNames",
        a.samples, a.nodes
    );
    let (mut hf, mut hp, mut gf, mut gs) = (histogram(), histogram(), histogram(), histogram());
    let mut feasible = 0;
    for _ in 0..a.samples {
        let t = Instant::now();
        let (st, b) = ext.post_raw("filter", body_bytes.clone()).await?;
        record(&mut hf, t.elapsed());
        anyhow::ensure!(st == 200, "filter HTTP {st}");
        let v: Value = serde_json::from_slice(&b)?;
        anyhow::ensure!(v["Error"] == "", "filter error: {v}");
        feasible = v["NodeNames"].as_array().map_or(0, Vec::len);
        let t = Instant::now();
        let (st, _) = ext.post_raw("prioritize", body_bytes.clone()).await?;
        record(&mut hp, t.elapsed());
        anyhow::ensure!(st == 200, "prioritize HTTP {st}");
    }
    anyhow::ensure!(
        feasible == a.nodes,
        "only {feasible} of {} nodes feasible",
        a.nodes
    );
    // Baseline: the allocator's gRPC API alone, called as the extender calls it.
    let mut c = stack.allocs.extender(0)?;
    for _ in 0..a.samples {
        let t = Instant::now();
        c.filter(api::FilterRequest {
            request: Some(api_pod(&uid, &a.policy)),
            nodes: names.clone(),
        })
        .await?;
        record(&mut gf, t.elapsed());
        let t = Instant::now();
        c.score(api::ScoreRequest {
            request: Some(api_pod(&uid, &a.policy)),
            nodes: names.clone(),
        })
        .await?;
        record(&mut gs, t.elapsed());
    }

    // Bind, one at a time: Reserve + annotate + Binding + ConfirmBound.
    println!("measuring: {} binds, one at a time", a.samples);
    let mut hb = histogram();
    for i in 0..a.samples {
        let name = format!("seq-{i}");
        // A gpuledger scheduler's pod: the allocator reserves only for those.
        let p = stack
            .api
            .add_pod(gpu_pod(&name, "gpuledger-scheduler", &a.policy))?;
        let b = json!({"PodName": name, "PodNamespace": "bench",
                       "PodUID": p["metadata"]["uid"], "Node": names[i % names.len()]});
        let t = Instant::now();
        let r = ext.post("bind", &b).await?;
        record(&mut hb, t.elapsed());
        anyhow::ensure!(r["Error"] == "", "bind error: {r}");
    }

    // End to end through the scheduler emulator.
    for i in 0..a.pods {
        stack.api.add_pod(gpu_pod(
            &format!("e2e-{i}"),
            "gpuledger-scheduler",
            &a.policy,
        ))?;
    }
    println!(
        "measuring: {} pods end to end through the scheduler emulator",
        a.pods
    );
    let seq_before = settle(&stack.allocs, Duration::from_secs(30)).await?;
    let t = Instant::now();
    let mut cfg = stack.extender_config()?;
    cfg.percentage_of_nodes_to_score = a.percentage_of_nodes_to_score;
    let window = gpuledger_testkit::kube::scheduler::num_feasible_nodes_to_find(
        a.nodes,
        a.percentage_of_nodes_to_score,
    );
    let sched = SchedulerEmulator::start(
        stack.api.client().await?,
        "gpuledger-scheduler",
        cfg,
        a.parallel,
        Duration::from_millis(100),
    )?;
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let bound = sched.stats.bound.load(std::sync::atomic::Ordering::Relaxed) as usize;
        if bound >= a.pods {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "only {bound}/{} pods bound in 600 s",
            a.pods
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let e2e = t.elapsed();
    let pods_per_s = a.pods as f64 / e2e.as_secs_f64();
    let failed = sched
        .stats
        .failed
        .load(std::sync::atomic::Ordering::Relaxed);
    let mut eb = histogram();
    for us in sched
        .stats
        .bind_us
        .lock()
        .map(|v| v.clone())
        .unwrap_or_default()
    {
        record(&mut eb, Duration::from_micros(us));
    }
    let mut ef = histogram();
    for us in sched
        .stats
        .filter_us
        .lock()
        .map(|v| v.clone())
        .unwrap_or_default()
    {
        record(&mut ef, Duration::from_micros(us));
    }
    drop(sched);
    let seq_after = settle(&stack.allocs, Duration::from_secs(30)).await?;
    let txns = log_batches_after(stack.etcd(), seq_before).await?;

    println!(
        "\n{:<44} {:>9} {:>9} {:>9}",
        "what", "p50 ms", "p99 ms", "max ms"
    );
    let row = |what: &str, h: &hdrhistogram::Histogram<u64>| {
        println!(
            "{what:<44} {:>9.2} {:>9.2} {:>9.2}",
            q_ms(h, 0.5),
            q_ms(h, 0.99),
            q_ms(h, 1.0)
        );
    };
    row(&format!("extender filter ({} NodeNames)", a.nodes), &hf);
    row("extender prioritize", &hp);
    row("baseline: allocator gRPC Filter", &gf);
    row("baseline: allocator gRPC Score", &gs);
    row("extender bind (sequential)", &hb);
    if let Some((free, spent)) = &webhook {
        row("webhook mutate+validate, no budget", free);
        row("webhook mutate+validate, budget spent", spent);
    }
    row(
        &format!(
            "extender filter in the e2e run ({} binds in flight)",
            a.parallel
        ),
        &ef,
    );
    row(
        &format!("extender bind in the e2e run ({} in flight)", a.parallel),
        &eb,
    );
    println!(
        "end to end: {} pods bound in {:.2} s through the scheduler emulator, {window} nodes per \
         filter ({failed} retried attempts)",
        a.pods,
        e2e.as_secs_f64()
    );
    println!(
        "ledger during the e2e run: {} events ({:.1} per pod) in {txns} etcd transactions",
        seq_after - seq_before,
        (seq_after - seq_before) as f64 / a.pods as f64
    );
    println!(
        "machine reference loop: {reference_before:.0} ms before, {:.0} ms after (lower is faster)",
        machine_reference_ms()
    );
    let webhook_keys = webhook.map_or(String::new(), |(free, spent)| {
        format!(
            " webhook_p99_ms={:.3} webhook_budget_spent_p99_ms={:.3}",
            q_ms(&free, 0.99),
            q_ms(&spent, 0.99)
        )
    });
    println!(
        "filter_p99_ms={:.2} prioritize_p99_ms={:.2} bind_p99_ms={:.2} pods_per_s={:.0}{webhook_keys}",
        q_ms(&hf, 0.99),
        q_ms(&hp, 0.99),
        q_ms(&hb, 0.99),
        pods_per_s
    );
    Ok(())
}

/// Admission latency without a budget and with a spent one (the budget lookup on the
/// extender's replica, the reason, the demotion patch), ABBA in one run: `samples` pods of
/// each, mutate + validate each, through one kept-alive HTTPS connection as the API server
/// keeps one. Returns (no budget, budget spent).
async fn webhook_budgets(
    stack: &KubeStack,
    node: &str,
    port: u16,
    samples: usize,
) -> Result<(hdrhistogram::Histogram<u64>, hdrhistogram::Histogram<u64>)> {
    let (free, spent) = ("bench-free", "bench-spent");
    stack
        .demote_budget(spent, "gpu-low", "gpuledger-bench")
        .await?;
    // 20,000 MiB held spends 1 MiB-hour in 180 ms.
    let mut req = api_pod("", "");
    req.containers[0].mem_mib = 20_000;
    // The allocator reserves only what the pod itself asks for.
    let hog = stack
        .api
        .add_pod(json!({"metadata": {"name": "hog", "namespace": spent},
        "spec": gpuledger_testkit::workload::pod_spec(&req, "gpuledger-scheduler")}))?;
    if let Some(p) = req.pod.as_mut() {
        (p.namespace, p.name) = (spent.into(), "hog".into());
        p.uid = hog["metadata"]["uid"].as_str().unwrap_or("").into();
    }
    let mut c = stack.allocs.extender(0)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        // The allocator reserves only for a pod its watch has seen.
        match c
            .reserve(api::ReserveRequest {
                request: Some(req.clone()),
                node: node.into(),
                ttl_ms: 0,
            })
            .await
        {
            Ok(_) => break,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(s) => anyhow::bail!("reserving the budget's hog: {}", s.message()),
        }
    }
    let hook = ExtenderClient::new(ExtenderConfig::gpuledger(
        &format!("https://127.0.0.1:{port}"),
        Some(scheduler_tls(&stack.ids.pki)?),
    ))?;
    let review = |ns: &str, op: &str| -> Result<Vec<u8>> {
        Ok(serde_json::to_vec(
            &json!({"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1",
            "request": {"uid": format!("{op}-{ns}"), "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"}, "namespace": ns,
                "operation": "CREATE", "userInfo": {"username": "system:admin"},
                "object": {"metadata": {"name": "w", "namespace": ns}, "spec": {"containers": [{"name": "c", "image": "x",
                    "resources": {"limits": {"gpuledger.io/gpu": "1", "gpuledger.io/gpu-mem": "1000"}}}]}}}}),
        )?)
    };
    let bodies = [free, spent]
        .map(|ns| Ok::<_, anyhow::Error>((review(ns, "mutate")?, review(ns, "validate")?)));
    let [Ok(free_b), Ok(spent_b)] = bodies else {
        anyhow::bail!("admission reviews do not serialize");
    };
    let admit = async |b: &(Vec<u8>, Vec<u8>)| -> Result<(Duration, Value)> {
        let t = Instant::now();
        let (s1, m) = hook.post_raw("mutate", b.0.clone()).await?;
        let (s2, _) = hook.post_raw("validate", b.1.clone()).await?;
        let took = t.elapsed();
        anyhow::ensure!(s1 == 200 && s2 == 200, "webhook answered {s1}/{s2}");
        Ok((took, serde_json::from_slice(&m)?))
    };
    // Until the extender's replica has the spent budget: its answer carries the demotion.
    let deadline = Instant::now() + Duration::from_secs(30);
    while admit(&spent_b).await?.1["response"]["warnings"].is_null() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the budget never showed as spent"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for _ in 0..200 {
        admit(&free_b).await?;
        admit(&spent_b).await?;
    }
    println!(
        "measuring: webhook, {samples} pods without a budget and {samples} with a spent one (ABBA)"
    );
    let (mut hf, mut hs) = (histogram(), histogram());
    let quarter = samples.div_ceil(2);
    for spent_turn in [false, true, true, false] {
        for _ in 0..quarter {
            let (took, m) = admit(if spent_turn { &spent_b } else { &free_b }).await?;
            anyhow::ensure!(
                m["response"]["warnings"].is_null() != spent_turn,
                "the wrong verdict: {m}"
            );
            record(if spent_turn { &mut hs } else { &mut hf }, took);
        }
    }
    Ok((hf, hs))
}
