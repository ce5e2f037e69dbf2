//! The kubelet plugin-registration service: what the plugin watcher asks when our socket
//! appears in its registry, and its verdict.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use gpuledger_proto::pluginregistration::v1 as reg;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use super::{DRIVER, PLUGIN_TYPE, SERVICE_VERSION};
use crate::agent::Agent;

/// The Registration service of the DRA plugin.
pub struct Registration {
    agent: Arc<Agent>,
    endpoint: PathBuf,
}

impl Registration {
    /// The service announcing the DRA service at `endpoint`.
    pub fn new(agent: Arc<Agent>, endpoint: PathBuf) -> Registration {
        Registration { agent, endpoint }
    }
}

#[tonic::async_trait]
impl reg::registration_server::Registration for Registration {
    async fn get_info(
        &self,
        _req: Request<reg::InfoRequest>,
    ) -> Result<Response<reg::PluginInfo>, Status> {
        Ok(Response::new(reg::PluginInfo {
            r#type: PLUGIN_TYPE.into(),
            name: DRIVER.into(),
            endpoint: self.endpoint.display().to_string(),
            supported_versions: std::iter::once(SERVICE_VERSION)
                .chain(super::health::SERVICE_VERSIONS)
                .map(String::from)
                .collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        req: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        let s = req.into_inner();
        self.agent
            .kubelet_registered
            .store(s.plugin_registered, Ordering::Release);
        if s.plugin_registered {
            info!(driver = DRIVER, "the kubelet registered the DRA plugin");
        } else {
            self.agent.metrics.dra_registration_failures.inc();
            warn!(driver = DRIVER, error = %s.error, "the kubelet refused the DRA plugin's registration");
        }
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}
