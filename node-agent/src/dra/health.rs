//! The kubelet's DRA health stream (KEP-4680, `DRAResourceHealth` v1 and v1alpha1, the two
//! Kubernetes 1.37 speaks): the health of each GPU of the node's slice as the ledger holds it,
//! with the ledger's reason, sent when one changes and every [`HEARTBEAT`]. The kubelet shows
//! it in `status.containerStatuses[].allocatedResourcesStatus` of the pods whose claims hold
//! the device. At most --dra-max-health-streams streams are open at once, of both versions
//! together: anything that reaches the socket could otherwise hold a task each, woken on every
//! view change. A kubelet refused tries again every 5 s.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::Stream;
use gpuledger_auth::limit::Slots;
use gpuledger_proto::drahealth::{v1 as h1, v1alpha1 as ha};
use gpuledger_proto::ledger::v1 as pb;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use crate::agent::Agent;

/// The service's names in `PluginInfo.supported_versions`. Kubernetes 1.37 opens the first of
/// its own list (v1, then v1alpha1) that a plugin names (`pickHealthService`,
/// pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go); 1.34 to 1.36 know only v1alpha1.
pub const SERVICE_VERSIONS: [&str; 2] = ["v1alpha1.DRAResourceHealth", "v1.DRAResourceHealth"];

/// How often the full list is sent again when nothing changed: a third of the kubelet's health
/// timeout, after which it shows a device it has not heard of again as Unknown (30 s,
/// `DefaultHealthTimeout` in 1.37's pkg/kubelet/cm/dra/healthinfo.go; we send no
/// `health_check_timeout_seconds` of our own).
pub const HEARTBEAT: Duration = Duration::from_secs(10);

/// The `limit` label of a health stream refused for --dra-max-health-streams.
pub const BITE_STREAMS: &str = "health_streams";

/// The longest message, in bytes, the kubelet keeps whole (`ResourceHealthMessageMaxLength`; it
/// cuts longer ones at a byte, possibly inside a character).
const MAX_MESSAGE: usize = 1024;

/// Each GPU of `inv` by its slice device (pool: the node), Healthy or Unhealthy with the
/// ledger's reason from `reasons` (by GPU UUID), in index order; stamped `now_s`. Empty before
/// the node is registered.
pub fn report(
    inv: Option<&pb::NodeInventory>,
    reasons: &BTreeMap<String, String>,
    now_s: i64,
) -> ha::NodeWatchResourcesResponse {
    let mut gpus: Vec<&pb::Gpu> = inv.iter().flat_map(|i| i.gpus.iter()).collect();
    gpus.sort_by_key(|g| g.index);
    let pool = inv.map(|i| i.node.clone()).unwrap_or_default();
    ha::NodeWatchResourcesResponse {
        devices: gpus
            .into_iter()
            .map(|g| ha::DeviceHealth {
                device: Some(ha::DeviceIdentifier {
                    pool_name: pool.clone(),
                    device_name: gpuledger_ledger::state::dra_device_name(&g.uuid),
                }),
                health: if g.healthy {
                    ha::HealthStatus::Healthy
                } else {
                    ha::HealthStatus::Unhealthy
                } as i32,
                last_updated_time: now_s,
                health_check_timeout_seconds: 0,
                message: if g.healthy {
                    String::new()
                } else {
                    reasons.get(&g.uuid).map_or_else(String::new, |r| cut(r))
                },
            })
            .collect(),
    }
}

/// `s` cut to at most [`MAX_MESSAGE`] bytes, at a character boundary.
fn cut(s: &str) -> String {
    let mut end = s.len().min(MAX_MESSAGE);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

/// What of a report a change is: the devices, their health and why, not the time.
fn health_of(
    r: &ha::NodeWatchResourcesResponse,
) -> Vec<(Option<ha::DeviceIdentifier>, i32, String)> {
    r.devices
        .iter()
        .map(|d| (d.device.clone(), d.health, d.message.clone()))
        .collect()
}

fn now_s() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// The DRAResourceHealth service, in every version.
#[derive(Clone)]
pub struct Health {
    agent: Arc<Agent>,
    streams: Arc<Slots<()>>,
}

type Reports = Pin<Box<dyn Stream<Item = Result<ha::NodeWatchResourcesResponse, Status>> + Send>>;

impl Health {
    /// The service for `agent`, its open streams counted in `streams`.
    pub fn new(agent: Arc<Agent>, streams: Arc<Slots<()>>) -> Health {
        Health { agent, streams }
    }

    /// The slots of --dra-max-health-streams, refusals counted in the agent's DRA bites.
    pub fn slots(agent: &Agent) -> Arc<Slots<()>> {
        Slots::new(
            (BITE_STREAMS, BITE_STREAMS),
            agent.cfg.dra_max_health_streams,
            0,
            agent.dra_bites.clone(),
        )
    }

    /// A stream of reports holding one of the slots until it is dropped (its client went), or
    /// RESOURCE_EXHAUSTED when every slot is taken.
    fn watch(&self, version: &'static str) -> Result<Reports, Status> {
        let node = &self.agent.cfg.node_name;
        let Ok(slot) = self.streams.try_acquire(()) else {
            warn!(%node, version, open = self.streams.in_use(),
                "a health stream refused: as many are open as --dra-max-health-streams allows");
            return Err(Status::resource_exhausted(format!(
                "node {node} serves {} health streams already, as many as its \
                 --dra-max-health-streams allows (the kubelet needs one); one must end first",
                self.streams.in_use()
            )));
        };
        info!(%node, version, open = self.streams.in_use(), "the kubelet watches the devices' health");
        let agent = self.agent.clone();
        let changes = agent.view_changes();
        // (agent, view changes, what was sent last, whether the next answer is due anyway, the
        // stream's slot: given back when the client goes and the stream is dropped)
        let s = futures::stream::unfold(
            (agent, changes, None::<Vec<_>>, true, slot),
            |(agent, mut changes, sent, mut due, slot)| async move {
                loop {
                    changes.mark_unchanged();
                    let r = agent
                        .with_view(|v| report(v.inventory.as_ref(), &v.health_reasons, now_s()));
                    let now = health_of(&r);
                    if due || sent.as_ref() != Some(&now) {
                        return Some((
                            Ok::<_, Status>(r),
                            (agent, changes, Some(now), false, slot),
                        ));
                    }
                    due = tokio::select! {
                        c = changes.changed() => {
                            // The agent is going away: end the stream.
                            c.ok()?;
                            false
                        }
                        _ = tokio::time::sleep(HEARTBEAT) => true,
                    };
                }
            },
        );
        Ok(Box::pin(s))
    }
}

#[tonic::async_trait]
impl ha::dra_resource_health_server::DraResourceHealth for Health {
    type NodeWatchResourcesStream = Reports;

    async fn node_watch_resources(
        &self,
        _req: Request<ha::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        self.watch("v1alpha1").map(Response::new)
    }
}

#[tonic::async_trait]
impl h1::dra_resource_health_server::DraResourceHealth for Health {
    type NodeWatchResourcesStream = Reports;

    async fn node_watch_resources(
        &self,
        _req: Request<ha::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        // The same messages (see proto/k8s/drahealth/v1/api.proto).
        self.watch("v1").map(Response::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(uuid: &str, index: u32, healthy: bool) -> pb::Gpu {
        pb::Gpu {
            uuid: uuid.into(),
            index,
            model: "H100".into(),
            memory_mib: 81_079,
            healthy,
            compute_capability: String::new(),
        }
    }

    #[test]
    fn every_gpu_by_its_slice_device_with_the_ledgers_health_and_reason() {
        let none = BTreeMap::new();
        assert!(report(None, &none, 7).devices.is_empty());
        let inv = pb::NodeInventory {
            node: "n1".into(),
            gpus: vec![gpu("GPU-BB", 1, false), gpu("GPU-AA", 0, true)],
            ..Default::default()
        };
        let reasons: BTreeMap<String, String> = [
            ("GPU-BB".to_string(), "critical Xid 79".to_string()),
            // A healthy GPU's stale reason is not shown.
            ("GPU-AA".to_string(), "critical Xid 48".to_string()),
        ]
        .into();
        let r = report(Some(&inv), &reasons, 1_700_000_000);
        let got: Vec<(String, String, ha::HealthStatus, i64, &str)> = r
            .devices
            .iter()
            .map(|d| {
                let id = d.device.clone().expect("identified");
                (
                    id.pool_name,
                    id.device_name,
                    d.health(),
                    d.last_updated_time,
                    d.message.as_str(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                (
                    "n1".to_string(),
                    "gpu-aa".to_string(),
                    ha::HealthStatus::Healthy,
                    1_700_000_000,
                    ""
                ),
                (
                    "n1".to_string(),
                    "gpu-bb".to_string(),
                    ha::HealthStatus::Unhealthy,
                    1_700_000_000,
                    "critical Xid 79"
                ),
            ]
        );
        // A later stamp alone is no change; a health flip is, and so is another reason.
        let again = report(Some(&inv), &reasons, 1_800_000_000);
        assert_eq!(health_of(&r), health_of(&again));
        let mut healed = inv.clone();
        healed.gpus[0].healthy = true;
        assert_ne!(
            health_of(&r),
            health_of(&report(Some(&healed), &reasons, 1_700_000_000))
        );
        let other: BTreeMap<String, String> =
            [("GPU-BB".to_string(), "GPU is lost".to_string())].into();
        assert_ne!(
            health_of(&r),
            health_of(&report(Some(&inv), &other, 1_700_000_000))
        );
    }

    #[test]
    fn a_long_reason_is_cut_to_what_the_kubelet_keeps_at_a_character() {
        let inv = pb::NodeInventory {
            node: "n1".into(),
            gpus: vec![gpu("GPU-AA", 0, false)],
            ..Default::default()
        };
        // 'é' is two bytes: 1023 of them would end inside one.
        let long = format!("x{}", "é".repeat(3000));
        let reasons: BTreeMap<String, String> = [("GPU-AA".to_string(), long.clone())].into();
        let m = &report(Some(&inv), &reasons, 1).devices[0].message;
        assert_eq!(m.len(), MAX_MESSAGE - 1);
        assert!(long.starts_with(m.as_str()));
        assert_eq!(cut("Xid 79"), "Xid 79");
    }
}
