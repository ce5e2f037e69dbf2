//! How fast the scheduler port answers `filter` and `prioritize`, per peer address.
//! kube-scheduler calls each once per pod it schedules, one pod at a time, so its rate is the
//! cluster's scheduling rate; whoever holds a copy of its certificate could otherwise have the
//! extender filter as fast as it can send, taking the cores the binds of real pods need. Each
//! address has its own turns, so a copy used from elsewhere spends only its own, never the real
//! scheduler's; and a turn is taken once the request's body has arrived, so a body that
//! trickles in holds no turn. Past the rate a call waits up to [`MAX_WAIT`] for its turn, then
//! is answered 429. Binds are never paced.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::connect_info::ConnectInfo;
use axum::extract::{FromRequest, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use gpuledger_auth::limit::{Bites, peer_key, wait_turn};

/// The limit name its refusals are counted under (listener `scheduler`).
pub const BITE_SCHEDULING_CALLS: &str = "scheduling_calls";

/// Longest a call waits for its turn before it is refused.
pub const MAX_WAIT: Duration = Duration::from_secs(1);

/// Peers remembered before those whose turns are all back are forgotten.
const MAX_PEERS: usize = 4096;

/// The rate of `filter` and `prioritize` calls together, per peer address.
pub struct Pace {
    per_s: u32,
    limiter: Option<DefaultKeyedRateLimiter<IpAddr>>,
    bites: Arc<Bites>,
}

impl Pace {
    /// `per_s` calls a second per peer after a burst of `burst` (`per_s` 0: no limit),
    /// refusals counted in `bites`.
    pub fn new(per_s: u32, burst: u32, bites: Arc<Bites>) -> Arc<Self> {
        let limiter = NonZeroU32::new(per_s).map(|rate| {
            bites.declare(BITE_SCHEDULING_CALLS);
            let burst = NonZeroU32::new(burst.max(per_s)).unwrap_or(rate);
            RateLimiter::keyed(Quota::per_second(rate).allow_burst(burst))
        });
        Arc::new(Pace {
            per_s,
            limiter,
            bites,
        })
    }

    /// Wait for the next call's turn of `peer`; Err(how long it was still away) when over
    /// [`MAX_WAIT`].
    pub async fn admit(&self, peer: IpAddr) -> Result<(), Duration> {
        let Some(limiter) = &self.limiter else {
            return Ok(());
        };
        if limiter.len() > MAX_PEERS {
            limiter.retain_recent();
        }
        let clock = DefaultClock::default();
        let turn = || {
            limiter
                .check_key(&peer)
                .err()
                .map(|n| n.wait_time_from(clock.now()))
        };
        wait_turn(turn, MAX_WAIT).await.inspect_err(|_| {
            self.bites.bite(BITE_SCHEDULING_CALLS);
        })
    }
}

/// The middleware that paces the routes it wraps: the body is read first (within the
/// listener's size and time limits), then the peer's turn is taken.
pub async fn paced(State(pace): State<Arc<Pace>>, req: Request, next: Next) -> Response {
    // Without ConnectInfo (a router served in-process) every caller shares one turn.
    let peer = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |c| peer_key(&c.0));
    let (parts, body) = req.into_parts();
    let head = Request::from_parts(parts.clone(), body);
    let body = match Bytes::from_request(head, &()).await {
        Ok(b) => b,
        Err(rejection) => return rejection.into_response(),
    };
    if let Err(wait) = pace.admit(peer).await {
        return (
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "filter and prioritize are called faster than this extender allows one address \
                 (--scheduling-calls-per-s {}); retry in {} ms\n",
                pace.per_s,
                wait.as_millis().max(1)
            ),
        )
            .into_response();
    }
    next.run(Request::from_parts(parts, Body::from(body))).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn calls_past_the_burst_wait_their_turn_and_past_a_second_are_refused() {
        let bites = Bites::new();
        let p = Pace::new(4, 4, bites.clone());
        let a = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
        for _ in 0..4 {
            p.admit(a).await.unwrap();
        }
        let t = std::time::Instant::now();
        p.admit(a).await.unwrap();
        assert!(
            t.elapsed() >= Duration::from_millis(200),
            "{:?}",
            t.elapsed()
        );
        let mut all = tokio::task::JoinSet::new();
        for _ in 0..10 {
            let p = p.clone();
            all.spawn(async move { p.admit(a).await });
        }
        let refused = all.join_all().await.iter().filter(|r| r.is_err()).count();
        assert!((4..=8).contains(&refused), "{refused} of 10 refused");
        assert_eq!(bites.count(BITE_SCHEDULING_CALLS), refused as u64);
        // Another address has all of its own turns.
        let t = std::time::Instant::now();
        for _ in 0..4 {
            p.admit(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)))
                .await
                .unwrap();
        }
        assert!(
            t.elapsed() < Duration::from_millis(100),
            "{:?}",
            t.elapsed()
        );
        assert!(Pace::new(0, 0, Bites::new()).admit(a).await.is_ok());
    }

    /// A call whose body is still arriving holds no turn: the next call of the same address,
    /// its body whole, is answered at once.
    #[tokio::test]
    async fn a_turn_is_taken_once_the_body_has_arrived() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let pace = Pace::new(1, 1, Bites::new());
        let app = axum::Router::new()
            .route("/filter", axum::routing::post(|b: Bytes| async move { b }))
            .route_layer(axum::middleware::from_fn_with_state(pace, paced));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            axum::serve(
                listener,
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .await
        });
        let head =
            "POST /filter HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nconnection: close\r\n\r\n";
        let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
        slow.write_all(format!("{head}{{").as_bytes())
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let t = std::time::Instant::now();
        let mut whole = tokio::net::TcpStream::connect(addr).await.unwrap();
        whole
            .write_all(format!("{head}{{}}").as_bytes())
            .await
            .unwrap();
        let mut answer = String::new();
        whole.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "{:?}",
            t.elapsed()
        );
        drop(slow);
    }
}
