//! Kubelet emulator: the device-plugin side of a kubelet, over the real gRPC protocol on unix
//! sockets. It serves `Registration` on `<dir>/kubelet.sock`, connects back to a plugin that
//! registers, follows its `ListAndWatch`, admits pods the way the kubelet's device manager does
//! (GetPreferredAllocation → Allocate → PreStartContainer), and serves PodResources `List` from
//! what it handed out. `restart` deletes every socket in the directory like a restarting
//! kubelet, and expects the plugin to register again. Device assignments survive a restart
//! (the kubelet checkpoints them).
//!
//! [`node`] runs a node agent process against the fake NVML library and this emulator;
//! [`dra`] emulates the kubelet's side of a DRA driver.

pub mod dra;
pub mod node;

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpuledger_proto::deviceplugin::v1beta1 as dp;
use gpuledger_proto::podresources::v1 as podres;
use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::{CancellationToken, DropGuard};
use tonic::transport::{Channel, Endpoint, Server, Uri};
use tonic::{Request, Response, Status};

/// A channel to the gRPC server on unix socket `path`.
pub async fn uds_channel(path: &Path) -> Result<Channel> {
    let path = path.to_path_buf();
    Ok(Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await?)
}

/// Devices the kubelet handed to one container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Container name.
    pub container: String,
    /// Resource name.
    pub resource: String,
    /// Device IDs.
    pub device_ids: Vec<String>,
}

/// The result of allocating devices for one container.
#[derive(Debug, Clone)]
pub struct Allocated {
    /// The devices chosen.
    pub device_ids: Vec<String>,
    /// The plugin's answer.
    pub response: dp::ContainerAllocateResponse,
    /// How long the plugin's Allocate took.
    pub elapsed: Duration,
}

struct Inner {
    dir: PathBuf,
    registrations: watch::Sender<u64>,
    last: Mutex<Option<dp::RegisterRequest>>,
    plugin: Mutex<Option<dp::device_plugin_client::DevicePluginClient<Channel>>>,
    devices: watch::Sender<Vec<dp::Device>>,
    assignments: Mutex<Vec<Assignment>>,
    /// Containers of the pods the kubelet knows (its pod manager): a pod is known from just
    /// before its admission, and PodResources lists it, with no devices yet, from then on.
    known: Mutex<Vec<(String, String, String)>>,
    /// Cancelled when the kubelet is dropped: every server and watch of it stops.
    stop: CancellationToken,
    /// Following the registered plugin's ListAndWatch; cancelled when another registers.
    plugin_watch: Mutex<CancellationToken>,
}

/// The emulated kubelet.
pub struct Kubelet {
    inner: Arc<Inner>,
    pod_resources: PathBuf,
    /// Serving `kubelet.sock`; cancelled by a restart.
    registration: CancellationToken,
    _stop: DropGuard,
}

struct RegistrationSvc(Arc<Inner>);

#[tonic::async_trait]
impl dp::registration_server::Registration for RegistrationSvc {
    async fn register(
        &self,
        req: Request<dp::RegisterRequest>,
    ) -> Result<Response<dp::Empty>, Status> {
        let r = req.into_inner();
        if r.version != "v1beta1" {
            return Err(Status::invalid_argument(format!(
                "unsupported version {:?}",
                r.version
            )));
        }
        if r.endpoint.contains('/') {
            return Err(Status::invalid_argument(
                "endpoint must be a bare socket file name",
            ));
        }
        let sock = self.0.dir.join(&r.endpoint);
        let ch = uds_channel(&sock)
            .await
            .map_err(|e| Status::unavailable(format!("connecting to the plugin: {e:#}")))?;
        let mut client = dp::device_plugin_client::DevicePluginClient::new(ch);
        let mut stream = client
            .list_and_watch(dp::Empty {})
            .await
            .map_err(|e| Status::unavailable(format!("ListAndWatch: {e}")))?
            .into_inner();
        let inner = self.0.clone();
        let watching = self.0.stop.child_token();
        let old = std::mem::replace(
            &mut *self.0.plugin_watch.lock().expect("lock"),
            watching.clone(),
        );
        old.cancel();
        tokio::spawn(watching.run_until_cancelled_owned(async move {
            while let Ok(Some(m)) = stream.message().await {
                inner.devices.send_replace(m.devices);
            }
        }));
        *self.0.plugin.lock().expect("lock") = Some(client);
        *self.0.last.lock().expect("lock") = Some(r);
        self.0.registrations.send_modify(|n| *n += 1);
        Ok(Response::new(dp::Empty {}))
    }
}

struct PodResourcesSvc(Arc<Inner>);

#[tonic::async_trait]
impl podres::pod_resources_lister_server::PodResourcesLister for PodResourcesSvc {
    async fn list(
        &self,
        _req: Request<podres::ListPodResourcesRequest>,
    ) -> Result<Response<podres::ListPodResourcesResponse>, Status> {
        let a = self.0.assignments.lock().expect("lock").clone();
        let mut pods: Vec<podres::PodResources> = Vec::new();
        // Known containers first, without devices, as the kubelet lists a pod it is admitting.
        for (ns, pod, container) in self.0.known.lock().expect("lock").iter() {
            let ctr = podres::ContainerResources {
                name: container.clone(),
                devices: Vec::new(),
                cpu_ids: Vec::new(),
            };
            match pods
                .iter_mut()
                .find(|p| &p.namespace == ns && &p.name == pod)
            {
                Some(p) => p.containers.push(ctr),
                None => pods.push(podres::PodResources {
                    name: pod.clone(),
                    namespace: ns.clone(),
                    containers: vec![ctr],
                }),
            }
        }
        for x in a {
            let ctr = podres::ContainerResources {
                name: x.container.clone(),
                devices: vec![podres::ContainerDevices {
                    resource_name: x.resource.clone(),
                    device_ids: x.device_ids.clone(),
                    topology: None,
                }],
                cpu_ids: Vec::new(),
            };
            match pods
                .iter_mut()
                .find(|p| p.namespace == x.namespace && p.name == x.pod)
            {
                Some(p) => match p.containers.iter_mut().find(|c| c.name == ctr.name) {
                    Some(c) if c.devices.is_empty() => *c = ctr,
                    _ => p.containers.push(ctr),
                },
                None => pods.push(podres::PodResources {
                    name: x.pod.clone(),
                    namespace: x.namespace.clone(),
                    containers: vec![ctr],
                }),
            }
        }
        Ok(Response::new(podres::ListPodResourcesResponse {
            pod_resources: pods,
        }))
    }

    async fn get_allocatable_resources(
        &self,
        _req: Request<podres::AllocatableResourcesRequest>,
    ) -> Result<Response<podres::AllocatableResourcesResponse>, Status> {
        let devs = self.0.devices.borrow().clone();
        let resource = self
            .0
            .last
            .lock()
            .expect("lock")
            .as_ref()
            .map(|r| r.resource_name.clone())
            .unwrap_or_default();
        Ok(Response::new(podres::AllocatableResourcesResponse {
            devices: vec![podres::ContainerDevices {
                resource_name: resource,
                device_ids: devs.into_iter().map(|d| d.id).collect(),
                topology: None,
            }],
            cpu_ids: Vec::new(),
        }))
    }

    async fn get(
        &self,
        req: Request<podres::GetPodResourcesRequest>,
    ) -> Result<Response<podres::GetPodResourcesResponse>, Status> {
        let r = req.into_inner();
        let all = self
            .list(Request::new(podres::ListPodResourcesRequest {}))
            .await?
            .into_inner();
        let p = all
            .pod_resources
            .into_iter()
            .find(|p| p.name == r.pod_name && p.namespace == r.pod_namespace)
            .ok_or_else(|| Status::not_found("no such pod"))?;
        Ok(Response::new(podres::GetPodResourcesResponse {
            pod_resources: Some(p),
        }))
    }
}

type Served = Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// Serve `Registration` on `kubelet.sock` until `stop` is cancelled.
fn serve_registration(inner: Arc<Inner>, stop: CancellationToken) -> Result<Served> {
    let sock = inner.dir.join("kubelet.sock");
    let _ = std::fs::remove_file(&sock);
    let l = UnixListener::bind(&sock).with_context(|| format!("binding {}", sock.display()))?;
    let svc = dp::registration_server::RegistrationServer::new(RegistrationSvc(inner));
    let serve = Server::builder()
        .add_service(svc)
        .serve_with_incoming(UnixListenerStream::new(l));
    Ok(Box::pin(async move {
        let _ = stop.run_until_cancelled(serve).await;
    }))
}

impl Kubelet {
    /// Start a kubelet whose device-plugin directory is `<dir>/device-plugins` and whose
    /// PodResources socket is `<dir>/pod-resources/kubelet.sock`.
    pub async fn start(dir: &Path) -> Result<Kubelet> {
        let dp_dir = dir.join("device-plugins");
        let pr_dir = dir.join("pod-resources");
        std::fs::create_dir_all(&dp_dir)?;
        std::fs::create_dir_all(&pr_dir)?;
        let stop = CancellationToken::new();
        let inner = Arc::new(Inner {
            dir: dp_dir,
            registrations: watch::Sender::new(0),
            last: Mutex::new(None),
            plugin: Mutex::new(None),
            devices: watch::Sender::new(Vec::new()),
            assignments: Mutex::new(Vec::new()),
            known: Mutex::new(Vec::new()),
            stop: stop.clone(),
            plugin_watch: Mutex::new(stop.child_token()),
        });
        let pod_resources = pr_dir.join("kubelet.sock");
        let _ = std::fs::remove_file(&pod_resources);
        let l = UnixListener::bind(&pod_resources)?;
        let pr = podres::pod_resources_lister_server::PodResourcesListerServer::new(
            PodResourcesSvc(inner.clone()),
        );
        let serve = Server::builder()
            .add_service(pr)
            .serve_with_incoming(UnixListenerStream::new(l));
        tokio::spawn(stop.clone().run_until_cancelled_owned(serve));
        let registration = stop.child_token();
        tokio::spawn(serve_registration(inner.clone(), registration.clone())?);
        Ok(Kubelet {
            inner,
            pod_resources,
            registration,
            _stop: stop.drop_guard(),
        })
    }

    /// The device-plugin directory (`--kubelet-dir` of a plugin).
    pub fn device_plugin_dir(&self) -> &Path {
        &self.inner.dir
    }

    /// The PodResources socket.
    pub fn pod_resources_socket(&self) -> &Path {
        &self.pod_resources
    }

    /// How many registrations this kubelet has accepted.
    pub fn registrations(&self) -> u64 {
        *self.inner.registrations.borrow()
    }

    /// The last registration request.
    pub fn last_registration(&self) -> Option<dp::RegisterRequest> {
        self.inner.last.lock().expect("lock").clone()
    }

    /// Wait until at least `n` registrations were accepted.
    pub async fn wait_registrations(&self, n: u64, timeout: Duration) -> Result<()> {
        let mut rx = self.inner.registrations.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|c| *c >= n))
            .await
            .with_context(|| {
                format!(
                    "no registration #{n} within {timeout:?} (have {})",
                    self.registrations()
                )
            })??;
        Ok(())
    }

    /// The devices from the plugin's last ListAndWatch message.
    pub fn devices(&self) -> Vec<dp::Device> {
        self.inner.devices.borrow().clone()
    }

    /// Wait until the device list satisfies `pred`.
    pub async fn wait_devices(
        &self,
        timeout: Duration,
        pred: impl Fn(&[dp::Device]) -> bool,
    ) -> Result<Vec<dp::Device>> {
        let mut rx = self.inner.devices.subscribe();
        let r = tokio::time::timeout(timeout, rx.wait_for(|d| pred(d)))
            .await
            .context("device list did not reach the expected state")??;
        Ok(r.clone())
    }

    /// Every device assignment (what PodResources lists).
    pub fn assignments(&self) -> Vec<Assignment> {
        self.inner.assignments.lock().expect("lock").clone()
    }

    fn client(&self) -> Result<dp::device_plugin_client::DevicePluginClient<Channel>> {
        self.inner
            .plugin
            .lock()
            .expect("lock")
            .clone()
            .context("no device plugin registered")
    }

    /// Choose `n` devices for a container (GetPreferredAllocation among the healthy unassigned
    /// ones), Allocate them and record the assignment, like the kubelet's device manager at pod
    /// admission. PreStartContainer is a separate step ([`Kubelet::pre_start`]).
    pub async fn allocate(
        &self,
        namespace: &str,
        pod: &str,
        container: &str,
        n: usize,
    ) -> Result<Allocated> {
        self.last_registration()
            .context("no device plugin registered")?;
        self.add_pod(namespace, pod, container);
        let used: Vec<String> = self
            .assignments()
            .into_iter()
            .flat_map(|a| a.device_ids)
            .collect();
        let available: Vec<String> = self
            .devices()
            .into_iter()
            .filter(|d| d.health == "Healthy" && !used.contains(&d.id))
            .map(|d| d.id)
            .collect();
        if available.len() < n {
            bail!("only {} devices available, {n} needed", available.len());
        }
        let mut c = self.client()?;
        let pref = c
            .get_preferred_allocation(dp::PreferredAllocationRequest {
                container_requests: vec![dp::ContainerPreferredAllocationRequest {
                    available_device_i_ds: available.clone(),
                    must_include_device_i_ds: Vec::new(),
                    allocation_size: n as i32,
                }],
            })
            .await?
            .into_inner();
        // The kubelet takes the preference only when it is a valid choice.
        let ids = match pref.container_responses.first() {
            Some(p)
                if p.device_i_ds.len() == n
                    && p.device_i_ds.iter().all(|d| available.contains(d)) =>
            {
                p.device_i_ds.clone()
            }
            _ => available[..n].to_vec(),
        };
        self.allocate_ids(namespace, pod, container, ids).await
    }

    /// Allocate exactly `ids` for a container and record the assignment (what the device
    /// manager does once it has chosen the devices).
    pub async fn allocate_ids(
        &self,
        namespace: &str,
        pod: &str,
        container: &str,
        ids: Vec<String>,
    ) -> Result<Allocated> {
        let resource = self
            .last_registration()
            .context("no device plugin registered")?
            .resource_name;
        self.add_pod(namespace, pod, container);
        let mut c = self.client()?;
        let t = Instant::now();
        let resp = c
            .allocate(dp::AllocateRequest {
                container_requests: vec![dp::ContainerAllocateRequest {
                    devices_ids: ids.clone(),
                }],
            })
            .await?
            .into_inner();
        let elapsed = t.elapsed();
        let response = resp
            .container_responses
            .into_iter()
            .next()
            .context("Allocate answered no container")?;
        self.inner
            .assignments
            .lock()
            .expect("lock")
            .push(Assignment {
                namespace: namespace.into(),
                pod: pod.into(),
                container: container.into(),
                resource,
                device_ids: ids.clone(),
            });
        Ok(Allocated {
            device_ids: ids,
            response,
            elapsed,
        })
    }

    /// Call Allocate again for devices already assigned (what a kubelet does when it restarts
    /// a container); returns the plugin's answer.
    pub async fn reallocate(&self, ids: &[String]) -> Result<dp::ContainerAllocateResponse> {
        let resp = self
            .client()?
            .allocate(dp::AllocateRequest {
                container_requests: vec![dp::ContainerAllocateRequest {
                    devices_ids: ids.to_vec(),
                }],
            })
            .await?
            .into_inner();
        resp.container_responses
            .into_iter()
            .next()
            .context("Allocate answered no container")
    }

    /// PreStartContainer for the devices of a container about to start.
    pub async fn pre_start(&self, ids: &[String]) -> Result<()> {
        self.client()?
            .pre_start_container(dp::PreStartContainerRequest {
                devices_ids: ids.to_vec(),
            })
            .await?;
        Ok(())
    }

    /// Admit one container: allocate, then PreStartContainer.
    pub async fn admit(
        &self,
        namespace: &str,
        pod: &str,
        container: &str,
        n: usize,
    ) -> Result<Allocated> {
        let a = self.allocate(namespace, pod, container, n).await?;
        self.pre_start(&a.device_ids).await?;
        Ok(a)
    }

    /// A raw Allocate (for bad-input tests): nothing is recorded.
    pub async fn raw_allocate(
        &self,
        ids: Vec<String>,
    ) -> std::result::Result<dp::AllocateResponse, Status> {
        let mut c = self
            .client()
            .map_err(|e| Status::unavailable(e.to_string()))?;
        c.allocate(dp::AllocateRequest {
            container_requests: vec![dp::ContainerAllocateRequest { devices_ids: ids }],
        })
        .await
        .map(Response::into_inner)
    }

    /// Know a pod's container without admitting it (the kubelet's pod manager adds each pod
    /// just before its admission, and keeps it after): PodResources lists it without devices.
    pub fn add_pod(&self, namespace: &str, pod: &str, container: &str) {
        let k = (
            namespace.to_string(),
            pod.to_string(),
            container.to_string(),
        );
        let mut known = self.inner.known.lock().expect("lock");
        if !known.contains(&k) {
            known.push(k);
        }
    }

    /// Forget a pod and its devices (the pod ended).
    pub fn remove_pod(&self, namespace: &str, pod: &str) {
        self.inner
            .assignments
            .lock()
            .expect("lock")
            .retain(|a| !(a.namespace == namespace && a.pod == pod));
        self.inner
            .known
            .lock()
            .expect("lock")
            .retain(|(ns, p, _)| !(ns == namespace && p == pod));
    }

    /// Restart: stop serving, delete every socket in the device-plugin directory (the
    /// plugin's too), drop the plugin connection, serve a new `kubelet.sock`. Assignments are
    /// kept (checkpoint). The plugin must notice and register again.
    pub async fn restart(&mut self) -> Result<()> {
        self.registration.cancel();
        self.inner.plugin_watch.lock().expect("lock").cancel();
        *self.inner.plugin.lock().expect("lock") = None;
        for e in std::fs::read_dir(&self.inner.dir)?.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "sock") {
                let _ = std::fs::remove_file(&p);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        self.registration = self.inner.stop.child_token();
        tokio::spawn(serve_registration(
            self.inner.clone(),
            self.registration.clone(),
        )?);
        Ok(())
    }
}
