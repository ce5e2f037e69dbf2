//! What a user reads when gpuledger says no: `kubectl create` refuses an invalid pod with the
//! webhook's reason; a pod that fits nowhere stays Pending and `kubectl describe` shows, per
//! node, gpuledger's reason (kube-scheduler 1.20 reads only `FailedNodes`), with every `%`
//! intact (kube-scheduler formats extender text as a Go format string).

use std::time::Duration;

use anyhow::{Result, ensure};
use gpuledger_e2e::pods;
use gpuledger_e2e::{E2e, Options, until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes (kube-apiserver, kube-scheduler 1.20.2): make test-e2e"]
async fn refusals_and_pending_reasons_read_as_gpuledger_wrote_them() -> Result<()> {
    let (e, nodes) = E2e::with_gpu_nodes(Options::default(), 2, 1, "users").await?;
    let k = e.kubectl();

    // Invalid: refused at create, with the reason, and nothing stored.
    let bad = pods::pod(
        "too-much-compute",
        &[("gpuledger.io/gpu-core", "150")],
        None,
    );
    let o = k.run_with_input(
        &["-n", "users", "create", "-f", "-"],
        Some(&bad.to_string()),
    )?;
    ensure!(
        !o.ok,
        "kubectl create accepted a pod asking for 150% of a GPU: {}",
        o.stdout
    );
    ensure!(
        o.stderr
            .contains("admission webhook \"validate.gpuledger.io\" denied the request")
            && o.stderr
                .contains("gpuledger.io/gpu-core must be between 0 and 100 (got 150)"),
        "kubectl create did not say why: {}",
        o.stderr
    );
    let o = k.run(&["-n", "users", "get", "pod", "too-much-compute"])?;
    ensure!(!o.ok, "the refused pod was stored anyway");

    // Never fits (larger than any GPU): Pending, gpuledger's reason for each node.
    let huge = pods::pod("huge", &[("gpuledger.io/gpu-mem", "40000")], None);
    pods::create(&e.client, "users", &huge).await?;
    // Does not fit now (the GPUs' compute is taken): the reason names what is free, in percent.
    for i in 0..nodes.len() {
        let full = pods::pod(
            &format!("full-{i}"),
            &[("gpuledger.io/gpu-core", "100")],
            None,
        );
        pods::create(&e.client, "users", &full).await?;
    }
    let full: Vec<String> = (0..nodes.len()).map(|i| format!("full-{i}")).collect();
    pods::wait_bound(&e.client, "users", &full, Duration::from_secs(60)).await?;
    let wait = pods::pod("waits", &[("gpuledger.io/gpu-core", "30")], None);
    pods::create(&e.client, "users", &wait).await?;

    let (huge_text, wait_text) = until(
        "FailedScheduling with gpuledger's reasons",
        Duration::from_secs(60),
        || async {
            let huge = k.ok(&["-n", "users", "describe", "pod", "huge"])?;
            let wait = k.ok(&["-n", "users", "describe", "pod", "waits"])?;
            let both = huge.contains("FailedScheduling") && wait.contains("FailedScheduling");
            Ok(both.then_some((huge, wait)))
        },
    )
    .await?;
    ensure!(
        huge_text.contains("container main needs 40000 MiB per GPU, largest GPU has 16384 MiB"),
        "`kubectl describe` does not show why the pod can never fit:\n{huge_text}\n{}",
        e.log_tails(10)
    );
    ensure!(
        wait_text.contains("compute free") && wait_text.contains("most free:"),
        "`kubectl describe` does not show why the pod waits:\n{wait_text}"
    );
    for t in [&huge_text, &wait_text] {
        ensure!(
            !t.contains("%!"),
            "a `%` was garbled by the scheduler's formatting:\n{t}"
        );
        ensure!(
            !t.contains("nodes are available: ."),
            "no reason at all:\n{t}"
        );
    }
    Ok(())
}
