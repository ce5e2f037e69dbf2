//! What a caller of the extender's verbs can make it do with requests that are well-formed but
//! hostile or impossible: `/bind` of another scheduler's pod is refused and binds nothing; a pod
//! with more than 64 GPU containers is refused by filter (every node, with the reason) and by
//! the webhook, instead of passing filter and failing Reserve forever; the webhook refuses sizes
//! no node can ever hold and absurd quantities instead of saturating them; filter calls past
//! the scheduling rate (a copy of the scheduler's certificate in a loop) wait their turn, and
//! binds beside them are not held up.

use crate::kit;

use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::free_port;
use gpuledger_testkit::kube::{KubeStack, StackOptions};
use gpuledger_testkit::workload::inventory;
use serde_json::{Value, json};

async fn stack(port: u16) -> anyhow::Result<KubeStack> {
    stack_with(port, &[]).await
}

async fn stack_with(port: u16, flags: &[&str]) -> anyhow::Result<KubeStack> {
    let mut extender_flags = vec![
        kit::webhook_flag(port),
        "--scheduler-name=gpuledger-scheduler".into(),
    ];
    extender_flags.extend(flags.iter().map(|f| f.to_string()));
    let stack = KubeStack::start(StackOptions {
        allocators: 1,
        extender_flags: Some(extender_flags),
        ..Default::default()
    })
    .await?;
    gpuledger_testkit::kube::stack::wait_http(port, std::time::Duration::from_secs(10)).await?;
    stack
        .allocs
        .node_agent(0, "n1")?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(inventory("n1", 2, 24_000, "NVIDIA A10")),
        })
        .await?;
    stack.api.add_node("n1", 128)?;
    Ok(stack)
}

fn gpu_pod(name: &str, scheduler: &str, containers: usize, mem: &str) -> Value {
    let cs: Vec<Value> = (0..containers)
        .map(|i| {
            json!({"name": format!("c{i}"), "image": "x",
                   "resources": {"limits": {"gpuledger.io/gpu-mem": mem}}})
        })
        .collect();
    json!({"metadata": {"name": name, "namespace": "default"},
           "spec": {"schedulerName": scheduler, "containers": cs}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bind_refuses_other_schedulers_pods_and_impossible_pods_are_refused_early()
-> anyhow::Result<()> {
    let port = free_port()?;
    let stack = stack(port).await?;
    let ext = kit::extender(&stack)?;
    let seq = stack.allocs.status(0).await.map(|s| s.seq);

    // Another scheduler's pod, bound through gpuledger's extender by whoever reaches it.
    let theirs = stack
        .api
        .add_pod(gpu_pod("theirs", "some-other-scheduler", 1, "1000"))?;
    let r = ext
        .post_raw(
            "bind",
            serde_json::to_vec(&json!({"PodName": "theirs", "PodNamespace": "default",
                "PodUID": theirs["metadata"]["uid"], "Node": "n1"}))?,
        )
        .await?;
    let text = String::from_utf8_lossy(&r.1);
    assert!(
        text.contains("not by a gpuledger scheduler"),
        "bind of another scheduler's pod: HTTP {} {text}",
        r.0
    );
    let pod = stack
        .api
        .store
        .get("v1", "pods", "default", "theirs")
        .map_err(|e| anyhow::anyhow!("{}", e.message()))?;
    assert_eq!(
        pod["spec"]["nodeName"].as_str(),
        None,
        "the pod was bound: {pod}"
    );
    assert_eq!(
        stack.allocs.status(0).await.map(|s| s.seq),
        seq,
        "the refused bind wrote to the ledger"
    );

    // 65 GPU containers: filter refuses every node, saying why (it used to pass filter and
    // then fail Reserve forever).
    let many = gpu_pod("many", "gpuledger-scheduler", 65, "10");
    let args = json!({"Pod": many, "Nodes": null, "NodeNames": ["n1"]});
    let f = ext.post("filter", &args).await?;
    let why = f["FailedAndUnresolvableNodes"]["n1"].as_str().unwrap_or("");
    assert!(why.contains("at most 64"), "filter of 65 containers: {f}");
    assert_eq!(f["NodeNames"], json!([]), "{f}");
    let hook = kit::webhook_client(&stack, port)?;
    let refused = kit::admit(&hook, gpu_pod("many", "gpuledger-scheduler", 65, "10")).await?;
    assert!(
        refused.as_ref().is_err_and(|m| m.contains("at most 64")),
        "{refused:?}"
    );

    // Sizes no node can ever hold, and absurd quantities, are refused at admission.
    let huge = kit::admit(&hook, gpu_pod("huge", "gpuledger-scheduler", 1, "100000")).await?;
    assert!(
        huge.as_ref()
            .is_err_and(|m| m.contains("can ever hold") && m.contains("24000 MiB")),
        "{huge:?}"
    );
    let absurd = kit::admit(&hook, gpu_pod("absurd", "gpuledger-scheduler", 1, "1e30")).await?;
    assert!(
        absurd
            .as_ref()
            .is_err_and(|m| m.contains("no GPU has more than")),
        "{absurd:?}"
    );
    // What fits is admitted.
    kit::admit(&hook, gpu_pod("fine", "gpuledger-scheduler", 1, "8000"))
        .await?
        .map_err(anyhow::Error::msg)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filters_past_the_scheduling_rate_wait_their_turn_and_binds_go_on() -> anyhow::Result<()> {
    let port = free_port()?;
    let stack = stack_with(
        port,
        &["--scheduling-calls-per-s=20", "--scheduling-call-burst=20"],
    )
    .await?;
    let ext = kit::extender(&stack)?;
    let secs = 3.0;
    let until = std::time::Instant::now() + std::time::Duration::from_secs_f64(secs);
    // Four loops of filters for pods that never bind, as fast as answers come.
    let mut floods = tokio::task::JoinSet::new();
    for w in 0..4 {
        let ext = ext.clone();
        floods.spawn(async move {
            let (mut answered, mut refused) = (0u32, 0u32);
            let mut i = 0;
            while std::time::Instant::now() < until {
                i += 1;
                let mut pod = gpu_pod(&format!("ghost-{w}-{i}"), "gpuledger-scheduler", 1, "100");
                pod["metadata"]["uid"] = json!(format!("ghost-{w}-{i}"));
                let args = json!({"Pod": pod, "Nodes": null, "NodeNames": ["n1"]});
                match ext.post_raw("filter", serde_json::to_vec(&args)?).await?.0 {
                    200 => answered += 1,
                    429 => refused += 1,
                    s => anyhow::bail!("filter answered HTTP {s}"),
                }
            }
            Ok((answered, refused))
        });
    }
    // Meanwhile a real pod binds.
    let pod = stack
        .api
        .add_pod(gpu_pod("real", "gpuledger-scheduler", 1, "1000"))?;
    let t0 = std::time::Instant::now();
    let bound = ext
        .post(
            "bind",
            &json!({"PodName": "real", "PodNamespace": "default",
                    "PodUID": pod["metadata"]["uid"], "Node": "n1"}),
        )
        .await?;
    let bind_took = t0.elapsed();
    let (mut answered, mut refused) = (0, 0);
    for r in floods.join_all().await {
        let (a, f) = r?;
        answered += a;
        refused += f;
    }
    assert_eq!(bound["Error"], "", "{bound}");
    assert!(
        bind_took < std::time::Duration::from_secs(1),
        "the bind took {bind_took:?}"
    );
    // 20 at once, then 20 a second: unpaced, the loops get hundreds answered.
    assert!(
        answered <= 20 + 20 * 3 + 4,
        "{answered} filters answered ({refused} refused) in {secs} s"
    );
    Ok(())
}

/// Whether `/validate` allows `pod` (the review sent without credentials, as anyone can).
async fn validated(hook: &kit::Https, pod: &Value) -> anyhow::Result<bool> {
    let (s, v) = hook.post("/validate", &kit::review(pod, "v")).await?;
    anyhow::ensure!(s == 200, "validate answered {s}: {v}");
    Ok(v["response"]["allowed"] == true)
}

/// `/validate` asks the allocator (a Filter over every node, as the extender) at most
/// `--validate-checks-per-s` new request shapes a second: a flood of reviews of distinct shapes
/// is mostly admitted unchecked and counted, and a shape already answered is answered again
/// from memory, so an impossible pod is still refused during the flood.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validate_asks_the_allocator_at_a_bounded_pace() -> anyhow::Result<()> {
    let port = free_port()?;
    let stack = stack_with(
        port,
        &["--validate-checks-per-s=5", "--validate-check-burst=5"],
    )
    .await?;
    let hook = kit::webhook_client(&stack, port)?;
    let impossible = gpu_pod("big", "gpuledger-scheduler", 1, "100000");
    assert!(
        !validated(&hook, &impossible).await?,
        "a pod no node can hold was admitted"
    );
    let t0 = std::time::Instant::now();
    const FLOOD: usize = 200;
    for i in 0..FLOOD {
        let p = gpu_pod(
            &format!("f{i}"),
            "gpuledger-scheduler",
            1,
            &(100 + i).to_string(),
        );
        assert!(validated(&hook, &p).await?, "pod f{i} refused");
    }
    let asked_at_most = 5.0 + 5.0 * t0.elapsed().as_secs_f64() + 1.0;
    let unchecked = kit::metric(
        &stack,
        "gpuledger_extender_limited_total{listener=\"webhook\",limit=\"validate_checks\"}",
    )
    .await?;
    assert!(
        unchecked >= FLOOD as f64 - asked_at_most,
        "{unchecked} of {FLOOD} reviews unchecked: the allocator was asked more than {asked_at_most:.0} times"
    );
    // Answered from memory: still refused, though no question may be asked now.
    assert!(
        !validated(&hook, &impossible).await?,
        "the cached refusal was lost"
    );
    Ok(())
}
