//! `gpuledger-bench replay`: how fast the ledger folds, and how fast a replica cold-starts.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use etcd_client::Client;
use gpuledger_allocator::log::EtcdLog;
use gpuledger_ledger::{Command, ContainerRequest, Ledger, PodRequest, Policy, pb};
use gpuledger_testkit::{Allocators, EtcdCluster};
use prost::Message;

use crate::common::{run_dir, title};

/// Flags of `gpuledger-bench replay`.
#[derive(clap::Args)]
pub struct Args {
    /// Events in the generated ledger.
    #[arg(long, default_value_t = 1_000_000)]
    events: usize,
    /// Nodes (8 GPUs each) in the generated ledger.
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
    /// Live allocations kept while generating (older ones are released).
    #[arg(long, default_value_t = 20_000)]
    live: usize,
    /// Snapshot interval used when writing the log to etcd (as the allocator does).
    #[arg(long, default_value_t = 10_000)]
    snapshot_every: u64,
    /// Measure the fold only (no etcd, no cold start).
    #[arg(long)]
    fold_only: bool,
}

/// Events per batch of the generated log.
const BATCH: u64 = 128;

/// A realistic event stream: registrations, then reserve → bound → assigned → release cycles.
/// With `budgets`, the namespace has a rolling budget and the cluster a default first (the
/// same workload; the log keeps its length).
fn generate(a: &Args, budgets: bool) -> Result<Vec<pb::Event>> {
    build_log(a.events, a.nodes, a.live, 7, budgets)
}

/// `events` events on `nodes` nodes (8 GPUs each) at `epoch`, keeping about `live`
/// allocations: registrations, then reserve → bound → assigned → release cycles.
pub fn generate_log(
    events: usize,
    nodes: usize,
    live_max: usize,
    epoch: u64,
) -> Result<Vec<pb::Event>> {
    build_log(events, nodes, live_max, epoch, false)
}

/// [`generate_log`], with budgets set first when `budgets`.
fn build_log(
    events: usize,
    nodes: usize,
    live_max: usize,
    epoch: u64,
    budgets: bool,
) -> Result<Vec<pb::Event>> {
    let mut l = Ledger::new();
    let mut out = Vec::with_capacity(events + 16);
    if budgets {
        // A 10-minute rolling window: 1-second buckets that fill and leave the window as the
        // generated clock (1 ms per pod) runs, the costliest kind of window to keep.
        for (ns, window, rolling_ms) in [
            ("team-a", pb::BudgetWindow::Rolling, 600_000),
            ("", pb::BudgetWindow::Day, 0),
        ] {
            let b = pb::BudgetSet {
                namespace: ns.into(),
                unit: pb::BudgetUnit::GpuMibHours as i32,
                amount: 1_000_000,
                window: window as i32,
                rolling_ms,
                policy: pb::BudgetPolicy::Warn as i32,
                ..Default::default()
            };
            out.extend(
                l.execute(Command::SetBudget(b), epoch, 1_700_000_000_000)?
                    .0,
            );
        }
    }
    for n in 0..nodes {
        let inv = pb::NodeInventory {
            mode: Default::default(),
            node: format!("node-{n:05}"),
            gpus: (0..8)
                .map(|g| pb::Gpu {
                    uuid: format!("GPU-{n:05}-{g}-6f1c2a34-9b1e-4d6f-8e2a-0c3d5b7a9e11"),
                    index: g,
                    model: "NVIDIA A100-SXM4-80GB".into(),
                    memory_mib: 81_920,
                    healthy: true,
                    compute_capability: String::new(),
                })
                .collect(),
            cpu_milli: 0,
            memory_mib: 0,
            isolation: String::new(),
            dra_cores: String::new(),
        };
        out.extend(l.execute(Command::RegisterNode(inv), epoch, 0)?.0);
    }
    let mut live: std::collections::VecDeque<(String, String)> = Default::default();
    let mut i = 0u64;
    while out.len() < events {
        let uid = format!("{i:08x}-5d2c-4b7e-9f3a-1e6b8c0d2f4a");
        let node = format!("node-{:05}", (i as usize * 7919) % nodes);
        let now = 1_700_000_000_000 + i as i64;
        let req = PodRequest {
            pod: pb::PodRef {
                uid: uid.clone(),
                namespace: "team-a".into(),
                name: format!("trainer-{i}"),
            },
            containers: vec![ContainerRequest {
                name: "main".into(),
                slices: 1,
                mem_mib: 4096,
                mem_percent: 0,
                core_milli: 100,
            }],
            policy: Policy::Binpack,
            ..Default::default()
        };
        if let Ok((ev, _)) = l.execute(
            Command::Reserve {
                request: req,
                node: node.clone(),
                deadline_ms: now + 60_000,
            },
            epoch,
            now,
        ) {
            let id = match ev.first().and_then(|e| e.body.as_ref()) {
                Some(pb::event::Body::Reserved(r)) => r.allocation_id,
                _ => 0,
            };
            out.extend(ev);
            out.extend(
                l.execute(
                    Command::ConfirmBound {
                        pod_uid: uid.clone(),
                        node: node.clone(),
                        reason: "extender".into(),
                    },
                    epoch,
                    now,
                )?
                .0,
            );
            out.extend(
                l.execute(
                    Command::Assign {
                        node: node.clone(),
                        allocation_id: id,
                        device_ids: vec![format!("GPU-{id}::0")],
                    },
                    epoch,
                    now,
                )?
                .0,
            );
            live.push_back((uid, node));
        }
        while live.len() > live_max {
            let (uid, _) = live.pop_front().expect("non-empty");
            out.extend(
                l.execute(
                    Command::Release {
                        pod_uid: uid,
                        container: String::new(),
                        allocation_id: 0,
                        reason: "pod deleted".into(),
                    },
                    epoch,
                    now,
                )?
                .0,
            );
        }
        i += 1;
    }
    out.truncate(events);
    Ok(out)
}

/// The log in batches of 128, hash-chained as a leader writes it.
fn batches(events: &[pb::Event]) -> Vec<pb::EventBatch> {
    let mut prev = gpuledger_ledger::chain::GENESIS;
    events
        .chunks(BATCH as usize)
        .map(|c| {
            let b = pb::EventBatch {
                version: 1,
                first_seq: c[0].seq,
                epoch: c[0].epoch,
                events: c.to_vec(),
                prev_hash: prev.to_vec(),
                stored: None,
            };
            prev = gpuledger_ledger::chain::hash_stored(&b.encode_to_vec());
            b
        })
        .collect()
}

async fn write_log(
    client: &Client,
    cluster: &str,
    batches: &[pb::EventBatch],
    snaps: &[pb::Snapshot],
) -> Result<()> {
    let log = EtcdLog::new(client, cluster, Duration::from_secs(30));
    let mut tasks = Vec::new();
    for part in batches.chunks(batches.len().div_ceil(16).max(1)) {
        let mut kv = client.kv_client();
        let part: Vec<(String, Vec<u8>)> = part
            .iter()
            .map(|b| (log.log_key(b.first_seq), b.encode_to_vec()))
            .collect();
        tasks.push(tokio::spawn(async move {
            for (k, v) in part {
                kv.put(k, v, None).await?;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let last = batches
        .last()
        .and_then(|b| b.events.last())
        .context("empty log")?;
    let head = pb::Head {
        seq: last.seq,
        epoch: last.epoch,
        hash: batches
            .last()
            .map(|b| gpuledger_ledger::chain::hash_stored(&b.encode_to_vec()).to_vec())
            .unwrap_or_default(),
    };
    client
        .kv_client()
        .put(log.head_key(), head.encode_to_vec(), None)
        .await?;
    for s in snaps {
        log.write_snapshot(s).await?;
    }
    Ok(())
}

async fn cold_start(
    dir: &std::path::Path,
    etcd: &EtcdCluster,
    cluster: &str,
    seq: u64,
    extra: &[&str],
) -> Result<(u128, String)> {
    let t = Instant::now();
    let a = Allocators::start(dir, etcd, 1, cluster, extra)?;
    a.wait_seq(seq, Duration::from_secs(600)).await?;
    let ms = t.elapsed().as_millis();
    let log = std::fs::read_to_string(a.procs[0].log_path()).unwrap_or_default();
    let how = if log.contains("loaded snapshot") {
        "snapshot + tail"
    } else {
        "whole log"
    };
    Ok((ms, how.to_string()))
}

/// Run the benchmark.
pub async fn run(a: Args) -> Result<()> {
    title(&format!(
        "generating {} events ({} nodes x 8 GPUs, ~{} live allocations)",
        a.events, a.nodes, a.live
    ));
    let t = Instant::now();
    let events = generate(&a, false)?;
    println!("generated in {:.1}s", t.elapsed().as_secs_f64());

    title("fold (apply with every invariant check), 3 runs");
    let mut best = f64::MAX;
    let mut live_state = Ledger::new();
    for _ in 0..3 {
        let mut l = Ledger::new();
        let t = Instant::now();
        l.apply_all(&events)
            .map_err(|e| anyhow::anyhow!("fold: {e}"))?;
        best = best.min(t.elapsed().as_secs_f64());
        live_state = l;
    }
    let fold = events.len() as f64 / best;
    // What publishing a full copy of the state would cost (see Shared's views).
    let rss0 = crate::common::rss_mib(std::process::id()).unwrap_or(0.0);
    let mut clone_best = f64::MAX;
    let mut copy = Ledger::new();
    for _ in 0..3 {
        let t = Instant::now();
        copy = live_state.clone();
        clone_best = clone_best.min(t.elapsed().as_secs_f64());
    }
    let copy_mib = crate::common::rss_mib(std::process::id()).unwrap_or(0.0) - rss0;
    drop(copy);
    let bs = batches(&events);
    let bytes: Vec<Vec<u8>> = bs.iter().map(Message::encode_to_vec).collect();
    let total_bytes: usize = bytes.iter().map(Vec::len).sum();
    let t = Instant::now();
    let mut n = 0;
    for b in &bytes {
        n += pb::EventBatch::decode(b.as_slice())?.events.len();
    }
    let decode = n as f64 / t.elapsed().as_secs_f64();
    let decode_fold_once = || -> Result<f64> {
        let t = Instant::now();
        let mut l = Ledger::new();
        for b in &bytes {
            l.apply_all(&pb::EventBatch::decode(b.as_slice())?.events)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        Ok(n as f64 / t.elapsed().as_secs_f64())
    };
    // What a replica does: hash the stored bytes, check the link, decode, fold.
    let chained_fold_once = || -> Result<f64> {
        let t = Instant::now();
        let mut l = Ledger::new();
        let mut chain = gpuledger_ledger::chain::Chain::new();
        for b in &bytes {
            let batch = pb::EventBatch::decode(b.as_slice())?;
            chain
                .link(&batch, gpuledger_ledger::chain::hash_stored(b))
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            l.apply_all(&batch.events)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        Ok(n as f64 / t.elapsed().as_secs_f64())
    };
    // Best of four each, in ABBA order twice, so that a machine whose speed drifts (shared,
    // virtual) weighs on both alike.
    let (mut decode_fold, mut chained_fold) = (0f64, 0f64);
    for _ in 0..2 {
        decode_fold = decode_fold.max(decode_fold_once()?);
        chained_fold = chained_fold.max(chained_fold_once()?);
        chained_fold = chained_fold.max(chained_fold_once()?);
        decode_fold = decode_fold.max(decode_fold_once()?);
    }
    // The chain's own cost: SHA-256 of every stored byte once (SHA-NI when the CPU has it).
    let t = Instant::now();
    for b in &bytes {
        std::hint::black_box(gpuledger_ledger::chain::hash_stored(b));
    }
    let hash_s = t.elapsed().as_secs_f64();
    println!("{:<40} {:>14}", "what", "events/s");
    println!("{:<40} {:>14.0}", "protobuf decode only (baseline)", decode);
    println!("{:<40} {:>14.0}", "fold (apply + invariants)", fold);
    println!("{:<40} {:>14.0}", "decode + fold", decode_fold);
    println!(
        "{:<40} {:>14.0}  ({:+.1} % against decode + fold, best of 4, ABBA)",
        "hash + chain check + decode + fold",
        chained_fold,
        (chained_fold / decode_fold - 1.0) * 100.0
    );
    println!(
        "{:<40} {:>14.0}  ({:.0} MB/s)",
        "SHA-256 of the stored bytes only",
        n as f64 / hash_s,
        total_bytes as f64 / 1e6 / hash_s
    );
    println!(
        "one full copy of the final state: {:.1} ms, ~{copy_mib:.0} MiB",
        clone_best * 1e3
    );
    println!(
        "log: {} batches, {:.1} MiB; final state: {} nodes, {} allocations",
        bs.len(),
        total_bytes as f64 / 1048576.0,
        live_state.nodes().len(),
        live_state.allocs().len()
    );

    if a.fold_only {
        let ratio = budget_fold_ratio(&a, &events)?;
        println!(
            "fold_budgets_ratio={ratio:.3} fold_events_per_s={fold:.0} decode_fold_events_per_s={decode_fold:.0} chained_fold_events_per_s={chained_fold:.0}"
        );
        return Ok(());
    }
    title("writing the log to a 3-member etcd");
    let dir = run_dir("replay")?;
    let etcd = EtcdCluster::start_in(&dir.path().join("etcd"), 3).await?;
    let client = etcd.client().await?;
    // The allocator keeps the two newest snapshots; write those.
    let mut snaps = Vec::new();
    if a.snapshot_every > 0 {
        let mut l = Ledger::new();
        let last = events.len() as u64;
        // Snapshots are taken between batches, with the chain's hash there.
        let s2 = last - last % a.snapshot_every;
        let s2 = s2 - s2 % BATCH;
        let s1 = s2.saturating_sub(a.snapshot_every);
        let s1 = s1 - s1 % BATCH;
        for (b, stored) in bs.iter().zip(&bytes) {
            l.apply_all(&b.events).map_err(|e| anyhow::anyhow!("{e}"))?;
            if (l.seq() == s1 || l.seq() == s2) && l.seq() > 0 {
                let mut s = l.to_snapshot();
                s.chain_hash = gpuledger_ledger::chain::hash_stored(stored).to_vec();
                snaps.push(s);
            }
        }
    }
    let t = Instant::now();
    write_log(&client, "replay", &bs, &snaps).await?;
    println!("written in {:.1}s", t.elapsed().as_secs_f64());

    title("cold start of a new replica until it serves at the head seq");
    let seq = events.len() as u64;
    let (with_snap, how1) = cold_start(dir.path(), &etcd, "replay", seq, &[]).await?;
    let (without, how2) = cold_start(
        &dir.path().join("nosnap"),
        &etcd,
        "replay",
        seq,
        &["--ignore-snapshots"],
    )
    .await?;
    println!("{:<40} {:>10}", "start from", "ms");
    println!("{:<40} {:>10}", how1, with_snap);
    println!(
        "{:<40} {:>10}",
        format!("{how2} (--ignore-snapshots)"),
        without
    );
    println!("fold_events_per_s={fold:.0} cold_start_ms={with_snap}");
    Ok(())
}

/// The fold of the same workload with budgets set against without, ABBA three times in this
/// run (best of each): the cost of keeping consumption in budget windows.
fn budget_fold_ratio(a: &Args, plain: &[pb::Event]) -> Result<f64> {
    title("fold with budgets (a rolling and a calendar window) against without, ABBA x 3");
    let budgeted = generate(a, true)?;
    let fold = |events: &[pb::Event]| -> Result<f64> {
        let mut l = Ledger::new();
        let t = Instant::now();
        l.apply_all(events)
            .map_err(|e| anyhow::anyhow!("fold: {e}"))?;
        Ok(events.len() as f64 / t.elapsed().as_secs_f64())
    };
    let (mut without, mut with) = (0f64, 0f64);
    for round in 0..3 {
        let a1 = fold(plain)?;
        let b1 = fold(&budgeted)?;
        let b2 = fold(&budgeted)?;
        let a2 = fold(plain)?;
        println!(
            "round {}: without {a1:.0} / {a2:.0}, with budgets {b1:.0} / {b2:.0} events/s",
            round + 1
        );
        without = without.max(a1).max(a2);
        with = with.max(b1).max(b2);
    }
    let ratio = with / without;
    println!("{:<40} {:>14.0}", "fold, no budget", without);
    println!("{:<40} {:>14.0}  ({ratio:.3}x)", "fold, budgets set", with);
    Ok(ratio)
}
