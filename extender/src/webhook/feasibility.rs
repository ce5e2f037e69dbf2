//! Whether any registered node can ever hold a pod, as `/validate` asks it. Anyone who reaches
//! the webhook can send a review (the API server's is not told apart), and each question is a
//! Filter over every node, asked as the extender, whose reads the allocator does not pace.
//! So answers are kept per request shape for [`ANSWER_TTL`], and at most
//! `--validate-checks-per-s` new shapes a second are asked; past that a pod is admitted
//! unchecked (kube-scheduler's filter refuses an impossible pod later with the same reason),
//! counted as the webhook's `validate_checks` limit.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use gpuledger_auth::limit::Bites;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::ledger::v1 as pb;
use prost::Message;
use tracing::warn;

use crate::allocator::Allocators;

/// The limit name an unchecked admission is counted under (listener `webhook`).
pub const BITE_VALIDATE_CHECKS: &str = "validate_checks";

/// How long an answer stands (nodes come and go; a shape asked again later is asked anew).
pub const ANSWER_TTL: Duration = Duration::from_secs(10);

/// Request shapes whose answers are kept at most.
const MAX_SHAPES: u64 = 4096;

/// The answers, and the pace of new questions.
pub struct Feasibility {
    answers: moka::future::Cache<Vec<u8>, Option<String>>,
    limiter: Option<DefaultDirectRateLimiter>,
    bites: Arc<Bites>,
}

/// What the check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Some node may hold the pod (or nobody could say: no node, or no allocator answer).
    Fits,
    /// No node ever can, and why.
    Never(String),
    /// Not asked: over `--validate-checks-per-s`.
    Unchecked,
}

impl Feasibility {
    /// `per_s` new shapes asked a second after a burst of `burst` (`per_s` 0: no pace),
    /// unchecked admissions counted in `bites`.
    pub fn new(per_s: u32, burst: u32, bites: Arc<Bites>) -> Arc<Self> {
        let limiter = NonZeroU32::new(per_s).map(|rate| {
            bites.declare(BITE_VALIDATE_CHECKS);
            let burst = NonZeroU32::new(burst.max(per_s)).unwrap_or(rate);
            RateLimiter::direct(Quota::per_second(rate).allow_burst(burst))
        });
        Arc::new(Feasibility {
            answers: moka::future::Cache::builder()
                .max_capacity(MAX_SHAPES)
                .time_to_live(ANSWER_TTL)
                .build(),
            limiter,
            bites,
        })
    }

    /// Whether any registered node can ever hold `containers` (each node answers "never").
    /// No node registered, or the allocator not answering, is no reason to refuse: the
    /// scheduler's filter says so again, and refusing pods for an outage is worse.
    pub async fn never_fits(
        &self,
        allocators: &Allocators,
        containers: Vec<api::ContainerRequest>,
    ) -> Verdict {
        let key: Vec<u8> = containers
            .iter()
            .flat_map(|c| c.encode_length_delimited_to_vec())
            .collect();
        if let Some(known) = self.answers.get(&key).await {
            return known.map_or(Verdict::Fits, Verdict::Never);
        }
        if let Some(l) = &self.limiter
            && l.check().is_err()
        {
            self.bites.bite(BITE_VALIDATE_CHECKS);
            return Verdict::Unchecked;
        }
        match ask(allocators, containers).await {
            Some(answer) => {
                self.answers.insert(key, answer.clone()).await;
                answer.map_or(Verdict::Fits, Verdict::Never)
            }
            None => Verdict::Fits,
        }
    }
}

/// The allocator's answer (Some(None): fits; Some(Some(why)): never), None when it gave none.
async fn ask(
    allocators: &Allocators,
    containers: Vec<api::ContainerRequest>,
) -> Option<Option<String>> {
    let probe = api::FilterRequest {
        request: Some(api::PodRequest {
            pod: Some(pb::PodRef {
                uid: "admission-probe".into(),
                namespace: "probe".into(),
                name: "probe".into(),
            }),
            containers,
            ..Default::default()
        }),
        nodes: Vec::new(),
    };
    match allocators
        .call("Filter", |mut c| {
            let p = probe.clone();
            async move { c.filter(p).await }
        })
        .await
    {
        Ok(r) if r.nodes.is_empty() && r.failed.is_empty() && !r.unresolvable.is_empty() => {
            let mut why: Vec<(String, String)> = r.unresolvable.into_iter().collect();
            why.sort();
            Some(
                why.first()
                    .map(|(node, why)| format!("{why} (node {node}, and every other node)")),
            )
        }
        Ok(_) => Some(None),
        Err(s) if s.code() == tonic::Code::InvalidArgument => Some(Some(s.message().to_string())),
        Err(s) => {
            warn!(error = %s.message(), "validate could not ask the allocator; admitting");
            None
        }
    }
}
