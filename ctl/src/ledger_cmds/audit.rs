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
        Some(Body::ClaimConsumersChanged(c)) => {
            let pods: Vec<String> = c.consumers.iter().map(|p| pod_name(Some(p))).collect();
            format!(
                "claim allocations {:?} now consumed by {}",
                c.allocation_ids,
                if pods.is_empty() {
                    "no pod".into()
                } else {
                    pods.join(", ")
                }
            )
        }
        None => "(empty event)".into(),
    }
}

/// What `audit --pod` follows: a pod (`namespace/name`, or a name or UID) and the allocations
/// it was granted so far, directly or through a claim it consumes.
struct Trail<'a> {
    ns: Option<&'a str>,
    name: &'a str,
    ids: Vec<u64>,
}

impl Trail<'_> {
    fn is(&self, p: Option<&pb::PodRef>) -> bool {
        p.is_some_and(|p| match self.ns {
            Some(ns) => p.namespace == ns && p.name == self.name,
            None => p.uid == self.name || p.name == self.name,
        })
    }

    fn is_claim(&self, c: Option<&pb::ClaimRef>) -> bool {
        c.is_some_and(|c| {
            self.is(Some(&pb::PodRef {
                uid: c.uid.clone(),
                namespace: c.namespace.clone(),
                name: c.name.clone(),
            }))
        })
    }

    /// Whether the event concerns the pod, remembering the allocations it is granted.
    fn concerns(&mut self, body: Option<&Body>) -> bool {
        let (hit, granted) = match body {
            Some(Body::Nominated(n)) => (
                self.is(n.pod.as_ref()) || n.victims.iter().any(|v| self.is(v.pod.as_ref())),
                None,
            ),
            Some(Body::NominationEnded(x)) => (self.is(x.pod.as_ref()), None),
            Some(Body::Reserved(r)) => (self.is(r.pod.as_ref()), Some(r.allocation_id)),
            // A pod's claim grants: the pod is a consumer, or the claim is named.
            Some(Body::ClaimGranted(g)) => (
                self.is_claim(g.claim.as_ref()) || g.consumers.iter().any(|p| self.is(Some(p))),
                Some(g.allocation_id),
            ),
            Some(Body::ClaimRefused(r)) => (self.is_claim(r.claim.as_ref()), None),
            Some(Body::ClaimPrepared(p)) => (self.any(&p.allocation_ids), None),
            Some(Body::ClaimUnprepared(u)) => (self.any(&u.allocation_ids), None),
            // A pod that joins a claim later follows its grants from then on.
            Some(Body::ClaimConsumersChanged(c)) => {
                let joins = c.consumers.iter().any(|p| self.is(Some(p)));
                if joins {
                    for id in &c.allocation_ids {
                        if !self.ids.contains(id) {
                            self.ids.push(*id);
                        }
                    }
                }
                (joins || self.any(&c.allocation_ids), None)
            }
            Some(Body::Bound(b)) => (self.any(&[b.allocation_id]), None),
            Some(Body::Assigned(x)) => (self.any(&[x.allocation_id]), None),
            Some(Body::Released(r)) => (self.any(&[r.allocation_id]), None),
            Some(Body::LimitViolated(v)) => (self.any(&[v.allocation_id]), None),
            Some(Body::IdentityCorrected(c)) => {
                (self.any(&[c.from_allocation_id, c.to_allocation_id]), None)
            }
            _ => (false, None),
        };
        if let (true, Some(id)) = (hit, granted) {
            self.ids.push(id);
        }
        hit
    }

    fn any(&self, ids: &[u64]) -> bool {
        ids.iter().any(|i| self.ids.contains(i))
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
    let mut trail = Trail {
        ns,
        name,
        ids: Vec::new(),
    };
    let mut t = Table::new(&["SEQ", "EPOCH", "TIME", "ACTOR", "EVENT"]);
    let mut found = 0;
    read_log(&a.target, 0, |e| {
        let mine = trail.concerns(e.body.as_ref());
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
    fn a_pods_trail_follows_the_claims_it_consumes() {
        let pod = |uid: &str, name: &str| pb::PodRef {
            uid: uid.into(),
            namespace: "team-a".into(),
            name: name.into(),
        };
        let grant = |id: u64, consumer: &str| {
            Body::ClaimGranted(pb::ClaimGranted {
                allocation_id: id,
                claim: Some(pb::ClaimRef {
                    uid: format!("claim-{id}"),
                    namespace: "team-a".into(),
                    name: format!("gpu-{id}"),
                }),
                consumers: vec![pod(&format!("uid-{consumer}"), consumer)],
                ..Default::default()
            })
        };
        let prepared = |id: u64| {
            Body::ClaimPrepared(pb::ClaimPrepared {
                allocation_ids: vec![id],
                ..Default::default()
            })
        };
        let released = |id: u64| {
            Body::Released(pb::Released {
                allocation_id: id,
                ..Default::default()
            })
        };
        let mut trail = Trail {
            ns: Some("team-a"),
            name: "trainer",
            ids: Vec::new(),
        };
        let log = [
            (grant(7, "trainer"), true),
            (grant(8, "other"), false),
            (prepared(8), false),
            (prepared(7), true),
            (released(8), false),
            (released(7), true),
        ];
        for (body, want) in log {
            assert_eq!(trail.concerns(Some(&body)), want, "{body:?}");
        }
        let mut by_claim = Trail {
            ns: Some("team-a"),
            name: "gpu-8",
            ids: Vec::new(),
        };
        assert!(by_claim.concerns(Some(&grant(8, "other"))));
        assert!(by_claim.concerns(Some(&released(8))));
        let line = describe(&pb::Event {
            body: Some(grant(7, "trainer")),
            ..Default::default()
        });
        assert!(
            line.contains("team-a/gpu-7") && line.contains("team-a/trainer"),
            "{line}"
        );
    }

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
