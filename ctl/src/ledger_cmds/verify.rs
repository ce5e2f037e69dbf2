//! `gpuledger verify`: replay the whole log, check every invariant, and compare the state with
//! each live replica's.

use anyhow::{Result, bail};
use gpuledger_ledger::Ledger;

use crate::client::{Target, connect_one, dump_of, read_log};

/// Arguments of `gpuledger verify`.
#[derive(clap::Args, Debug)]
pub struct VerifyArgs {
    /// Allocator replicas to compare, comma-separated; every one must match the replayed log.
    #[command(flatten)]
    target: Target,
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
