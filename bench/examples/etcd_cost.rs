//! etcd's CPU per transaction of the ledger's commit shape (two compares, two puts), one
//! transaction in flight as the allocator's sequencer sends them, by value size. Shows that
//! etcd's cost is mostly per transaction, not per byte: why group commit pays.
//!
//! `cargo run --release -p gpuledger-bench --example etcd_cost -- 200 4096 16384`

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp};
use gpuledger_testkit::EtcdCluster;

/// CPU seconds (user + system) of a process, from /proc.
fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| -> Result<f64> {
        Ok(f.get(i).context("short /proc stat")?.parse::<f64>()? / 100.0)
    };
    Ok(tick(11)? + tick(12)?)
}

#[tokio::main]
async fn main() -> Result<()> {
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().context("value sizes in bytes"))
        .collect::<Result<_>>()?;
    let sizes = if sizes.is_empty() {
        vec![200, 4096, 16384]
    } else {
        sizes
    };
    let dir = tempfile::tempdir()?;
    let etcd = EtcdCluster::start_in(dir.path(), 3).await?;
    let pids: Vec<u32> = (0..etcd.len())
        .filter_map(|i| etcd.member(i).and_then(|p| p.pid()))
        .collect();
    let members_cpu = || -> Result<f64> { pids.iter().map(|p| cpu_seconds(*p)).sum() };
    let mut c = Client::connect(etcd.endpoints(), None).await?;
    c.put("leader", "me", None).await?;
    let resp = c.get("leader", None).await?;
    let epoch = resp.kvs().first().context("leader key")?.create_revision();
    println!(
        "{:>9} {:>8} {:>22} {:>11}",
        "value B", "txn/s", "etcd CPU/txn (3 mbrs)", "latency"
    );
    for size in sizes {
        let mut head = c
            .put("head", "h", None)
            .await?
            .header()
            .map_or(0, |h| h.revision());
        let before = members_cpu()?;
        let t = Instant::now();
        let mut n = 0u64;
        while t.elapsed() < Duration::from_secs(5) {
            let txn = Txn::new()
                .when([
                    Compare::create_revision("leader", CompareOp::Equal, epoch),
                    Compare::mod_revision("head", CompareOp::Equal, head),
                ])
                .and_then([
                    TxnOp::put(format!("log/{size}/{n:020}"), vec![7u8; size], None),
                    TxnOp::put("head", vec![1u8; 12], None),
                ]);
            let r = c.txn(txn).await?;
            if !r.succeeded() {
                bail!("the fence failed: nobody else writes here");
            }
            head = r.header().map_or(0, |h| h.revision());
            n += 1;
        }
        let secs = t.elapsed().as_secs_f64();
        println!(
            "{size:>9} {:>8.0} {:>19.0} µs {:>8.2} ms",
            n as f64 / secs,
            (members_cpu()? - before) * 1e6 / n as f64,
            secs * 1e3 / n as f64
        );
    }
    Ok(())
}
