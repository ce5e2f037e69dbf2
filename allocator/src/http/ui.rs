//! The live GPU map: `/ui` (one static page, embedded) over two JSON endpoints,
//! `/api/v1/state` and `/api/v1/events?limit=N`.
//!
//! The JSON is written by hand rather than through serde: the allocator has no serde
//! dependency, and positional arrays keep 1,000 nodes × 8 GPUs small enough for the page to
//! fetch, parse and draw in well under a second. The page documents the array layouts.

use std::collections::HashMap;
use std::fmt::Write as _;

use gpuledger_ledger::pb::event::Body;
use gpuledger_ledger::{AllocState, Ledger, pb};

use crate::shared::Shared;

/// The page, embedded so that every replica serves it with no files to deploy.
pub const PAGE: &str = include_str!("ui.html");

/// Events returned when `limit` is not given.
const DEFAULT_EVENTS: usize = 50;
/// Most events one request may ask for.
const MAX_EVENTS: usize = 1000;

/// A query string that the endpoint cannot accept, with a message for the caller.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadQuery(String);

/// `?limit=N` of `/api/v1/events`: 1..=1000, default 50. Any other parameter is refused so a
/// typo does not silently fall back to the default.
pub fn events_limit(query: Option<&str>) -> Result<usize, BadQuery> {
    let mut limit = DEFAULT_EVENTS;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "limit" => {
                limit = v.parse().map_err(|_| {
                    BadQuery(format!(
                        "limit must be a whole number from 1 to {MAX_EVENTS}, got {v:?}"
                    ))
                })?;
                if !(1..=MAX_EVENTS).contains(&limit) {
                    return Err(BadQuery(format!(
                        "limit must be from 1 to {MAX_EVENTS}, got {limit}"
                    )));
                }
            }
            other => {
                return Err(BadQuery(format!(
                    "unknown query parameter {other:?} (this endpoint takes: limit)"
                )));
            }
        }
    }
    Ok(limit)
}

/// `/api/v1/state` takes no parameters.
pub fn no_params(query: Option<&str>) -> Result<(), BadQuery> {
    match query.filter(|q| !q.is_empty()) {
        None => Ok(()),
        Some(q) => Err(BadQuery(format!(
            "this endpoint takes no query parameters, got {q:?}"
        ))),
    }
}

/// Append `s` as a JSON string literal.
fn json_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn state_char(s: AllocState) -> &'static str {
    match s {
        AllocState::Reserved => "\"r\"",
        AllocState::Bound => "\"b\"",
        AllocState::Assigned => "\"a\"",
    }
}

/// The whole map as compact JSON:
///
/// ```text
/// {"replica","role","leader","epoch","seq","ready","why",
///  "models":[model…],
///  "nodes":[[name,[[index,uuid,model#,mem_mib,mem_used,core_used,healthy(0|1),[alloc#…]]…]]…],
///  "allocs":[[id,"namespace/pod",container,"r"|"b"|"a",mem_mib,core_milli]…]}
/// ```
/// `model#` indexes `models`; `alloc#` indexes `allocs`.
pub fn state_json(shared: &Shared) -> String {
    // Building the map takes O(GPUs) of CPU (at 5,000 nodes × 8 GPUs about 160 ms), from a
    // view that no fold waits for. However many browsers poll, build it at most once per
    // STATE_MAX_AGE and let them share it.
    static CACHE: std::sync::Mutex<Option<(tokio::time::Instant, String, String)>> =
        std::sync::Mutex::new(None);
    let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    let now = shared.clock.now();
    if let Some((at, replica, json)) = cache.as_ref()
        && *replica == shared.replica
        && now.saturating_duration_since(*at) < STATE_MAX_AGE
    {
        return json.clone();
    }
    let json = build_state_json(shared);
    *cache = Some((now, shared.replica.clone(), json.clone()));
    json
}

/// How stale `/api/v1/state` may be (the page polls every 2 s).
const STATE_MAX_AGE: std::time::Duration = std::time::Duration::from_millis(1000);

fn build_state_json(shared: &Shared) -> String {
    let role = shared.role_info();
    let why = shared.readiness().err().unwrap_or_default();
    let mut out = String::with_capacity(1 << 16);
    out.push_str("{\"replica\":");
    json_str(&mut out, &shared.replica);
    out.push_str(",\"role\":");
    json_str(&mut out, role.role.as_str());
    out.push_str(",\"leader\":");
    json_str(&mut out, &role.leader);
    let _ = write!(out, ",\"ready\":{},\"why\":", why.is_empty());
    json_str(&mut out, &why);
    let l = shared.view_blocking();
    let _ = write!(
        out,
        ",\"epoch\":{},\"seq\":{}",
        role.epoch.max(l.epoch()),
        l.seq()
    );
    ledger_json(&mut out, &l);
    out.push('}');
    out
}

fn ledger_json(out: &mut String, l: &Ledger) {
    let mut models: Vec<&str> = Vec::new();
    let mut allocs: Vec<u64> = Vec::with_capacity(l.allocs().len());
    let mut alloc_pos: HashMap<u64, usize> = HashMap::with_capacity(l.allocs().len());
    out.push_str(",\"nodes\":[");
    for (i, n) in l.nodes().values().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push('[');
        json_str(out, &n.name);
        out.push_str(",[");
        for (j, g) in n.gpus.iter().enumerate() {
            if j > 0 {
                out.push(',');
            }
            let model = match models.iter().position(|m| *m == g.model) {
                Some(p) => p,
                None => {
                    models.push(&g.model);
                    models.len() - 1
                }
            };
            let _ = write!(out, "[{},", g.index);
            json_str(out, &g.uuid);
            let _ = write!(
                out,
                ",{model},{},{},{},{},[",
                g.memory_mib,
                g.mem_used,
                g.core_used,
                u8::from(g.healthy)
            );
            let mut first = true;
            for id in &n.allocs {
                let Some(a) = l.alloc(*id) else { continue };
                if !a.shares.iter().any(|s| s.gpu_uuid == g.uuid) {
                    continue;
                }
                let pos = *alloc_pos.entry(*id).or_insert_with(|| {
                    allocs.push(*id);
                    allocs.len() - 1
                });
                if !first {
                    out.push(',');
                }
                first = false;
                let _ = write!(out, "{pos}");
            }
            out.push_str("]]");
        }
        out.push_str("]]");
    }
    out.push_str("],\"models\":[");
    for (i, m) in models.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        json_str(out, m);
    }
    out.push_str("],\"allocs\":[");
    for (i, id) in allocs.iter().enumerate() {
        let Some(a) = l.alloc(*id) else { continue };
        if i > 0 {
            out.push(',');
        }
        let _ = write!(out, "[{},", a.id);
        json_str(out, &format!("{}/{}", a.pod.namespace, a.pod.name));
        out.push(',');
        json_str(out, &a.container);
        let core = a.shares.first().map_or(0, |s| s.core_milli);
        let _ = write!(out, ",{},{},{core}]", state_char(a.state), a.mem_mib());
    }
    out.push(']');
}

/// The latest `limit` committed events this replica folded, newest first:
///
/// ```text
/// {"seq":N,"events":[[seq,epoch,time_ms,type,node,summary]…]}
/// ```
/// Only what the replica still holds in memory (its recent-batches buffer) is returned; after
/// a snapshot load that can be fewer than asked for.
pub fn events_json(shared: &Shared, limit: usize) -> String {
    let seq = shared.seq();
    let from = seq.saturating_sub(limit as u64);
    let batches = match shared.recent_after(from) {
        Some(b) => b,
        None => {
            // The buffer starts after `from` (it restarts empty after a snapshot load): find
            // the lowest seq it still reaches back to. recent_after(lo) is None throughout.
            let (mut lo, mut hi) = (from, seq);
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                if shared.recent_after(mid).is_some() {
                    hi = mid;
                } else {
                    lo = mid;
                }
            }
            shared.recent_after(hi).unwrap_or_default()
        }
    };
    let events: Vec<&pb::Event> = batches
        .iter()
        .flat_map(|b| b.events.iter())
        .filter(|e| e.seq > from)
        .collect();
    let mut out = String::with_capacity(128 * limit.min(events.len()) + 32);
    let _ = write!(out, "{{\"seq\":{seq},\"events\":[");
    for (i, e) in events.iter().rev().take(limit).enumerate() {
        if i > 0 {
            out.push(',');
        }
        let (kind, node, summary) = describe(e);
        let _ = write!(out, "[{},{},{},\"{kind}\",", e.seq, e.epoch, e.time_ms);
        json_str(&mut out, node);
        out.push(',');
        json_str(&mut out, &summary);
        out.push(']');
    }
    out.push_str("]}");
    out
}

/// Type, node and a one-line summary of an event, for people.
fn describe(e: &pb::Event) -> (&'static str, &str, String) {
    let pod = |p: &Option<pb::PodRef>| {
        p.as_ref()
            .map_or_else(String::new, |p| format!("{}/{}", p.namespace, p.name))
    };
    let claim = |c: &Option<pb::ClaimRef>| {
        c.as_ref()
            .map_or_else(String::new, |c| format!("{}/{}", c.namespace, c.name))
    };
    let share = |s: Option<&pb::GpuShare>| {
        s.map_or_else(String::new, |s| {
            format!("{} {} MiB {}", s.gpu_uuid, s.mem_mib, s.core_milli)
        })
    };
    let ids = |ids: &[u64]| {
        ids.iter()
            .map(|i| format!("#{i}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    match &e.body {
        Some(Body::NodeRegistered(r)) => {
            let inv = r.inventory.as_ref();
            let node = inv.map_or("", |i| i.node.as_str());
            let gpus = inv.map_or(0, |i| i.gpus.len());
            let model = inv
                .and_then(|i| i.gpus.first())
                .map_or("", |g| g.model.as_str());
            ("node_registered", node, format!("{gpus} GPUs {model}"))
        }
        Some(Body::NodeRemoved(r)) => ("node_removed", &r.node, r.reason.clone()),
        Some(Body::DeviceHealthChanged(h)) => (
            "device_health_changed",
            &h.node,
            format!(
                "{} {}{}{}",
                h.gpu_uuid,
                if h.healthy { "healthy" } else { "UNHEALTHY" },
                if h.reason.is_empty() {
                    String::new()
                } else {
                    format!(": {}", h.reason)
                },
                if h.xid > 0 {
                    format!(" (Xid {})", h.xid)
                } else {
                    String::new()
                }
            ),
        ),
        Some(Body::Reserved(r)) => {
            let mem: u64 = r.shares.iter().map(|s| s.mem_mib).sum();
            (
                "reserved",
                &r.node,
                format!(
                    "#{} {}/{} on {} GPU(s), {mem} MiB",
                    r.allocation_id,
                    pod(&r.pod),
                    r.container,
                    r.shares.len()
                ),
            )
        }
        Some(Body::Bound(b)) => (
            "bound",
            &b.node,
            format!("#{} {}", b.allocation_id, b.reason),
        ),
        Some(Body::Assigned(a)) => (
            "assigned",
            &a.node,
            format!("#{} devices {}", a.allocation_id, a.device_ids.join(" ")),
        ),
        Some(Body::IdentityCorrected(c)) => (
            "identity_corrected",
            &c.node,
            format!(
                "#{} -> #{} devices {}",
                c.from_allocation_id,
                c.to_allocation_id,
                c.device_ids.join(" ")
            ),
        ),
        Some(Body::Released(r)) => (
            "released",
            &r.node,
            format!("#{} {}", r.allocation_id, r.reason),
        ),
        Some(Body::LimitViolated(v)) => (
            "limit_violated",
            &v.node,
            format!(
                "#{} {} pid {} used {} of {} MiB: {}",
                v.allocation_id, v.gpu_uuid, v.pid, v.used_mib, v.limit_mib, v.action
            ),
        ),
        Some(Body::LeaderElected(l)) => (
            "leader_elected",
            "",
            format!("{} at {}", l.replica, l.address),
        ),
        Some(Body::QuotaSet(q)) => (
            "quota_set",
            "",
            format!(
                "{}: {} MiB, {} core_milli",
                q.namespace, q.mem_mib, q.core_milli
            ),
        ),
        Some(Body::BudgetSet(b)) => (
            "budget_set",
            "",
            format!(
                "{}: {}",
                ns_or_default(&b.namespace),
                gpuledger_ledger::state::budget_summary(b)
            ),
        ),
        Some(Body::BudgetRemoved(b)) => {
            ("budget_removed", "", ns_or_default(&b.namespace).to_owned())
        }
        Some(Body::Nominated(n)) => (
            "nominated",
            &n.node,
            format!(
                "{} (priority {}) evicting {} pod(s)",
                pod(&n.pod),
                n.priority,
                n.victims.len()
            ),
        ),
        Some(Body::NominationEnded(x)) => (
            "nomination_ended",
            &x.node,
            format!("{}: {}", pod(&x.pod), x.reason),
        ),
        Some(Body::ClaimGranted(g)) => (
            "claim_granted",
            &g.node,
            format!(
                "#{} claim {} {}/{} {}",
                g.allocation_id,
                claim(&g.claim),
                g.request,
                g.share_id,
                share(g.share.as_ref())
            ),
        ),
        Some(Body::ClaimRefused(r)) => (
            "claim_refused",
            &r.node,
            format!("claim {} {}: {}", claim(&r.claim), r.request, r.reason),
        ),
        Some(Body::ClaimPrepared(p)) => (
            "claim_prepared",
            &p.node,
            format!(
                "{} CDI {}",
                ids(&p.allocation_ids),
                p.cdi_device_ids.join(" ")
            ),
        ),
        Some(Body::ClaimUnprepared(u)) => ("claim_unprepared", &u.node, ids(&u.allocation_ids)),
        Some(Body::ClaimConsumersChanged(c)) => (
            "claim_consumers_changed",
            &c.node,
            format!(
                "{} consumers {}",
                ids(&c.allocation_ids),
                c.consumers
                    .iter()
                    .map(|p| format!("{}/{}", p.namespace, p.name))
                    .collect::<Vec<_>>()
                    .join(" ")
            ),
        ),
        None => ("empty", "", String::new()),
    }
}

fn ns_or_default(ns: &str) -> &str {
    if ns.is_empty() {
        "(cluster default)"
    } else {
        ns
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limit_is_parsed_and_bounded() {
        assert_eq!(events_limit(None), Ok(DEFAULT_EVENTS));
        assert_eq!(events_limit(Some("")), Ok(DEFAULT_EVENTS));
        assert_eq!(events_limit(Some("limit=7")), Ok(7));
        assert_eq!(events_limit(Some("limit=1000")), Ok(1000));
        for bad in [
            "limit=0",
            "limit=1001",
            "limit=-3",
            "limit=",
            "limit=ten",
            "lim=3",
        ] {
            let e = events_limit(Some(bad)).expect_err(bad);
            assert!(
                e.0.contains("limit") || e.0.contains("unknown"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn state_takes_no_params() {
        assert!(no_params(None).is_ok());
        assert!(no_params(Some("")).is_ok());
        assert!(no_params(Some("x=1")).is_err());
    }

    #[test]
    fn strings_are_escaped() {
        let mut s = String::new();
        json_str(&mut s, "a\"b\\c\nd\u{1}é<");
        assert_eq!(s, "\"a\\\"b\\\\c\\nd\\u0001é<\"");
    }
}
