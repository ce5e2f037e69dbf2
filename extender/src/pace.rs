//! How fast the scheduler port answers `filter` and `prioritize`. kube-scheduler calls each
//! once per pod it schedules, one pod at a time, so its rate is the cluster's scheduling rate;
//! whoever holds a copy of its certificate could otherwise have the extender filter as fast as
//! it can send, taking the cores the binds of real pods need. Past the rate a call waits up to
//! [`MAX_WAIT`] for its turn, then is answered 429. Binds are never paced.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use gpuledger_auth::limit::{Bites, wait_turn};

/// The limit name its refusals are counted under (listener `scheduler`).
pub const BITE_SCHEDULING_CALLS: &str = "scheduling_calls";

/// Longest a call waits for its turn before it is refused.
pub const MAX_WAIT: Duration = Duration::from_secs(1);

/// The rate of `filter` and `prioritize` calls together.
pub struct Pace {
    per_s: u32,
    limiter: Option<DefaultDirectRateLimiter>,
    bites: Arc<Bites>,
}

impl Pace {
    /// `per_s` calls a second after a burst of `burst` (`per_s` 0: no limit), refusals counted
    /// in `bites`.
    pub fn new(per_s: u32, burst: u32, bites: Arc<Bites>) -> Arc<Self> {
        let limiter = NonZeroU32::new(per_s).map(|rate| {
            bites.declare(BITE_SCHEDULING_CALLS);
            let burst = NonZeroU32::new(burst.max(per_s)).unwrap_or(rate);
            RateLimiter::direct(Quota::per_second(rate).allow_burst(burst))
        });
        Arc::new(Pace {
            per_s,
            limiter,
            bites,
        })
    }

    /// Wait for the next call's turn; Err(how long it was still away) when over [`MAX_WAIT`].
    pub async fn admit(&self) -> Result<(), Duration> {
        let Some(limiter) = &self.limiter else {
            return Ok(());
        };
        let clock = DefaultClock::default();
        let turn = || limiter.check().err().map(|n| n.wait_time_from(clock.now()));
        wait_turn(turn, MAX_WAIT).await.inspect_err(|_| {
            self.bites.bite(BITE_SCHEDULING_CALLS);
        })
    }
}

/// The middleware that paces the routes it wraps.
pub async fn paced(State(pace): State<Arc<Pace>>, req: Request, next: Next) -> Response {
    match pace.admit().await {
        Ok(()) => next.run(req).await,
        Err(wait) => (
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "filter and prioritize are called faster than this extender allows \
                 (--scheduling-calls-per-s {}); retry in {} ms\n",
                pace.per_s,
                wait.as_millis().max(1)
            ),
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn calls_past_the_burst_wait_their_turn_and_past_a_second_are_refused() {
        let bites = Bites::new();
        let p = Pace::new(4, 4, bites.clone());
        for _ in 0..4 {
            p.admit().await.unwrap();
        }
        let t = std::time::Instant::now();
        p.admit().await.unwrap();
        assert!(
            t.elapsed() >= Duration::from_millis(200),
            "{:?}",
            t.elapsed()
        );
        let mut all = tokio::task::JoinSet::new();
        for _ in 0..10 {
            let p = p.clone();
            all.spawn(async move { p.admit().await });
        }
        let refused = all.join_all().await.iter().filter(|r| r.is_err()).count();
        assert!((4..=8).contains(&refused), "{refused} of 10 refused");
        assert_eq!(bites.count(BITE_SCHEDULING_CALLS), refused as u64);
        assert!(Pace::new(0, 0, Bites::new()).admit().await.is_ok());
    }
}
