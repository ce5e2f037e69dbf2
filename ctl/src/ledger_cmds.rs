//! Commands over the live ledger: status, inspect and replay here; audit and verify in their
//! own rooms.

mod audit;
mod verify;

use std::collections::BTreeMap;

use anyhow::{Context, Result, bail};
use gpuledger_ledger::Ledger;
use gpuledger_proto::allocator::v1 as api;

use crate::client::{Target, connect, connect_one, dump_of, read_log};
use crate::table::Table;
use crate::when::{fmt_time, parse_rfc3339};

pub use audit::{AuditArgs, audit};
pub use verify::{VerifyArgs, verify};

/// Arguments of `gpuledger inspect`.
#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    #[command(flatten)]
    target: Target,
    /// Also list the allocations (pod, container, share) on every GPU.
    #[arg(short, long)]
    details: bool,
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

/// `gpuledger status`.
pub async fn status(t: Target) -> Result<()> {
    let mut table = Table::new(&[
        "REPLICA", "ADDRESS", "ROLE", "LEADER", "EPOCH", "SEQ", "NODES", "ALLOCS", "READY",
    ]);
    let mut any = false;
    let mut nospace = false;
    let creds = t.credentials().await?;
    for a in &t.addrs().await? {
        match connect_one(a, &creds).await {
            Ok(mut c) => match c.status(api::StatusRequest {}).await {
                Ok(s) => {
                    any = true;
                    let s = s.into_inner();
                    nospace |= s.etcd_alarm == "NOSPACE";
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
    if nospace {
        print!("{NOSPACE_RECOVERY}");
    }
    if !any {
        bail!("no allocator replica answered");
    }
    Ok(())
}

/// What `status` tells an operator whose etcd is out of space.
const NOSPACE_RECOVERY: &str = "
etcd is OUT OF SPACE: its NOSPACE alarm is raised and it refuses every write, so no GPU is
granted, bound or released until it is cleared. Reads (filter, inspect) still work.
To recover (etcdctl with the allocators' etcd endpoints and certificates):
  1. Make room for the future: run the allocators with --archive-dir (old ledger batches move
     out of etcd), or raise etcd's --quota-backend-bytes (8 GiB is etcd's suggested maximum).
  2. Compact etcd's history to its current revision:
       rev=$(etcdctl endpoint status --write-out=json | grep -o '\"revision\":[0-9]*' | head -n1 | cut -d: -f2)
       etcdctl compaction --physical \"$rev\"
  3. Defragment every member (gives the freed space back):
       etcdctl defrag --cluster
  4. Disarm the alarm:
       etcdctl alarm disarm
The allocators notice within a second or two and write again by themselves (metric
gpuledger_allocator_etcd_nospace goes back to 0).
";

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
    let isolation: Vec<String> = l
        .nodes()
        .values()
        .map(|n| {
            let first = if n.isolation.is_empty() {
                "nvml"
            } else {
                n.isolation.as_str()
            };
            format!("{}={first}", n.name)
        })
        .collect();
    if !isolation.is_empty() {
        out.push_str(&format!(
            "\nisolation (first layer; NVML sampling with a kill behind every one): {}\n",
            isolation.join(" ")
        ));
    }
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

/// `gpuledger inspect`.
pub async fn inspect(a: InspectArgs) -> Result<()> {
    let mut c = connect(&a.target).await?;
    let (_, snap) = dump_of(&mut c).await?;
    let l =
        Ledger::from_snapshot(&snap).map_err(|e| anyhow::anyhow!("the dump does not load: {e}"))?;
    print!("{}", render_state(&l, a.details));
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
    let t = parse_rfc3339(s)
        .with_context(|| format!("--at {s:?} is neither a seq nor an RFC 3339 time"))?;
    Ok(At::Time(t))
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
    if !l.budgets().budgets().is_empty() || !l.quotas().is_empty() {
        println!("\nbudgets then:");
        print!("{}", crate::budget::render_budgets(&l, l.time_ms()));
    }
    Ok(())
}
