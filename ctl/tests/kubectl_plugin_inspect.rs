//! `kubectl gpuledger`: the same binary run as `kubectl-gpuledger` finds the allocator through
//! a kubeconfig (Service port `grpc` → ready pod → port-forward through the API server) and
//! prints the same `inspect` table as `gpuledger inspect --allocator`.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use gpuledger_auth::identity::Role;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::cluster::SCHEDULER_NAME;
use gpuledger_testkit::kube::FakeApiServer;
use gpuledger_testkit::kube::portforward::forwarded_connections;
use gpuledger_testkit::pki::{NAMESPACE, credential_flags};
use gpuledger_testkit::workload::{inventory, pod};
use gpuledger_testkit::{Allocators, EtcdCluster, Identities};
use serde_json::json;

/// Run `bin` with `args` and `env`, with no GPULEDGER_*/KUBECONFIG from the caller's environment.
fn run(bin: &Path, args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let mut c = Command::new(bin);
    c.args(args)
        .env_remove("GPULEDGER_ALLOCATOR")
        .env_remove("KUBECONFIG")
        .env_remove("GPULEDGER_TLS_SERVER_NAME")
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
    // The cluster's API server reviews the operators' tokens for the allocator, and holds the
    // pods the extender reserves for.
    let kube = FakeApiServer::start(&dir.path().join("kube")).await?;
    let ids = Identities::tokens(kube.pki.clone(), kube.store.clone());
    let kubeconfig_flag = format!("--kubeconfig={}", kube.kubeconfig().display());
    let allocs = Allocators::start_each(
        &dir.path().join("alloc"),
        &etcd,
        &[etcd.endpoints_flag()],
        "plugin",
        &[&kubeconfig_flag],
        ids.clone(),
    )?;
    let leader = allocs.wait_leader(Duration::from_secs(20)).await?;
    kube.add_node("node-a", 8)?;
    allocs
        .node_agent(leader, "node-a")?
        .register_node(api::RegisterNodeRequest {
            inventory: Some(pb::NodeInventory {
                isolation: "hami-core".into(),
                dra_cores: String::new(),
                ..inventory("node-a", 2, 16_000, "NVIDIA A100")
            }),
        })
        .await?;
    let mut ext = allocs.extender(leader)?;
    for (uid, mem) in [("u1", 4_000), ("u2", 6_000)] {
        let asks = pod(uid, mem, 20);
        kube.add_pod(json!({
            "metadata": {"name": format!("pod-{uid}"), "namespace": "default", "uid": uid},
            "spec": gpuledger_testkit::workload::pod_spec(&asks, SCHEDULER_NAME),
        }))?;
        let req = api::ReserveRequest {
            request: Some(asks),
            node: "node-a".into(),
            ttl_ms: 0,
        };
        // The allocator admits the extender's Reserve once its pod watch has the pod.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match ext.reserve(req.clone()).await {
                Err(s)
                    if s.code() == tonic::Code::PermissionDenied && Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                r => break r.map(|_| ())?,
            }
        }
    }
    // The node's allocatable comes from the API server: wait for it, so that every inspect
    // below sees the same state.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let snap = allocs
            .viewer(leader)?
            .dump(api::DumpRequest {})
            .await?
            .into_inner()
            .snapshot;
        let nodes = snap.map(|s| s.nodes).unwrap_or_default();
        if nodes.iter().any(|n| n.node == "node-a" && n.cpu_milli > 0) {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "node-a never got its allocatable"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let addr = allocs.addrs[leader].clone();
    let grpc_port: u16 = addr.rsplit(':').next().expect("port").parse()?;
    // An operator's own credentials, for a run that names the allocator itself.
    let viewer = credential_flags(&ids.credentials(&Role::Viewer)?);
    let viewer: Vec<&str> = viewer.iter().map(String::as_str).collect();

    // The cluster as kubectl sees it: the Service, one ready allocator pod whose container port
    // named grpc is the real process's port, one pod that is not ready (never used), the
    // ConfigMap with the allocator's CA and the viewers' ServiceAccount, as the install has them.
    kube.store
        .create(
            "v1",
            "serviceaccounts",
            NAMESPACE,
            json!({"metadata": {"name": "gpuledger-viewer", "namespace": NAMESPACE}}),
        )
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    kube.store
        .create(
            "v1",
            "configmaps",
            NAMESPACE,
            json!({
                "metadata": {"name": "gpuledger-ca", "namespace": NAMESPACE},
                "data": {"ca.crt": std::fs::read_to_string(ids.pki.ca_file())?},
            }),
        )
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
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
        &[&["inspect", "--details", "--allocator", &addr], &viewer[..]].concat(),
        &[],
    );
    assert!(ok, "{err}");
    assert!(want.contains("allocations=2"), "{want}");
    assert!(want.contains("default/pod-u2:main"), "{want}");
    assert!(
        want.contains("NVML sampling with a kill behind every one): node-a=hami-core"),
        "the node's isolation as its agent reported it:\n{want}"
    );

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
        &[&["inspect", "--details", "--allocator", &addr], &viewer[..]].concat(),
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
