//! The kubelet's DRA health stream (KEP-4680, `v1alpha1.DRAResourceHealth`): the health of
//! each GPU of the node's slice as the ledger holds it, sent when one changes and every
//! [`HEARTBEAT`] (the kubelet turns a device it has not heard of for a while Unknown). The
//! kubelet shows it in `status.containerStatuses[].allocatedResourcesStatus` of the pods whose
//! claims hold the device.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::Stream;
use gpuledger_proto::drahealth::v1alpha1 as hp;
use gpuledger_proto::ledger::v1 as pb;
use tonic::{Request, Response, Status};
use tracing::info;

use crate::agent::Agent;

/// The service's name in `PluginInfo.supported_versions`.
pub const SERVICE_VERSION: &str = "v1alpha1.DRAResourceHealth";

/// How often the full list is sent again when nothing changed.
pub const HEARTBEAT: Duration = Duration::from_secs(10);

/// Each GPU of `inv` by its slice device (pool: the node), Healthy or Unhealthy, in index
/// order; stamped `now_s`. Empty before the node is registered.
pub fn report(inv: Option<&pb::NodeInventory>, now_s: i64) -> hp::NodeWatchResourcesResponse {
    let mut gpus: Vec<&pb::Gpu> = inv.iter().flat_map(|i| i.gpus.iter()).collect();
    gpus.sort_by_key(|g| g.index);
    let pool = inv.map(|i| i.node.clone()).unwrap_or_default();
    hp::NodeWatchResourcesResponse {
        devices: gpus
            .into_iter()
            .map(|g| hp::DeviceHealth {
                device: Some(hp::DeviceIdentifier {
                    pool_name: pool.clone(),
                    device_name: gpuledger_ledger::state::dra_device_name(&g.uuid),
                }),
                health: if g.healthy {
                    hp::HealthStatus::Healthy
                } else {
                    hp::HealthStatus::Unhealthy
                } as i32,
                last_updated_time: now_s,
            })
            .collect(),
    }
}

/// What of a report a change is: the devices and their health, not the time.
fn health_of(r: &hp::NodeWatchResourcesResponse) -> Vec<(Option<hp::DeviceIdentifier>, i32)> {
    r.devices
        .iter()
        .map(|d| (d.device.clone(), d.health))
        .collect()
}

fn now_s() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// The DRAResourceHealth service.
pub struct Health {
    agent: Arc<Agent>,
}

impl Health {
    /// The service for `agent`.
    pub fn new(agent: Arc<Agent>) -> Health {
        Health { agent }
    }
}

type HealthStream =
    Pin<Box<dyn Stream<Item = Result<hp::NodeWatchResourcesResponse, Status>> + Send>>;

#[tonic::async_trait]
impl hp::dra_resource_health_server::DraResourceHealth for Health {
    type NodeWatchResourcesStream = HealthStream;

    async fn node_watch_resources(
        &self,
        _req: Request<hp::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        info!(node = %self.agent.cfg.node_name, "the kubelet watches the devices' health");
        let agent = self.agent.clone();
        let changes = agent.view_changes();
        // (agent, view changes, what was sent last, whether the next answer is due anyway)
        let s = futures::stream::unfold(
            (agent, changes, None::<Vec<_>>, true),
            |(agent, mut changes, sent, mut due)| async move {
                loop {
                    changes.mark_unchanged();
                    let r = agent.with_view(|v| report(v.inventory.as_ref(), now_s()));
                    let now = health_of(&r);
                    if due || sent.as_ref() != Some(&now) {
                        return Some((Ok::<_, Status>(r), (agent, changes, Some(now), false)));
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
        Ok(Response::new(Box::pin(s)))
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
    fn every_gpu_by_its_slice_device_with_the_ledgers_health() {
        assert!(report(None, 7).devices.is_empty());
        let inv = pb::NodeInventory {
            node: "n1".into(),
            gpus: vec![gpu("GPU-BB", 1, false), gpu("GPU-AA", 0, true)],
            ..Default::default()
        };
        let r = report(Some(&inv), 1_700_000_000);
        let got: Vec<(String, String, hp::HealthStatus, i64)> = r
            .devices
            .iter()
            .map(|d| {
                let id = d.device.clone().expect("identified");
                (
                    id.pool_name,
                    id.device_name,
                    d.health(),
                    d.last_updated_time,
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                (
                    "n1".to_string(),
                    "gpu-aa".to_string(),
                    hp::HealthStatus::Healthy,
                    1_700_000_000
                ),
                (
                    "n1".to_string(),
                    "gpu-bb".to_string(),
                    hp::HealthStatus::Unhealthy,
                    1_700_000_000
                ),
            ]
        );
        // A later stamp alone is no change; a health flip is.
        assert_eq!(health_of(&r), health_of(&report(Some(&inv), 1_800_000_000)));
        let mut healed = inv.clone();
        healed.gpus[0].healthy = true;
        assert_ne!(
            health_of(&r),
            health_of(&report(Some(&healed), 1_700_000_000))
        );
    }
}
