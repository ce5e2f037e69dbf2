//! `kubectl gpuledger`: the same binary run as `kubectl-gpuledger` finds the allocator through
//! a kubeconfig (Service port `grpc` → ready pod → port-forward through the API server) and
//! prints the same `inspect` table as `gpuledger inspect --allocator`.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::kube::FakeApiServer;
use gpuledger_testkit::kube::portforward::forwarded_connections;
use gpuledger_testkit::workload::{inventory, pod};
use gpuledger_testkit::{Allocators, EtcdCluster};
use serde_json::json;

/// Run `bin` with `args` and `env`, with no GPULEDGER_*/KUBECONFIG from the caller's environment.
fn run(bin: &Path, args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let mut c = Command::new(bin);
    c.args(args)
        .env_remove("GPULEDGER_ALLOCATOR")
        .env_remove("KUBECONFIG")
        .env("HOME", "/nonexistent-home");
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().expect("the CLI runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "{stderr}");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr,
    )
}

fn which(bin: &str) -> Option<std::path::PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(bin))
        .find(|p| p.is_file())
}

fn allocator_pod(name: &str, grpc_port: u16, ready: bool) -> serde_json::Value {
    json!({
        "metadata": {"name": name, "namespace": "gpuledger-system",
                     "labels": {"app.kubernetes.io/name": "gpuledger-allocator"}},
        "spec": {"containers": [{"name": "allocator", "image": "gpuledger",
                                 "ports": [{"name": "grpc", "containerPort": grpc_port},
                                           {"name": "http", "containerPort": 1}]}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1",
                   "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_gpuledger_inspect_equals_gpuledger_inspect() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let allocs = Allocators::start(
        &dir.path().join("alloc"),
        &etcd.endpoints_flag(),
        1,
        "plugin",
        &[],
    )?;
    let leader = allocs.wait_leader(Duration::from_secs(20)).await?;
    let mut c = allocs.client(leader)?;
    c.register_node(api::RegisterNodeRequest {
        inventory: Some(inventory("node-a", 2, 16_000, "NVIDIA A100")),
    })
    .await?;
    for (uid, mem) in [("u1", 4_000), ("u2", 6_000)] {
        c.reserve(api::ReserveRequest {
            request: Some(pod(uid, mem, 20)),
            node: "node-a".into(),
            ttl_ms: 0,
        })
        .await?;
    }
    let addr = allocs.addrs[leader].clone();
    let grpc_port: u16 = addr.rsplit(':').next().expect("port").parse()?;

    // The cluster as kubectl sees it: the Service, one ready allocator pod whose container port
    // named grpc is the real process's port, and one pod that is not ready (never used).
    let kube = FakeApiServer::start(&dir.path().join("kube")).await?;
    kube.store
        .create(
            "v1",
            "services",
            "gpuledger-system",
            json!({
                "metadata": {"name": "gpuledger-allocator", "namespace": "gpuledger-system"},
                "spec": {"selector": {"app.kubernetes.io/name": "gpuledger-allocator"},
                         "ports": [{"name": "grpc", "port": 7420, "targetPort": "grpc"},
                                   {"name": "http", "port": 7421, "targetPort": "http"}]},
            }),
        )
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    kube.add_pod(allocator_pod("gpuledger-allocator-0", grpc_port, true))?;
    kube.add_pod(allocator_pod("gpuledger-allocator-1", 1, false))?;
    let kubeconfig = kube.kubeconfig().to_str().expect("utf-8 path").to_string();

    // The plugin is the same binary under kubectl's name, as `ln -s` installs it.
    let gpuledger = Path::new(env!("CARGO_BIN_EXE_gpuledger"));
    let plugin = dir.path().join("kubectl-gpuledger");
    std::os::unix::fs::symlink(gpuledger, &plugin)?;

    let (ok, want, err) = run(
        gpuledger,
        &["inspect", "--details", "--allocator", &addr],
        &[],
    );
    assert!(ok, "{err}");
    assert!(want.contains("allocations=2"), "{want}");
    assert!(want.contains("default/pod-u2:main"), "{want}");

    let before = forwarded_connections();
    let (ok, got, err) = run(
        &plugin,
        &["inspect", "--details"],
        &[("KUBECONFIG", &kubeconfig)],
    );
    assert!(ok, "kubectl-gpuledger inspect failed:\n{err}");
    assert!(
        err.is_empty(),
        "a clean run prints nothing on stderr:\n{err}"
    );
    assert_eq!(
        got, want,
        "kubectl gpuledger inspect differs from gpuledger inspect"
    );
    assert!(
        forwarded_connections() > before,
        "the plugin did not go through the API server's port-forward"
    );
    println!("kubectl-gpuledger inspect --details:\n{got}");

    // Through kubectl itself, when it is installed: it finds the link on the PATH and runs it.
    match which("kubectl") {
        Some(kubectl) => {
            let path = format!(
                "{}:{}",
                dir.path().display(),
                std::env::var("PATH").unwrap_or_default()
            );
            let (ok, got, err) = run(
                &kubectl,
                &["gpuledger", "inspect", "--details"],
                &[("KUBECONFIG", &kubeconfig), ("PATH", &path)],
            );
            assert!(ok, "kubectl gpuledger inspect failed:\n{err}");
            assert_eq!(got, want, "kubectl gpuledger inspect differs");
        }
        None => eprintln!("kubectl is not installed: ran kubectl-gpuledger directly only"),
    }

    // --kubeconfig and --context work the same; a context that does not exist is an error.
    let (ok, got, err) = run(
        &plugin,
        &[
            "inspect",
            "--details",
            "--kubeconfig",
            &kubeconfig,
            "--context",
            "fake",
        ],
        &[],
    );
    assert!(ok, "{err}");
    assert_eq!(got, want);
    let (ok, _, err) = run(
        &plugin,
        &["inspect", "--kubeconfig", &kubeconfig, "--context", "nope"],
        &[],
    );
    assert!(!ok);
    assert!(err.contains("nope"), "{err}");

    // Only the ready pod is a replica: status lists exactly one, and it answers.
    let (ok, out, err) = run(&plugin, &["status"], &[("KUBECONFIG", &kubeconfig)]);
    assert!(ok, "{out}{err}");
    assert_eq!(out.lines().count(), 2, "header + one replica:\n{out}");
    assert!(out.contains("alloc0") && out.contains("leader"), "{out}");

    // Plain `gpuledger` with --kubeconfig finds the allocator the same way.
    let (ok, got, err) = run(
        gpuledger,
        &["inspect", "--details", "--kubeconfig", &kubeconfig],
        &[],
    );
    assert!(ok, "{err}");
    assert_eq!(got, want);

    // An explicit --allocator wins over the kubeconfig, which is then not even read.
    let (ok, got, err) = run(
        &plugin,
        &["inspect", "--details", "--allocator", &addr],
        &[("KUBECONFIG", "/nonexistent/kubeconfig")],
    );
    assert!(ok, "{err}");
    assert_eq!(got, want);

    // Errors name what is missing.
    let (ok, _, err) = run(
        &plugin,
        &["inspect", "--allocator-service", "nope"],
        &[("KUBECONFIG", &kubeconfig)],
    );
    assert!(!ok);
    assert!(err.contains("gpuledger-system/nope"), "{err}");
    kube.store
        .update(
            "v1",
            "pods",
            "gpuledger-system",
            "gpuledger-allocator-0",
            |p| {
                p["status"]["conditions"][0]["status"] = json!("False");
                Ok(())
            },
        )
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let (ok, _, err) = run(&plugin, &["inspect"], &[("KUBECONFIG", &kubeconfig)]);
    assert!(!ok);
    assert!(err.contains("no ready pod (2 pod(s)"), "{err}");

    // kubectl shows the plugin under its own name.
    let (ok, out, _) = run(&plugin, &["--help"], &[]);
    assert!(ok);
    assert!(out.contains("Usage: kubectl gpuledger"), "{out}");
    Ok(())
}
