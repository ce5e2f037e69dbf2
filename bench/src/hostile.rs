//! `gpuledger-bench hostile`: honest load (binds through the extender, reservations with the
//! node agents' Assign, admission reviews) measured without an attack and then under each
//! attack of the hostile-load list, one at a time, at full strength from this machine. Every
//! attack is plain client calls over real TLS with real identities. Per attack: the honest p99
//! and success rate against the quiet run's; at the end, leader lease losses, process exits and
//! `gpuledger verify`.
//!
//! Attackers connect from other loopback addresses (127.0.0.2 and up), as other pods would;
//! the honest clients from 127.0.0.1.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use gpuledger_auth::identity::Role;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::allocators::{Client, connect};
use gpuledger_testkit::attacker::{tcp_from, tls_from, tls_trusting};
use gpuledger_testkit::kube::{ExtenderClient, KubeStack, StackOptions};
use gpuledger_testkit::pki::{Identities, credential_flags};
use gpuledger_testkit::workload::inventory;
use hdrhistogram::Histogram;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::common::{histogram, q_ms, record, title};

/// Flags.
#[derive(clap::Args, Clone)]
pub struct Args {
    /// Seconds of honest load per phase (quiet, then each attack).
    #[arg(long, default_value_t = 8)]
    seconds: u64,
    /// Honest clients, each one request at a time.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Allocator replicas.
    #[arg(long, default_value_t = 2)]
    allocators: usize,
    /// GPU nodes (8 GPUs of 80 GB each).
    #[arg(long, default_value_t = 4)]
    nodes: usize,
    /// Slow-body connections to the webhook (attack 1).
    #[arg(long, default_value_t = 4000)]
    slow_connections: usize,
    /// Idle TCP connections to each allocator (attack 2).
    #[arg(long, default_value_t = 1100)]
    idle_connections: usize,
    /// Subscribe streams a viewer opens, 5,000 per connection (attack 3).
    #[arg(long, default_value_t = 15000)]
    streams: usize,
    /// Run only the attacks whose name contains this.
    #[arg(long, default_value = "")]
    only: String,
}

/// What every client, honest or not, needs to reach the stack.
struct Ctx {
    store: Arc<gpuledger_testkit::kube::store::Store>,
    addrs: Vec<String>,
    ids: Identities,
    hook_port: u16,
    ext_port: u16,
    nodes: Vec<String>,
    scheduler: ExtenderClient,
    extender: Client,
    admin: Client,
    agents: Vec<Client>,
    seq: AtomicU64,
}

const NS: &str = "bench";

fn gpu_pod(name: &str, scheduler: &str) -> Value {
    json!({"metadata": {"name": name, "namespace": NS},
           "spec": {"schedulerName": scheduler, "containers": [{"name": "c", "image": "x",
              "resources": {"limits": {"gpuledger.io/gpu": "1", "gpuledger.io/gpu-mem": "1000", "gpuledger.io/gpu-core": "10"},
                            "requests": {"gpuledger.io/gpu": "1", "gpuledger.io/gpu-mem": "1000", "gpuledger.io/gpu-core": "10"}}}]}})
}

/// What the extender asks the allocator for `gpu_pod`.
fn pod_request(uid: &str, name: &str, mem_mib: u64, mem_percent: u32) -> api::PodRequest {
    api::PodRequest {
        pod: Some(pb::PodRef {
            uid: uid.into(),
            namespace: NS.into(),
            name: name.into(),
        }),
        containers: vec![api::ContainerRequest {
            name: "c".into(),
            slices: 1,
            mem_mib,
            mem_percent,
            core_milli: 100,
        }],
        ..Default::default()
    }
}

impl Ctx {
    fn next(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Create `pod` in the API server; its UID.
    fn add_pod(&self, pod: Value) -> Result<String> {
        let p = self
            .store
            .create("v1", "pods", NS, pod)
            .map_err(|e| anyhow::anyhow!("{}", e.message()))?;
        Ok(p["metadata"]["uid"].as_str().unwrap_or("").to_string())
    }

    /// A client of allocator `i` as `role`.
    fn client(&self, i: usize, role: &Role) -> Result<Client> {
        connect(
            &self.addrs[i % self.addrs.len()],
            &self.ids.credentials(role)?,
        )
    }

    /// An HTTPS client of the webhook (trusting the stack's CA, as the API server does).
    fn tls_connector(&self) -> Result<tokio_rustls::TlsConnector> {
        tls_trusting(self.ids.pki.ca_file())
    }
}

/// A request whose body never ends: headers promising 1 MB, then a byte every 2 s, until the
/// server cuts the connection.
async fn slow_body(
    connector: &tokio_rustls::TlsConnector,
    source: &str,
    to: SocketAddr,
    started: &AtomicU64,
) -> std::io::Result<()> {
    let mut s = tls_from(connector, source, to).await?;
    s.write_all(b"POST /mutate HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: 1000000\r\n\r\n{")
        .await?;
    started.fetch_add(1, Ordering::Relaxed);
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        s.write_all(b" ").await?;
    }
}

/// One admission review of a GPU pod over a fresh TLS connection, as the API server sends it.
async fn admit(ctx: &Ctx, connector: &tokio_rustls::TlsConnector, i: u64) -> Result<()> {
    let review = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": format!("r-{i}"), "kind": {"group": "", "version": "v1", "kind": "Pod"},
                    "resource": {"group": "", "version": "v1", "resource": "pods"},
                    "operation": "CREATE", "namespace": NS, "userInfo": {"username": "bench"},
                    "object": gpu_pod(&format!("admit-{i}"), "default-scheduler")}});
    let body = serde_json::to_vec(&review)?;
    let to = SocketAddr::from(([127, 0, 0, 1], ctx.hook_port));
    let mut s = tls_from(connector, "127.0.0.1", to).await?;
    let head = format!(
        "POST /mutate HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await?;
    s.write_all(&body).await?;
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer).await;
    anyhow::ensure!(
        answer.starts_with(b"HTTP/1.1 200"),
        "webhook answered {:?}",
        String::from_utf8_lossy(&answer[..answer.len().min(80)])
    );
    Ok(())
}

/// One honest operation: a bind through the extender, a reservation and its node agent's
/// Assign, or an admission review; the UID of the pod that now holds GPU, if any.
async fn honest(ctx: &Ctx, connector: &tokio_rustls::TlsConnector) -> Result<Option<String>> {
    let i = ctx.next();
    let node = &ctx.nodes[i as usize % ctx.nodes.len()];
    match i % 3 {
        0 => {
            let name = format!("bind-{i}");
            let uid = ctx.add_pod(gpu_pod(&name, "gpuledger-scheduler"))?;
            let r = ctx
                .scheduler
                .post(
                    "bind",
                    &json!({"PodName": name, "PodNamespace": NS, "PodUID": uid, "Node": node}),
                )
                .await?;
            anyhow::ensure!(r["Error"] == "", "bind: {r}");
            Ok(Some(uid))
        }
        1 => {
            let name = format!("reserve-{i}");
            let uid = ctx.add_pod(gpu_pod(&name, "gpuledger-scheduler"))?;
            let r = ctx
                .extender
                .clone()
                .reserve(api::ReserveRequest {
                    request: Some(pod_request(&uid, &name, 1000, 0)),
                    node: node.clone(),
                    ttl_ms: 0,
                })
                .await?
                .into_inner();
            let id = r.allocations.first().context("no allocation")?.id;
            let agent = i as usize % ctx.nodes.len();
            ctx.agents[agent]
                .clone()
                .assign(api::AssignRequest {
                    node: node.clone(),
                    allocation_id: id,
                    device_ids: vec![format!("dev-{i}")],
                })
                .await?;
            Ok(Some(uid))
        }
        _ => admit(ctx, connector, i).await.map(|()| None),
    }
}

/// Honest load for `d`: its latencies, successes and attempts, and the first error seen.
async fn measure(ctx: &Arc<Ctx>, d: Duration, concurrency: usize) -> Result<Phase> {
    let connector = ctx.tls_connector()?;
    let end = Instant::now() + d;
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..concurrency.max(1) {
        let (ctx, connector) = (ctx.clone(), connector.clone());
        workers.spawn(async move {
            let mut p = Phase::new();
            while Instant::now() < end {
                let t = Instant::now();
                let r = tokio::time::timeout(Duration::from_secs(10), honest(&ctx, &connector))
                    .await
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("no answer within 10 s")));
                record(&mut p.latency, t.elapsed());
                p.total += 1;
                match r {
                    Ok(held) => {
                        p.ok += 1;
                        // Untimed: give the GPU back, so that every phase finds the same room.
                        if let Some(uid) = held {
                            let _ = ctx
                                .admin
                                .clone()
                                .release(api::ReleaseRequest {
                                    pod_uid: uid,
                                    reason: "bench".into(),
                                    ..Default::default()
                                })
                                .await;
                        }
                    }
                    Err(e) => {
                        if p.error.is_none() {
                            p.error = Some(format!("{e:#}"));
                        }
                    }
                }
            }
            p
        });
    }
    let mut all = Phase::new();
    while let Some(p) = workers.join_next().await {
        let p = p?;
        all.latency
            .add(&p.latency)
            .map_err(|e| anyhow::anyhow!("merging histograms: {e:?}"))?;
        all.ok += p.ok;
        all.total += p.total;
        all.error = all.error.or(p.error);
    }
    Ok(all)
}

struct Phase {
    latency: Histogram<u64>,
    ok: u64,
    total: u64,
    error: Option<String>,
}

impl Phase {
    fn new() -> Self {
        Phase {
            latency: histogram(),
            ok: 0,
            total: 0,
            error: None,
        }
    }

    fn success(&self) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            self.ok as f64 / self.total as f64
        }
    }
}

/// The attacks, by name, each with a line on what it does.
const ATTACKS: [(&str, &str); 11] = [
    (
        "slow-bodies",
        "webhook: slow bodies (Content-Length 1 MB, a byte every 2 s) from 8 addresses",
    ),
    (
        "idle-tcp",
        "allocators: idle TCP connections that never send a ClientHello",
    ),
    (
        "viewer-streams",
        "a viewer opens Subscribe streams, 5,000 per connection, and holds them",
    ),
    (
        "violation-flood",
        "a node agent floods ReportViolation with 256 KiB actions",
    ),
    (
        "foreign-certs",
        "a viewer's and a node agent's certificates bind another scheduler's pods",
    ),
    (
        "absurd-inventory",
        "a node agent registers absurd GPU memory, then percent-of-memory Reserves",
    ),
    (
        "whole-gpu-for-plain-pod",
        "the extender reserves and confirms a whole GPU for non-GPU pods of another scheduler",
    ),
    ("fake-filters", "/filter calls for pods that never bind"),
    (
        "junk-tokens",
        "distinct junk and forged tokens, each a new connection",
    ),
    (
        "heavy-reads",
        "a viewer's Filter over every node and ReadLog from the start, in a loop",
    ),
    (
        "forged-forwarding",
        "an allocator's token with a forwarding header claiming an admin",
    ),
];

/// Run `attack` until `stop`; what it managed, for the table.
async fn attack(name: &str, ctx: Arc<Ctx>, a: &Args, stop: CancellationToken) -> Result<String> {
    let hits = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    match name {
        "slow-bodies" => {
            let connector = ctx.tls_connector()?;
            let to = SocketAddr::from(([127, 0, 0, 1], ctx.hook_port));
            for i in 0..a.slow_connections {
                let (connector, stop, hits) = (connector.clone(), stop.clone(), hits.clone());
                let source = format!("127.0.0.{}", 2 + i % 8);
                tasks.spawn(async move {
                    while !stop.is_cancelled() {
                        tokio::select! {
                            _ = stop.cancelled() => return,
                            _ = slow_body(&connector, &source, to, &hits) => {}
                        }
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                });
            }
        }
        "idle-tcp" => {
            for i in 0..a.idle_connections * ctx.addrs.len() {
                let to: SocketAddr = ctx.addrs[i % ctx.addrs.len()].parse()?;
                let (stop, hits) = (stop.clone(), hits.clone());
                let source = format!("127.0.0.{}", 10 + i % 8);
                tasks.spawn(async move {
                    while !stop.is_cancelled() {
                        if let Ok(mut s) = tcp_from(&source, to).await {
                            hits.fetch_add(1, Ordering::Relaxed);
                            let mut b = [0u8; 1];
                            tokio::select! {
                                _ = stop.cancelled() => return,
                                _ = s.read(&mut b) => {}
                            }
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                });
            }
        }
        "viewer-streams" => {
            let conns = a.streams.div_ceil(5000).max(1);
            let viewers: Vec<Client> = (0..conns)
                .map(|i| ctx.client(i, &Role::Viewer))
                .collect::<Result<_>>()?;
            for i in 0..a.streams {
                let mut v = viewers[i % conns].clone();
                let (stop, hits, node) = (stop.clone(), hits.clone(), ctx.nodes[0].clone());
                tasks.spawn(async move {
                    while !stop.is_cancelled() {
                        let sub = v.subscribe(api::SubscribeRequest {
                            node: node.clone(),
                            from_seq: 0,
                        });
                        let held = async {
                            if let Ok(s) = sub.await {
                                hits.fetch_add(1, Ordering::Relaxed);
                                let mut s = s.into_inner();
                                while let Ok(Some(_)) = s.message().await {}
                            }
                        };
                        tokio::select! {
                            _ = stop.cancelled() => return,
                            _ = held => {}
                        }
                        // Refused or cut: try again, as often as holding streams could use.
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                });
            }
        }
        "violation-flood" => {
            let node = ctx.nodes[0].clone();
            let name = format!("victim-{}", ctx.next());
            let uid = ctx.add_pod(gpu_pod(&name, "gpuledger-scheduler"))?;
            let id = ctx
                .extender
                .clone()
                .reserve(api::ReserveRequest {
                    request: Some(pod_request(&uid, &name, 1000, 0)),
                    node: node.clone(),
                    ttl_ms: 0,
                })
                .await?
                .into_inner()
                .allocations
                .first()
                .context("no allocation")?
                .id;
            for _ in 0..4 {
                let (mut c, stop, hits, node) = (
                    ctx.agents[0].clone(),
                    stop.clone(),
                    hits.clone(),
                    node.clone(),
                );
                tasks.spawn(async move {
                    let action = "x".repeat(256 * 1024 - 64);
                    while !stop.is_cancelled() {
                        let r = c
                            .report_violation(api::ReportViolationRequest {
                                violation: Some(pb::LimitViolated {
                                    allocation_id: id,
                                    node: node.clone(),
                                    gpu_uuid: format!("GPU-{node}-0"),
                                    pid: 1,
                                    used_mib: 2000,
                                    limit_mib: 1000,
                                    action: action.clone(),
                                }),
                            })
                            .await;
                        if r.is_ok() {
                            hits.fetch_add(1, Ordering::Relaxed);
                        } else {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                });
            }
        }
        "foreign-certs" => {
            for role in [
                Role::Viewer,
                Role::NodeAgent {
                    node: ctx.nodes[0].clone(),
                },
            ] {
                let (cert, key) = ctx.ids.pki.client_cert(&role, "mallory")?;
                let mut cfg = gpuledger_testkit::kube::ExtenderConfig::gpuledger(
                    &format!("https://127.0.0.1:{}/gpuledger", ctx.ext_port),
                    Some(gpuledger_testkit::kube::stack::scheduler_tls(&ctx.ids.pki)?),
                );
                if let Some(t) = cfg.tls.as_mut() {
                    t.cert = cert;
                    t.key = key;
                }
                let client = ExtenderClient::new(cfg)?;
                let (ctx, stop, hits) = (ctx.clone(), stop.clone(), hits.clone());
                tasks.spawn(async move {
                    while !stop.is_cancelled() {
                        let i = ctx.next();
                        let name = format!("foreign-{i}");
                        let Ok(uid) = ctx.add_pod(gpu_pod(&name, "another-scheduler")) else {
                            continue;
                        };
                        let r = client
                            .post(
                                "bind",
                                &json!({"PodName": name, "PodNamespace": NS, "PodUID": uid,
                                        "Node": ctx.nodes[i as usize % ctx.nodes.len()]}),
                            )
                            .await;
                        if matches!(&r, Ok(v) if v["Error"] == "") {
                            hits.fetch_add(1, Ordering::Relaxed);
                        }
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                });
            }
        }
        "absurd-inventory" => {
            let rogue = "rogue-node".to_string();
            let mut agent = ctx.client(
                0,
                &Role::NodeAgent {
                    node: rogue.clone(),
                },
            )?;
            let mut inv = inventory(&rogue, 1, 0, "A100");
            inv.gpus[0].memory_mib = u64::MAX / 2;
            let _ = agent
                .register_node(api::RegisterNodeRequest {
                    inventory: Some(inv),
                })
                .await;
            for _ in 0..2 {
                let (ctx, stop, hits, rogue) =
                    (ctx.clone(), stop.clone(), hits.clone(), rogue.clone());
                tasks.spawn(async move {
                    while !stop.is_cancelled() {
                        let i = ctx.next();
                        let name = format!("percent-{i}");
                        let Ok(uid) = ctx.add_pod(gpu_pod(&name, "gpuledger-scheduler")) else {
                            continue;
                        };
                        let r = ctx
                            .extender
                            .clone()
                            .reserve(api::ReserveRequest {
                                request: Some(pod_request(&uid, &name, 0, 100)),
                                node: rogue.clone(),
                                ttl_ms: 0,
                            })
                            .await;
                        if r.is_ok() {
                            hits.fetch_add(1, Ordering::Relaxed);
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                });
            }
        }
        "whole-gpu-for-plain-pod" => {
            for _ in 0..2 {
                let (ctx, stop, hits) = (ctx.clone(), stop.clone(), hits.clone());
                tasks.spawn(async move {
                    while !stop.is_cancelled() {
                        let i = ctx.next();
                        let name = format!("nginx-{i}");
                        let plain = json!({"metadata": {"name": name, "namespace": NS},
                            "spec": {"schedulerName": "another-scheduler",
                                     "containers": [{"name": "nginx", "image": "nginx"}]}});
                        let Ok(uid) = ctx.add_pod(plain) else {
                            continue;
                        };
                        let node = ctx.nodes[i as usize % ctx.nodes.len()].clone();
                        let mut req = pod_request(&uid, &name, 0, 100);
                        req.containers[0].core_milli = 1000;
                        let mut e = ctx.extender.clone();
                        let r = e
                            .reserve(api::ReserveRequest {
                                request: Some(req),
                                node: node.clone(),
                                ttl_ms: 0,
                            })
                            .await;
                        if r.is_ok()
                            && e.confirm_bound(api::ConfirmBoundRequest { pod_uid: uid, node })
                                .await
                                .is_ok()
                        {
                            hits.fetch_add(1, Ordering::Relaxed);
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                });
            }
        }
        "fake-filters" => {
            for _ in 0..4 {
                let (ctx, stop, hits) = (ctx.clone(), stop.clone(), hits.clone());
                tasks.spawn(async move {
                    while !stop.is_cancelled() {
                        let i = ctx.next();
                        let pod = gpu_pod(&format!("ghost-{i}"), "gpuledger-scheduler");
                        let mut pod = pod;
                        pod["metadata"]["uid"] = json!(format!("ghost-uid-{i}"));
                        let r = ctx
                            .scheduler
                            .post(
                                "filter",
                                &json!({"Pod": pod, "Nodes": null, "NodeNames": ctx.nodes}),
                            )
                            .await;
                        if r.is_ok() {
                            hits.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        }
        "junk-tokens" => {
            let dir = tempfile::tempdir()?;
            let dir = Arc::new(dir);
            for w in 0..4 {
                let (ctx, stop, hits, dir) = (ctx.clone(), stop.clone(), hits.clone(), dir.clone());
                tasks.spawn(async move {
                    let file = dir.path().join(format!("token-{w}"));
                    while !stop.is_cancelled() {
                        let i = ctx.next();
                        let token = if i % 2 == 0 {
                            format!("junk-{i}")
                        } else {
                            let b = |s: &str| {
                                use base64::Engine;
                                base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s)
                            };
                            format!(
                                "{}.{}.sig",
                                b("{}"),
                                b(&format!(
                                    r#"{{"aud":["gpuledger"],"exp":4000000000,"n":{i}}}"#
                                ))
                            )
                        };
                        if std::fs::write(&file, token).is_err() {
                            return;
                        }
                        let creds = gpuledger_auth::CredentialArgs {
                            ca: Some(ctx.ids.pki.ca_file().to_path_buf()),
                            token_file: Some(file.clone()),
                            ..Default::default()
                        };
                        if let Ok(mut c) = connect(&ctx.addrs[i as usize % ctx.addrs.len()], &creds)
                        {
                            let _ = c.status(api::StatusRequest {}).await;
                            hits.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        }
        "heavy-reads" => {
            for w in 0..4 {
                let mut v = ctx.client(w, &Role::Viewer)?;
                let (stop, hits) = (stop.clone(), hits.clone());
                tasks.spawn(async move {
                    while !stop.is_cancelled() {
                        if w % 2 == 0 {
                            let r = v
                                .filter(api::FilterRequest {
                                    request: Some(pod_request("heavy", "heavy", 1000, 0)),
                                    nodes: vec![],
                                })
                                .await;
                            if r.is_ok() {
                                hits.fetch_add(1, Ordering::Relaxed);
                            }
                        } else if let Ok(s) = v
                            .read_log(api::ReadLogRequest {
                                from_seq: 1,
                                to_seq: 0,
                            })
                            .await
                        {
                            let mut s = s.into_inner();
                            while let Ok(Some(_)) = s.message().await {}
                            hits.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        }
        "forged-forwarding" => {
            let mut allocator = ctx.client(0, &Role::Allocator)?;
            let (stop, hits) = (stop.clone(), hits.clone());
            let node = ctx.nodes[0].clone();
            tasks.spawn(async move {
                let admin = gpuledger_auth::identity::Caller {
                    role: Role::Admin,
                    subject: "system:serviceaccount:gpuledger-system:invented".into(),
                };
                while !stop.is_cancelled() {
                    let mut r = tonic::Request::new(api::SetDeviceHealthRequest {
                        node: node.clone(),
                        gpu_uuid: format!("GPU-{node}-7"),
                        healthy: true,
                        reason: "forged".into(),
                        xid: 0,
                    });
                    if let Ok(v) = gpuledger_auth::server::on_behalf_of(&admin)
                        .to_str()
                        .map(str::to_string)
                        && let Ok(v) = v.parse()
                    {
                        r.metadata_mut()
                            .insert(gpuledger_auth::server::ON_BEHALF_OF, v);
                    }
                    if allocator.set_device_health(r).await.is_ok() {
                        hits.fetch_add(1, Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            });
        }
        other => anyhow::bail!("no attack {other}"),
    }
    stop.cancelled().await;
    tasks.shutdown().await;
    let n = hits.load(Ordering::Relaxed);
    Ok(match name {
        "slow-bodies" => format!("{n} slow bodies started"),
        "idle-tcp" => format!("{n} idle connections opened"),
        "viewer-streams" => format!("{n} streams opened"),
        "violation-flood" => format!("{n} 256 KiB violations written"),
        "foreign-certs" => format!("{n} foreign binds accepted"),
        "absurd-inventory" => format!("{n} percent reserves granted"),
        "whole-gpu-for-plain-pod" => format!("{n} plain pods given a GPU"),
        "fake-filters" => format!("{n} filters answered"),
        "junk-tokens" => format!("{n} junk calls"),
        "heavy-reads" => format!("{n} heavy reads"),
        "forged-forwarding" => format!("{n} forged writes accepted"),
        _ => String::new(),
    })
}

/// `gpuledger_allocator_leaderships_total` summed over the replicas that answer.
async fn leaderships(http: &[String]) -> u64 {
    let mut n = 0;
    for h in http {
        if let Ok((_, text)) = gpuledger_testkit::http::get(&format!("http://{h}/metrics")).await {
            n += text
                .lines()
                .find_map(|l| l.strip_prefix("gpuledger_allocator_leaderships_total "))
                .and_then(|v| v.trim().parse::<f64>().ok())
                .unwrap_or(0.0) as u64;
        }
    }
    n
}

/// Run the benchmark.
pub async fn run(a: Args) -> Result<()> {
    let open_files = gpuledger_auth::limit::raise_open_files();
    title(&format!(
        "hostile: {} s of honest load per phase ({} clients), {} allocators, {} nodes; open files {open_files:?}",
        a.seconds, a.concurrency, a.allocators, a.nodes
    ));
    let hook_port = gpuledger_testkit::free_port()?;
    let mut stack = KubeStack::start(StackOptions {
        etcd_members: 1,
        allocators: a.allocators,
        allocator_flags: vec![],
        extender_flags: Some(vec![format!("--webhook-listen=127.0.0.1:{hook_port}")]),
    })
    .await?;
    gpuledger_testkit::kube::stack::wait_http(hook_port, Duration::from_secs(20)).await?;
    let ext_port: u16 = stack
        .extender_url
        .trim_end_matches("/gpuledger")
        .rsplit(':')
        .next()
        .unwrap_or_default()
        .parse()?;
    let nodes: Vec<String> = (0..a.nodes).map(|i| format!("gpu-{i}")).collect();
    let mut agents = Vec::new();
    for n in &nodes {
        stack.api.add_node(n, 64 * 8)?;
        let mut c = connect(
            &stack.allocs.addrs[0],
            &stack
                .ids
                .credentials(&Role::NodeAgent { node: n.clone() })?,
        )?;
        c.register_node(api::RegisterNodeRequest {
            inventory: Some(inventory(n, 8, 80_000, "NVIDIA A100-SXM4-80GB")),
        })
        .await?;
        agents.push(c);
    }
    let ctx = Arc::new(Ctx {
        store: stack.api.store.clone(),
        addrs: stack.allocs.addrs.clone(),
        ids: stack.ids.clone(),
        hook_port,
        ext_port,
        nodes,
        scheduler: ExtenderClient::new(stack.extender_config()?)?,
        extender: connect(
            &stack.allocs.addrs[0],
            &stack.ids.credentials(&Role::Extender)?,
        )?,
        admin: connect(
            &stack.allocs.addrs[0],
            &stack.ids.credentials(&Role::Admin)?,
        )?,
        agents,
        seq: AtomicU64::new(0),
    });
    let d = Duration::from_secs(a.seconds.max(1));
    // Warm up connections and caches.
    measure(&ctx, Duration::from_secs(2), a.concurrency).await?;
    let quiet = measure(&ctx, d, a.concurrency).await?;
    let quiet_p99 = q_ms(&quiet.latency, 0.99).max(0.001);
    let leaderships_before = leaderships(&stack.allocs.http).await;
    println!(
        "\n{:<24} {:>9} {:>10} {:>9} {:>8}  attack",
        "phase", "honest ok", "p99 ms", "p99/quiet", "ops"
    );
    println!(
        "{:<24} {:>9.4} {:>10.1} {:>9.2} {:>8}  -",
        "quiet",
        quiet.success(),
        q_ms(&quiet.latency, 0.99),
        1.0,
        quiet.total
    );
    let (mut attacks, mut success_min, mut ratio_max) = (0, f64::INFINITY, 0.0f64);
    let mut errors = Vec::new();
    for (name, what) in ATTACKS {
        if !name.contains(a.only.as_str()) {
            continue;
        }
        attacks += 1;
        let stop = CancellationToken::new();
        let running = tokio::spawn({
            let (ctx, stop, name, a) = (ctx.clone(), stop.clone(), name.to_string(), a.clone());
            async move { attack(&name, ctx, &a, stop).await }
        });
        // Full strength before measuring.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let under = measure(&ctx, d, a.concurrency).await?;
        stop.cancel();
        let done = running
            .await?
            .unwrap_or_else(|e| format!("attack failed: {e:#}"));
        let p99 = q_ms(&under.latency, 0.99);
        let ratio = p99 / quiet_p99;
        success_min = success_min.min(under.success());
        ratio_max = ratio_max.max(ratio);
        println!(
            "{name:<24} {:>9.4} {:>10.1} {ratio:>9.2} {:>8}  {what}: {done}",
            under.success(),
            p99,
            under.total
        );
        if let Some(e) = under.error {
            errors.push(format!("{name}: {e}"));
        }
        // Let the attack's connections drain before the next one.
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    for e in &errors {
        println!("first honest error under {e}");
    }
    let lease_losses = leaderships(&stack.allocs.http)
        .await
        .saturating_sub(leaderships_before);
    let mut exits = 0;
    for p in stack
        .allocs
        .procs
        .iter_mut()
        .chain(stack.extender.iter_mut())
    {
        if let Some(st) = p.exited() {
            exits += 1;
            println!("{} exited ({st}):\n{}", p.name, p.log_tail(10));
        }
    }
    let bin = gpuledger_testkit::bin_path("gpuledger")?;
    let mut args = vec![
        "verify".to_string(),
        format!("--allocator={}", stack.allocs.addrs.join(",")),
    ];
    args.extend(credential_flags(&stack.ids.credentials(&Role::Viewer)?));
    let out = tokio::process::Command::new(&bin)
        .args(&args)
        .output()
        .await
        .with_context(|| format!("running {}", bin.display()))?;
    let verified = out.status.success();
    if !verified {
        println!(
            "gpuledger verify failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    if success_min.is_infinite() {
        success_min = quiet.success();
    }
    println!(
        "attacks={attacks} honest_success_min={success_min:.4} p99_ratio_max={ratio_max:.2} \
         quiet_p99_ms={:.1} quiet_success={:.4} lease_losses={lease_losses} process_exits={exits} \
         verify={}",
        q_ms(&quiet.latency, 0.99),
        quiet.success(),
        if verified { "ok" } else { "failed" }
    );
    Ok(())
}
