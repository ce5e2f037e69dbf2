//! What a user reads when gpuledger says no: `kubectl create` refuses an invalid pod, and one no
//! GPU of the cluster can ever hold, with the webhook's reason; a pod that fits on none of the
//! nodes (a GPU type the cluster does not have yet, or compute that is taken) stays Pending and
//! `kubectl describe` shows, per node, gpuledger's reason, with every `%` intact
//! (kube-scheduler formats extender text as a Go format string).

use std::time::Duration;

use anyhow::{Result, ensure};
use gpuledger_e2e::pods;
use gpuledger_e2e::{E2e, Options, until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes (kube-apiserver, kube-scheduler): make test-e2e"]
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

    // Larger than any GPU of the cluster: refused at create, with the reason.
    let huge = pods::pod("huge", &[("gpuledger.io/gpu-mem", "40000")], None);
    let o = k.run_with_input(
        &["-n", "users", "create", "-f", "-"],
        Some(&huge.to_string()),
    )?;
    ensure!(
        !o.ok
            && o.stderr
                .contains("no node in the cluster can ever hold this pod")
            && o.stderr
                .contains("container main needs 40000 MiB per GPU, largest GPU has 16384 MiB"),
        "kubectl create of a pod larger than every GPU: ok={} {}{}",
        o.ok,
        o.stdout,
        o.stderr
    );
    // A GPU type no node has (one may come): admitted, Pending, the reason for each node.
    let mut other = pods::pod("other-type", &[("gpuledger.io/gpu-mem", "4000")], None);
    other["metadata"]["annotations"] = serde_json::json!({"gpuledger.io/gpu-type": "NVIDIA H100"});
    pods::create(&e.client, "users", &other).await?;
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
            let huge = k.ok(&["-n", "users", "describe", "pod", "other-type"])?;
            let wait = k.ok(&["-n", "users", "describe", "pod", "waits"])?;
            let both = huge.contains("FailedScheduling") && wait.contains("FailedScheduling");
            Ok(both.then_some((huge, wait)))
        },
    )
    .await?;
    ensure!(
        huge_text.contains("no GPU on the node matches the pod's gpu-type/gpu-uuid selectors"),
        "`kubectl describe` does not show why the pod fits on no node:\n{huge_text}\n{}",
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
