//! The extender's metrics (`gpuledger_extender_*`): latency and outcome of every verb, webhook
//! reviews included.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// `gpuledger_extender_limited_total{listener,limit}`: what each listener's limits refused
/// (connections, bodies, client certificates naming another identity).
pub use gpuledger_auth::limit::Limited;

type Labels = Vec<(&'static str, &'static str)>;

const VERBS: [&str; 6] = [
    "filter",
    "prioritize",
    "bind",
    "preempt",
    "mutate",
    "validate",
];
const OUTCOMES: [&str; 3] = ["ok", "error", "bad_request"];

/// How a request ended, when the status code alone does not say (bind and filter answer 200
/// with an `Error` field).
#[derive(Debug, Clone, Copy)]
pub struct Outcome(pub &'static str);

/// Every series the extender exports.
pub struct Metrics {
    /// Where the series are registered; `/metrics` encodes it.
    pub registry: Arc<Registry>,
    requests: Family<Labels, Counter>,
    latency: Family<Labels, Histogram>,
}

fn latency_histogram() -> Histogram {
    // 0.25 ms .. ~4 s.
    Histogram::new(exponential_buckets(0.000_25, 2.0, 15))
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new(|_| {})
    }
}

impl Metrics {
    /// The verb series plus whatever `more` registers (the ledger replica's).
    pub fn new(more: impl FnOnce(&mut Registry)) -> Self {
        let mut registry = Registry::with_prefix("gpuledger_extender");
        more(&mut registry);
        let requests = Family::<Labels, Counter>::default();
        let latency =
            Family::<Labels, Histogram>::new_with_constructor(latency_histogram as fn() -> _);
        registry.register(
            "requests",
            "Requests by verb (filter, prioritize, bind, preempt, mutate, validate) and outcome (ok, error, bad_request)",
            requests.clone(),
        );
        registry.register_with_unit(
            "request_duration",
            "Time to answer a request, by verb",
            prometheus_client::registry::Unit::Seconds,
            latency.clone(),
        );
        // Every series exists from the start (at 0), so rate() and the dashboard see a fresh
        // extender, not a missing one.
        for verb in VERBS {
            let _ = latency.get_or_create(&vec![("verb", verb)]);
            for outcome in OUTCOMES {
                let _ = requests.get_or_create(&vec![("verb", verb), ("outcome", outcome)]);
            }
        }
        Metrics {
            registry: Arc::new(registry),
            requests,
            latency,
        }
    }

    /// Record one request of `verb` that took `secs` and ended as `outcome`.
    pub fn observe(&self, verb: &'static str, outcome: &'static str, secs: f64) {
        self.requests
            .get_or_create(&vec![("verb", verb), ("outcome", outcome)])
            .inc();
        self.latency
            .get_or_create(&vec![("verb", verb)])
            .observe(secs);
    }
}

/// The verb a request path names, if it is one the extender serves.
pub fn verb_of(path: &str) -> Option<&'static str> {
    match path.rsplit('/').next()? {
        "filter" => Some("filter"),
        "prioritize" => Some("prioritize"),
        "bind" => Some("bind"),
        "preempt" => Some("preempt"),
        "mutate" => Some("mutate"),
        "validate" => Some("validate"),
        _ => None,
    }
}

/// Middleware: time every verb and count its outcome.
pub async fn track(State(m): State<Arc<Metrics>>, req: Request, next: Next) -> Response {
    let verb = verb_of(req.uri().path());
    let t0 = Instant::now();
    let resp = next.run(req).await;
    if let Some(verb) = verb {
        let outcome = match resp.extensions().get::<Outcome>() {
            Some(o) => o.0,
            None if resp.status().is_success() => "ok",
            None if resp.status().is_client_error() => "bad_request",
            None => "error",
        };
        m.observe(verb, outcome, t0.elapsed().as_secs_f64());
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verbs_are_named_by_the_last_path_segment() {
        assert_eq!(verb_of("/gpuledger/filter"), Some("filter"));
        assert_eq!(verb_of("/bind"), Some("bind"));
        assert_eq!(verb_of("/metrics"), None);
    }

    #[test]
    fn observed_requests_appear_in_the_text() {
        let m = Metrics::default();
        m.observe("bind", "error", 0.003);
        let text = gpuledger_ops::metrics::encode(&m.registry).unwrap();
        assert!(
            text.contains(r#"gpuledger_extender_requests_total{verb="bind",outcome="error"} 1"#),
            "{text}"
        );
        assert!(
            text.contains("gpuledger_extender_request_duration_seconds_count{verb=\"bind\"} 1"),
            "{text}"
        );
    }
}
