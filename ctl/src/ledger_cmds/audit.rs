//! `gpuledger audit`: every ledger event that concerns one pod, in order.

use anyhow::{Result, bail};
use gpuledger_ledger::pb;
use gpuledger_ledger::pb::event::Body;

use crate::client::{Target, read_log};
use crate::table::Table;
use crate::when::fmt_time;

/// Arguments of `gpuledger audit`.
#[derive(clap::Args, Debug)]
pub struct AuditArgs {
    #[command(flatten)]
    target: Target,
    /// The pod, as NAMESPACE/NAME or its UID.
    #[arg(long)]
    pod: String,
}

/// One line describing an event.
pub fn describe(e: &pb::Event) -> String {
    match &e.body {
        Some(Body::NodeRegistered(r)) => {
            let inv = r.inventory.clone().unwrap_or_default();
            format!(
                "node {} registered with {} GPU(s)",
                inv.node,
                inv.gpus.len()
            )
        }
        Some(Body::NodeRemoved(r)) => format!("node {} removed ({})", r.node, r.reason),
        Some(Body::DeviceHealthChanged(h)) => format!(
            "GPU {} on {} {} ({})",
            h.gpu_uuid,
            h.node,
            if h.healthy { "healthy" } else { "UNHEALTHY" },
            h.reason
        ),
        Some(Body::Reserved(r)) => {
            let pod = r.pod.clone().unwrap_or_default();
            let shares: Vec<String> = r
                .shares
                .iter()
                .map(|s| format!("{} {}MiB {}%", s.gpu_uuid, s.mem_mib, s.core_milli / 10))
                .collect();
            format!(
                "allocation {} reserved for {}/{}:{} on {}: {} ({})",
                r.allocation_id,
                pod.namespace,
                pod.name,
                r.container,
                r.node,
                shares.join(", "),
                r.policy
            )
        }
        Some(Body::Bound(b)) => format!("allocation {} bound ({})", b.allocation_id, b.reason),
        Some(Body::Assigned(a)) => format!(
            "allocation {} assigned to devices {}",
            a.allocation_id,
            a.device_ids.join(",")
        ),
        Some(Body::IdentityCorrected(c)) => format!(
            "allocations {} and {} swapped pods (kubelet gave the devices to the other pod)",
            c.from_allocation_id, c.to_allocation_id
        ),
        Some(Body::Released(r)) => {
            format!("allocation {} released ({})", r.allocation_id, r.reason)
        }
        Some(Body::LimitViolated(v)) => format!(
            "allocation {} pid {} used {} MiB over its {} MiB limit on {}: {}",
            v.allocation_id, v.pid, v.used_mib, v.limit_mib, v.gpu_uuid, v.action
        ),
        Some(Body::LeaderElected(l)) => format!("leader {} ({}) elected", l.replica, l.address),
        Some(Body::QuotaSet(q)) => format!(
            "quota of namespace {} set to {} MiB, {} thousandths of a GPU (0 = no cap)",
            q.namespace, q.mem_mib, q.core_milli
        ),
        Some(Body::BudgetSet(b)) => format!(
            "budget of {} set to {} ({})",
            budget_owner(&b.namespace),
            gpuledger_ledger::state::budget_summary(b),
            b.source
        ),
        Some(Body::BudgetRemoved(b)) => format!(
            "budget of {} removed ({})",
            budget_owner(&b.namespace),
            b.source
        ),
        Some(Body::Nominated(n)) => {
            let victims: Vec<String> = n
                .victims
                .iter()
                .map(|v| format!("{} (priority {})", pod_name(v.pod.as_ref()), v.priority))
                .collect();
            let shares: Vec<String> = n
                .containers
                .iter()
                .flat_map(|c| &c.shares)
                .map(|s| format!("{} {}MiB {}%", s.gpu_uuid, s.mem_mib, s.core_milli / 10))
                .collect();
            format!(
                "{} (priority {}) nominated on {} for {} until {}, evicting {}",
                pod_name(n.pod.as_ref()),
                n.priority,
                n.node,
                shares.join(", "),
                fmt_time(n.deadline_ms),
                if victims.is_empty() {
                    "nothing (the room was already being freed)".to_string()
                } else {
                    victims.join(", ")
                }
            )
        }
        Some(Body::NominationEnded(x)) => format!(
            "nomination of {} on {} ended ({})",
            pod_name(x.pod.as_ref()),
            x.node,
            x.reason
        ),
        Some(Body::ClaimGranted(g)) => {
            let s = g.share.clone().unwrap_or_default();
            let consumers: Vec<String> = g.consumers.iter().map(|p| pod_name(Some(p))).collect();
            format!(
                "allocation {} granted to claim {} request {} share {} on {}: {} {}MiB {}%                  (device {}, {}, for {})",
                g.allocation_id,
                claim_name(g.claim.as_ref()),
                g.request,
                g.share_id,
                g.node,
                s.gpu_uuid,
                s.mem_mib,
                s.core_milli / 10,
                g.device,
                g.source,
                if consumers.is_empty() {
                    "no pod yet".into()
                } else {
                    consumers.join(", ")
                }
            )
        }
        Some(Body::ClaimRefused(r)) => format!(
            "claim {} request {} share {} refused on {} device {}: {}",
            claim_name(r.claim.as_ref()),
            r.request,
            r.share_id,
            r.node,
            r.device,
            r.reason
        ),
        Some(Body::ClaimPrepared(p)) => format!(
            "claim allocations {:?} prepared with CDI devices {}",
            p.allocation_ids,
            p.cdi_device_ids.join(",")
        ),
        Some(Body::ClaimUnprepared(u)) => {
            format!("claim allocations {:?} unprepared", u.allocation_ids)
        }
        None => "(empty event)".into(),
    }
}

/// `namespace/name` of a claim reference.
fn claim_name(c: Option<&pb::ClaimRef>) -> String {
    c.map_or_else(|| "?".into(), |c| format!("{}/{}", c.namespace, c.name))
}

/// `namespace/name` of a pod reference.
fn pod_name(p: Option<&pb::PodRef>) -> String {
    p.map_or_else(|| "?".into(), |p| format!("{}/{}", p.namespace, p.name))
}

/// Whose budget an event is about: a namespace, or "" for the cluster default.
fn budget_owner(ns: &str) -> &str {
    if ns.is_empty() {
        "the cluster default"
    } else {
        ns
    }
}

/// `gpuledger audit --pod`.
/// Who caused an event: `role name` (`@node` for a node agent); "-" in batches written before
/// actors were recorded.
pub fn actor(a: Option<&pb::Actor>) -> String {
    match a {
        None => "-".into(),
        Some(a) if a.node.is_empty() => format!("{} {}", a.role, a.name),
        Some(a) => format!("{} {}@{}", a.role, a.name, a.node),
    }
}

pub async fn audit(a: AuditArgs) -> Result<()> {
    let (ns, name) = a
        .pod
        .split_once('/')
        .map_or((None, a.pod.as_str()), |(n, m)| (Some(n), m));
    let mut ids: Vec<u64> = Vec::new();
    let mut t = Table::new(&["SEQ", "EPOCH", "TIME", "ACTOR", "EVENT"]);
    let mut found = 0;
    let is = |p: Option<&pb::PodRef>| {
        let p = p.cloned().unwrap_or_default();
        match ns {
            Some(ns) => p.namespace == ns && p.name == name,
            None => p.uid == name || p.name == name,
        }
    };
    read_log(&a.target, 0, |e| {
        let mine = match &e.body {
            Some(Body::Nominated(n)) => {
                is(n.pod.as_ref()) || n.victims.iter().any(|v| is(v.pod.as_ref()))
            }
            Some(Body::NominationEnded(x)) => is(x.pod.as_ref()),
            Some(Body::Reserved(r)) => {
                let p = r.pod.clone().unwrap_or_default();
                let hit = match ns {
                    Some(ns) => p.namespace == ns && p.name == name,
                    None => p.uid == name || p.name == name,
                };
                if hit {
                    ids.push(r.allocation_id);
                }
                hit
            }
            // A pod's claim grants: the pod is a consumer (or the claim is named).
            Some(Body::ClaimGranted(g)) => {
                let c = g.claim.clone().unwrap_or_default();
                let as_pod = pb::PodRef {
                    uid: c.uid,
                    namespace: c.namespace,
                    name: c.name,
                };
                let hit = is(Some(&as_pod)) || g.consumers.iter().any(|p| is(Some(p)));
                if hit {
                    ids.push(g.allocation_id);
                }
                hit
            }
            Some(Body::ClaimPrepared(p)) => p.allocation_ids.iter().any(|i| ids.contains(i)),
            Some(Body::ClaimUnprepared(u)) => u.allocation_ids.iter().any(|i| ids.contains(i)),
            Some(Body::Bound(b)) => ids.contains(&b.allocation_id),
            Some(Body::Assigned(x)) => ids.contains(&x.allocation_id),
            Some(Body::Released(r)) => ids.contains(&r.allocation_id),
            Some(Body::LimitViolated(v)) => ids.contains(&v.allocation_id),
            Some(Body::IdentityCorrected(c)) => {
                ids.contains(&c.from_allocation_id) || ids.contains(&c.to_allocation_id)
            }
            _ => false,
        };
        if mine {
            found += 1;
            t.row(vec![
                e.seq.to_string(),
                e.epoch.to_string(),
                fmt_time(e.time_ms),
                actor(e.actor.as_ref()),
                describe(e),
            ]);
        }
        Ok(true)
    })
    .await?;
    if found == 0 {
        bail!("no ledger event concerns pod {}", a.pod);
    }
    print!("{}", t.render());
    Ok(())
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;

    #[test]
    fn an_event_written_before_actors_were_recorded_shows_a_dash() {
        // Field 4 absent, as in every batch written before it existed.
        let old = pb::Event {
            seq: 3,
            actor: None,
            ..Default::default()
        }
        .encode_to_vec();
        let e = pb::Event::decode(old.as_slice()).expect("an old event decodes");
        assert_eq!(actor(e.actor.as_ref()), "-");
        let node_agent = pb::Actor {
            role: "node-agent".into(),
            name: "gpuledger/agent".into(),
            node: "n1".into(),
            ..Default::default()
        };
        assert_eq!(actor(Some(&node_agent)), "node-agent gpuledger/agent@n1");
    }
}
