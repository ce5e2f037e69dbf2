//! The node agent as a kubelet DRA plugin for driver `gpu.gpuledger.io` (--mode=dra): the
//! plugin-registration service in the kubelet's plugin registry, the `DRAPlugin` v1 service and
//! the kubelet's health stream (`DRAResourceHealth`) on its own socket, and the node's
//! ResourceSlice. A claim is prepared only when the ledger holds
//! a grant for its current allocation; its limits reach the container through a per-claim CDI
//! spec.

pub mod cdi;
pub mod health;
pub mod prepare;
mod registration;
mod service;
pub mod slice;
pub mod unhealthy;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use gpuledger_proto::dra::v1 as dra;
use gpuledger_proto::drahealth::{v1 as hv1, v1alpha1 as hv1alpha1};
use gpuledger_proto::pluginregistration::v1 as reg;
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

pub use self::prepare::DRIVER;
use crate::agent::Agent;
use crate::config::Config;

/// The gRPC service name advertised to the kubelet (`supported_versions`).
pub const SERVICE_VERSION: &str = "v1.DRAPlugin";

/// How long the kubelet waits for one NodePrepareResources or NodeUnprepareResources.
pub const KUBELET_CALL_TIMEOUT: Duration = Duration::from_secs(45);

/// The plugin type the kubelet's plugin watcher hands to its DRA handler.
pub const PLUGIN_TYPE: &str = "DRAPlugin";

/// The largest request either socket reads (tonic's default, stated): a NodePrepareResources
/// names the claims of one pod, a few hundred bytes each. Past it, OUT_OF_RANGE.
pub const MAX_REQUEST_BYTES: usize = 4 * 1024 * 1024;

/// Concurrent HTTP/2 streams one connection to either socket may open: the kubelet's one
/// connection carries its prepares of several pods and the health stream.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 64;

/// The registration socket: `<--dra-registry-dir>/gpu.gpuledger.io-reg.sock`.
pub fn registration_socket(cfg: &Config) -> PathBuf {
    cfg.dra_registry_dir.join(format!("{DRIVER}-reg.sock"))
}

/// The DRA service socket: `<--dra-plugin-dir>/gpu.gpuledger.io/dra.sock`.
pub fn service_socket(cfg: &Config) -> PathBuf {
    cfg.dra_plugin_dir.join(DRIVER).join("dra.sock")
}

fn inode(p: &Path) -> Option<u64> {
    std::fs::metadata(p).ok().map(|m| m.ino())
}

/// Bind `path` afresh: a stale socket of an earlier run is removed first.
fn bind(path: &Path) -> std::io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    UnixListener::bind(path)
}

/// Serve both sockets until `shutdown`; serve them again when either is removed (the
/// kubelet's plugin watcher registers a socket when it appears).
pub async fn serve(agent: Arc<Agent>, shutdown: CancellationToken) {
    let reg_sock = registration_socket(&agent.cfg);
    let svc_sock = service_socket(&agent.cfg);
    // Kept across re-serves: a stream of a stopped server gives its slot back as it is dropped.
    let health_streams = health::Health::slots(&agent);
    loop {
        agent.kubelet_registered.store(false, Ordering::Release);
        // The service first: the kubelet dials it as soon as it read the registration.
        let (svc_l, reg_l) = match (bind(&svc_sock), bind(&reg_sock)) {
            (Ok(s), Ok(r)) => (s, r),
            (Err(e), _) | (_, Err(e)) => {
                warn!(registration = %reg_sock.display(), service = %svc_sock.display(),
                    "binding the DRA plugin sockets: {e}; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let mine = (inode(&reg_sock), inode(&svc_sock));
        let stop = shutdown.child_token();
        let plugin =
            dra::dra_plugin_server::DraPluginServer::new(service::Plugin::new(agent.clone()))
                .max_decoding_message_size(MAX_REQUEST_BYTES);
        let health = health::Health::new(agent.clone(), health_streams.clone());
        let health_v1alpha1 =
            hv1alpha1::dra_resource_health_server::DraResourceHealthServer::new(health.clone())
                .max_decoding_message_size(MAX_REQUEST_BYTES);
        let health_v1 = hv1::dra_resource_health_server::DraResourceHealthServer::new(health)
            .max_decoding_message_size(MAX_REQUEST_BYTES);
        let registration = reg::registration_server::RegistrationServer::new(
            registration::Registration::new(agent.clone(), svc_sock.clone()),
        )
        .max_decoding_message_size(MAX_REQUEST_BYTES);
        let svc = tokio::spawn(
            stop.clone().run_until_cancelled_owned(
                tonic::transport::Server::builder()
                    .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
                    .add_service(plugin)
                    .add_service(health_v1alpha1)
                    .add_service(health_v1)
                    .serve_with_incoming(UnixListenerStream::new(svc_l)),
            ),
        );
        let regs = tokio::spawn(
            stop.clone().run_until_cancelled_owned(
                tonic::transport::Server::builder()
                    .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
                    .add_service(registration)
                    .serve_with_incoming(UnixListenerStream::new(reg_l)),
            ),
        );
        info!(registration = %reg_sock.display(), service = %svc_sock.display(), driver = DRIVER,
            "serving the DRA plugin");
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            if (inode(&reg_sock), inode(&svc_sock)) != mine {
                info!("a DRA plugin socket was removed; serving both again");
                break;
            }
            if svc.is_finished() || regs.is_finished() {
                warn!("a DRA plugin server stopped; restarting both");
                break;
            }
        }
        stop.cancel();
        let _ = svc.await;
        let _ = regs.await;
        if shutdown.is_cancelled() {
            return;
        }
    }
}

/// Remove both sockets (on shutdown: the kubelet sees the plugin gone).
pub fn remove_sockets(agent: &Agent) {
    let _ = std::fs::remove_file(registration_socket(&agent.cfg));
    let _ = std::fs::remove_file(service_socket(&agent.cfg));
}
