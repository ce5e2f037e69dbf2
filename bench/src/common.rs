//! Shared pieces: run directory, latency histograms, process memory and CPU time.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Result;
use hdrhistogram::Histogram;

/// A latency histogram in microseconds (1 µs .. 60 s).
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("static bounds are valid")
}

/// Record a duration.
pub fn record(h: &mut Histogram<u64>, d: Duration) {
    let _ = h.record((d.as_micros() as u64).max(1));
}

/// Quantile in milliseconds.
pub fn q_ms(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

/// Resident set size of a process in MiB, from /proc.
pub fn rss_mib(pid: u32) -> Result<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb: f64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    Ok(kb / 1024.0)
}

/// Every process on the machine: its parent's pid and its name (`comm`), from `/proc`.
pub fn processes() -> HashMap<u32, (u32, String)> {
    let mut out = HashMap::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid …`: the name may hold spaces, the fields after it do not.
        let Some((head, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let name = head.split_once('(').map_or("", |(_, n)| n).to_string();
        let ppid = rest
            .split_whitespace()
            .nth(1)
            .and_then(|x| x.parse().ok())
            .unwrap_or(0);
        out.insert(pid, (ppid, name));
    }
    out
}

/// CPU seconds (user + system) a process has used, from /proc.
pub fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    ticks / 100.0
}

/// A temporary run directory that is kept (and printed) when GPULEDGER_KEEP_RUN is set.
pub fn run_dir(name: &str) -> Result<tempfile::TempDir> {
    let keep = std::env::var_os("GPULEDGER_KEEP_RUN").is_some();
    let d = tempfile::Builder::new()
        .prefix(&format!("gpuledger-bench-{name}-"))
        .disable_cleanup(keep)
        .tempdir()?;
    if keep {
        println!("run directory (kept): {}", d.path().display());
    }
    Ok(d)
}

/// Print a section title.
pub fn title(s: &str) {
    println!("\n== {s}");
}

/// Milliseconds one core takes for a fixed loop of arithmetic and random reads over 32 MiB:
/// how fast this machine is right now. Shared and virtual machines change speed from hour to
/// hour (seen here: 1.0x to 1.8x), which moves every latency; compare runs at similar values.
pub fn machine_reference_ms() -> f64 {
    let mem: Vec<u64> = (0..4u64 << 20)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect();
    let t = std::time::Instant::now();
    let (mut x, mut acc) = (1u64, 0u64);
    for _ in 0..3_000_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        acc = acc.wrapping_add(mem[(x as usize) & (mem.len() - 1)]);
    }
    std::hint::black_box(acc);
    t.elapsed().as_secs_f64() * 1e3
}
