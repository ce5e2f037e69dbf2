//! Commands over the live ledger: status, inspect, audit, replay, verify.

use std::collections::BTreeMap;

use anyhow::{Context, Result, bail};
use gpuledger_ledger::pb::event::Body;
use gpuledger_ledger::{Ledger, pb};
use gpuledger_proto::allocator::v1 as api;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::client::{Target, connect, connect_one};
use crate::table::Table;

/// Arguments of `gpuledger inspect`.
#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    #[command(flatten)]
    target: Target,
    /// Also list the allocations (pod, container, share) on every GPU.
    #[arg(short, long)]
    details: bool,
}

/// Arguments of `gpuledger audit`.
#[derive(clap::Args, Debug)]
pub struct AuditArgs {
    #[command(flatten)]
    target: Target,
    /// The pod, as NAMESPACE/NAME or its UID.
    #[arg(long)]
    pod: String,
}

/// Arguments of `gpuledger replay`.
#[derive(clap::Args, Debug)]
pub struct ReplayArgs {
    #[command(flatten)]
    target: Target,
    /// Rebuild the state as it was after this seq, or at this time (RFC 3339, e.g.
    /// 2026-11-21T10:00:00Z). Default: the end of the log.
    #[arg(long)]
    at: Option<String>,
    /// Also list the allocations on every GPU.
    #[arg(short, long)]
    details: bool,
}

/// Arguments of `gpuledger verify`.
#[derive(clap::Args, Debug)]
pub struct VerifyArgs {
    /// Allocator replicas to compare, comma-separated; every one must match the replayed log.
    #[command(flatten)]
    target: Target,
}

/// `gpuledger status`.
pub async fn status(t: Target) -> Result<()> {
    let mut table = Table::new(&[
        "REPLICA", "ADDRESS", "ROLE", "LEADER", "EPOCH", "SEQ", "NODES", "ALLOCS", "READY",
    ]);
    let mut any = false;
    for a in &t.addrs().await? {
        match connect_one(a).await {
            Ok(mut c) => match c.status(api::StatusRequest {}).await {
                Ok(s) => {
                    any = true;
                    let s = s.into_inner();
                    table.row(vec![
                        s.replica,
                        s.address,
                        s.role,
                        s.leader,
                        s.epoch.to_string(),
                        s.seq.to_string(),
                        s.nodes.to_string(),
                        s.allocations.to_string(),
                        if s.ready {
                            "yes".into()
                        } else {
                            format!("no: {}", s.not_ready_reason)
                        },
                    ]);
                }
                Err(e) => table.row(vec![
                    a.clone(),
                    a.clone(),
                    format!("error: {}", e.message()),
                ]),
            },
            Err(e) => table.row(vec![a.clone(), a.clone(), format!("unreachable: {e:#}")]),
        }
    }
    print!("{}", table.render());
    if !any {
        bail!("no allocator replica answered");
    }
    Ok(())
}

fn pct(a: u64, b: u64) -> String {
    (a * 100)
        .checked_div(b)
        .map_or_else(|| "-".into(), |p| format!("{p}%"))
}

/// The inspect table of a state.
pub fn render_state(l: &Ledger, details: bool) -> String {
    let mut t = Table::new(&[
        "NODE",
        "GPU",
        "MODEL",
        "MEMORY (MiB)",
        "MEM%",
        "CORE%",
        "ALLOCS",
        "HEALTH",
    ]);
    let (mut mem_used, mut mem_total, mut core_used, mut gpus) = (0u64, 0u64, 0u64, 0u64);
    let mut by_gpu: BTreeMap<&str, Vec<&gpuledger_ledger::Alloc>> = BTreeMap::new();
    for a in l.allocs().values() {
        for s in &a.shares {
            by_gpu.entry(s.gpu_uuid.as_str()).or_default().push(a);
        }
    }
    for n in l.nodes().values() {
        for g in &n.gpus {
            mem_used += g.mem_used;
            mem_total += g.memory_mib;
            core_used += u64::from(g.core_used);
            gpus += 1;
            t.row(vec![
                n.name.clone(),
                format!("{} {}", g.index, short_uuid(&g.uuid)),
                g.model.clone(),
                format!("{}/{}", g.mem_used, g.memory_mib),
                pct(g.mem_used, g.memory_mib),
                format!("{}%", g.core_used / 10),
                g.holders.to_string(),
                if g.healthy {
                    "ok".into()
                } else {
                    "UNHEALTHY".into()
                },
            ]);
            if details {
                let mut allocs = by_gpu.get(g.uuid.as_str()).cloned().unwrap_or_default();
                allocs.sort_by_key(|a| a.id);
                for a in allocs {
                    let share = a.shares.iter().find(|s| s.gpu_uuid == g.uuid);
                    t.row(vec![
                        String::new(),
                        format!("  #{}", a.id),
                        format!("{}/{}:{}", a.pod.namespace, a.pod.name, a.container),
                        share.map_or(String::new(), |s| s.mem_mib.to_string()),
                        String::new(),
                        share.map_or(String::new(), |s| format!("{}%", s.core_milli / 10)),
                        a.state.as_str().into(),
                        String::new(),
                    ]);
                }
            }
        }
    }
    let mut out = t.render();
    out.push_str(&format!(
        "\nnodes={} gpus={} allocations={} memory={}/{} MiB ({}) compute={}% of {} GPUs seq={} epoch={}\n",
        l.nodes().len(),
        gpus,
        l.allocs().len(),
        mem_used,
        mem_total,
        pct(mem_used, mem_total),
        core_used / 10,
        gpus,
        l.seq(),
        l.epoch()
    ));
    out
}

fn short_uuid(u: &str) -> String {
    let s: String = u.chars().take(12).collect();
    if u.chars().count() > 12 {
        format!("{s}…")
    } else {
        s
    }
}

async fn dump_of(
    c: &mut gpuledger_proto::allocator::v1::allocator_client::AllocatorClient<
        tonic::transport::Channel,
    >,
) -> Result<(String, pb::Snapshot)> {
    let d = c
        .dump(api::DumpRequest {})
        .await
        .map_err(|s| anyhow::anyhow!("dump failed: {}", s.message()))?
        .into_inner();
    Ok((d.replica, d.snapshot.context("dump without a snapshot")?))
}

/// `gpuledger inspect`.
pub async fn inspect(a: InspectArgs) -> Result<()> {
    let mut c = connect(&a.target).await?;
    let (_, snap) = dump_of(&mut c).await?;
    let l =
        Ledger::from_snapshot(&snap).map_err(|e| anyhow::anyhow!("the dump does not load: {e}"))?;
    print!("{}", render_state(&l, a.details));
    Ok(())
}

/// Read the log from seq 1 to `to` (0 = the end), handing each event to `f` (false = stop).
pub(crate) async fn read_log(
    t: &Target,
    to: u64,
    mut f: impl FnMut(&pb::Event) -> Result<bool>,
) -> Result<()> {
    let mut c = connect(t).await?;
    let mut stream = c
        .read_log(api::ReadLogRequest {
            from_seq: 1,
            to_seq: to,
        })
        .await
        .map_err(|s| anyhow::anyhow!("reading the log: {}", s.message()))?
        .into_inner();
    while let Some(b) = stream
        .message()
        .await
        .map_err(|s| anyhow::anyhow!("reading the log: {}", s.message()))?
    {
        for e in &b.events {
            if to > 0 && e.seq > to {
                return Ok(());
            }
            if !f(e)? {
                return Ok(());
            }
        }
    }
    Ok(())
}

fn fmt_time(ms: i64) -> String {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .ok()
        .and_then(|t| t.format(&Rfc3339).ok())
        .unwrap_or_else(|| ms.to_string())
}

/// One line describing an event.
pub fn describe(e: &pb::Event) -> String {
    match &e.body {
        Some(Body::NodeRegistered(r)) => {
            let inv = r.inventory.clone().unwrap_or_default();
            format!(
                "node {} registered with {} GPU(s)",
                inv.node,
                inv.gpus.len()
            )
        }
        Some(Body::NodeRemoved(r)) => format!("node {} removed ({})", r.node, r.reason),
        Some(Body::DeviceHealthChanged(h)) => format!(
            "GPU {} on {} {} ({})",
            h.gpu_uuid,
            h.node,
            if h.healthy { "healthy" } else { "UNHEALTHY" },
            h.reason
        ),
        Some(Body::Reserved(r)) => {
            let pod = r.pod.clone().unwrap_or_default();
            let shares: Vec<String> = r
                .shares
                .iter()
                .map(|s| format!("{} {}MiB {}%", s.gpu_uuid, s.mem_mib, s.core_milli / 10))
                .collect();
            format!(
                "allocation {} reserved for {}/{}:{} on {}: {} ({})",
                r.allocation_id,
                pod.namespace,
                pod.name,
                r.container,
                r.node,
                shares.join(", "),
                r.policy
            )
        }
        Some(Body::Bound(b)) => format!("allocation {} bound ({})", b.allocation_id, b.reason),
        Some(Body::Assigned(a)) => format!(
            "allocation {} assigned to devices {}",
            a.allocation_id,
            a.device_ids.join(",")
        ),
        Some(Body::IdentityCorrected(c)) => format!(
            "allocations {} and {} swapped pods (kubelet gave the devices to the other pod)",
            c.from_allocation_id, c.to_allocation_id
        ),
        Some(Body::Released(r)) => {
            format!("allocation {} released ({})", r.allocation_id, r.reason)
        }
        Some(Body::LimitViolated(v)) => format!(
            "allocation {} pid {} used {} MiB over its {} MiB limit on {}: {}",
            v.allocation_id, v.pid, v.used_mib, v.limit_mib, v.gpu_uuid, v.action
        ),
        Some(Body::LeaderElected(l)) => format!("leader {} ({}) elected", l.replica, l.address),
        Some(Body::QuotaSet(q)) => format!(
            "quota of namespace {} set to {} MiB",
            q.namespace, q.mem_mib
        ),
        None => "(empty event)".into(),
    }
}

/// `gpuledger audit --pod`.
pub async fn audit(a: AuditArgs) -> Result<()> {
    let (ns, name) = a
        .pod
        .split_once('/')
        .map_or((None, a.pod.as_str()), |(n, m)| (Some(n), m));
    let mut ids: Vec<u64> = Vec::new();
    let mut t = Table::new(&["SEQ", "EPOCH", "TIME", "EVENT"]);
    let mut found = 0;
    read_log(&a.target, 0, |e| {
        let mine = match &e.body {
            Some(Body::Reserved(r)) => {
                let p = r.pod.clone().unwrap_or_default();
                let hit = match ns {
                    Some(ns) => p.namespace == ns && p.name == name,
                    None => p.uid == name || p.name == name,
                };
                if hit {
                    ids.push(r.allocation_id);
                }
                hit
            }
            Some(Body::Bound(b)) => ids.contains(&b.allocation_id),
            Some(Body::Assigned(x)) => ids.contains(&x.allocation_id),
            Some(Body::Released(r)) => ids.contains(&r.allocation_id),
            Some(Body::LimitViolated(v)) => ids.contains(&v.allocation_id),
            Some(Body::IdentityCorrected(c)) => {
                ids.contains(&c.from_allocation_id) || ids.contains(&c.to_allocation_id)
            }
            _ => false,
        };
        if mine {
            found += 1;
            t.row(vec![
                e.seq.to_string(),
                e.epoch.to_string(),
                fmt_time(e.time_ms),
                describe(e),
            ]);
        }
        Ok(true)
    })
    .await?;
    if found == 0 {
        bail!("no ledger event concerns pod {}", a.pod);
    }
    print!("{}", t.render());
    Ok(())
}

enum At {
    End,
    Seq(u64),
    Time(i64),
}

fn parse_at(s: Option<&str>) -> Result<At> {
    let Some(s) = s else { return Ok(At::End) };
    if let Ok(n) = s.parse::<u64>() {
        return Ok(At::Seq(n));
    }
    let t = OffsetDateTime::parse(s, &Rfc3339)
        .with_context(|| format!("--at {s:?} is neither a seq nor an RFC 3339 time"))?;
    Ok(At::Time((t.unix_timestamp_nanos() / 1_000_000) as i64))
}

/// `gpuledger replay --at`.
pub async fn replay(a: ReplayArgs) -> Result<()> {
    let at = parse_at(a.at.as_deref())?;
    let mut l = Ledger::new();
    let to = match at {
        At::Seq(n) => n,
        _ => 0,
    };
    read_log(&a.target, to, |e| {
        if let At::Time(t) = at
            && e.time_ms > t
        {
            return Ok(false);
        }
        l.apply(e)
            .map_err(|err| anyhow::anyhow!("the log does not replay: {err}"))?;
        Ok(true)
    })
    .await?;
    if let At::Seq(n) = at
        && l.seq() < n
    {
        bail!("the log ends at seq {}, before {n}", l.seq());
    }
    println!("state after seq {} ({})\n", l.seq(), fmt_time(l.time_ms()));
    print!("{}", render_state(&l, a.details));
    Ok(())
}

/// Differences between a replayed state and a replica's dump (empty = equal).
pub fn diff(replayed: &Ledger, live: &Ledger) -> Vec<String> {
    let mut d = Vec::new();
    if replayed.seq() != live.seq() || replayed.epoch() != live.epoch() {
        d.push(format!(
            "seq/epoch: replayed {}/{}, live {}/{}",
            replayed.seq(),
            replayed.epoch(),
            live.seq(),
            live.epoch()
        ));
    }
    for (name, n) in replayed.nodes() {
        match live.node(name) {
            None => d.push(format!("node {name}: in the log, not in the live state")),
            Some(m) if m != n => d.push(format!("node {name}: differs")),
            _ => {}
        }
    }
    for name in live.nodes().keys() {
        if replayed.node(name).is_none() {
            d.push(format!("node {name}: live, not in the log"));
        }
    }
    let mut ids: Vec<u64> = replayed
        .allocs()
        .keys()
        .chain(live.allocs().keys())
        .copied()
        .collect();
    ids.sort_unstable();
    ids.dedup();
    for id in ids {
        match (replayed.alloc(id), live.alloc(id)) {
            (Some(a), Some(b)) if a != b => d.push(format!(
                "allocation {id}: log says {}/{} on {} {:?} ({}), live says {}/{} on {} {:?} ({})",
                a.pod.namespace,
                a.pod.name,
                a.node,
                a.shares
                    .iter()
                    .map(|s| (&s.gpu_uuid, s.mem_mib))
                    .collect::<Vec<_>>(),
                a.state.as_str(),
                b.pod.namespace,
                b.pod.name,
                b.node,
                b.shares
                    .iter()
                    .map(|s| (&s.gpu_uuid, s.mem_mib))
                    .collect::<Vec<_>>(),
                b.state.as_str()
            )),
            (Some(_), None) => d.push(format!("allocation {id}: in the log, not live")),
            (None, Some(_)) => d.push(format!("allocation {id}: live, not in the log")),
            _ => {}
        }
    }
    if d.is_empty() && !replayed.same_state(live) {
        d.push("states differ in their indexes".into());
    }
    d
}

/// `gpuledger verify`.
pub async fn verify(a: VerifyArgs) -> Result<()> {
    // Dumps first: the log can only be longer than any dump.
    let mut dumps: Vec<(String, Ledger)> = Vec::new();
    let mut problems: Vec<String> = Vec::new();
    for addr in &a.target.addrs().await? {
        match connect_one(addr).await {
            Ok(mut c) => match dump_of(&mut c).await {
                Ok((replica, snap)) => match Ledger::from_snapshot(&snap) {
                    Ok(l) => dumps.push((format!("{replica} ({addr})"), l)),
                    Err(e) => problems.push(format!("{addr}: its state does not load: {e}")),
                },
                Err(e) => problems.push(format!("{addr}: {e:#}")),
            },
            Err(e) => problems.push(format!("{addr}: {e:#}")),
        }
    }
    if dumps.is_empty() {
        bail!("no replica to compare with: {}", problems.join("; "));
    }
    dumps.sort_by_key(|(_, l)| l.seq());
    let mut l = Ledger::new();
    let mut next = 0;
    let mut events = 0u64;
    let compare =
        |l: &Ledger, dumps: &[(String, Ledger)], next: &mut usize, problems: &mut Vec<String>| {
            while *next < dumps.len() && dumps[*next].1.seq() == l.seq() {
                let (name, live) = &dumps[*next];
                for d in diff(l, live) {
                    problems.push(format!("{name}: {d}"));
                }
                *next += 1;
            }
        };
    compare(&l, &dumps, &mut next, &mut problems);
    let read = read_log(&a.target, 0, |e| {
        if let Err(err) = l.apply(e) {
            problems.push(format!("log: {err}"));
            return Ok(false);
        }
        events += 1;
        compare(&l, &dumps, &mut next, &mut problems);
        Ok(true)
    })
    .await;
    if let Err(e) = read {
        problems.push(format!("log: {e:#}"));
    }
    if let Err(e) = l.check() {
        problems.push(format!("replayed state: {e}"));
    }
    for (name, live) in &dumps[next..] {
        problems.push(format!(
            "{name}: at seq {}, but the log replays only to seq {}",
            live.seq(),
            l.seq()
        ));
    }
    println!(
        "replayed {events} events to seq {} (epoch {}): {} nodes, {} allocations; compared {} replica(s)",
        l.seq(),
        l.epoch(),
        l.nodes().len(),
        l.allocs().len(),
        dumps.len()
    );
    if problems.is_empty() {
        println!("verify: OK — every invariant holds and every replica equals the replayed log");
        Ok(())
    } else {
        for p in &problems {
            println!("DIFFERENCE {p}");
        }
        bail!("verify failed: {} difference(s)", problems.len())
    }
}
