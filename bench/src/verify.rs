//! `gpuledger-bench verify`: how long the real `gpuledger verify` takes end to end over a long
//! hash-chained log, most of it archived (goal: 1,000,000 events in ≤ 5 s).
//!
//! The log is written by the allocator's own log writer and archiver, not through its gRPC API:
//! a million events through Reserve/Bound/Assign/Release would take a 2-core machine tens of
//! minutes. The writer holds a real election key and appends every batch in the leader's fenced
//! transaction (`EtcdLog::commit_encoded`, chained by `log::encode`), writes snapshots as the
//! leader does, and moves old batches to the archive with `archive::trim_once`. A real
//! allocator replica then loads that log and serves it over TLS, and `gpuledger verify` (and,
//! as the baseline, `gpuledger replay`: the same read and fold with no chain, replica or
//! snapshot checks) run against it as an operator runs them.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpuledger_allocator::archive::{Archive, TrimPolicy, trim_once};
use gpuledger_allocator::election::{Session, campaign};
use gpuledger_allocator::log::{Commit, EtcdLog, Fence, encode};
use gpuledger_allocator::tail::snapshot_due;
use gpuledger_auth::identity::Role;
use gpuledger_ledger::chain::{GENESIS, hash_stored};
use gpuledger_ledger::{Ledger, pb};
use gpuledger_testkit::pki::credential_flags;
use gpuledger_testkit::{Allocators, EtcdCluster, bin_path};

use crate::common::{run_dir, title};
use crate::replay::generate_log;

/// Flags of `gpuledger-bench verify`.
#[derive(clap::Args)]
pub struct Args {
    /// Events in the log.
    #[arg(long, default_value_t = 1_000_000)]
    events: usize,
    /// Events per batch (the leader's group commit under load fills batches of this order).
    #[arg(long, default_value_t = 128)]
    batch: usize,
    /// Nodes (8 GPUs each).
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
    /// Live allocations kept while generating (older ones are released).
    #[arg(long, default_value_t = 20_000)]
    live: usize,
    /// A snapshot (and an archiving step) every this many events, as `--snapshot-every`.
    #[arg(long, default_value_t = 100_000)]
    snapshot_every: u64,
    /// Events kept in etcd behind the head, as `--log-retain-events`.
    #[arg(long, default_value_t = 100_000)]
    retain: u64,
    /// Timed runs of each command (the best is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
}

/// Run `gpuledger <args>` and time it; fail with its output unless it succeeds.
async fn timed(bin: &std::path::Path, args: &[String]) -> Result<(f64, String)> {
    let t = Instant::now();
    let out = tokio::process::Command::new(bin)
        .args(args)
        .output()
        .await
        .with_context(|| format!("running {}", bin.display()))?;
    let secs = t.elapsed().as_secs_f64();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "{} {} failed:\n{text}{}",
            bin.display(),
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok((secs, text))
}

/// SHA-256 throughput of this machine in MB/s, over 64 MiB.
fn sha256_mb_per_s() -> f64 {
    let buf = vec![0x5au8; 64 << 20];
    let t = Instant::now();
    std::hint::black_box(hash_stored(&buf));
    buf.len() as f64 / 1e6 / t.elapsed().as_secs_f64()
}

/// Run the benchmark.
pub async fn run(a: Args) -> Result<()> {
    anyhow::ensure!(
        a.events > 0 && a.batch > 0,
        "--events and --batch must be > 0"
    );
    let dir = run_dir("verify")?;
    let etcd = EtcdCluster::start_in(&dir.path().join("etcd"), 1).await?;
    let client = etcd.client().await?;
    let cluster = "verify";
    let log = EtcdLog::new(&client, cluster, Duration::from_secs(60));
    let session = Session::start(&client, Duration::from_secs(10)).await?;
    let key = campaign(
        &client,
        &log.election_name(),
        "bench-writer",
        session.lease_id,
    )
    .await?;
    let fence = Fence::from(&key);
    let epoch = u64::try_from(fence.epoch).context("negative epoch")?;

    title(&format!(
        "generating {} events ({} nodes x 8 GPUs, ~{} live allocations)",
        a.events, a.nodes, a.live
    ));
    let t = Instant::now();
    let events = generate_log(a.events, a.nodes, a.live, epoch)?;
    println!("generated in {:.1}s", t.elapsed().as_secs_f64());

    title(&format!(
        "writing the log: fenced commits of {} events, a snapshot and an archiving step every {}",
        a.batch, a.snapshot_every
    ));
    let archive_dir = dir.path().join("archive");
    let archive = Archive::open(&archive_dir)?;
    let policy = TrimPolicy {
        retain_events: a.retain,
        interval: Duration::from_secs(1),
    };
    let mut head_rev = log.head().await?.mod_rev;
    let (mut prev, mut last_snap, mut archived) = (GENESIS, 0, 0);
    let (mut batches, mut bytes) = (0usize, 0usize);
    let mut l = Ledger::new();
    let total = events.len().div_ceil(a.batch);
    let t = Instant::now();
    for chunk in events.chunks(a.batch) {
        let b = pb::EventBatch {
            version: 1,
            first_seq: chunk[0].seq,
            epoch,
            events: chunk.to_vec(),
            prev_hash: prev.to_vec(),
            stored: None,
        };
        let enc = encode(&b);
        prev = enc.hash;
        bytes += enc.bytes.len();
        match log
            .commit_encoded(&fence.key, fence.epoch, head_rev, enc)
            .await?
        {
            Commit::Done { head_rev: r } => head_rev = r,
            Commit::Fenced => bail!("the writer lost its election key"),
        }
        batches += 1;
        l.apply_all(&b.events)
            .map_err(|e| anyhow::anyhow!("fold: {e}"))?;
        if snapshot_due(&l, last_snap, a.snapshot_every) {
            let mut s = l.to_snapshot();
            s.chain_hash = prev.to_vec();
            log.write_snapshot(&s).await?;
            log.prune_snapshots(2).await?;
            last_snap = l.seq();
            archived = trim_once(&archive, &log, &fence.key, fence.epoch, l.seq(), policy).await?;
        }
        if batches % (total / 10).max(1) == 0 || batches == total {
            println!(
                "  {:>9} events in {batches:>6} batches, {:>6.1} MiB, archived to seq {archived:>9}, {:.1}s",
                l.seq(),
                bytes as f64 / 1048576.0,
                t.elapsed().as_secs_f64()
            );
        }
    }
    let head = l.seq();
    drop(events);
    session.revoke(&client).await;

    title("a real allocator replica loads the log (snapshot + etcd tail) and serves it");
    let archive_flag = format!("--archive-dir={}", archive_dir.display());
    let allocs = Allocators::start(
        &dir.path().join("allocator"),
        &etcd,
        1,
        cluster,
        &[&archive_flag],
    )?;
    let t = Instant::now();
    allocs.wait_seq(head, Duration::from_secs(600)).await?;
    println!(
        "serving at seq {head} after {:.1}s",
        t.elapsed().as_secs_f64()
    );
    let in_etcd = head - archived;
    let archived_batches = archived.div_ceil(a.batch as u64);

    let bin = bin_path("gpuledger")?;
    let mut args = vec![format!("--allocator={}", allocs.addrs[0])];
    args.extend(credential_flags(&allocs.ids.credentials(&Role::Viewer)?));
    let with = |cmd: &str| {
        let mut v = vec![cmd.to_string()];
        v.extend(args.iter().cloned());
        v
    };
    title(&format!(
        "gpuledger verify and gpuledger replay, end to end, best of {}",
        a.runs
    ));
    let (mut verify, mut replay) = (f64::MAX, f64::MAX);
    let mut verified = String::new();
    for _ in 0..a.runs.max(1) {
        let (s, out) = timed(&bin, &with("verify")).await?;
        verify = verify.min(s);
        verified = out;
        replay = replay.min(timed(&bin, &with("replay")).await?.0);
    }
    let replayed: u64 = verified
        .lines()
        .find_map(|l| l.strip_prefix("replayed "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .context("verify did not say how many events it replayed")?;
    anyhow::ensure!(
        replayed >= head,
        "verify replayed {replayed} events, the log holds {head}"
    );
    let sha = sha256_mb_per_s();
    println!(
        "log: {replayed} events in {batches} batches ({:.1} MiB); archive: seqs 1..{archived} ({archived_batches} batches), etcd: {in_etcd} events ({} batches)",
        bytes as f64 / 1048576.0,
        batches as u64 - archived_batches.min(batches as u64)
    );
    println!("{:<58} {:>8} {:>12}", "command", "s", "events/s");
    println!(
        "{:<58} {:>8.2} {:>12.0}",
        "gpuledger verify (chain, invariants, replicas, snapshots)",
        verify,
        replayed as f64 / verify
    );
    println!(
        "{:<58} {:>8.2} {:>12.0}",
        "gpuledger replay (read + fold only; baseline)",
        replay,
        replayed as f64 / replay
    );
    println!(
        "verify / replay: {:.2}x; SHA-256 of every stored byte once: {:.2}s at {sha:.0} MB/s (the chain's own cost)",
        verify / replay,
        bytes as f64 / 1e6 / sha
    );
    println!(
        "verify_events={replayed} verify_s={verify:.2} verify_events_per_s={:.0} replay_s={replay:.2} sha256_mb_per_s={sha:.0}",
        replayed as f64 / verify
    );
    Ok(())
}
