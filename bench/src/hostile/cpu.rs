//! Who used the CPU: the stack's processes (children of the bench, by name), the attackers'
//! runtime (its threads, by their scheduler statistics), and the honest side (the rest of
//! the bench: honest clients and the fake API server). And a governor that holds the
//! attackers to a CPU budget: on one machine every cycle an attacker burns is taken from the
//! stack it attacks, which a real attacker, on its own machine, would not take.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::common::{cpu_seconds, processes};

/// CPU seconds of each child process of this one, summed by process name.
pub fn children_cpu() -> BTreeMap<String, f64> {
    let me = std::process::id();
    let mut by_name = BTreeMap::new();
    for (pid, (ppid, name)) in processes() {
        if ppid != me {
            continue;
        }
        let name = match name.as_str() {
            n if n.starts_with("gpuledger-alloc") => "allocators",
            n if n.starts_with("gpuledger-exten") => "extender",
            "etcd" => "etcd",
            _ => "other",
        };
        *by_name.entry(name.to_string()).or_insert(0.0) += cpu_seconds(pid);
    }
    by_name
}

/// The threads of one runtime and the CPU they used (threads that ended keep counting what
/// they used before).
#[derive(Debug, Default)]
pub struct Threads(Mutex<Vec<(String, u64)>>);

impl Threads {
    /// Count the calling thread (a runtime's `on_thread_start`).
    pub fn enter(&self) {
        // `/proc/thread-self` links to `<pid>/task/<tid>`.
        if let Ok(p) = std::fs::read_link("/proc/thread-self") {
            self.0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((format!("/proc/{}/schedstat", p.display()), 0));
        }
    }

    /// CPU time of the threads so far (the first field of schedstat: nanoseconds on CPU).
    pub fn cpu(&self) -> Duration {
        let mut threads = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let mut ns = 0;
        for (path, last) in threads.iter_mut() {
            if let Some(now) = std::fs::read_to_string(&*path)
                .ok()
                .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            {
                *last = now;
            }
            ns += *last;
        }
        Duration::from_nanos(ns)
    }
}

/// Holds the attackers' threads to `cores` on average: a token bucket refilled at `cores`
/// and drained by what the threads used, checked every 10 ms; while it is empty, attackers
/// start nothing new ([`Governor::pace`]). What they already hold (connections, streams) they
/// keep. `cores` 0: no bound.
pub struct Governor {
    cores: f64,
    threads: Arc<Threads>,
    open: AtomicBool,
    wake: Notify,
}

/// How far ahead of its budget the attackers may burst.
const BURST: Duration = Duration::from_millis(100);

impl Governor {
    /// A governor of `threads` at `cores` (0 = unbounded); runs until `stop`.
    pub fn start(
        cores: f64,
        threads: Arc<Threads>,
        stop: tokio_util::sync::CancellationToken,
    ) -> Arc<Self> {
        let g = Arc::new(Governor {
            cores,
            threads,
            open: AtomicBool::new(true),
            wake: Notify::new(),
        });
        if cores > 0.0 {
            let g = g.clone();
            tokio::spawn(async move {
                let cap = BURST.as_secs_f64() * g.cores;
                let (mut allowance, mut used, mut at) = (cap, g.threads.cpu(), Instant::now());
                let mut tick = tokio::time::interval(Duration::from_millis(10));
                loop {
                    tokio::select! {
                        () = stop.cancelled() => break,
                        _ = tick.tick() => {}
                    }
                    let (now_used, now) = (g.threads.cpu(), Instant::now());
                    allowance += (now - at).as_secs_f64() * g.cores;
                    allowance -= (now_used - used).as_secs_f64();
                    allowance = allowance.min(cap);
                    (used, at) = (now_used, now);
                    let open = allowance > 0.0;
                    if open && !g.open.swap(true, Ordering::AcqRel) {
                        g.wake.notify_waiters();
                    } else if !open {
                        g.open.store(false, Ordering::Release);
                    }
                }
                g.open.store(true, Ordering::Release);
                g.wake.notify_waiters();
            });
        }
        g
    }

    /// Wait until the attackers are within their budget.
    pub async fn pace(&self) {
        loop {
            let woken = self.wake.notified();
            if self.open.load(Ordering::Acquire) {
                return;
            }
            woken.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_governor_holds_spinning_threads_to_their_budget() {
        let threads = Arc::new(Threads::default());
        let rt = {
            let t = threads.clone();
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .on_thread_start(move || t.enter())
                .build()
                .unwrap()
        };
        let stop = tokio_util::sync::CancellationToken::new();
        let g = Governor::start(0.2, threads.clone(), stop.clone());
        for _ in 0..2 {
            let g = g.clone();
            rt.spawn(async move {
                loop {
                    g.pace().await;
                    let t = Instant::now();
                    while t.elapsed() < Duration::from_millis(1) {}
                    tokio::task::yield_now().await;
                }
            });
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (before, t) = (threads.cpu(), Instant::now());
        tokio::time::sleep(Duration::from_secs(2)).await;
        let cores = (threads.cpu() - before).as_secs_f64() / t.elapsed().as_secs_f64();
        stop.cancel();
        rt.shutdown_background();
        // Two spinning threads would use up to 2 cores; held to 0.2 with a few ms of slack.
        assert!(
            cores > 0.0 && cores < 0.3,
            "attackers used {cores:.2} cores"
        );
    }
}
