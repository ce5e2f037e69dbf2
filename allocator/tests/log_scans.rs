//! Regression ("Hostile load II"): 128 viewer loops of `ReadLog` from seq 1 over a long log
//! raised the leader's write p99 from 14 to 748 ms and were never refused. Archived history was
//! streamed unpaced, etcd pages cost a heavy-read turn however many events they held, and
//! nothing bounded the scans in flight. Now at most `--max-log-scans` run at once, at most
//! `--max-log-scans-per-holder` of one holder (the rest are refused `RESOURCE_EXHAUSTED`,
//! counted as `log_scans` and `log_scans_per_holder`), so the loops of one viewer token leave
//! room for another operator's scan, and each holder's scans together get
//! `--log-scan-events-per-s` events, from the archive and etcd alike.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gpuledger_allocator::archive::Archive;
use gpuledger_auth::server::OVER_LIMIT;
use gpuledger_ledger::pb;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::{Allocators, EtcdCluster};
use tokio_util::sync::CancellationToken;
use tonic::Code;

use crate::hostile_load::{limited, metric};

/// Concurrent scans the allocator allows in this test.
const MAX_SCANS: usize = 4;
/// Concurrent scans one holder may run.
const PER_HOLDER: usize = 2;
/// Events a second one holder's scans may stream.
const EVENTS_PER_S: u64 = 1_000;

/// Every event `ReadLog` from seq 1 streams from `c`: their seqs.
async fn scan(c: &mut gpuledger_client::Client) -> Result<Vec<u64>, tonic::Status> {
    let mut s = c
        .read_log(api::ReadLogRequest {
            from_seq: 1,
            to_seq: 0,
        })
        .await?
        .into_inner();
    let mut seqs = Vec::new();
    while let Some(b) = s.message().await? {
        seqs.extend(b.events.iter().map(|e| e.seq));
    }
    Ok(seqs)
}

/// `writers` admins writing `each` quotas at once: a log of `writers × each` events.
async fn write_quotas(
    admin: &gpuledger_client::Client,
    writers: u64,
    each: u64,
) -> anyhow::Result<()> {
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..writers {
        let mut a = admin.clone();
        tasks.spawn(async move {
            for i in 0..each {
                a.set_quota(api::SetQuotaRequest {
                    quota: Some(pb::QuotaSet {
                        namespace: format!("ns-{w}"),
                        mem_mib: i + 1,
                        core_milli: 0,
                    }),
                })
                .await?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_scans_are_capped_and_paced_from_the_archive_on_and_writes_go_on() -> anyhow::Result<()>
{
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let archive_dir = dir.path().join("archive");
    let flags = [
        format!("--archive-dir={}", archive_dir.display()),
        "--snapshot-every=200".into(),
        "--log-retain-events=200".into(),
        "--archive-interval-ms=100".into(),
        // Only the limits under test refuse: no heavy-read rate, no stream bound in the way.
        "--heavy-reads-per-identity-per-s=0".into(),
        format!("--max-log-scans={MAX_SCANS}"),
        format!("--max-log-scans-per-holder={PER_HOLDER}"),
        format!("--log-scan-events-per-s={EVENTS_PER_S}"),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let allocs = Allocators::start(dir.path(), &etcd, 1, "scans", &flags)?;
    allocs.wait_leader(Duration::from_secs(20)).await?;
    let epoch = allocs.status(0).await.map(|s| s.epoch);

    // A log of a few thousand events, most of it archived.
    let admin = allocs.admin(0)?;
    write_quotas(&admin, 16, 250).await?;
    let head = allocs.status(0).await.expect("status").seq;
    assert!(head >= 4_000, "{head} events written");
    let t0 = Instant::now();
    let mut archived = 0;
    while archived + 500 < head && t0.elapsed() < Duration::from_secs(20) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        archived = Archive::open(&archive_dir)?.last_seq()?;
    }
    assert!(archived + 500 >= head, "only {archived} of {head} archived");

    // One honest scan: the whole history in order, at the holder's pace (archive included).
    let mut viewer = allocs.viewer(0)?;
    let t = Instant::now();
    let seqs = scan(&mut viewer).await?;
    let took = t.elapsed();
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());
    assert!(seqs.len() as u64 >= head);
    // A second's worth comes at once, the rest at the rate.
    let paced = Duration::from_secs_f64((head - EVENTS_PER_S) as f64 / EVENTS_PER_S as f64);
    assert!(
        took >= paced.mul_f64(0.9),
        "{head} events ({archived} archived) scanned in {took:?}: not paced at {EVENTS_PER_S}/s"
    );

    // The attack: 32 viewer loops of ReadLog from seq 1, while an admin's writes are timed
    // and the scans in flight sampled.
    let stop = CancellationToken::new();
    let (done, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut attackers = tokio::task::JoinSet::new();
    for _ in 0..32 {
        let mut v = allocs.viewer(0)?;
        let (stop, done, refused) = (stop.clone(), done.clone(), refused.clone());
        attackers.spawn(async move {
            while !stop.is_cancelled() {
                match stop.run_until_cancelled(scan(&mut v)).await {
                    None => break,
                    Some(Ok(_)) => done.fetch_add(1, Ordering::Relaxed),
                    Some(Err(s)) if s.code() == Code::ResourceExhausted => {
                        let limit = s.metadata().get(OVER_LIMIT).map(|v| v.to_str());
                        anyhow::ensure!(
                            matches!(limit, Some(Ok("log_scans_per_holder"))),
                            "refused by another limit: {s:?}"
                        );
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        refused.fetch_add(1, Ordering::Relaxed)
                    }
                    Some(Err(s)) => anyhow::bail!("a scan failed otherwise: {s:?}"),
                };
            }
            anyhow::Ok(())
        });
    }
    // Another operator (another holder) scans the whole history meanwhile.
    let mut other = admin.clone();
    let honest = tokio::spawn(async move { scan(&mut other).await });
    let mut most = 0f64;
    let mut writes = Vec::new();
    let mut a = admin.clone();
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(6) {
        let w = Instant::now();
        a.set_quota(api::SetQuotaRequest {
            quota: Some(pb::QuotaSet {
                namespace: "honest".into(),
                mem_mib: writes.len() as u64 + 1,
                core_milli: 0,
            }),
        })
        .await?;
        writes.push(w.elapsed());
        most = most.max(metric(&allocs, 0, "log_scans").await?);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.cancel();
    while let Some(r) = attackers.join_next().await {
        r??;
    }
    let honest = honest.await?;
    assert!(
        matches!(&honest, Ok(seqs) if seqs.len() as u64 >= head),
        "another operator's scan beside one viewer's loops: {:?}",
        honest.map(|s| s.len())
    );
    writes.sort_unstable();
    let p99 = writes[writes.len() * 99 / 100];
    let (done, refused) = (
        done.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
    );
    eprintln!(
        "scan of {head} events: {took:?}; attack: {done} scans done, {refused} refused, \
         at most {most} in flight; {} writes, p99 {p99:?}",
        writes.len()
    );
    assert!(
        most <= (PER_HOLDER + 1) as f64,
        "{most} scans in flight (the viewer's {PER_HOLDER} and the other operator's)"
    );
    assert!(
        refused > 0,
        "no scan past the viewer's {PER_HOLDER} was refused"
    );
    assert!(limited(&allocs, 0, "log_scans_per_holder").await? >= refused as f64);
    // One holder's scans share its pace: 6 s at 1,000 events/s is under two whole scans.
    assert!(done <= 2, "{done} scans of {head} events in 6 s");
    assert!(
        p99 < Duration::from_secs(1),
        "the admin's writes' p99 under the attack: {p99:?}"
    );
    let st = allocs.status(0).await.expect("status");
    assert_eq!((st.role.as_str(), Some(st.epoch)), ("leader", epoch));
    Ok(())
}

/// A `ReadLog` from seq 1 on `c`, started (its slot taken) and not read.
async fn open_scan(
    c: &mut gpuledger_client::Client,
) -> Result<tonic::Streaming<pb::EventBatch>, tonic::Status> {
    Ok(c.read_log(api::ReadLogRequest {
        from_seq: 1,
        to_seq: 0,
    })
    .await?
    .into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scans_past_the_allocators_bound_are_refused() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let flags = [
        "--max-log-scans=2",
        // Only the bound under test refuses: one holder may run every scan.
        "--max-log-scans-per-holder=0",
        "--heavy-reads-per-identity-per-s=0",
        // A scan of a hundred events lasts seconds.
        "--log-scan-events-per-s=2",
    ];
    let allocs = Allocators::start(dir.path(), &etcd, 1, "allscans", &flags)?;
    allocs.wait_leader(Duration::from_secs(20)).await?;
    let mut admin = allocs.admin(0)?;
    for i in 0..100u64 {
        admin
            .set_quota(api::SetQuotaRequest {
                quota: Some(pb::QuotaSet {
                    namespace: "ns".into(),
                    mem_mib: i + 1,
                    core_milli: 0,
                }),
            })
            .await?;
    }
    let mut viewer = allocs.viewer(0)?;
    let held = (open_scan(&mut viewer).await?, open_scan(&mut viewer).await?);
    let third = open_scan(&mut viewer).await.map(drop);
    let refused = third.as_ref().err();
    assert_eq!(
        refused.map(tonic::Status::code),
        Some(Code::ResourceExhausted),
        "a third scan beside two: {third:?}"
    );
    let limit = refused.and_then(|s| s.metadata().get(OVER_LIMIT)?.to_str().ok());
    assert_eq!(limit, Some("log_scans"));
    assert_eq!(limited(&allocs, 0, "log_scans").await?, 1.0);
    assert_eq!(metric(&allocs, 0, "log_scans").await?, 2.0);
    drop(held);
    Ok(())
}

/// A scan whose client went away gives its slot back at once, also while its next page waits
/// for the holder's pace: a holder that cancels scans in a loop holds no slot it does not use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_scan_gives_its_slot_back_while_paced() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let flags = [
        "--heavy-reads-per-identity-per-s=0",
        "--max-log-scans-per-holder=1",
        "--log-scan-events-per-s=2",
    ];
    let allocs = Allocators::start(dir.path(), &etcd, 1, "cancelled", &flags)?;
    allocs.wait_leader(Duration::from_secs(20)).await?;
    let mut admin = allocs.admin(0)?;
    for i in 0..100u64 {
        admin
            .set_quota(api::SetQuotaRequest {
                quota: Some(pb::QuotaSet {
                    namespace: format!("ns-{}", i % 7),
                    mem_mib: i + 1,
                    core_milli: 0,
                }),
            })
            .await?;
    }
    let mut viewer = allocs.viewer(0)?;
    // The first page (100 events) waits ~50 s for its turn at 2 events a second; the client
    // goes away meanwhile.
    let s = viewer
        .read_log(api::ReadLogRequest {
            from_seq: 1,
            to_seq: 0,
        })
        .await?
        .into_inner();
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(s);
    let t = Instant::now();
    loop {
        match viewer
            .read_log(api::ReadLogRequest {
                from_seq: 1,
                to_seq: 1,
            })
            .await
        {
            Ok(_) => break,
            Err(e)
                if e.code() == Code::ResourceExhausted && t.elapsed() < Duration::from_secs(3) =>
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => anyhow::bail!("the cancelled scan's slot after {:?}: {e:?}", t.elapsed()),
        }
    }
    Ok(())
}

/// Many holders' scans together stream at most `--log-scan-events-total-per-s`: two operators
/// (two holders, each unpaced on its own) scanning at once share it, so what many identities'
/// loops cost the leader is what one scan at that rate costs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_holders_scans_share_the_total_pace() -> anyhow::Result<()> {
    const TOTAL: u64 = 500;
    let etcd = EtcdCluster::start(1).await?;
    let dir = tempfile::tempdir()?;
    let total = format!("--log-scan-events-total-per-s={TOTAL}");
    let flags = [
        "--heavy-reads-per-identity-per-s=0",
        "--log-scan-events-per-s=0",
        total.as_str(),
    ];
    let allocs = Allocators::start(dir.path(), &etcd, 1, "total", &flags)?;
    allocs.wait_leader(Duration::from_secs(20)).await?;
    let admin = allocs.admin(0)?;
    write_quotas(&admin, 4, 150).await?;
    let head = allocs.status(0).await.expect("status").seq;
    let (mut viewer, mut other) = (allocs.viewer(0)?, admin.clone());
    let t = Instant::now();
    let (a, b) = tokio::join!(scan(&mut viewer), scan(&mut other));
    let took = t.elapsed();
    let events = (a?.len() + b?.len()) as u64;
    assert!(events >= 2 * head, "{events} events of two scans of {head}");
    // A second's worth at once, the rest at the total rate.
    let paced = Duration::from_secs_f64((events - TOTAL) as f64 / TOTAL as f64);
    assert!(
        took >= paced.mul_f64(0.9),
        "two holders streamed {events} events in {took:?}: not held to {TOTAL}/s together"
    );
    Ok(())
}
