//! `prioritize`: a 0-10 score per node, from the same placement policy that bind will use.

use std::borrow::Cow;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use gpuledger_proto::allocator::v1 as api;
use serde_json::json;
use tracing::field::Empty;
use tracing::{Span, instrument, warn};

use super::wire::{ExtenderArgs, HostPriority, take_node_names};
use super::{App, bad_request, json_sized, record_pod};
use crate::parallel;

#[instrument(name = "prioritize", skip_all, fields(pod_uid = Empty, pod = Empty, nodes = Empty))]
pub(super) async fn prioritize(State(app): State<App>, body: Bytes) -> Response {
    let mut args: ExtenderArgs<'_> = match serde_json::from_slice(&body) {
        Ok(a) => a,
        Err(e) => return bad_request("prioritize", e),
    };
    let names = take_node_names(&mut args);
    let Some(pod) = args.pod.as_ref() else {
        return bad_request("prioritize", "Pod is missing");
    };
    record_pod(pod);
    Span::current().record("nodes", names.len());
    fn zero(names: Vec<Cow<'_, str>>) -> Vec<HostPriority<'_>> {
        names
            .into_iter()
            .map(|host| HostPriority { host, score: 0 })
            .collect()
    }
    let req = match super::dra::pod_request(&app, pod).await {
        Ok(Some(r)) => r,
        Ok(None) | Err(_) => return axum::Json(zero(names)).into_response(),
    };
    let local = match &app.replica {
        None => None,
        Some(r) => {
            r.read("prioritize", |l, d| match d.request(req.clone()) {
                // A node the replica does not know yet may be registered by now: ask.
                Ok(pr) => {
                    let mut scores = parallel::score_nodes(l, &names, &pr);
                    r.in_flight.scores(l, d, &pr, &names, &mut scores);
                    names
                        .iter()
                        .zip(scores)
                        .map(|(n, s)| {
                            Some(HostPriority {
                                host: Cow::Borrowed(n.as_ref()),
                                score: i64::from(s?.min(10)),
                            })
                        })
                        .collect::<Option<Vec<_>>>()
                        .map(Ok)
                }
                Err(why) => Some(Err(why)),
            })
            .await
        }
    };
    let res = match local {
        Some(Ok(list)) => return json_sized(&list, names.len() * 40),
        Some(Err(why)) => Err(tonic::Status::invalid_argument(why)),
        None => {
            let sr = api::ScoreRequest {
                request: Some(req),
                nodes: names.iter().map(|n| n.to_string()).collect(),
            };
            app.allocators
                .call("Score", |mut c| {
                    let sr = sr.clone();
                    async move { c.score(sr).await }
                })
                .await
        }
    };
    match res {
        Ok(r) => {
            let list: Vec<HostPriority<'_>> = r
                .scores
                .into_iter()
                .map(|s| HostPriority {
                    host: s.node.into(),
                    score: i64::from(s.score.min(10)),
                })
                .collect();
            axum::Json(list).into_response()
        }
        Err(s) => {
            let status = super::status_of(&s);
            if status.is_server_error() {
                warn!(error = %s.message(), "prioritize failed");
            }
            (
                status,
                axum::Json(json!({"Error": crate::scheduler_text::without_percent(s.message())})),
            )
                .into_response()
        }
    }
}
