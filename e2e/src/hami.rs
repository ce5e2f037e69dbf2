//! HAMi (v2.10.0) beside gpuledger on the tier's control plane: its real `scheduler` (built by
//! `e2e/peers/build.sh`) as the extender of a second kube-scheduler whose only profile is
//! `hami-scheduler`, as HAMi's chart configures it (filter and bind verbs, its resources
//! managed and ignored by kube-scheduler itself), called over HTTPS; and kubelet-less GPU nodes
//! registered as HAMi's device plugin registers real ones. Pods name `hami-scheduler` directly
//! (HAMi's webhook, which would set it, is not run). Test material for the `versus` bench and
//! the differential tests: nothing of HAMi is in the product.
//!
//! How a node's GPUs exist for HAMi 2.10.0 (`pkg/device/nvidia/device.go`,
//! `pkg/device/devices.go`): the annotation `hami.io/node-nvidia-register` holds a JSON list of
//! device infos, and `status.allocatable["nvidia.com/gpu"]` is above 0 (the device plugin
//! advertises `deviceSplitCount` device IDs per GPU). HAMi's scheduler stamps
//! `hami.io/node-handshake` with `Requesting_<time>` when it takes the node in, and drops the
//! node's devices once that stamp is older than 60 s only if the allocatable count has gone
//! to 0: the device plugin of 2.10.0 no longer answers the stamp, it keeps the node alive
//! through the kubelet's allocatable, which a kubelet-less node keeps as created. Its
//! kube-node-lease is renewed by the tier's [`Heartbeat`](crate::nodes::Heartbeat). What the
//! device plugin does at the kubelet's Allocate (mark the pod allocated, release HAMi's
//! per-node lock) is done for these nodes by a task of [`Hami`].

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use gpuledger_testkit::{Proc, free_port};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use crate::E2e;
use crate::peers::{HAMI_SCHEDULER, PeerBins};
use crate::pki::Identity;

/// The scheduler name HAMi's pods carry (its chart's `schedulerName`).
pub const SCHEDULER_NAME: &str = "hami-scheduler";
/// The identity HAMi's scheduler runs as, authorized by [`CLUSTER_ROLE`] only.
pub const SERVICE_ACCOUNT: &str = "hami-scheduler";
/// The node annotation with the node's GPUs, as HAMi's NVIDIA device plugin writes it.
pub const REGISTER: &str = "hami.io/node-nvidia-register";
/// The node annotation HAMi's scheduler stamps `Requesting_<time>` on a node it takes in.
pub const HANDSHAKE: &str = "hami.io/node-handshake";
/// The pod annotation with what HAMi allocated (`uuid,type,mem,cores:` per GPU, `;` per
/// container).
pub const ALLOCATED: &str = "hami.io/vgpu-devices-allocated";
/// The pod annotation with the node HAMi placed the pod on.
pub const ASSIGNED_NODE: &str = "hami.io/vgpu-node";
/// The pod annotation with the GPUs the device plugin has yet to hand out (`;` per container
/// once it has).
pub const TO_ALLOCATE: &str = "hami.io/vgpu-devices-to-allocate";
/// The pod annotation with the phase of the pod's binding: `allocating` from HAMi's bind,
/// `success` once the device plugin allocated.
pub const BIND_PHASE: &str = "hami.io/bind-phase";
/// The node annotation HAMi's bind takes as a per-node lock (`<RFC 3339 time>,<ns>,<pod>`),
/// released by the device plugin once it allocated that pod's GPUs.
pub const NODE_LOCK: &str = "hami.io/mutex.lock";
/// The label of HAMi's kubelet-less nodes.
pub const NODE_LABEL: (&str, &str) = ("gpuledger.io/e2e", "hami");
/// The resources HAMi manages, as its chart lists them for kube-scheduler (NVIDIA's only).
pub const RESOURCES: [&str; 5] = [
    "nvidia.com/gpu",
    "nvidia.com/gpumem",
    "nvidia.com/gpucores",
    "nvidia.com/gpumem-percentage",
    "nvidia.com/priority",
];

/// What HAMi's scheduler may do, as its chart's ClusterRole grants it.
const CLUSTER_ROLE: &str = "e2e-hami-scheduler";

/// HAMi's device configuration: its chart's NVIDIA section with the chart's defaults.
const DEVICE_CONFIG: &str = "nvidia:
  resourceCountName: nvidia.com/gpu
  resourceMemoryName: nvidia.com/gpumem
  resourceMemoryPercentageName: nvidia.com/gpumem-percentage
  resourceCoreName: nvidia.com/gpucores
  resourcePriorityName: nvidia.com/priority
  overwriteEnv: false
  defaultMemory: 0
  defaultCores: 0
  defaultGPUNum: 1
  memoryFactor: 1
  deviceSplitCount: 10
  deviceMemoryScaling: 1
  deviceCoreScaling: 1
";

/// The shape of HAMi's kubelet-less nodes.
#[derive(Debug, Clone)]
pub struct NodeShape {
    /// GPUs per node.
    pub gpus: u32,
    /// Memory of each GPU, MiB.
    pub gpu_mem_mib: u32,
    /// GPU model as NVML names it (HAMi prefixes `NVIDIA-` to a name without `NVIDIA`).
    pub model: String,
    /// Tasks one GPU takes at most (the device plugin's `deviceSplitCount`, chart default 10).
    pub split: u32,
}

impl Default for NodeShape {
    fn default() -> NodeShape {
        NodeShape {
            gpus: 2,
            gpu_mem_mib: 16_384,
            model: "NVIDIA A10".into(),
            split: 10,
        }
    }
}

/// The UUID of GPU `i` of `node`.
pub fn gpu_uuid(node: &str, i: u32) -> String {
    format!("GPU-hami-{node}-{i}")
}

/// `hami.io/node-nvidia-register` as HAMi's device plugin writes it for these GPUs: one device
/// info per GPU (`id`, `index`, `count` = split, `devmem` MiB, `devcore` 100, `type`, `numa`,
/// `mode` `hami-core`, `health`).
pub fn register_annotation(node: &str, shape: &NodeShape) -> String {
    let uuids: Vec<String> = (0..shape.gpus).map(|i| gpu_uuid(node, i)).collect();
    register_annotation_of(&uuids, shape)
}

/// [`register_annotation`] for GPUs of these UUIDs, indexed in order (a real node's, as NVML
/// names them).
pub fn register_annotation_of(uuids: &[String], shape: &NodeShape) -> String {
    let devices: Vec<Value> = uuids
        .iter()
        .zip(0u32..)
        .map(|(uuid, i)| {
            json!({
                "id": uuid,
                "index": i,
                "count": shape.split,
                "devmem": shape.gpu_mem_mib,
                "devcore": 100,
                "type": shape.model,
                "mode": "hami-core",
                "health": true,
            })
        })
        .collect();
    Value::Array(devices).to_string()
}

/// The Node object: Ready, with cpu, memory, pods, `nvidia.com/gpu` (GPUs × split, the device
/// IDs HAMi's device plugin advertises) and the register annotation.
pub fn node_object(name: &str, shape: &NodeShape) -> Result<Node> {
    let res = json!({
        "cpu": "64", "memory": "256Gi", "pods": "110",
        "nvidia.com/gpu": (shape.gpus * shape.split).to_string(),
    });
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, NODE_LABEL.0: NODE_LABEL.1},
            "annotations": {REGISTER: register_annotation(name, shape)},
        },
        "status": {
            "capacity": res,
            "allocatable": res,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletLess",
                            "message": "created by the e2e tier for HAMi; no kubelet runs here"}],
        },
    }))?)
}

/// One GPU of a HAMi allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Granted {
    /// The GPU's UUID.
    pub uuid: String,
    /// Its type as registered.
    pub model: String,
    /// MiB.
    pub mem_mib: u64,
    /// Percent of the GPU's cores.
    pub cores: u32,
}

/// Parse `hami.io/vgpu-devices-allocated`: per container (`;`-terminated), its GPUs
/// (`uuid,type,mem,cores`, each `:`-terminated).
pub fn parse_allocation(s: &str) -> Result<Vec<Vec<Granted>>> {
    let body = s
        .strip_suffix(';')
        .with_context(|| format!("{ALLOCATED} {s:?} does not end with `;`"))?;
    body.split(';')
        .map(|container| {
            container
                .split(':')
                .filter(|d| !d.is_empty())
                .map(|d| {
                    let f: Vec<&str> = d.split(',').collect();
                    let [uuid, model, mem, cores] = f[..] else {
                        bail!("{ALLOCATED} device {d:?} is not uuid,type,mem,cores");
                    };
                    Ok(Granted {
                        uuid: uuid.into(),
                        model: model.into(),
                        mem_mib: mem.parse().with_context(|| format!("memory of {d:?}"))?,
                        cores: cores.parse().with_context(|| format!("cores of {d:?}"))?,
                    })
                })
                .collect()
        })
        .collect()
}

/// A pod written in HAMi's YAML: limits `nvidia.com/gpu`, `nvidia.com/gpumem` (MiB) and
/// `nvidia.com/gpucores` (percent), `schedulerName: hami-scheduler`.
pub fn pod(name: &str, gpus: u32, mem_mib: u64, cores: u32) -> Value {
    let (g, m, c) = (gpus.to_string(), mem_mib.to_string(), cores.to_string());
    let mut p = crate::pods::pod(
        name,
        &[
            ("nvidia.com/gpu", &g),
            ("nvidia.com/gpumem", &m),
            ("nvidia.com/gpucores", &c),
        ],
        None,
    );
    p["spec"]["schedulerName"] = json!(SCHEDULER_NAME);
    p
}

/// HAMi's scheduler and its kube-scheduler, running. Dropping it stops both.
pub struct Hami {
    /// kube-scheduler with the `hami-scheduler` profile and HAMi as its extender.
    pub kube_scheduler: Proc,
    /// HAMi's `scheduler` (extender; its webhook route is not registered with the API server).
    pub scheduler: Proc,
    /// `https://127.0.0.1:<port>`.
    pub url: String,
    /// HAMi's `/metrics` (plain HTTP, as it serves them).
    pub metrics_url: String,
    client: kube::Client,
    device_plugins: tokio::task::JoinHandle<()>,
}

impl Drop for Hami {
    fn drop(&mut self) {
        self.device_plugins.abort();
    }
}

impl Hami {
    /// Start HAMi's scheduler beside `e`'s control plane (as ServiceAccount
    /// [`SERVICE_ACCOUNT`] with HAMi's RBAC, serving HTTPS with a certificate of a CA of its
    /// own) and a second kube-scheduler (as `system:kube-scheduler`, no leader election: one
    /// instance) calling it; return once both listen.
    pub async fn start(e: &E2e) -> Result<Hami> {
        Hami::start_with_qps(e, None).await
    }

    /// [`Hami::start`] with its kube-scheduler's client QPS `qps` (burst twice that) instead
    /// of the default 50, as the benchmark gives gpuledger's, and HAMi's scheduler's own client
    /// the same (`--kube-qps`, `--kube-burst`; its default is client-go's 5 and 10).
    pub async fn start_with_qps(e: &E2e, qps: Option<u32>) -> Result<Hami> {
        let bins = PeerBins::get()?;
        let dir = e.dir().join("hami");
        std::fs::create_dir_all(&dir)?;
        rbac(&e.kubectl())?;
        let tls = gpuledger_testkit::pki::Pki::new(&dir)?;
        let (cert, key) = tls.server("hami")?;
        let device_config = dir.join("device-config.yaml");
        std::fs::write(&device_config, DEVICE_CONFIG)?;
        let port = free_port()?;
        let url = format!("https://127.0.0.1:{port}");
        let metrics_port = free_port()?;
        let metrics_url = format!("http://127.0.0.1:{metrics_port}/metrics");
        let kubeconfig = e.cp.pki.kubeconfig(
            &e.cp.server,
            &Identity::ServiceAccount(SERVICE_ACCOUNT.into()),
        )?;
        let mut scheduler = Proc::spawn(
            &dir,
            "hami-scheduler",
            &bins.path(HAMI_SCHEDULER),
            vec![
                format!("--http_bind=127.0.0.1:{port}"),
                format!("--cert_file={}", cert.display()),
                format!("--key_file={}", key.display()),
                format!("--device-config-file={}", device_config.display()),
                format!("--metrics-bind-address=127.0.0.1:{metrics_port}"),
                format!("--scheduler-name={SCHEDULER_NAME}"),
                "--leader-elect=false".into(),
                "--v=4".into(),
            ]
            .into_iter()
            .chain(
                qps.into_iter()
                    .flat_map(|q| [format!("--kube-qps={q}"), format!("--kube-burst={}", 2 * q)]),
            )
            .collect(),
            vec![("KUBECONFIG".into(), kubeconfig.display().to_string())],
        )?;
        wait_listening(&mut scheduler, port).await?;
        let config = dir.join("kube-scheduler.yaml");
        let mut text = kube_scheduler_config(
            &e.cp.pki.kubeconfig(&e.cp.server, &Identity::Scheduler)?,
            &url,
            tls.ca_file(),
        );
        if let Some(q) = qps {
            text = text.replacen(
                "clientConnection:\n",
                &format!("clientConnection:\n  qps: {q}\n  burst: {}\n", 2 * q),
                1,
            );
        }
        std::fs::write(&config, text)?;
        let secure_port = free_port()?;
        let mut args = vec![
            format!("--config={}", config.display()),
            format!("--secure-port={secure_port}"),
            "--bind-address=127.0.0.1".into(),
            "--v=2".into(),
        ];
        args.extend(e.bins.feature_gate_flags()?);
        let mut kube_scheduler = Proc::spawn(
            &dir,
            "kube-scheduler-hami",
            &e.bins.path("kube-scheduler"),
            args,
            vec![],
        )?;
        wait_listening(&mut kube_scheduler, secure_port).await?;
        let client = e.client.clone();
        // Pods are answered as their bindings arrive; a sweep of the nodes every few seconds
        // catches what a restarted watch missed.
        let device_plugins = tokio::spawn({
            let client = client.clone();
            async move {
                let watch = async {
                    loop {
                        if let Err(err) = allocate_as_bound(&client).await {
                            eprintln!("HAMi's device plugins (stand-in), watch: {err:#}");
                        }
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                };
                let sweep = async {
                    loop {
                        if let Err(err) = allocate(&client).await {
                            eprintln!("HAMi's device plugins (stand-in): {err:#}");
                        }
                        tokio::time::sleep(SWEEP).await;
                    }
                };
                futures::join!(watch, sweep);
            }
        });
        Ok(Hami {
            kube_scheduler,
            scheduler,
            url,
            metrics_url,
            client,
            device_plugins,
        })
    }

    /// Create `names` as kubelet-less HAMi GPU nodes of `shape`, their Leases renewed by `e`'s
    /// heartbeat; return once HAMi's scheduler has taken every one in (its GPUs are in HAMi's
    /// metrics, its handshake stamp on the node) and the node lifecycle controller has lifted
    /// its `not-ready` taint.
    pub async fn add_nodes(&self, e: &E2e, names: &[String], shape: &NodeShape) -> Result<()> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        for n in names {
            nodes
                .create(&PostParams::default(), &node_object(n, shape)?)
                .await
                .with_context(|| format!("creating HAMi node {n}"))?;
            e.heartbeat.keep(n).await?;
        }
        let gpus: Vec<String> = names
            .iter()
            .flat_map(|n| (0..shape.gpus).map(move |i| gpu_uuid(n, i)))
            .collect();
        self.wait_taken_in(names, &gpus).await?;
        crate::nodes::wait_untainted(&self.client, names).await
    }

    /// Make the existing node `name` (a real kubelet's) one of HAMi's, as HAMi's device plugin
    /// would on it: its GPUs `uuids` in the register annotation, `nvidia.com/gpu` (GPUs ×
    /// split) in its status, where an operator advertises an extended resource and the
    /// kubelet keeps it. Return once HAMi's scheduler has taken it in.
    pub async fn take_in(&self, name: &str, uuids: &[String], shape: &NodeShape) -> Result<()> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let annotation = register_annotation_of(uuids, shape);
        nodes
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"annotations": {REGISTER: annotation}}})),
            )
            .await
            .with_context(|| format!("annotating node {name} with HAMi's GPUs"))?;
        let count = (uuids.len() as u64 * u64::from(shape.split)).to_string();
        nodes
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {
                    "capacity": {"nvidia.com/gpu": count},
                    "allocatable": {"nvidia.com/gpu": count},
                }})),
            )
            .await
            .with_context(|| format!("advertising nvidia.com/gpu on node {name}"))?;
        self.wait_taken_in(&[name.to_string()], uuids).await
    }

    /// Wait until HAMi's scheduler lists every GPU of `gpus` in its metrics and has stamped
    /// the handshake of every node of `names`.
    async fn wait_taken_in(&self, names: &[String], gpus: &[String]) -> Result<()> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        crate::until(
            "HAMi's scheduler takes every new node's GPUs in (its /metrics lists them)",
            Duration::from_secs(60),
            || async {
                // HAMi answers /metrics slowly while it first goes through every node of the
                // cluster (its client is throttled): a timed-out scrape is a "not yet".
                let Ok(text) = self.metrics().await else {
                    return Ok(None);
                };
                let known = |g: &String| text.contains(&format!("device_uuid=\"{g}\""));
                Ok(gpus.iter().all(known).then_some(()))
            },
        )
        .await
        .with_context(|| self.log_tails(30))?;
        for n in names {
            let node = nodes.get(n).await?;
            let stamp = node.metadata.annotations.unwrap_or_default();
            ensure!(
                stamp
                    .get(HANDSHAKE)
                    .is_some_and(|s| s.starts_with("Requesting_")),
                "HAMi took node {n} in without stamping its {HANDSHAKE}: {:?}",
                stamp.get(HANDSHAKE)
            );
        }
        Ok(())
    }

    /// Create namespace `ns` for HAMi's pods, left alone by gpuledger's webhooks (which would
    /// otherwise translate HAMi's resources into gpuledger's): its name is added to their
    /// `namespaceSelector`'s excluded names, as an operator running both would.
    pub async fn namespace(&self, e: &E2e, ns: &str) -> Result<()> {
        let k = e.kubectl();
        for kind in [
            "mutatingwebhookconfiguration",
            "validatingwebhookconfiguration",
        ] {
            let patch = json!([
                {"op": "test", "path": "/webhooks/0/namespaceSelector/matchExpressions/0/key",
                 "value": "kubernetes.io/metadata.name"},
                {"op": "test", "path": "/webhooks/0/namespaceSelector/matchExpressions/0/operator",
                 "value": "NotIn"},
                {"op": "add", "path": "/webhooks/0/namespaceSelector/matchExpressions/0/values/-",
                 "value": ns},
            ]);
            k.ok(&[
                "patch",
                kind,
                "gpuledger",
                "--type=json",
                "-p",
                &patch.to_string(),
            ])
            .with_context(|| format!("excluding namespace {ns} from gpuledger's {kind}"))?;
        }
        crate::pods::namespace(&self.client, ns, &[]).await
    }

    /// HAMi's scheduler's `/metrics` text (per GPU: `hami_gpu_memory_limit_bytes`, …).
    pub async fn metrics(&self) -> Result<String> {
        let (code, body) = gpuledger_testkit::http::get(&self.metrics_url).await?;
        ensure!(code == 200, "HAMi's /metrics answered {code}");
        Ok(body)
    }

    /// The last lines of HAMi's scheduler's and its kube-scheduler's logs, for a failure.
    pub fn log_tails(&self, n: usize) -> String {
        format!(
            "--- HAMi scheduler:\n{}\n--- kube-scheduler (hami-scheduler):\n{}\n",
            self.scheduler.log_tail(n),
            self.kube_scheduler.log_tail(n)
        )
    }
}

/// How often the stand-in for HAMi's device plugins looks at every HAMi node's lock.
const SWEEP: Duration = Duration::from_secs(5);

/// [`allocate`] for each pod as soon as the watch sees it bound with bind phase `allocating`.
async fn allocate_as_bound(client: &kube::Client) -> Result<()> {
    use futures::TryStreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let nodes: Api<Node> = Api::all(client.clone());
    let mut s = std::pin::pin!(
        watcher(Api::<Pod>::all(client.clone()), watcher::Config::default()).applied_objects()
    );
    while let Some(p) = s.try_next().await? {
        let annos = p.metadata.annotations.clone().unwrap_or_default();
        let Some(node) = p.spec.as_ref().and_then(|s| s.node_name.clone()) else {
            continue;
        };
        if annos.get(BIND_PHASE).map(String::as_str) != Some("allocating") {
            continue;
        }
        // One pod's failure (deleted meanwhile, a conflict) is the sweep's to retry; the
        // watch goes on.
        if let Some(n) = nodes.get_opt(&node).await?
            && let Err(err) = allocate_on(client, &n).await
        {
            eprintln!("HAMi's device plugins (stand-in), node {node}: {err:#}");
        }
    }
    Ok(())
}

/// What HAMi's device plugin does at the kubelet's Allocate, for every kubelet-less HAMi node
/// (`pkg/device-plugin/nvidiadevice/nvinternal/plugin/server.go`, `util.go`): the pod that
/// holds the node's lock, once bound there with bind phase `allocating`, gets its GPUs (its
/// `hami.io/vgpu-devices-to-allocate` emptied, bind phase `success`) and the node's lock is
/// released, only if it is still that pod's. Without it HAMi's bind holds each node for 5
/// minutes (its lock timeout) after every pod.
async fn allocate(client: &kube::Client) -> Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let label = format!("{}={}", NODE_LABEL.0, NODE_LABEL.1);
    for node in nodes
        .list(&kube::api::ListParams::default().labels(&label))
        .await?
    {
        allocate_on(client, &node).await?;
    }
    Ok(())
}

/// [`allocate`] for one node.
async fn allocate_on(client: &kube::Client, node: &Node) -> Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let name = node.metadata.name.clone().unwrap_or_default();
    let annos = node.metadata.annotations.clone().unwrap_or_default();
    let Some(lock) = annos.get(NODE_LOCK) else {
        return Ok(());
    };
    let Some((ns, pod)) = lock_owner(lock) else {
        return Ok(());
    };
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let Some(p) = pods.get_opt(pod).await? else {
        return Ok(());
    };
    let pod_annos = p.metadata.annotations.clone().unwrap_or_default();
    let bound_here = p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(&name);
    if !bound_here || pod_annos.get(BIND_PHASE).map(String::as_str) != Some("allocating") {
        return Ok(());
    }
    let containers = pod_annos
        .get(TO_ALLOCATE)
        .map_or(1, |a| a.matches(';').count());
    pods.patch(
        pod,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {
            TO_ALLOCATE: ";".repeat(containers),
            BIND_PHASE: "success",
        }}})),
    )
    .await
    .with_context(|| format!("marking {ns}/{pod} allocated"))?;
    // Only the lock just read: the resourceVersion makes the patch fail if it changed.
    let release = json!({"metadata": {
        "resourceVersion": node.metadata.resource_version,
        "annotations": {NODE_LOCK: null},
    }});
    match nodes
        .patch(&name, &PatchParams::default(), &Patch::Merge(release))
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(err) => return Err(err).with_context(|| format!("releasing {name}'s lock")),
    }
    Ok(())
}

/// The pod (namespace, name) a node lock `<time>,<ns>,<pod>` names.
pub fn lock_owner(lock: &str) -> Option<(&str, &str)> {
    match lock.split(',').collect::<Vec<_>>()[..] {
        [_, ns, pod] if !ns.is_empty() && !pod.is_empty() => Some((ns, pod)),
        _ => None,
    }
}

/// Every bound pod of `ns` as HAMi annotated it: node → pod name → its allocation (one list
/// of GPUs per container); a bound pod whose `hami.io/vgpu-node` is not its node, or without
/// an allocation, is an error.
pub async fn allocations(
    client: &kube::Client,
    ns: &str,
) -> Result<BTreeMap<String, BTreeMap<String, Vec<Vec<Granted>>>>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let mut out: BTreeMap<String, BTreeMap<String, Vec<Vec<Granted>>>> = BTreeMap::new();
    for p in pods.list(&Default::default()).await? {
        let name = p.metadata.name.clone().unwrap_or_default();
        let Some(node) = p.spec.as_ref().and_then(|s| s.node_name.clone()) else {
            continue;
        };
        let annos = p.metadata.annotations.clone().unwrap_or_default();
        ensure!(
            annos.get(ASSIGNED_NODE) == Some(&node),
            "pod {ns}/{name} is bound to {node} but HAMi's {ASSIGNED_NODE} says {:?}",
            annos.get(ASSIGNED_NODE)
        );
        let a = annos
            .get(ALLOCATED)
            .with_context(|| format!("pod {ns}/{name} is bound with no {ALLOCATED}"))?;
        out.entry(node)
            .or_default()
            .insert(name, parse_allocation(a)?);
    }
    Ok(out)
}

/// Grant HAMi's ServiceAccount what HAMi's chart grants its scheduler (pods and configmaps:
/// get, list, watch, patch; pods/binding: create; nodes: get, list, watch, patch; events:
/// create, get, list; resourcequotas: get, list, watch), plus Events in `events.k8s.io`.
fn rbac(k: &crate::kubectl::Kubectl) -> Result<()> {
    let rules = json!([
        {"apiGroups": [""], "resources": ["pods", "configmaps"],
         "verbs": ["get", "list", "watch", "patch"]},
        {"apiGroups": [""], "resources": ["pods/binding"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch", "patch"]},
        {"apiGroups": ["", "events.k8s.io"], "resources": ["events"],
         "verbs": ["create", "get", "list", "patch"]},
        {"apiGroups": [""], "resources": ["resourcequotas"], "verbs": ["get", "list", "watch"]},
    ]);
    k.grant(
        "HAMi's RBAC",
        (CLUSTER_ROLE, SERVICE_ACCOUNT),
        rules,
        Vec::new(),
    )
}

/// kube-scheduler's configuration for HAMi, as HAMi's chart writes it (profile
/// `hami-scheduler`; extender with verbs `filter` and `bind`, `nodeCacheCapable`, weight 1,
/// 30 s; its resources managed and ignored by kube-scheduler), but called over HTTPS and
/// checking HAMi's certificate against `ca` (the chart skips verification), with a
/// kubeconfig and no leader election.
pub fn kube_scheduler_config(
    kubeconfig: &std::path::Path,
    url: &str,
    ca: &std::path::Path,
) -> String {
    let managed: String = RESOURCES
        .iter()
        .map(|r| format!("  - name: {r}\n    ignoredByScheduler: true\n"))
        .collect();
    format!(
        "apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\n\
         clientConnection:\n  kubeconfig: {kc}\nleaderElection:\n  leaderElect: false\n\
         profiles:\n- schedulerName: {SCHEDULER_NAME}\nextenders:\n- urlPrefix: {url}\n  \
         enableHTTPS: true\n  tlsConfig:\n    insecure: false\n    caFile: {ca}\n  \
         filterVerb: filter\n  bindVerb: bind\n  nodeCacheCapable: true\n  weight: 1\n  \
         httpTimeout: 30s\n  managedResources:\n{managed}",
        kc = kubeconfig.display(),
        ca = ca.display(),
    )
}

/// Wait up to 60 s until `p` accepts connections on 127.0.0.1:`port`, failing at once with
/// its log if it exits.
async fn wait_listening(p: &mut Proc, port: u16) -> Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while std::time::Instant::now() < deadline {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return Ok(());
        }
        if let Some(st) = p.exited() {
            bail!("{} exited ({st}):\n{}", p.name, p.log_tail(30));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    bail!(
        "{} does not listen on 127.0.0.1:{port} after 60 s:\n{}",
        p.name,
        p.log_tail(30)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_register_annotation_is_the_device_plugins_json() -> Result<()> {
        let a = register_annotation("n1", &NodeShape::default());
        let v: Value = serde_json::from_str(&a)?;
        let list = v.as_array().context("a JSON list")?;
        assert_eq!(list.len(), 2);
        assert_eq!(list[1]["id"], "GPU-hami-n1-1");
        assert_eq!(list[1]["index"], 1);
        assert_eq!(list[0]["count"], 10);
        assert_eq!(list[0]["devmem"], 16_384);
        assert_eq!(list[0]["devcore"], 100);
        assert_eq!(list[0]["type"], "NVIDIA A10");
        assert_eq!(list[0]["mode"], "hami-core");
        assert_eq!(list[0]["health"], true);
        let n = node_object("n1", &NodeShape::default())?;
        let alloc = n.status.and_then(|s| s.allocatable).unwrap_or_default();
        assert_eq!(
            alloc.get("nvidia.com/gpu").map(|q| q.0.as_str()),
            Some("20")
        );
        Ok(())
    }

    #[test]
    fn an_allocation_reads_per_container_and_gpu() -> Result<()> {
        let a =
            parse_allocation("GPU-a,NVIDIA,4096,30:GPU-b,NVIDIA,4096,30:;;GPU-c,NVIDIA,100,0:;")?;
        assert_eq!(a.len(), 3);
        assert_eq!(a[0].len(), 2);
        assert!(a[1].is_empty());
        assert_eq!(
            a[2],
            vec![Granted {
                uuid: "GPU-c".into(),
                model: "NVIDIA".into(),
                mem_mib: 100,
                cores: 0
            }]
        );
        for bad in [
            "GPU-a,NVIDIA,4096,30:",
            "GPU-a,NVIDIA,4096:;",
            "GPU-a,NVIDIA,x,30:;",
        ] {
            assert!(parse_allocation(bad).is_err(), "{bad:?} parsed");
        }
        Ok(())
    }

    #[test]
    fn a_node_lock_names_its_pod() {
        assert_eq!(
            lock_owner("2026-12-02T05:56:21Z,hami,vgpu-1"),
            Some(("hami", "vgpu-1"))
        );
        for bad in ["2026-12-02T05:56:21Z", "t,,p", "t,ns,", "a,b,c,d"] {
            assert_eq!(lock_owner(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn kube_scheduler_calls_hami_over_verified_https() {
        let c = kube_scheduler_config(
            std::path::Path::new("/k"),
            "https://127.0.0.1:1",
            std::path::Path::new("/ca"),
        );
        for line in [
            "- schedulerName: hami-scheduler",
            "- urlPrefix: https://127.0.0.1:1",
            "  enableHTTPS: true",
            "    insecure: false",
            "    caFile: /ca",
            "  filterVerb: filter",
            "  bindVerb: bind",
            "  - name: nvidia.com/gpumem",
        ] {
            assert!(c.lines().any(|l| l == line), "no {line:?} in:\n{c}");
        }
    }
}
