//! Malformed requests get HTTP 400 with an `Error`, never a crash; an unreachable ledger makes
//! filter answer an `Error` that says the ledger is unavailable; a pod the ledger refuses is
//! the caller's error (4xx), never the extender's unavailability (503).

use crate::kit;

use std::time::Duration;

use gpuledger_auth::identity::Role;
use gpuledger_testkit::kube::stack::{extender_tls_flags, scheduler_tls, wait_http};
use gpuledger_testkit::kube::{ExtenderClient, ExtenderConfig};
use gpuledger_testkit::{Identities, Pki, Proc, bin_path, free_port};
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_json_is_400_and_a_dead_ledger_is_named() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (port, http_port) = (free_port()?, free_port()?);
    // Two allocator addresses where nothing listens.
    let dead = format!("127.0.0.1:{},127.0.0.1:{}", free_port()?, free_port()?);
    let pki = Pki::new(dir.path())?;
    let mut flags = vec![
        format!("--listen=127.0.0.1:{port}"),
        format!("--http-listen=127.0.0.1:{http_port}"),
        format!("--allocator={dead}"),
    ];
    flags.extend(extender_tls_flags(&pki)?);
    flags.extend(Identities::certs(pki.clone()).flags(&Role::Extender)?);
    let mut p = Proc::spawn(
        dir.path(),
        "extender",
        &bin_path("gpuledger-extender")?,
        flags,
        vec![],
    )?;
    wait_http(port, Duration::from_secs(20)).await?;
    let ext = ExtenderClient::new(ExtenderConfig::gpuledger(
        &format!("https://127.0.0.1:{port}/gpuledger"),
        Some(scheduler_tls(&pki)?),
    ))?;
    for verb in ["filter", "prioritize", "bind", "preempt"] {
        for body in [&b"{not json"[..], b"", b"[1,2]", b"{\"Pod\": 7}"] {
            let (status, b) = ext.post_raw(verb, body.to_vec()).await?;
            assert_eq!(status, 400, "{verb} {body:?}");
            let v: Value = serde_json::from_slice(&b)?;
            assert!(
                v["Error"].as_str().is_some_and(|e| e.contains("malformed")),
                "{verb}: {v}"
            );
        }
    }
    let fx = kit::fixtures();
    let req = kit::read_json(&fx.join("extender/003-filter.json"))?;
    let r = ext.post("filter", &req).await?;
    let err = r["Error"].as_str().unwrap_or("");
    assert!(err.contains("ledger unavailable"), "{r}");
    // A pod whose request can never be met is unresolvable on every node, with the reason.
    let mut bad = req.clone();
    bad["Pod"]["spec"]["containers"][1]["resources"]["limits"]["gpuledger.io/gpu-core"] =
        json!("150");
    bad["Pod"]["spec"]["containers"][1]["resources"]["requests"]["gpuledger.io/gpu-core"] =
        json!("150");
    let r = ext.post("filter", &bad).await?;
    assert_eq!(r["NodeNames"], json!([]), "{r}");
    let why = r["FailedAndUnresolvableNodes"]["gpu-node-2"]
        .as_str()
        .unwrap_or("");
    assert!(why.contains("between 0 and 100"), "{r}");
    // Alive but not ready without a ledger, and /readyz says why.
    let base = format!("http://127.0.0.1:{http_port}");
    let (code, _) = gpuledger_testkit::http::get(&format!("{base}/healthz")).await?;
    assert_eq!(code, 200);
    let (code, body) = gpuledger_testkit::http::get(&format!("{base}/readyz")).await?;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("ledger unavailable"), "{body}");
    // The failed filter shows in the metrics as an error, the malformed bodies as bad requests.
    let (_, text) = gpuledger_testkit::http::get(&format!("{base}/metrics")).await?;
    for want in [
        r#"gpuledger_extender_requests_total{verb="filter",outcome="error"} 1"#,
        r#"gpuledger_extender_requests_total{verb="bind",outcome="bad_request"} 4"#,
    ] {
        assert!(text.contains(want), "{want} not in:\n{text}");
    }
    assert!(p.exited().is_none(), "the extender survived all of it");
    Ok(())
}

/// Regression (hostile load II): prioritize answered a pod the ledger refuses (here: no uid)
/// with 503, as if the extender were unavailable; it is the caller's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_impossible_request_is_the_callers_error_not_503() -> anyhow::Result<()> {
    use gpuledger_testkit::kube::{KubeStack, StackOptions};
    let stack = KubeStack::start(StackOptions {
        etcd_members: 1,
        allocators: 1,
        allocator_flags: vec![],
        extender_flags: Some(vec![]),
    })
    .await?;
    let ext = ExtenderClient::new(stack.extender_config()?)?;
    // A GPU pod the ledger cannot name: no uid.
    let mut bad = kit::read_json(&kit::fixtures().join("extender/003-filter.json"))?;
    bad["Pod"]["metadata"]["uid"] = json!("");
    let (status, body) = ext
        .post_raw("prioritize", serde_json::to_vec(&bad)?)
        .await?;
    let v: Value = serde_json::from_slice(&body)?;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["Error"]
            .as_str()
            .is_some_and(|e| e.contains("uid is empty")),
        "{v}"
    );
    let line = r#"gpuledger_extender_requests_total{verb="prioritize",outcome="bad_request"} "#;
    assert_eq!(kit::metric(&stack, line).await?, 1.0);
    Ok(())
}
