//! The faults of a run: which kinds, when (by the seed), and how each is injected and
//! healed.

use std::time::{Duration, Instant};

use anyhow::Result;
use gpuledger_testkit::cluster::{LocalCluster, allocator_etcd_host};
use nix::sys::signal::Signal;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::netns::{iptables, partition_rules};

/// The faults a run draws from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL the allocator leader, restart it.
    KillLeader,
    /// SIGSTOP the leader past its lease, then SIGCONT.
    PauseLeader,
    /// SIGKILL a follower, restart it.
    KillFollower,
    /// SIGKILL one etcd member, restart it.
    KillEtcdMember,
    /// SIGKILL an extender replica, restart it.
    KillExtender,
    /// SIGKILL a node agent, restart it.
    KillNodeAgent,
    /// Drop all traffic between the allocator leader and etcd until another replica leads.
    PartitionLeader,
}

impl Fault {
    const ALL: [Fault; 7] = [
        Fault::KillLeader,
        Fault::PauseLeader,
        Fault::KillFollower,
        Fault::KillEtcdMember,
        Fault::KillExtender,
        Fault::KillNodeAgent,
        Fault::PartitionLeader,
    ];
}

/// The fault schedule of a seed: which faults, at which fraction of the workload. Every kind
/// of fault comes once (as far as `faults` allows), the rest are drawn at random, and the
/// order is shuffled: all by the seed.
pub fn schedule(seed: u64, faults: usize) -> Vec<(f64, Fault)> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
    let mut kinds: Vec<Fault> = Fault::ALL.to_vec();
    kinds.shuffle(&mut rng);
    kinds.truncate(faults);
    while kinds.len() < faults {
        kinds.push(Fault::ALL[rng.random_range(0..Fault::ALL.len())]);
    }
    kinds.shuffle(&mut rng);
    kinds
        .into_iter()
        .enumerate()
        .map(|(i, f)| {
            let at = (i as f64 + rng.random_range(0.2..0.8)) / faults.max(1) as f64;
            (at, f)
        })
        .collect()
}

/// One injected fault.
pub(super) struct Injected {
    /// Since the workload started.
    pub(super) at: Duration,
    /// Until the fault was over (process restarted, partition healed).
    pub(super) until: Duration,
    /// What was done, and how long the cluster took to recover.
    pub(super) what: String,
}

/// Inject `fault`, the `n`-th of the run, and wait until it is over; what was done.
pub(super) async fn inject(
    c: &mut LocalCluster,
    fault: Fault,
    seed: u64,
    n: usize,
    partitions: bool,
) -> Result<String> {
    let leader = c.allocs.wait_leader(Duration::from_secs(30)).await?;
    let pick = |len: usize| (seed as usize).wrapping_add(n) % len.max(1);
    Ok(match fault {
        Fault::KillLeader => {
            let t = Instant::now();
            c.allocs.procs[leader].kill();
            let new = c
                .allocs
                .wait_leader_except(Duration::from_secs(30), Some(leader))
                .await?;
            let ms = t.elapsed().as_millis();
            c.allocs.procs[leader].start()?;
            format!("SIGKILL allocator leader alloc{leader}; alloc{new} leading after {ms} ms")
        }
        Fault::PauseLeader => {
            let t = Instant::now();
            c.allocs.procs[leader].signal(Signal::SIGSTOP)?;
            let new = c
                .allocs
                .wait_leader_except(Duration::from_secs(30), Some(leader))
                .await?;
            let ms = t.elapsed().as_millis();
            tokio::time::sleep(Duration::from_millis(500)).await;
            c.allocs.procs[leader].signal(Signal::SIGCONT)?;
            format!(
                "SIGSTOP allocator leader alloc{leader} past its lease; alloc{new} leading after {ms} ms; SIGCONT"
            )
        }
        Fault::KillFollower => {
            let k = c.allocs.addrs.len();
            let f = (leader + 1 + pick(k - 1)) % k;
            c.allocs.procs[f].kill();
            tokio::time::sleep(Duration::from_millis(500)).await;
            c.allocs.procs[f].start()?;
            format!("SIGKILL allocator follower alloc{f}, restarted after 0.5 s")
        }
        Fault::KillEtcdMember => {
            let m = pick(3);
            c.etcd().kill(m);
            tokio::time::sleep(Duration::from_millis(1500)).await;
            c.etcd().restart(m)?;
            format!("SIGKILL etcd member etcd{m}, restarted after 1.5 s")
        }
        Fault::KillExtender => {
            let e = pick(c.extenders.len());
            c.extenders[e].kill();
            tokio::time::sleep(Duration::from_secs(1)).await;
            c.extenders[e].start()?;
            format!("SIGKILL extender{e}, restarted after 1 s")
        }
        Fault::KillNodeAgent => {
            let i = pick(c.nodes.len());
            let running = c
                .runs
                .running()
                .iter()
                .filter(|r| r.node == c.nodes[i].name)
                .count();
            let back = c.restart_agent(i, Duration::from_secs(1)).await?;
            format!(
                "SIGKILL node agent of {} ({running} pods running there), restarted after 1 s, ready after {} ms",
                c.nodes[i].name,
                back.as_millis()
            )
        }
        Fault::PartitionLeader if !partitions => {
            "partition of the allocator leader from etcd skipped (no network namespace)".into()
        }
        Fault::PartitionLeader => {
            let host = allocator_etcd_host(leader);
            let rules = partition_rules(&host);
            let t = Instant::now();
            for r in &rules {
                iptables("-I", r)?;
            }
            let new = c
                .allocs
                .wait_leader_except(Duration::from_secs(30), Some(leader))
                .await;
            let ms = t.elapsed().as_millis();
            // Hold it a little longer: the deposed leader tries (and fails) to write.
            tokio::time::sleep(Duration::from_millis(1000)).await;
            for r in &rules {
                iptables("-D", r)?;
            }
            let new = new?;
            format!(
                "partition alloc{leader} from etcd (iptables DROP {host}); alloc{new} leading after {ms} ms; healed after {} ms",
                t.elapsed().as_millis()
            )
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn same_seed_same_schedule() {
        assert_eq!(schedule(7, 20), schedule(7, 20));
        assert_ne!(schedule(7, 20), schedule(8, 20));
        let s = schedule(1, 20);
        assert!(s.windows(2).all(|w| w[0].0 < w[1].0));
        assert!(s.iter().all(|(at, _)| *at > 0.0 && *at < 1.0));
        for faults in [7, 20] {
            let kinds: BTreeSet<String> = schedule(3, faults)
                .iter()
                .map(|(_, f)| format!("{f:?}"))
                .collect();
            assert_eq!(kinds.len(), Fault::ALL.len(), "{faults} faults: {kinds:?}");
        }
    }
}
