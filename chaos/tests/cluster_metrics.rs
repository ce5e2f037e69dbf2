//! Pods run through the whole local cluster (etcd ×3, allocators ×3, extenders ×2, the
//! scheduler emulator, 2 nodes with kubelet emulator + fake NVML + node agent), and every
//! binary's `/metrics`, `/healthz` and `/readyz` say so: the allocators' ledger seq rises, the
//! extenders count the binds, the agents time their Allocate calls and report the memory the
//! fake NVML measures for the running pods, then none once the pods are done.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use gpuledger_testkit::cluster::{ClusterOptions, LocalCluster, RunOutcome, metric, pod_json};
use gpuledger_testkit::http::get;
use serde_json::json;

const MIB: f64 = 1_048_576.0;

async fn scrape(base: &str) -> Result<String> {
    let (code, text) = get(&format!("{base}/metrics")).await?;
    ensure!(code == 200, "{base}/metrics answered {code}: {text}");
    Ok(text)
}

/// Sum of every series of `name` whose labels contain `labels` (e.g. `verb="bind"`).
fn sum(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|l| labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn probes(base: &str) -> Result<()> {
    for p in ["/healthz", "/readyz"] {
        let (code, body) = get(&format!("{base}{p}")).await?;
        ensure!(code == 200, "{base}{p} answered {code}: {body}");
    }
    Ok(())
}

async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut f: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<String>>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let why = f().await?;
        let Some(why) = why else { return Ok(()) };
        ensure!(
            Instant::now() < deadline,
            "{what} within {timeout:?}: {why}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_binary_exports_metrics_that_follow_the_pods() -> Result<()> {
    let mut c = LocalCluster::start(ClusterOptions {
        nodes: 2,
        gpus: 2,
        ..Default::default()
    })
    .await?;
    let alloc_urls: Vec<String> = c
        .allocs
        .http
        .iter()
        .map(|a| format!("http://{a}"))
        .collect();
    let ext_urls: Vec<String> = (0..c.extenders.len()).map(|i| c.extender_http(i)).collect();
    let agent_urls: Vec<String> = c.nodes.iter().map(|n| n.health_url()).collect();
    for u in alloc_urls.iter().chain(&ext_urls).chain(&agent_urls) {
        probes(u).await?;
    }
    let mut seq0 = Vec::new();
    for u in &alloc_urls {
        let t = scrape(u).await?;
        seq0.push(metric(&t, "gpuledger_allocator_ledger_seq").context("no ledger_seq")?);
    }
    for u in &ext_urls {
        let t = scrape(u).await?;
        assert_eq!(
            sum(&t, "gpuledger_extender_requests_total", &[r#"verb="bind""#]),
            0.0,
            "{t}"
        );
    }

    // Four pods that run for a while: canonical names, a HAMi alias (as admitted by the
    // webhook, which adds the slice count), and a two-GPU pod; each container uses half of
    // its limit as NVML sees it.
    let pods = [
        ("m-a", vec![("gpuledger.io/gpu-mem", "4000".to_string())]),
        (
            "m-b",
            vec![
                ("gpuledger.io/gpu-mem", "6000".to_string()),
                ("gpuledger.io/gpu-core", "30".to_string()),
            ],
        ),
        (
            "m-hami",
            vec![
                ("nvidia.com/gpumem", "3000".to_string()),
                ("gpuledger.io/gpu", "1".to_string()),
            ],
        ),
        (
            "m-two",
            vec![
                ("gpuledger.io/gpu", "2".to_string()),
                ("gpuledger.io/gpu-mem", "2000".to_string()),
            ],
        ),
    ];
    let want_used_mib: u64 = 2000 + 3000 + 1500 + 2 * 1000;
    for (name, res) in &pods {
        let mut p = pod_json(name, res, 12.0);
        p["metadata"]["annotations"] = json!({"chaos.gpuledger.io/gpu-mem-used-percent": "50"});
        c.add_pod(p)?;
    }
    wait_for("every pod Running", Duration::from_secs(30), || async {
        let not: Vec<String> = pods
            .iter()
            .filter(|(n, _)| {
                c.api
                    .pod("default", n)
                    .is_none_or(|p| p["status"]["phase"] != "Running")
            })
            .map(|(n, _)| n.to_string())
            .collect();
        Ok((!not.is_empty()).then(|| {
            format!(
                "not running: {not:?}; scheduler errors: {:?}",
                c.scheduler.stats.last_error.lock().map(|m| m.clone())
            )
        }))
    })
    .await?;

    // Node agents: the fake NVML memory of the running pods, per GPU and in all; one
    // successful Allocate per pod; the allocations the ledger holds on the node.
    wait_for(
        "agents report the NVML memory of the pods",
        Duration::from_secs(10),
        || async {
            let mut total = 0.0;
            let mut why = Vec::new();
            for n in &c.nodes {
                let t = scrape(&n.health_url()).await?;
                let nv = n.nvml.lock().map(|x| x.clone()).expect("nvml lock");
                for g in &nv.gpus {
                    let expect: u64 = nv
                        .processes
                        .iter()
                        .filter(|p| p.2 == g.uuid)
                        .map(|p| p.1)
                        .sum();
                    let series = format!(
                        "gpuledger_node_agent_gpu_memory_used_bytes{{gpu=\"{}\"}}",
                        g.uuid
                    );
                    let got = metric(&t, &series).unwrap_or(-1.0);
                    if got != expect as f64 * MIB {
                        why.push(format!("{series} = {got}, NVML has {expect} MiB"));
                    }
                    total += got.max(0.0);
                }
            }
            if total != want_used_mib as f64 * MIB {
                why.push(format!(
                    "{} MiB in use in all, want {want_used_mib}",
                    total / MIB
                ));
            }
            Ok((!why.is_empty()).then(|| why.join("; ")))
        },
    )
    .await?;
    let mut allocates = 0.0;
    let mut agent_allocs = 0.0;
    for u in &agent_urls {
        let t = scrape(u).await?;
        allocates += sum(
            &t,
            "gpuledger_node_agent_allocate_duration_seconds_count",
            &[r#"outcome="ok""#],
        );
        agent_allocs += metric(&t, "gpuledger_node_agent_allocations").unwrap_or(0.0);
        assert_eq!(
            metric(&t, "gpuledger_node_agent_kubelet_registered"),
            Some(1.0),
            "{t}"
        );
    }
    assert_eq!(allocates, pods.len() as f64, "one Allocate per pod");
    assert_eq!(
        agent_allocs,
        pods.len() as f64,
        "allocations held by agents"
    );
    let views = c.check_agent_views(Duration::from_secs(5)).await;
    for v in &views {
        assert!(v.agree, "{}: agent and ledger differ: {}", v.node, v.detail);
    }

    // Extenders: every pod bound once, by either replica; the scheduler alternated.
    let mut binds = Vec::new();
    for u in &ext_urls {
        let t = scrape(u).await?;
        binds.push(sum(
            &t,
            "gpuledger_extender_requests_total",
            &[r#"verb="bind""#, r#"outcome="ok""#],
        ));
        assert!(
            t.contains(r#"gpuledger_extender_request_duration_seconds_count{verb="filter"}"#),
            "{t}"
        );
    }
    assert_eq!(binds.iter().sum::<f64>(), pods.len() as f64, "{binds:?}");
    assert!(
        binds.iter().all(|b| *b >= 1.0),
        "both extenders bind: {binds:?}"
    );

    // Allocators: every replica folded the new events; exactly one leads.
    let mut leaders = 0.0;
    let mut seq1 = Vec::new();
    for (u, s0) in alloc_urls.iter().zip(&seq0) {
        let t = scrape(u).await?;
        let s = metric(&t, "gpuledger_allocator_ledger_seq").unwrap_or(0.0);
        // Reserved and Assigned per pod at least; Bound too unless the pod was assigned
        // before the extender's confirmation arrived (then that confirmation writes nothing).
        assert!(s >= s0 + 2.0 * pods.len() as f64, "{u}: seq {s0} -> {s}");
        leaders += metric(&t, "gpuledger_allocator_is_leader").unwrap_or(0.0);
        seq1.push(s);
    }
    assert_eq!(leaders, 1.0);

    // The pods finish: allocations released, no memory in use, seq moved on.
    wait_for("every pod Succeeded", Duration::from_secs(30), || async {
        let left: Vec<String> = pods
            .iter()
            .filter_map(|(n, _)| {
                let phase = c.api.pod("default", n)?["status"]["phase"].clone();
                (phase != "Succeeded").then(|| format!("{n}: {phase}"))
            })
            .collect();
        Ok((!left.is_empty()).then(|| left.join(", ")))
    })
    .await?;
    assert!(
        c.runs
            .all()
            .iter()
            .all(|r| r.outcome == RunOutcome::Succeeded),
        "{:?}",
        c.runs.all()
    );
    wait_for(
        "the ledger and the agents are empty",
        Duration::from_secs(20),
        || async {
            let mut why = Vec::new();
            for n in &c.nodes {
                let t = scrape(&n.health_url()).await?;
                let used = sum(&t, "gpuledger_node_agent_gpu_memory_used_bytes", &[]);
                let allocs = metric(&t, "gpuledger_node_agent_allocations");
                if used != 0.0 || allocs != Some(0.0) {
                    why.push(format!("{}: used {used} B, allocations {allocs:?}", n.name));
                }
            }
            let live = c.dump().await?.allocations.len();
            if live != 0 {
                why.push(format!("ledger: {live} allocations"));
            }
            Ok((!why.is_empty()).then(|| why.join("; ")))
        },
    )
    .await?;
    for (u, s1) in alloc_urls.iter().zip(&seq1) {
        let t = scrape(u).await?;
        let s = metric(&t, "gpuledger_allocator_ledger_seq").unwrap_or(0.0);
        assert!(
            s >= s1 + pods.len() as f64,
            "{u}: releases not folded ({s1} -> {s})"
        );
        let released = sum(
            &t,
            "gpuledger_allocator_events_total",
            &[r#"type="released""#],
        );
        assert!(released >= pods.len() as f64, "{u}:\n{t}");
        probes(u).await?;
    }
    for u in ext_urls.iter().chain(&agent_urls) {
        probes(u).await?;
    }
    c.check_processes()?;
    Ok(())
}
