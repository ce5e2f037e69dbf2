//! Followers: load the newest snapshot, range-read the rest of the log, then watch `log/`.
//! A watch cancelled by compaction (or broken by any error) recovers by range-reading from the
//! last applied seq and watching again from the revision of that read.

use std::sync::Arc;
use std::time::Duration;

use backon::Retryable;
use etcd_client::{Client, EventType, WatchOptions};
use gpuledger_ledger::Ledger;
use tracing::{debug, info, warn};

use crate::archive::Archive;
use crate::log::{EtcdLog, LedgerLog, LogError, decode_batch};
use crate::shared::Shared;

/// Build the state from the newest snapshot plus the log after it (and, for history etcd no
/// longer holds, the archive).
pub async fn load(
    shared: &Arc<Shared>,
    log: &EtcdLog,
    use_snapshots: bool,
    archive: Option<&Archive>,
) -> Result<(), LogError> {
    let started = std::time::Instant::now();
    let mut ledger = Ledger::new();
    let mut chain_hash = Vec::new();
    let snap = if use_snapshots {
        log.latest_snapshot(0).await?
    } else {
        None
    };
    if let Some(snap) = snap {
        ledger = Ledger::from_snapshot(&snap).map_err(|why| LogError::Corrupt {
            key: format!("{}snapmeta/{:020}", log.prefix(), snap.seq),
            why,
        })?;
        info!(
            seq = snap.seq,
            chained = !snap.chain_hash.is_empty(),
            "loaded snapshot"
        );
        chain_hash = snap.chain_hash;
    }
    shared.reset(ledger, &chain_hash).await;
    catch_up(shared, log, archive).await?;
    let seq = shared.seq();
    info!(
        seq,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "ledger loaded"
    );
    Ok(())
}

/// Range-read and apply every batch after the applied seq. Seqs that etcd no longer holds
/// (archived while this replica lagged) come from `archive`; without one that is
/// [`LogError::Archived`]. Returns the revision of the last etcd read.
pub async fn catch_up<L: LedgerLog>(
    shared: &Arc<Shared>,
    log: &L,
    archive: Option<&Archive>,
) -> Result<i64, LogError> {
    loop {
        let from = shared.seq() + 1;
        let mut broken = false;
        let mut gap = None;
        let rev = log
            .read_with(from, 0, |b| {
                if b.first_seq > shared.seq() + 1 {
                    // Trimmed away while this replica lagged: folding on would skip events.
                    gap = Some(b.first_seq);
                    return false;
                }
                if shared.apply_committed(b) {
                    true
                } else {
                    broken = true;
                    false
                }
            })
            .await?;
        let broken_err = || LogError::Corrupt {
            key: log.location(),
            why: "an event breaks an invariant (see the log above)".into(),
        };
        if broken {
            return Err(broken_err());
        }
        let Some(first) = gap else { return Ok(rev) };
        let needed = shared.seq() + 1;
        let Some(archive) = archive else {
            return Err(LogError::Archived { needed, first });
        };
        let sh = shared.clone();
        let filled = archive
            .off_thread(move |a| {
                let mut ok = true;
                a.read(needed, 0, |b| {
                    ok = sh.apply_committed(b);
                    ok
                })
                .map(|_| ok)
            })
            .await?;
        if !filled {
            return Err(broken_err());
        }
        if shared.seq() + 1 == needed {
            return Err(LogError::Archived { needed, first });
        }
        info!(
            from = needed,
            to = shared.seq(),
            "filled from the archive what etcd no longer holds"
        );
    }
}

fn is_broken(shared: &Shared) -> bool {
    shared
        .health
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .broken
        .is_some()
}

/// [`catch_up`]; when etcd no longer holds what this replica needs next (it lagged past the
/// archived part of the log), load the newest snapshot first.
async fn catch_up_or_reload(
    shared: &Arc<Shared>,
    log: &EtcdLog,
    archive: Option<&Archive>,
) -> Result<i64, LogError> {
    match catch_up(shared, log, archive).await {
        Err(e @ LogError::Archived { .. }) => {
            warn!(error = %e, "this replica fell behind the archived log; reloading from the newest snapshot");
            load(shared, log, true, archive).await?;
            catch_up(shared, log, archive).await
        }
        other => other,
    }
}

/// Follow the log until cancelled. Every error is retried; a broken state stops applying.
pub async fn follow(
    shared: Arc<Shared>,
    client: Client,
    log: EtcdLog,
    snapshot_every: u64,
    archive: Option<Archive>,
) {
    let mut last_snap = shared.seq();
    loop {
        if is_broken(&shared) {
            // Nothing to retry: an operator has to look at the log.
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        let caught_up = (|| catch_up_or_reload(&shared, &log, archive.as_ref()))
            .retry(crate::retry::forever(Duration::from_millis(200)))
            .when(|_| !is_broken(&shared))
            .notify(|e, _| warn!(error = %e, "catching up with the log failed; retrying"));
        let Ok(rev) = caught_up.await else {
            continue;
        };
        if let Err(e) = watch_from(
            &shared,
            &client,
            &log,
            rev + 1,
            snapshot_every,
            &mut last_snap,
        )
        .await
        {
            debug!(error = %e, "log watch ended; catching up");
        }
    }
}

async fn watch_from(
    shared: &Arc<Shared>,
    client: &Client,
    log: &EtcdLog,
    start: i64,
    snapshot_every: u64,
    last_snap: &mut u64,
) -> Result<(), LogError> {
    let mut wc = client
        .watch_client()
        .max_decoding_message_size(256 * 1024 * 1024);
    let mut stream = wc
        .watch(
            log.log_prefix(),
            Some(WatchOptions::new().with_prefix().with_start_revision(start)),
        )
        .await?;
    while let Some(resp) = stream.message().await? {
        if resp.canceled() {
            if resp.compact_revision() > 0 {
                info!(
                    compact_revision = resp.compact_revision(),
                    "log watch cancelled by compaction; range-reading to catch up"
                );
            }
            return Ok(());
        }
        for ev in resp.events() {
            if ev.event_type() != EventType::Put {
                continue;
            }
            let Some(kv) = ev.kv() else { continue };
            if kv.version() > 1 {
                let msg = format!(
                    "log key {} was overwritten (version {}): log entries are immutable",
                    String::from_utf8_lossy(kv.key()),
                    kv.version()
                );
                tracing::error!("{msg}");
                shared
                    .health
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .broken = Some(msg);
                return Ok(());
            }
            let batch = decode_batch(kv.key(), kv.value())?;
            let seq = shared.seq();
            if batch.first_seq != seq + 1 {
                if batch.first_seq > seq + 1 {
                    // A gap: something was missed; the range read fills it.
                    return Ok(());
                }
                continue;
            }
            if !shared.apply_committed(batch) {
                return Ok(());
            }
        }
        let (seq, due) =
            shared.with_live(|l| (l.seq(), snapshot_due(l, *last_snap, snapshot_every)));
        if due {
            *last_snap = seq;
            spawn_snapshot(shared.clone(), log.clone());
        }
    }
    Ok(())
}

/// Whether a snapshot is due: `every` events since the last one, and never more often than the
/// state's own size in events, so that writing snapshots costs O(1) per event however large
/// the ledger grows.
pub fn snapshot_due(l: &Ledger, last_snap: u64, every: u64) -> bool {
    let size = (l.allocs().len() + l.nodes().len()) as u64;
    every > 0 && l.seq() >= last_snap + every.max(2 * size)
}

/// Write a snapshot of the committed state in the background and prune old ones. The
/// snapshot is encoded from a view, off the caller's task (at 100,000 allocations that takes
/// tens of milliseconds the sequencer would otherwise spend).
pub fn spawn_snapshot<L: LedgerLog>(shared: Arc<Shared>, log: L) {
    tokio::spawn(async move {
        let view = shared.view().await;
        // A snapshot records the chain's hash at its seq, so a replica starting from it
        // checks the very next link.
        let Some(hash) = shared.chain_hash_at(view.seq()) else {
            warn!(
                seq = view.seq(),
                "no chain hash known at the view's seq; no snapshot this time"
            );
            return;
        };
        let mut snap = match tokio::task::spawn_blocking(move || view.to_snapshot()).await {
            Ok(s) => s,
            Err(e) => {
                warn!(error = %e, "encoding a snapshot failed");
                return;
            }
        };
        snap.chain_hash = hash.to_vec();
        let seq = snap.seq;
        match log.write_snapshot(&snap).await {
            Ok(true) => {
                info!(seq, "snapshot written");
                if let Err(e) = log.prune_snapshots(2).await {
                    warn!(error = %e, "pruning old snapshots failed");
                }
            }
            Ok(false) => debug!(seq, "snapshot already present"),
            Err(e) => warn!(seq, error = %e, "writing snapshot failed"),
        }
    });
}
