//! What the allocator's tests share: a lone replica started by hand, and the pods the
//! extender's `Reserve` needs (with a Kubernetes API, the allocator admits it only for a pod
//! the API server has, scheduled by gpuledger, asking for what is reserved).

#![allow(dead_code)]

use std::path::Path;
use std::time::{Duration, Instant};

use gpuledger_auth::identity::Role;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::allocators::Client;
use gpuledger_testkit::cluster::SCHEDULER_NAME;
use gpuledger_testkit::kube::FakeApiServer;
use gpuledger_testkit::pki::NAMESPACE;
use gpuledger_testkit::{Identities, Proc, bin_path, free_port};
use k8s_openapi::serde_json::{Value, json};
use tonic::{Code, Status};

/// Create `r`'s pod in the fake API server (its namespace, name and uid), pending, scheduled
/// by gpuledger's scheduler and asking for what `r` asks for.
pub fn add_api_pod(api: &FakeApiServer, r: &api::PodRequest) -> anyhow::Result<Value> {
    let p = r
        .pod
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("the request names no pod"))?;
    api.add_pod(json!({
        "metadata": {"name": p.name, "namespace": p.namespace, "uid": p.uid},
        "spec": gpuledger_testkit::workload::pod_spec(r, SCHEDULER_NAME),
    }))
}

/// Whether `s` says the allocator's pod watch has not seen the pod (yet).
pub fn pod_not_seen(s: &Status) -> bool {
    s.code() == Code::PermissionDenied && s.message().contains("has no pod with this UID")
}

/// Reserve as the extender, retrying for a few seconds while the allocator's pod watch has
/// not yet seen a pod the test just created (every other answer is returned at once).
pub async fn reserve_admitted(
    c: &mut Client,
    req: api::ReserveRequest,
) -> Result<api::ReserveResponse, Status> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match c.reserve(req.clone()).await {
            Err(s) if pod_not_seen(&s) && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            r => return r.map(tonic::Response::into_inner),
        }
    }
}

/// One allocator replica `name` (also its cluster), started by hand with `args` besides its
/// listeners, TLS and authentication (certificates of `ids`), its log level `log`; its gRPC
/// address. For a test that needs flags `Allocators` would not let it choose.
pub fn spawn_allocator(
    dir: &Path,
    ids: &Identities,
    name: &str,
    args: Vec<String>,
    log: &str,
) -> anyhow::Result<(Proc, String)> {
    let addr = format!("127.0.0.1:{}", free_port()?);
    let (cert, key) = ids.pki.server("allocator")?;
    let mut all = vec![
        format!("--listen={addr}"),
        format!("--http-listen=127.0.0.1:{}", free_port()?),
        format!("--cluster={name}"),
        format!("--replica={name}"),
        format!("--tls-cert={}", cert.display()),
        format!("--tls-key={}", key.display()),
        format!("--client-ca={}", ids.pki.ca_file().display()),
        format!("--auth-namespace={NAMESPACE}"),
    ];
    all.extend(ids.flags(&Role::Allocator)?);
    all.extend(args);
    let p = Proc::spawn(
        dir,
        name,
        &bin_path("gpuledger-allocator")?,
        all,
        vec![("GPULEDGER_LOG".into(), log.into())],
    )?;
    Ok((p, addr))
}

/// Poll `f` every 50 ms until it holds; how long that took, or an error naming `what`.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut f: F) -> anyhow::Result<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bool>>,
{
    let t0 = Instant::now();
    while t0.elapsed() < timeout {
        if f().await? {
            return Ok(t0.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("{what}: not within {timeout:?}")
}
