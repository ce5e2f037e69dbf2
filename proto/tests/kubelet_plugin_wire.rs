//! The kubelet reaches a DRA driver by literal gRPC paths. This serves our generated
//! plugin-registration, DRAPlugin and DRAResourceHealth services over a real unix socket and
//! calls them by upstream's paths with a generic client, so a package, service or method name
//! that drifts from the kubelet's fails here instead of on a node.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use gpuledger_proto::dra::v1 as dra;
use gpuledger_proto::dra::v1::dra_plugin_server::{DraPlugin, DraPluginServer};
use gpuledger_proto::drahealth::v1 as health_v1;
use gpuledger_proto::drahealth::v1alpha1 as health;
use gpuledger_proto::drahealth::v1alpha1::dra_resource_health_server::{
    DraResourceHealth, DraResourceHealthServer,
};
use gpuledger_proto::pluginregistration::v1 as reg;
use gpuledger_proto::pluginregistration::v1::registration_server::{
    Registration, RegistrationServer,
};
use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Code, Request, Response, Status};
use tonic_prost::ProstCodec;

/// A report of device `gpu-0` of pool `node-a`: Unhealthy, for `why`.
fn gpu0_unhealthy(why: &str) -> health::NodeWatchResourcesResponse {
    health::NodeWatchResourcesResponse {
        devices: vec![health::DeviceHealth {
            device: Some(health::DeviceIdentifier {
                pool_name: "node-a".into(),
                device_name: "gpu-0".into(),
            }),
            health: health::HealthStatus::Unhealthy as i32,
            last_updated_time: 1_700_000_000,
            health_check_timeout_seconds: 0,
            message: why.into(),
        }],
    }
}

/// Answers as a driver named `gpu.gpuledger.io` would, echoing what it was asked.
struct Driver;

#[tonic::async_trait]
impl Registration for Driver {
    async fn get_info(
        &self,
        _: Request<reg::InfoRequest>,
    ) -> Result<Response<reg::PluginInfo>, Status> {
        Ok(Response::new(reg::PluginInfo {
            r#type: "DRAPlugin".into(),
            name: "gpu.gpuledger.io".into(),
            endpoint: "/plugins/gpu.gpuledger.io/dra.sock".into(),
            supported_versions: vec!["v1.DRAPlugin".into()],
        }))
    }

    async fn notify_registration_status(
        &self,
        req: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        if req.get_ref().plugin_registered {
            Ok(Response::new(reg::RegistrationStatusResponse {}))
        } else {
            Err(Status::failed_precondition(req.into_inner().error))
        }
    }
}

#[tonic::async_trait]
impl DraPlugin for Driver {
    async fn node_prepare_resources(
        &self,
        req: Request<dra::NodePrepareResourcesRequest>,
    ) -> Result<Response<dra::NodePrepareResourcesResponse>, Status> {
        let claims = req
            .into_inner()
            .claims
            .into_iter()
            .map(|c| {
                let device = dra::Device {
                    request_names: vec!["c0".into()],
                    pool_name: "node-a".into(),
                    device_name: "gpu-0".into(),
                    cdi_device_ids: vec![format!("gpuledger.io/claim={}-c0", c.uid)],
                    share_id: Some(format!("share-of-{}/{}", c.namespace, c.name)),
                };
                (
                    c.uid,
                    dra::NodePrepareResourceResponse {
                        devices: vec![device],
                        error: String::new(),
                    },
                )
            })
            .collect();
        Ok(Response::new(dra::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        req: Request<dra::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<dra::NodeUnprepareResourcesResponse>, Status> {
        let claims = req
            .into_inner()
            .claims
            .into_iter()
            .map(|c| {
                (
                    c.uid,
                    dra::NodeUnprepareResourceResponse {
                        error: String::new(),
                    },
                )
            })
            .collect();
        Ok(Response::new(dra::NodeUnprepareResourcesResponse {
            claims,
        }))
    }
}

#[tonic::async_trait]
impl DraResourceHealth for Driver {
    type NodeWatchResourcesStream =
        tokio_stream::Once<Result<health::NodeWatchResourcesResponse, Status>>;

    async fn node_watch_resources(
        &self,
        _: Request<health::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        Ok(Response::new(tokio_stream::once(Ok(gpu0_unhealthy("")))))
    }
}

/// v1 serves v1alpha1's messages (they are the same in 1.37); this one answers with a message.
struct DriverV1;

#[tonic::async_trait]
impl health_v1::dra_resource_health_server::DraResourceHealth for DriverV1 {
    type NodeWatchResourcesStream =
        tokio_stream::Once<Result<health::NodeWatchResourcesResponse, Status>>;

    async fn node_watch_resources(
        &self,
        _: Request<health::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        Ok(Response::new(tokio_stream::once(Ok(gpu0_unhealthy(
            "critical Xid 79",
        )))))
    }
}

async fn serve(dir: &tempfile::TempDir) -> Result<PathBuf> {
    let path = dir.path().join("gpu.gpuledger.io-reg.sock");
    let listener = UnixListener::bind(&path).context("bind the plugin socket")?;
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(Driver))
            .add_service(DraPluginServer::new(Driver))
            .add_service(DraResourceHealthServer::new(Driver))
            .add_service(
                health_v1::dra_resource_health_server::DraResourceHealthServer::new(DriverV1),
            )
            .serve_with_incoming(UnixListenerStream::new(listener)),
    );
    Ok(path)
}

async fn dial(path: PathBuf) -> Result<tonic::client::Grpc<Channel>> {
    let channel = Endpoint::from_static("http://[::]:50051")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
        .context("dial the plugin socket")?;
    Ok(tonic::client::Grpc::new(channel))
}

/// One unary call by a literal path, as the kubelet's Go client makes it.
async fn call<Req, Resp>(
    client: &mut tonic::client::Grpc<Channel>,
    path: &'static str,
    req: Req,
) -> Result<Resp, Status>
where
    Req: prost::Message + Send + Sync + 'static,
    Resp: prost::Message + Default + Send + Sync + 'static,
{
    client
        .ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let codec = ProstCodec::<Req, Resp>::default();
    Ok(client
        .unary(Request::new(req), PathAndQuery::from_static(path), codec)
        .await?
        .into_inner())
}

#[tokio::test]
async fn registration_and_dra_plugin_answer_on_upstream_paths() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut client = dial(serve(&dir).await?).await?;

    let info: reg::PluginInfo = call(
        &mut client,
        "/pluginregistration.Registration/GetInfo",
        reg::InfoRequest {},
    )
    .await?;
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, "gpu.gpuledger.io");
    assert_eq!(info.supported_versions, ["v1.DRAPlugin"]);

    let ok = reg::RegistrationStatus {
        plugin_registered: true,
        error: String::new(),
    };
    let _: reg::RegistrationStatusResponse = call(
        &mut client,
        "/pluginregistration.Registration/NotifyRegistrationStatus",
        ok,
    )
    .await?;

    let claim = dra::Claim {
        namespace: "team-a".into(),
        uid: "uid-1".into(),
        name: "pod-gpu".into(),
    };
    let prepared: dra::NodePrepareResourcesResponse = call(
        &mut client,
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
        dra::NodePrepareResourcesRequest {
            claims: vec![claim.clone()],
        },
    )
    .await?;
    let answer = prepared
        .claims
        .get("uid-1")
        .context("an entry for the claim")?;
    assert_eq!(answer.error, "");
    assert_eq!(
        answer.devices[0].cdi_device_ids,
        ["gpuledger.io/claim=uid-1-c0"]
    );
    assert_eq!(
        answer.devices[0].share_id.as_deref(),
        Some("share-of-team-a/pod-gpu")
    );

    let unprepared: dra::NodeUnprepareResourcesResponse = call(
        &mut client,
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
        dra::NodeUnprepareResourcesRequest {
            claims: vec![claim],
        },
    )
    .await?;
    let keys: HashMap<_, _> = unprepared.claims.into_iter().collect();
    assert_eq!(keys.keys().collect::<Vec<_>>(), ["uid-1"]);
    Ok(())
}

/// The first answer of the health stream served on `path`, as the kubelet opens it.
async fn first_health(path: &'static str) -> Result<health::NodeWatchResourcesResponse> {
    let dir = tempfile::tempdir()?;
    let mut client = dial(serve(&dir).await?).await?;
    client
        .ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let codec = ProstCodec::<
        health::NodeWatchResourcesRequest,
        health::NodeWatchResourcesResponse,
    >::default();
    let mut stream = client
        .server_streaming(
            Request::new(health::NodeWatchResourcesRequest {}),
            PathAndQuery::from_static(path),
            codec,
        )
        .await?
        .into_inner();
    stream.message().await?.context("one answer")
}

#[tokio::test]
async fn the_health_stream_answers_on_the_kubelets_path() -> Result<()> {
    let first = first_health("/v1alpha1.DRAResourceHealth/NodeWatchResources").await?;
    let d = &first.devices[0];
    assert_eq!(d.health(), health::HealthStatus::Unhealthy);
    assert_eq!(
        d.device
            .as_ref()
            .map(|i| (i.pool_name.as_str(), i.device_name.as_str())),
        Some(("node-a", "gpu-0"))
    );
    Ok(())
}

/// v1, which a 1.37 kubelet opens before v1alpha1 (`pickHealthService`), on its own package's
/// path with its per-device message.
#[tokio::test]
async fn the_v1_health_stream_answers_on_the_kubelets_path() -> Result<()> {
    let first = first_health("/v1.DRAResourceHealth/NodeWatchResources").await?;
    assert_eq!(
        (first.devices[0].health(), first.devices[0].message.as_str()),
        (health::HealthStatus::Unhealthy, "critical Xid 79")
    );
    Ok(())
}

#[tokio::test]
async fn paths_the_kubelet_does_not_use_are_unimplemented() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut client = dial(serve(&dir).await?).await?;
    // Near misses: the versioned registration package, the Go directory name as package, v1beta1.
    for path in [
        "/pluginregistration.v1.Registration/GetInfo",
        "/v1.DRAPlugin/NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources",
        // Kubernetes 1.37 has no v1beta1 of the health API (v1 and v1alpha1 only).
        "/v1beta1.DRAResourceHealth/NodeWatchResources",
    ] {
        let got: Result<reg::PluginInfo, Status> =
            call(&mut client, path, reg::InfoRequest {}).await;
        let code = got.err().map(|s| s.code());
        assert_eq!(code, Some(Code::Unimplemented), "{path} must not be served");
    }
    Ok(())
}
