//! How fast one caller may start heavy reads (a filter over every node, a dump, a read of the
//! whole log): each takes milliseconds of CPU on the heavy-read threads, which honest reads and
//! the leader's own work share, so one identity may start only so many a second. A read past
//! the rate waits for its turn (a client that reads in a loop is slowed, not refused) up to
//! [`MAX_WAIT`], then is refused with `RESOURCE_EXHAUSTED`.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use gpuledger_auth::identity::{Holder, Role};
use gpuledger_auth::limit::{Bites, wait_turn};
use gpuledger_auth::rules::Call;
use gpuledger_auth::server::over_limit;
use tonic::Status;

/// The limit name its refusals are counted under.
pub const BITE_HEAVY_READS: &str = "heavy_reads_per_identity";

/// Longest a heavy read waits for its turn before it is refused.
pub const MAX_WAIT: Duration = Duration::from_secs(1);

/// Identities remembered before those that have not read lately are forgotten.
const MAX_KEYS: usize = 10_000;

/// Whether `call` is a heavy read.
pub fn is_heavy(call: Call) -> bool {
    matches!(
        call,
        Call::Filter | Call::Score | Call::Dump | Call::ReadLog | Call::ReadSnapshots
    )
}

/// None when `caller` may start a heavy read now (its turn taken), else how long until it may.
fn next_turn(limiter: &DefaultKeyedRateLimiter<Holder>, caller: &Holder) -> Option<Duration> {
    let clock = DefaultClock::default();
    limiter
        .check_key(caller)
        .err()
        .map(|n| n.wait_time_from(clock.now()))
}

/// The heavy-read rate of each identity.
pub struct ReadLimits {
    per_s: u32,
    burst: u32,
    limiter: Option<DefaultKeyedRateLimiter<Holder>>,
    bites: Arc<Bites>,
}

impl ReadLimits {
    /// `per_s` heavy reads a second per identity after a burst of `burst` (`per_s` 0: no
    /// limit), refusals counted in `bites`.
    pub fn new(per_s: u32, burst: u32, bites: Arc<Bites>) -> Self {
        let limiter = NonZeroU32::new(per_s).map(|rate| {
            let burst = NonZeroU32::new(burst.max(per_s)).unwrap_or(rate);
            bites.declare(BITE_HEAVY_READS);
            RateLimiter::keyed(Quota::per_second(rate).allow_burst(burst))
        });
        ReadLimits {
            per_s,
            burst,
            limiter,
            bites,
        }
    }

    /// No limit.
    pub fn unlimited(bites: Arc<Bites>) -> Self {
        ReadLimits::new(0, 0, bites)
    }

    /// Wait for `caller`'s turn to make the heavy read `call`, or refuse it when the turn is
    /// more than [`MAX_WAIT`] away. Allocators and the extender are not held to the rate: their
    /// reads are scheduling itself, bounded by their requests in flight.
    pub async fn admit(&self, caller: &Holder, call: Call) -> Result<(), Status> {
        let Some(limiter) = &self.limiter else {
            return Ok(());
        };
        if !is_heavy(call) || matches!(caller.caller.role, Role::Allocator | Role::Extender) {
            return Ok(());
        }
        if limiter.len() > MAX_KEYS {
            limiter.retain_recent();
        }
        let turn = || next_turn(limiter, caller);
        wait_turn(turn, MAX_WAIT).await.map_err(|wait| {
            self.bites.bite(BITE_HEAVY_READS);
            over_limit(
                Status::resource_exhausted(format!(
                    "{caller} makes heavy reads ({}) faster than this allocator allows \
                     (--heavy-reads-per-identity-per-s {}, --heavy-read-burst {}); retry in {} ms",
                    call.name(),
                    self.per_s,
                    self.burst.max(self.per_s),
                    wait.as_millis().max(1)
                )),
                BITE_HEAVY_READS,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(role: Role, subject: &str) -> Holder {
        Holder {
            caller: gpuledger_auth::identity::Caller {
                role,
                subject: subject.into(),
            },
            instance: "token:0".into(),
        }
    }

    fn viewer() -> Holder {
        holder(Role::Viewer, "system:serviceaccount:x:dashboards")
    }

    #[tokio::test]
    async fn a_burst_passes_then_reads_wait_their_turn_then_are_refused() {
        let bites = Bites::new();
        let l = ReadLimits::new(2, 4, bites.clone());
        for _ in 0..4 {
            l.admit(&viewer(), Call::Dump).await.unwrap();
        }
        // The fifth waits ~500 ms for its turn.
        let t = std::time::Instant::now();
        l.admit(&viewer(), Call::Filter).await.unwrap();
        assert!(
            t.elapsed() >= Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );
        assert_eq!(bites.count(BITE_HEAVY_READS), 0);
        // Many at once: those whose turn is over a second away are refused, and counted.
        let v = viewer();
        let waits = futures::future::join_all((0..6).map(|_| l.admit(&v, Call::ReadLog)));
        let refused = waits.await.iter().filter(|r| r.is_err()).count();
        assert!(refused >= 3, "{refused} refused");
        assert_eq!(bites.count(BITE_HEAVY_READS), refused as u64);
    }

    #[tokio::test]
    async fn light_calls_scheduling_and_other_identities_are_not_held() {
        let l = ReadLimits::new(1, 1, Bites::new());
        l.admit(&viewer(), Call::Dump).await.unwrap();
        assert!(l.admit(&viewer(), Call::Status).await.is_ok());
        for role in [Role::Extender, Role::Allocator] {
            let c = holder(role, "s");
            for _ in 0..10 {
                l.admit(&c, Call::Filter).await.unwrap();
            }
        }
        let other = holder(Role::Viewer, "system:serviceaccount:x:other");
        l.admit(&other, Call::Dump).await.unwrap();
    }
}
