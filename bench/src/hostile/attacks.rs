//! The attacks of the hostile-load list, each as an attacker would run it: its own clients
//! and connections (from eight loopback addresses of its own where an address matters), at full strength, and
//! trying again whatever it was refused — each new attempt paced by the [`Governor`], so that
//! an attacker pays for its attempts with its own CPU budget, as one on its own machine would.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use gpuledger_auth::identity::Role;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::attacker::{
    ClientFrom, allocator_from, bodiless, channel_from, post_once, raw_unary, tcp_from, tls_as,
    tls_from, tls_trusting,
};
use gpuledger_testkit::kube::{ExtenderClient, ExtenderConfig};
use gpuledger_testkit::workload::inventory;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use super::cpu::Governor;
use super::{Args, Ctx, NS, gpu_pod, pod_request};

/// The attacks, by name, each with a line on what it does.
pub const ATTACKS: [(&str, &str); 19] = [
    (
        "slow-bodies",
        "webhook: bodies of 1 MB promised, a byte every 2 s, from 8 addresses; refused ones retried",
    ),
    (
        "idle-tcp",
        "allocators: TCP connections that never send a ClientHello, from 8 addresses; reopened when cut",
    ),
    (
        "viewer-streams",
        "a viewer opens Subscribe streams, 5,000 per connection, and holds them; refused ones retried each second",
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
        "the extender's identity reserves and confirms a whole GPU for non-GPU pods of another scheduler",
    ),
    (
        "fake-filters",
        "the scheduler's identity sends /filter for pods that never bind",
    ),
    (
        "junk-tokens",
        "distinct junk and forged tokens, each on a new connection",
    ),
    (
        "heavy-reads",
        "a viewer's Filter over every node and ReadLog from the start, in a loop",
    ),
    (
        "forged-forwarding",
        "an allocator's token with a forwarding header claiming an admin",
    ),
    (
        "forwarded-brake",
        "an admin holds its calls in flight on the leader and writes through the follower, whose forwards the leader refuses",
    ),
    (
        "bodiless-requests",
        "a viewer's calls with headers and no message, 64 per connection from 8 addresses; reopened when cut",
    ),
    (
        "undecodable",
        "an admin sends messages that do not decode, to every write and read",
    ),
    (
        "idle-plain-http",
        "idle TCP connections to every plain HTTP port (probes, /metrics), from 8 addresses; reopened when cut",
    ),
    (
        "webhook-reserve-fill",
        "idle TLS connections to the webhook: 4 addresses at the per-peer limit, 8 more at 15 each; reopened when cut",
    ),
    (
        "scheduler-cert-copy",
        "a copy of the scheduler's certificate sends /filter from 8 other addresses, as fast as it can",
    ),
    (
        "log-scans",
        "a viewer's 128 loops of ReadLog from seq 1 (16 per connection from 8 addresses), each stream read to its end",
    ),
    (
        "anonymous-reviews",
        "admission reviews without credentials, from 8 addresses: /mutate of kube-system DRA pods and /validate, each of a new shape",
    ),
];

/// The control phase: no attack, the attackers' CPU budget burnt in a loop.
pub const CPU_BURN: &str = "cpu-burn";

/// What an attacker did.
#[derive(Debug, Default)]
pub struct Tally {
    /// Attempts the servers accepted (a connection held, a stream opened, a call answered).
    pub ok: AtomicU64,
    /// Attempts refused or cut.
    pub refused: AtomicU64,
    /// Connections or streams held now.
    held: AtomicI64,
    /// The most held at once.
    pub held_max: AtomicI64,
}

impl Tally {
    fn ok(&self) {
        self.ok.fetch_add(1, Ordering::Relaxed);
    }

    /// One call answered (`ok`) or refused.
    fn answered(&self, ok: bool) {
        if ok { self.ok() } else { self.refused() }
    }

    fn refused(&self) {
        self.refused.fetch_add(1, Ordering::Relaxed);
    }

    /// One more held until the guard drops.
    fn hold(self: &Arc<Self>) -> Held {
        let n = self.held.fetch_add(1, Ordering::Relaxed) + 1;
        self.held_max.fetch_max(n, Ordering::Relaxed);
        self.ok();
        Held(self.clone())
    }

    /// What the attack did in `secs` seconds, in words.
    pub fn describe(&self, name: &str, secs: f64) -> String {
        let (ok, refused) = (
            self.ok.load(Ordering::Relaxed),
            self.refused.load(Ordering::Relaxed),
        );
        let held = self.held_max.load(Ordering::Relaxed);
        let rate = |n: u64| n as f64 / secs.max(0.001);
        match name {
            "slow-bodies" => format!(
                "{held} slow bodies held at most, {ok} started ({:.0}/s), {refused} connections refused or cut ({:.0}/s)",
                rate(ok),
                rate(refused)
            ),
            "idle-tcp" => format!(
                "{held} idle connections held at most, {ok} opened ({:.0}/s), {refused} failed",
                rate(ok)
            ),
            "viewer-streams" => format!(
                "{held} streams held at most, {refused} refused ({:.0}/s)",
                rate(refused)
            ),
            "violation-flood" => format!(
                "{ok} 256 KiB violations written, {refused} refused ({:.0}/s)",
                rate(refused)
            ),
            "foreign-certs" => format!(
                "{ok} foreign binds accepted, {refused} refused ({:.0}/s)",
                rate(refused)
            ),
            "absurd-inventory" => format!(
                "{ok} percent reserves granted, {refused} refused ({:.0}/s)",
                rate(refused)
            ),
            "whole-gpu-for-plain-pod" => format!(
                "{ok} plain pods given a GPU, {refused} refused ({:.0}/s)",
                rate(refused)
            ),
            "fake-filters" => format!("{ok} filters answered ({:.0}/s)", rate(ok)),
            "junk-tokens" => format!(
                "{} junk calls ({:.0}/s), {ok} of them answered",
                ok + refused,
                rate(ok + refused)
            ),
            "heavy-reads" => format!("{ok} heavy reads ({:.0}/s)", rate(ok)),
            "forwarded-brake" => format!(
                "{ok} writes through the follower, {refused} refused ({:.0}/s)",
                rate(refused)
            ),
            "bodiless-requests" => format!(
                "{held} calls without a message held at most, {ok} started, {refused} cut or refused"
            ),
            "undecodable" => format!(
                "{} undecodable messages ({:.0}/s), {refused} not answered INVALID_ARGUMENT",
                ok + refused,
                rate(ok + refused)
            ),
            "log-scans" => format!(
                "{ok} whole-log scans ({:.1}/s), {refused} refused or cut ({:.0}/s)",
                rate(ok),
                rate(refused)
            ),
            "forged-forwarding" => format!(
                "{ok} forged writes accepted, {refused} refused ({:.0}/s)",
                rate(refused)
            ),
            "idle-plain-http" | "webhook-reserve-fill" => format!(
                "{held} idle connections held at most, {ok} opened ({:.0}/s), {refused} refused or cut",
                rate(ok)
            ),
            "anonymous-reviews" => format!(
                "{ok} reviews answered ({:.0}/s), {refused} refused or failed",
                rate(ok)
            ),
            "scheduler-cert-copy" => format!(
                "{ok} filters answered ({:.0}/s), {refused} refused ({:.0}/s)",
                rate(ok),
                rate(refused)
            ),
            CPU_BURN => "no calls; the attackers' CPU budget burnt".to_string(),
            _ => String::new(),
        }
    }
}

/// An AdmissionReview no API server sent: `/mutate` of a DRA pod in kube-system, or
/// `/validate` of a pod, asking `mib` MiB of GPU memory.
fn anonymous_review(mutate: bool, mib: u64) -> (&'static str, Vec<u8>) {
    let pod = json!({"metadata": {"name": format!("anon-{mib}"), "namespace": "kube-system",
            "annotations": {"gpuledger.io/path": "dra"}},
        "spec": {"containers": [{"name": "c", "image": "x",
            "resources": {"limits": {"gpuledger.io/gpu-mem": mib.to_string()}}}]}});
    let review = json!({"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1",
        "request": {"uid": format!("anon-{mib}"), "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "kube-system", "operation": "CREATE",
            "userInfo": {"username": "nobody"}, "object": pod}});
    let path = if mutate { "/mutate" } else { "/validate" };
    (path, serde_json::to_vec(&review).unwrap_or_default())
}

/// One connection or stream held, counted in its [`Tally`] until dropped.
struct Held(Arc<Tally>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The loopback addresses of one attack: eight of its own network, 127.0.`net`.2 to .9, so
/// that what the stack holds against one attack's addresses (a refused peer's penalty, its
/// connection count) does not fall on the next attack, as two attacking pods would not share
/// an address either.
#[derive(Debug, Clone, Copy)]
struct Sources(u8);

impl Sources {
    /// The sources of attack `name`: network 1 + its place in [`ATTACKS`] (the control: 1).
    fn of(name: &str) -> Self {
        let place = ATTACKS.iter().position(|(n, _)| *n == name).unwrap_or(0);
        Sources(u8::try_from(place + 1).unwrap_or(u8::MAX))
    }

    /// The address of attacker `i` of 8.
    fn addr(self, i: usize) -> String {
        self.nth(i % 8)
    }

    /// The `i`th address of this attack's network (of 250).
    fn nth(self, i: usize) -> String {
        format!("127.0.{}.{}", self.0, 2 + i % 250)
    }
}

/// An allocator client from attacker address `i` of `from`, as `role`.
fn client(ctx: &Ctx, from: Sources, i: usize, role: &Role) -> Result<ClientFrom> {
    allocator_from(
        &from.addr(i),
        &ctx.addrs[i % ctx.addrs.len()],
        &ctx.ids.credentials(role)?,
    )
}

/// A client of the extender's scheduler port as kube-scheduler (its stolen identity).
fn scheduler(ctx: &Ctx) -> Result<ExtenderClient> {
    ExtenderClient::new(ExtenderConfig::gpuledger(
        &ctx.ext_url,
        Some(gpuledger_testkit::kube::stack::scheduler_tls(&ctx.ids.pki)?),
    ))
}

/// A request whose body never ends: headers promising 1 MB, then a byte every 2 s, until the
/// server cuts the connection.
async fn slow_body(
    connector: &tokio_rustls::TlsConnector,
    source: &str,
    to: SocketAddr,
    tally: &Arc<Tally>,
) -> std::io::Result<()> {
    let mut s = tls_from(connector, source, to).await?;
    s.write_all(b"POST /mutate HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: 1000000\r\n\r\n{")
        .await?;
    let _held = tally.hold();
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        s.write_all(b" ").await?;
    }
}

/// [`tcp_from`] with an owned source, for a closure that opens again and again.
async fn tcp_from_owned(source: String, to: SocketAddr) -> std::io::Result<tokio::net::TcpStream> {
    tcp_from(&source, to).await
}

/// Hold a connection `open` makes from `source` until the server closes it or `stop`; again
/// whenever it is refused or cut.
async fn hold_idle<S, F>(
    open: impl Fn() -> F,
    stop: CancellationToken,
    tally: Arc<Tally>,
    gov: Arc<Governor>,
) where
    S: tokio::io::AsyncRead + Unpin,
    F: std::future::Future<Output = std::io::Result<S>>,
{
    while !stop.is_cancelled() {
        gov.pace().await;
        match open().await {
            Ok(mut s) => {
                let _held = tally.hold();
                let mut b = [0u8; 1];
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = s.read(&mut b) => {}
                }
            }
            Err(_) => tally.refused(),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Run attack `name` until `stop`, each new attempt paced by `gov`, counting in `tally`.
pub async fn run(
    name: &str,
    ctx: Arc<Ctx>,
    a: &Args,
    gov: Arc<Governor>,
    tally: Arc<Tally>,
    stop: CancellationToken,
) -> Result<()> {
    let mut tasks = tokio::task::JoinSet::new();
    let from = Sources::of(name);
    match name {
        CPU_BURN => {
            for _ in 0..2 {
                let (gov, stop) = (gov.clone(), stop.clone());
                tasks.spawn(async move {
                    while !stop.is_cancelled() {
                        gov.pace().await;
                        let t = std::time::Instant::now();
                        while t.elapsed() < Duration::from_millis(1) {
                            std::hint::spin_loop();
                        }
                        tokio::task::yield_now().await;
                    }
                });
            }
        }
        "slow-bodies" => {
            let connector = tls_trusting(ctx.ids.pki.ca_file())?;
            let to = SocketAddr::from(([127, 0, 0, 1], ctx.hook_port));
            for i in 0..a.slow_connections {
                let (connector, stop, tally, gov) =
                    (connector.clone(), stop.clone(), tally.clone(), gov.clone());
                tasks.spawn(async move {
                    let from = from.addr(i);
                    while !stop.is_cancelled() {
                        gov.pace().await;
                        tokio::select! {
                            _ = stop.cancelled() => return,
                            _ = slow_body(&connector, &from, to, &tally) => tally.refused(),
                        }
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                });
            }
        }
        "idle-tcp" => {
            for i in 0..a.idle_connections * ctx.addrs.len() {
                let to: SocketAddr = ctx.addrs[i % ctx.addrs.len()].parse()?;
                let source = from.addr(i);
                let open = move || tcp_from_owned(source.clone(), to);
                tasks.spawn(hold_idle(open, stop.clone(), tally.clone(), gov.clone()));
            }
        }
        "idle-plain-http" => {
            // 8 addresses, each at twice the per-peer default (32), on every plain port.
            for i in 0..64 * ctx.plain.len() {
                let to = ctx.plain[i % ctx.plain.len()];
                let source = from.addr(i / ctx.plain.len());
                let open = move || tcp_from_owned(source.clone(), to);
                tasks.spawn(hold_idle(open, stop.clone(), tally.clone(), gov.clone()));
            }
        }
        "webhook-reserve-fill" => {
            let connector = tls_trusting(ctx.ids.pki.ca_file())?;
            let to = SocketAddr::from(([127, 0, 0, 1], ctx.hook_port));
            // The webhook's defaults: 1,024 connections, 256 per peer.
            let held = (0..4)
                .flat_map(|p| [p; 256])
                .chain((4..12).flat_map(|p| [p; 15]));
            for p in held {
                let (connector, source) = (connector.clone(), from.nth(p));
                let open = move || {
                    let (connector, source) = (connector.clone(), source.clone());
                    async move { tls_from(&connector, &source, to).await }
                };
                tasks.spawn(hold_idle(open, stop.clone(), tally.clone(), gov.clone()));
            }
        }
        "anonymous-reviews" => {
            // Whoever reaches the webhook: a DRA pod of kube-system to convert (which once had
            // the extender create a template there) and a pod to validate (which once was a
            // Filter over every node), each of a shape never sent before.
            let connector = tls_trusting(ctx.ids.pki.ca_file())?;
            let to = SocketAddr::from(([127, 0, 0, 1], ctx.hook_port));
            let shape = Arc::new(AtomicU64::new(1));
            for i in 0..16 {
                let (connector, stop, tally, gov, shape) = (
                    connector.clone(),
                    stop.clone(),
                    tally.clone(),
                    gov.clone(),
                    shape.clone(),
                );
                tasks.spawn(async move {
                    let source = from.addr(i);
                    while !stop.is_cancelled() {
                        gov.pace().await;
                        let mib = shape.fetch_add(1, Ordering::Relaxed) % 16_000 + 1;
                        let (path, review) = anonymous_review(i % 2 == 0, mib);
                        let answered = async {
                            let s = tls_from(&connector, &source, to).await?;
                            post_once(s, path, &review).await
                        };
                        match answered.await {
                            Ok(200) => tally.ok(),
                            _ => tally.refused(),
                        }
                    }
                });
            }
        }
        "scheduler-cert-copy" => {
            let (cert, key) = ctx.ids.pki.peer("gpuledger-scheduler")?;
            let connector = tls_as(ctx.ids.pki.ca_file(), &cert, &key)?;
            let to: SocketAddr = ctx
                .ext_url
                .trim_start_matches("https://")
                .trim_end_matches("/gpuledger")
                .parse()?;
            let body = serde_json::to_vec(&json!({"Pod": gpu_pod("copy", "gpuledger-scheduler"),
                "Nodes": null, "NodeNames": ctx.nodes}))?;
            for i in 0..16 {
                let (connector, stop, tally, gov, body) = (
                    connector.clone(),
                    stop.clone(),
                    tally.clone(),
                    gov.clone(),
                    body.clone(),
                );
                tasks.spawn(async move {
                    let source = from.addr(i);
                    while !stop.is_cancelled() {
                        gov.pace().await;
                        let answered = async {
                            let s = tls_from(&connector, &source, to).await?;
                            post_once(s, "/filter", &body).await
                        };
                        match answered.await {
                            Ok(200) => tally.ok(),
                            _ => tally.refused(),
                        }
                    }
                });
            }
        }
        "viewer-streams" => {
            let conns = a.streams.div_ceil(5000).max(1);
            let viewers: Vec<ClientFrom> = (0..conns)
                .map(|i| client(&ctx, from, i, &Role::Viewer))
                .collect::<Result<_>>()?;
            for i in 0..a.streams {
                let mut v = viewers[i % conns].clone();
                let (stop, tally, gov, node) = (
                    stop.clone(),
                    tally.clone(),
                    gov.clone(),
                    ctx.nodes[0].clone(),
                );
                tasks.spawn(async move {
                    while !stop.is_cancelled() {
                        gov.pace().await;
                        let sub = v.subscribe(api::SubscribeRequest {
                            node: node.clone(),
                            from_seq: 0,
                        });
                        let held = async {
                            match sub.await {
                                Ok(s) => {
                                    let _held = tally.hold();
                                    let mut s = s.into_inner();
                                    while let Ok(Some(_)) = s.message().await {}
                                }
                                Err(_) => tally.refused(),
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
            let id = client(&ctx, from, 0, &Role::Extender)?
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
            // The compromised node agent's own connection.
            let agent = client(&ctx, from, 0, &Role::NodeAgent { node: node.clone() })?;
            for _ in 0..4 {
                let (mut c, stop, tally, gov, node) = (
                    agent.clone(),
                    stop.clone(),
                    tally.clone(),
                    gov.clone(),
                    node.clone(),
                );
                tasks.spawn(async move {
                    let action = "x".repeat(256 * 1024 - 64);
                    while !stop.is_cancelled() {
                        gov.pace().await;
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
                        tally.answered(r.is_ok());
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
                let mut cfg = ExtenderConfig::gpuledger(
                    &ctx.ext_url,
                    Some(gpuledger_testkit::kube::stack::scheduler_tls(&ctx.ids.pki)?),
                );
                if let Some(t) = cfg.tls.as_mut() {
                    t.cert = cert;
                    t.key = key;
                }
                let client = ExtenderClient::new(cfg)?;
                let (ctx, stop, tally, gov) =
                    (ctx.clone(), stop.clone(), tally.clone(), gov.clone());
                tasks.spawn(async move {
                    while !stop.is_cancelled() {
                        gov.pace().await;
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
                        tally.answered(matches!(&r, Ok(v) if v["Error"] == ""));
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                });
            }
        }
        "absurd-inventory" => {
            let rogue = "rogue-node".to_string();
            let mut agent = client(
                &ctx,
                from,
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
            let extender = client(&ctx, from, 1, &Role::Extender)?;
            for _ in 0..2 {
                let (ctx, stop, tally, gov, rogue, mut e) = (
                    ctx.clone(),
                    stop.clone(),
                    tally.clone(),
                    gov.clone(),
                    rogue.clone(),
                    extender.clone(),
                );
                tasks.spawn(async move {
                    while !stop.is_cancelled() {
                        gov.pace().await;
                        let i = ctx.next();
                        let name = format!("percent-{i}");
                        let Ok(uid) = ctx.add_pod(gpu_pod(&name, "gpuledger-scheduler")) else {
                            continue;
                        };
                        let r = e
                            .reserve(api::ReserveRequest {
                                request: Some(pod_request(&uid, &name, 0, 100)),
                                node: rogue.clone(),
                                ttl_ms: 0,
                            })
                            .await;
                        tally.answered(r.is_ok());
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                });
            }
        }
        "whole-gpu-for-plain-pod" => {
            let extender = client(&ctx, from, 2, &Role::Extender)?;
            for _ in 0..2 {
                let (ctx, stop, tally, gov, mut e) = (
                    ctx.clone(),
                    stop.clone(),
                    tally.clone(),
                    gov.clone(),
                    extender.clone(),
                );
                tasks.spawn(async move {
                    while !stop.is_cancelled() {
                        gov.pace().await;
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
                            tally.ok();
                        } else {
                            tally.refused();
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                });
            }
        }
        "fake-filters" => {
            let s = scheduler(&ctx)?;
            for _ in 0..4 {
                let (ctx, stop, tally, gov, s) = (
                    ctx.clone(),
                    stop.clone(),
                    tally.clone(),
                    gov.clone(),
                    s.clone(),
                );
                tasks.spawn(async move {
                    while !stop.is_cancelled() {
                        gov.pace().await;
                        let i = ctx.next();
                        let mut pod = gpu_pod(&format!("ghost-{i}"), "gpuledger-scheduler");
                        pod["metadata"]["uid"] = json!(format!("ghost-uid-{i}"));
                        let r = s
                            .post(
                                "filter",
                                &json!({"Pod": pod, "Nodes": null, "NodeNames": ctx.nodes}),
                            )
                            .await;
                        tally.answered(r.is_ok());
                    }
                });
            }
        }
        "junk-tokens" => {
            let dir = Arc::new(tempfile::tempdir()?);
            for w in 0..4 {
                let (ctx, stop, tally, gov, dir) = (
                    ctx.clone(),
                    stop.clone(),
                    tally.clone(),
                    gov.clone(),
                    dir.clone(),
                );
                tasks.spawn(async move {
                    let file = dir.path().join(format!("token-{w}"));
                    while !stop.is_cancelled() {
                        gov.pace().await;
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
                        let addr = &ctx.addrs[i as usize % ctx.addrs.len()];
                        let answered = match allocator_from(&from.addr(w), addr, &creds) {
                            Ok(mut c) => c.status(api::StatusRequest {}).await.is_ok(),
                            Err(_) => false,
                        };
                        tally.answered(answered);
                    }
                });
            }
        }
        "heavy-reads" => {
            for w in 0..4 {
                let mut v = client(&ctx, from, w, &Role::Viewer)?;
                let (stop, tally, gov) = (stop.clone(), tally.clone(), gov.clone());
                tasks.spawn(async move {
                    while !stop.is_cancelled() {
                        gov.pace().await;
                        if w % 2 == 0 {
                            let r = v
                                .filter(api::FilterRequest {
                                    request: Some(pod_request("heavy", "heavy", 1000, 0)),
                                    nodes: vec![],
                                })
                                .await;
                            tally.answered(r.is_ok());
                        } else if let Ok(s) = v
                            .read_log(api::ReadLogRequest {
                                from_seq: 1,
                                to_seq: 0,
                            })
                            .await
                        {
                            let mut s = s.into_inner();
                            while let Ok(Some(_)) = s.message().await {}
                            tally.ok();
                        } else {
                            tally.refused();
                        }
                    }
                });
            }
        }
        "forged-forwarding" => {
            let mut allocator = client(&ctx, from, 0, &Role::Allocator)?;
            let (stop, tally, gov) = (stop.clone(), tally.clone(), gov.clone());
            let node = ctx.nodes[0].clone();
            tasks.spawn(async move {
                let admin = gpuledger_auth::identity::Caller {
                    role: Role::Admin,
                    subject: "system:serviceaccount:gpuledger-system:invented".into(),
                };
                while !stop.is_cancelled() {
                    gov.pace().await;
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
                    tally.answered(allocator.set_device_health(r).await.is_ok());
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            });
        }
        "forwarded-brake" => {
            // The follower: the replica that does not lead.
            let mut follower = None;
            for (i, addr) in ctx.addrs.iter().enumerate() {
                let mut c =
                    allocator_from(&from.addr(i), addr, &ctx.ids.credentials(&Role::Admin)?)?;
                if c.status(api::StatusRequest {}).await?.into_inner().role == "follower" {
                    follower = Some(i);
                }
            }
            let follower = follower.context("no follower: run with --allocators 2 or more")?;
            let leader = (follower + 1) % ctx.addrs.len();
            // Dumps that wait their turn hold the admin's calls in flight on the leader...
            for w in 0..16 {
                let mut c = allocator_from(
                    &from.addr(w),
                    &ctx.addrs[leader],
                    &ctx.ids.credentials(&Role::Admin)?,
                )?;
                let (stop, gov) = (stop.clone(), gov.clone());
                tasks.spawn(async move {
                    while !stop.is_cancelled() {
                        gov.pace().await;
                        let _ = c.dump(api::DumpRequest {}).await;
                    }
                });
            }
            // ...while its writes through the follower are forwarded to the leader.
            let through = allocator_from(
                &from.addr(0),
                &ctx.addrs[follower],
                &ctx.ids.credentials(&Role::Admin)?,
            )?;
            for _ in 0..4 {
                let (mut c, stop, tally, gov, node) = (
                    through.clone(),
                    stop.clone(),
                    tally.clone(),
                    gov.clone(),
                    ctx.nodes[0].clone(),
                );
                tasks.spawn(async move {
                    while !stop.is_cancelled() {
                        gov.pace().await;
                        let r = c
                            .set_device_health(api::SetDeviceHealthRequest {
                                node: node.clone(),
                                gpu_uuid: format!("GPU-{node}-7"),
                                healthy: true,
                                reason: "forwarded".into(),
                                xid: 0,
                            })
                            .await;
                        tally.answered(r.is_ok());
                    }
                });
            }
        }
        "bodiless-requests" => {
            let creds = ctx.ids.credentials(&Role::Viewer)?;
            for w in 0..8 {
                let ch = channel_from(&from.addr(w), &ctx.addrs[w % ctx.addrs.len()], &creds)?;
                for _ in 0..64 {
                    let (ch, stop, tally, gov) =
                        (ch.clone(), stop.clone(), tally.clone(), gov.clone());
                    tasks.spawn(async move {
                        while !stop.is_cancelled() {
                            gov.pace().await;
                            let held = tally.hold();
                            tokio::select! {
                                _ = stop.cancelled() => return,
                                _ = bodiless(ch.clone(), "Status") => {}
                            }
                            drop(held);
                            tally.refused();
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    });
                }
            }
        }
        "undecodable" => {
            let ch = channel_from(
                &from.addr(0),
                &ctx.addrs[0],
                &ctx.ids.credentials(&Role::Admin)?,
            )?;
            for w in 0..2u64 {
                let (ch, stop, tally, gov) = (ch.clone(), stop.clone(), tally.clone(), gov.clone());
                tasks.spawn(async move {
                    let methods = [
                        "RegisterNode",
                        "Reserve",
                        "Release",
                        "SetDeviceHealth",
                        "Filter",
                        "Status",
                    ];
                    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ w;
                    let mut n = 0usize;
                    while !stop.is_cancelled() {
                        gov.pace().await;
                        n += 1;
                        // A field whose length runs past the message, then random bytes.
                        let mut bytes = vec![0x0a, 0x7f];
                        bytes.extend((0..n % 23).map(|_| {
                            x ^= x << 13;
                            x ^= x >> 7;
                            x ^= x << 17;
                            x as u8
                        }));
                        match raw_unary(ch.clone(), methods[n % methods.len()], bytes).await {
                            Err(s) if s.code() == tonic::Code::InvalidArgument => tally.ok(),
                            _ => tally.refused(),
                        }
                    }
                });
            }
        }
        "log-scans" => {
            for c in 0..8 {
                let v = client(&ctx, from, c, &Role::Viewer)?;
                for _ in 0..16 {
                    let (mut v, stop, tally, gov) =
                        (v.clone(), stop.clone(), tally.clone(), gov.clone());
                    tasks.spawn(async move {
                        while !stop.is_cancelled() {
                            gov.pace().await;
                            let scanned = match v
                                .read_log(api::ReadLogRequest {
                                    from_seq: 1,
                                    to_seq: 0,
                                })
                                .await
                            {
                                Ok(s) => {
                                    let mut s = s.into_inner();
                                    loop {
                                        match s.message().await {
                                            Ok(Some(_)) => {}
                                            Ok(None) => break true,
                                            Err(_) => break false,
                                        }
                                    }
                                }
                                Err(_) => false,
                            };
                            tally.answered(scanned);
                        }
                    });
                }
            }
        }
        other => anyhow::bail!("no attack {other}"),
    }
    stop.cancelled().await;
    tasks.shutdown().await;
    Ok(())
}
