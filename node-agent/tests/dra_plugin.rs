//! The agent as a kubelet DRA plugin (--mode=dra), against real etcd, a real allocator, the
//! fake API server, the fake NVML library and the DRA kubelet emulator over real gRPC: it
//! registers, publishes its node's ResourceSlice and republishes it when wiped, refuses to
//! prepare a claim the ledger has not granted (with a reason the user can read), prepares a
//! granted one through a CDI spec carrying the share's limits, and unprepares idempotently.
//! The grant comes from an admin's GrantClaim, checked by the ledger as the allocator's own
//! certification is.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpuledger_auth::identity::Role;
use gpuledger_proto::allocator::v1 as api;
use gpuledger_proto::dra::v1 as dra;
use gpuledger_proto::ledger::v1 as pb;
use gpuledger_testkit::kube::FakeApiServer;
use gpuledger_testkit::kubelet::Kubelet;
use gpuledger_testkit::kubelet::dra::DraKubelet;
use gpuledger_testkit::kubelet::node::{FakeNvml, NodeAgent};
use gpuledger_testkit::{Allocators, EtcdCluster};
use serde_json::{Value, json};

pub(crate) const NODE: &str = "dra-node-1";
const GPU_MIB: u64 = 40_960;
const SLICES: (&str, &str) = ("resource.k8s.io/v1", "resourceslices");
const CLAIMS: (&str, &str) = ("resource.k8s.io/v1", "resourceclaims");

pub(crate) struct DraNode {
    pub(crate) dir: tempfile::TempDir,
    pub(crate) _etcd: EtcdCluster,
    pub(crate) allocs: Allocators,
    pub(crate) api: FakeApiServer,
    pub(crate) kubelet: Kubelet,
    pub(crate) dra: DraKubelet,
    pub(crate) nvml: FakeNvml,
    pub(crate) agent: NodeAgent,
}

impl DraNode {
    pub(crate) async fn start() -> Result<DraNode> {
        Self::start_with(|_| {}, &[]).await
    }

    /// Start with `api` prepared by `before` (before the agent starts) and `extra` agent flags.
    pub(crate) async fn start_with(
        before: impl FnOnce(&FakeApiServer),
        extra: &[String],
    ) -> Result<DraNode> {
        Self::start_full(before, extra, None).await
    }

    /// [`DraNode::start_with`], the fake NVML state changed by `nvml` before the agent starts.
    pub(crate) async fn start_full(
        before: impl FnOnce(&FakeApiServer),
        extra: &[String],
        edit_nvml: Option<crate::support::NvmlEdit>,
    ) -> Result<DraNode> {
        let dir = tempfile::tempdir()?;
        let etcd = EtcdCluster::start(1).await?;
        let allocs = Allocators::start(&dir.path().join("alloc"), &etcd, 1, "t", &["--no-kube"])?;
        allocs.wait_leader(Duration::from_secs(30)).await?;
        let api = FakeApiServer::start(&dir.path().join("api")).await?;
        api.store
            .create(
                "v1",
                "nodes",
                "",
                json!({"metadata": {"name": NODE, "uid": "node-uid-1"}}),
            )
            .map_err(|e| anyhow::anyhow!("{}", e.message()))?;
        before(&api);
        let kubelet = Kubelet::start(&dir.path().join("kubelet")).await?;
        let dra = DraKubelet::start(&dir.path().join("dra")).await?;
        let nvml = FakeNvml::new(dir.path(), NODE, 2, GPU_MIB)?;
        if let Some(f) = edit_nvml {
            crate::support::edit_fake_nvml(nvml.path(), f)?;
        }
        let mut flags = allocs.ids.flags(&Role::NodeAgent { node: NODE.into() })?;
        flags.extend([
            "--mode=dra".to_string(),
            format!("--dra-registry-dir={}", dra.registry_dir().display()),
            format!("--dra-plugin-dir={}", dra.plugins_dir().display()),
            format!("--cdi-spec-dir={}", dir.path().join("cdi").display()),
            format!("--kubeconfig={}", api.kubeconfig().display()),
            "--prepare-grant-wait=2s".to_string(),
        ]);
        flags.extend(extra.iter().cloned());
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let agent = NodeAgent::start(dir.path(), NODE, &allocs.addrs, &nvml, &kubelet, &flags)?;
        let n = DraNode {
            dir,
            _etcd: etcd,
            allocs,
            api,
            kubelet,
            dra,
            nvml,
            agent,
        };
        n.dra
            .wait_registered(1, Duration::from_secs(30))
            .await
            .with_context(|| n.log())?;
        Ok(n)
    }

    pub(crate) fn log(&self) -> String {
        format!("agent log:\n{}", self.agent.proc.log_tail(40))
    }

    fn cdi_dir(&self) -> PathBuf {
        self.dir.path().join("cdi")
    }

    pub(crate) fn device(&self, i: usize) -> String {
        gpuledger_ledger::state::dra_device_name(&self.nvml.gpus[i].uuid)
    }

    /// The node's slices in the API server.
    pub(crate) fn slices(&self) -> Vec<Value> {
        self.api
            .store
            .objects(SLICES.0, SLICES.1)
            .into_iter()
            .filter(|s| s["spec"]["nodeName"] == NODE)
            .collect()
    }

    pub(crate) async fn wait_slice(&self, not: Option<&str>) -> Result<Value> {
        let t0 = Instant::now();
        loop {
            if let Some(s) = self
                .slices()
                .into_iter()
                .find(|s| s["metadata"]["name"].as_str() != not)
            {
                return Ok(s);
            }
            if t0.elapsed() > Duration::from_secs(20) {
                bail!("no ResourceSlice for {NODE}\n{}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A claim allocated on GPU `gpu` with share `share`, as the scheduler writes it.
    pub(crate) fn add_claim(
        &self,
        uid: &str,
        name: &str,
        gpu: usize,
        share: &str,
    ) -> Result<dra::Claim> {
        let request = json!({"name": "c0", "exactly": {"deviceClassName": "gpu.gpuledger.io"}});
        self.add_claim_of(uid, name, gpu, share, request, "c0")
    }

    /// A claim of request `request` allocated as `result` (a request name, or
    /// `request/subrequest`) on GPU `gpu` with share `share`.
    fn add_claim_of(
        &self,
        uid: &str,
        name: &str,
        gpu: usize,
        share: &str,
        request: Value,
        result: &str,
    ) -> Result<dra::Claim> {
        self.add_claim_with(uid, name, request, &[(result, gpu, share)])
    }

    /// A claim of request `request` allocated as `results`: (result, GPU, share) each.
    fn add_claim_with(
        &self,
        uid: &str,
        name: &str,
        request: Value,
        results: &[(&str, usize, &str)],
    ) -> Result<dra::Claim> {
        let results: Vec<Value> = results
            .iter()
            .map(|(result, gpu, share)| {
                json!({
                    "request": result, "driver": "gpu.gpuledger.io", "pool": NODE,
                    "device": self.device(*gpu), "shareID": share,
                    "consumedCapacity": {"memory": "3000Mi", "cores": "300"},
                })
            })
            .collect();
        self.api
            .store
            .create(
                CLAIMS.0,
                CLAIMS.1,
                "team-a",
                json!({
                    "metadata": {"name": name, "namespace": "team-a", "uid": uid},
                    "spec": {"devices": {"requests": [request]}},
                    "status": {"allocation": {"devices": {"results": results}}},
                }),
            )
            .map_err(|e| anyhow::anyhow!("{}", e.message()))?;
        Ok(dra::Claim {
            namespace: "team-a".into(),
            uid: uid.into(),
            name: name.into(),
        })
    }

    pub(crate) fn grant(&self, c: &dra::Claim, gpu: usize, share: &str) -> pb::ClaimGranted {
        self.grant_of(c, gpu, share, "c0")
    }

    /// The grant of result `result` of claim `c`.
    fn grant_of(&self, c: &dra::Claim, gpu: usize, share: &str, result: &str) -> pb::ClaimGranted {
        pb::ClaimGranted {
            allocation_id: 0,
            claim: Some(pb::ClaimRef {
                uid: c.uid.clone(),
                namespace: c.namespace.clone(),
                name: c.name.clone(),
            }),
            request: result.into(),
            node: NODE.into(),
            pool: NODE.into(),
            device: self.device(gpu),
            share_id: share.into(),
            share: Some(pb::GpuShare {
                gpu_uuid: self.nvml.gpus[gpu].uuid.clone(),
                mem_mib: 3000,
                core_milli: 300,
            }),
            consumers: Vec::new(),
            source: "claim".into(),
            priority: 0,
        }
    }

    /// An admin's refusal of claim `c`'s result `c0` on GPU `gpu` with share `share`.
    async fn refuse(&self, c: &dra::Claim, gpu: usize, share: &str, reason: &str) -> Result<()> {
        let g = self.grant(c, gpu, share);
        self.allocs
            .admin(0)?
            .refuse_claim(api::RefuseClaimRequest {
                refusal: Some(pb::ClaimRefused {
                    claim: g.claim,
                    request: g.request,
                    node: NODE.into(),
                    device: g.device,
                    share_id: g.share_id,
                    share: g.share,
                    reason: reason.into(),
                }),
            })
            .await?;
        Ok(())
    }

    /// The claim grant of claim `uid` in the ledger, once `pred` holds for it.
    async fn wait_grant(
        &self,
        uid: &str,
        pred: impl Fn(&pb::ClaimGrant) -> bool,
    ) -> Result<pb::ClaimGrant> {
        let t0 = Instant::now();
        loop {
            let l = self.allocs.ledger(0).await?;
            let found = l
                .allocs()
                .values()
                .filter(|a| a.pod.uid == uid)
                .find_map(|a| a.claim.as_ref().map(|c| c.to_pb()));
            if let Some(c) = found.filter(|c| pred(c)) {
                return Ok(c);
            }
            if t0.elapsed() > Duration::from_secs(10) {
                bail!("claim {uid}'s grant never got there\n{}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Make `api` change every device of every ResourceSlice written with `f` (an API server with
/// a feature gate off drops the gated fields).
pub(crate) fn on_each_slice_device(api: &FakeApiServer, f: fn(&mut Value)) {
    api.store
        .set_on_write(std::sync::Arc::new(move |_, resource, obj| {
            if resource != "resourceslices" {
                return;
            }
            for d in obj["spec"]["devices"].as_array_mut().into_iter().flatten() {
                f(d);
            }
        }));
}

fn env_of(spec: &Value) -> Vec<String> {
    spec["devices"][0]["containerEdits"]["env"]
        .as_array()
        .map(|e| {
            e.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_plugin_registers_and_keeps_its_resource_slice() -> Result<()> {
    let n = DraNode::start().await?;
    let r = n.dra.registrations();
    let info = &r[0].info;
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, "gpu.gpuledger.io");
    assert_eq!(
        info.supported_versions,
        [
            "v1.DRAPlugin",
            "v1alpha1.DRAResourceHealth",
            "v1.DRAResourceHealth"
        ]
    );
    assert_eq!(
        PathBuf::from(&info.endpoint),
        n.dra
            .plugins_dir()
            .join("gpu.gpuledger.io")
            .join("dra.sock")
    );
    assert_eq!(
        r[0].socket,
        n.dra.registry_dir().join("gpu.gpuledger.io-reg.sock")
    );

    let s = n.wait_slice(None).await?;
    let l = n.allocs.ledger(0).await?;
    assert_eq!(
        l.node(NODE).context("node registered")?.mode,
        pb::NodeMode::Dra,
        "the agent registers its node in DRA mode"
    );
    assert_eq!(
        n.kubelet.registrations(),
        0,
        "a DRA node never registers the device plugin"
    );
    assert_eq!(s["spec"]["driver"], "gpu.gpuledger.io");
    assert_eq!(s["spec"]["pool"]["name"], NODE);
    assert_eq!(s["spec"]["pool"]["resourceSliceCount"], 1);
    let owner = &s["metadata"]["ownerReferences"][0];
    assert_eq!(
        (&owner["kind"], &owner["name"], &owner["uid"]),
        (&json!("Node"), &json!(NODE), &json!("node-uid-1"))
    );
    let devices = s["spec"]["devices"].as_array().context("devices")?;
    assert_eq!(devices.len(), 2);
    for (i, d) in devices.iter().enumerate() {
        let uuid = &n.nvml.gpus[i].uuid;
        assert_eq!(
            d["name"],
            format!("gpu-{}", uuid.trim_start_matches("GPU-").to_lowercase())
        );
        assert_eq!(d["allowMultipleAllocations"], true);
        assert_eq!(d["attributes"]["uuid"]["string"], uuid.as_str());
        assert_eq!(d["attributes"]["index"]["int"], i);
        assert_eq!(d["attributes"]["cudaComputeCapability"]["version"], "8.0.0");
        let mem = format!("{GPU_MIB}Mi");
        assert_eq!(d["capacity"]["memory"]["value"], mem.as_str());
        assert_eq!(
            d["capacity"]["memory"]["requestPolicy"],
            json!({"default": mem, "validRange": {"min": "1Mi", "step": "1Mi"}})
        );
        assert_eq!(d["capacity"]["cores"]["value"], "1000");
        assert_eq!(d["bindingConditions"], json!(["gpuledger.io/Granted"]));
        assert_eq!(
            d["bindingFailureConditions"],
            json!(["gpuledger.io/Refused"])
        );
    }

    // The kubelet wipes a node's slices when it starts: the agent publishes it again.
    let name = s["metadata"]["name"].as_str().context("name")?.to_string();
    n.api
        .store
        .delete(SLICES.0, SLICES.1, "", &name)
        .map_err(|e| anyhow::anyhow!("{}: {:?}\n{}", e.message(), n.slices(), n.log()))?;
    let again = n.wait_slice(Some(&name)).await?;
    assert_eq!(again["spec"]["devices"], s["spec"]["devices"]);
    assert!(
        again["spec"]["pool"]["generation"].as_i64() > s["spec"]["pool"]["generation"].as_i64(),
        "a new generation: {again}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_prepare_serves_only_ledger_grants_through_a_cdi_spec() -> Result<()> {
    let n = DraNode::start().await?;
    n.wait_slice(None).await?;
    let claim = n.add_claim("claim-uid-1", "gpu", 1, "share-1")?;

    // Allocated by the scheduler, never granted: refused after --prepare-grant-wait.
    let t0 = Instant::now();
    let r = n.dra.prepare(std::slice::from_ref(&claim)).await?;
    let waited = t0.elapsed();
    let a = &r.claims["claim-uid-1"];
    assert!(a.devices.is_empty());
    assert!(
        a.error
            .starts_with("ResourceClaim team-a/gpu (claim-uid-1): no gpuledger grant: "),
        "{}",
        a.error
    );
    assert!(a.error.contains("request c0"), "{}", a.error);
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_secs(10),
        "waited {waited:?}"
    );
    assert!(
        std::fs::read_dir(n.cdi_dir()).map_or(true, |mut d| d.next().is_none()),
        "no CDI spec for a refused claim"
    );

    // Granted (on the same GPU and share): prepared through a CDI spec.
    let w = n
        .allocs
        .admin(0)?
        .grant_claim(api::GrantClaimRequest {
            grant: Some(n.grant(&claim, 1, "share-1")),
        })
        .await?
        .into_inner();
    assert!(w.changed);
    let r = n.dra.prepare(std::slice::from_ref(&claim)).await?;
    let a = &r.claims["claim-uid-1"];
    assert_eq!(a.error, "", "{}", n.log());
    let want = vec![dra::Device {
        request_names: vec!["c0".into()],
        pool_name: NODE.into(),
        device_name: n.device(1),
        cdi_device_ids: vec![
            "gpuledger.io/claim=claim-uid-1-c0".into(),
            format!("nvidia.com/gpu={}", n.nvml.gpus[1].uuid),
        ],
        share_id: Some("share-1".into()),
    }];
    assert_eq!(a.devices, want);
    let path = n.cdi_dir().join("gpuledger.io-claim_claim-uid-1.json");
    let spec: Value = serde_json::from_slice(&std::fs::read(&path)?)?;
    assert_eq!(spec["kind"], "gpuledger.io/claim");
    assert_eq!(spec["devices"][0]["name"], "claim-uid-1-c0");
    let env = env_of(&spec);
    for e in [
        "GPULEDGER_GPU_MEM_MIB=3000",
        "GPULEDGER_GPU_CORE=30",
        "CUDA_DEVICE_MEMORY_LIMIT_0=3000m",
        "CUDA_DEVICE_SM_LIMIT=30",
    ] {
        assert!(env.iter().any(|x| x == e), "{e} not in {env:?}");
    }
    let g = n.wait_grant("claim-uid-1", |c| c.prepared).await?;
    assert_eq!(g.cdi_device_ids, ["gpuledger.io/claim=claim-uid-1-c0"]);

    // The kubelet prepares again after a restart: the same devices.
    let again = n.dra.prepare(std::slice::from_ref(&claim)).await?;
    assert_eq!(again.claims["claim-uid-1"].devices, want);

    // Unprepare: the spec goes, the ledger records it; again, and for an unknown claim, too.
    let unknown = dra::Claim {
        namespace: "team-a".into(),
        uid: "never-seen".into(),
        name: "gone".into(),
    };
    let u = n.dra.unprepare(&[claim.clone(), unknown.clone()]).await?;
    assert_eq!(u.claims.len(), 2, "every claim gets an entry");
    assert!(u.claims.values().all(|c| c.error.is_empty()), "{u:?}");
    assert!(!path.exists());
    n.wait_grant("claim-uid-1", |c| !c.prepared).await?;
    let u = n.dra.unprepare(&[claim, unknown]).await?;
    assert!(u.claims.values().all(|c| c.error.is_empty()), "{u:?}");
    Ok(())
}

/// A claim allocated from a `firstAvailable` subrequest (`gpu/small`) is answered under its
/// main request `gpu`, the name its containers give: the kubelet attaches a device only to
/// containers whose request is among the device's request names, so answering `gpu/small`
/// started the container without its GPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_prepare_answers_a_subrequest_under_its_main_request() -> Result<()> {
    let n = DraNode::start().await?;
    n.wait_slice(None).await?;
    let request = json!({"name": "gpu", "firstAvailable": [
        {"name": "small", "deviceClassName": "gpu.gpuledger.io"}]});
    let claim = n.add_claim_of("claim-uid-sub", "sub", 0, "share-s", request, "gpu/small")?;
    n.allocs
        .admin(0)?
        .grant_claim(api::GrantClaimRequest {
            grant: Some(n.grant_of(&claim, 0, "share-s", "gpu/small")),
        })
        .await?;
    let r = n.dra.prepare(std::slice::from_ref(&claim)).await?;
    let a = &r.claims["claim-uid-sub"];
    assert_eq!(a.error, "", "{}", n.log());
    assert_eq!(a.devices.len(), 1);
    assert_eq!(a.devices[0].request_names, ["gpu"]);
    assert_eq!(
        a.devices[0].cdi_device_ids[0],
        "gpuledger.io/claim=claim-uid-sub-gpu_small"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_prepare_fails_fast_with_the_ledgers_refusal() -> Result<()> {
    let n = DraNode::start().await?;
    n.wait_slice(None).await?;
    let claim = n.add_claim("claim-uid-2", "big", 0, "share-9")?;
    n.refuse(
        &claim,
        0,
        "share-9",
        "namespace team-a is over its GPU memory quota",
    )
    .await?;
    let t0 = Instant::now();
    let r = n.dra.prepare(std::slice::from_ref(&claim)).await?;
    let e = &r.claims["claim-uid-2"].error;
    assert!(
        e.contains("over its GPU memory quota") && e.contains("ResourceClaim team-a/big"),
        "{e}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "a refusal needs no wait: {:?}",
        t0.elapsed()
    );
    Ok(())
}

/// Regression: a refusal was matched by claim UID and request only, so a claim refused once and
/// allocated afresh by the scheduler (another device and share), whose prepare came before the
/// new grant reached the agent's view, failed at once with the old result's reason. A refusal
/// applies only to the result it refused; the new result waits for its grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_prepare_waits_for_the_grant_of_a_result_allocated_after_a_refusal() -> Result<()> {
    let n = DraNode::start().await?;
    n.wait_slice(None).await?;
    let claim = n.add_claim("claim-uid-3", "again", 0, "share-a")?;
    n.refuse(&claim, 0, "share-a", "GPU 0 has too little free memory")
        .await?;
    // The scheduler allocates the claim afresh: GPU 1, another share.
    let b = json!({"request": "c0", "driver": "gpu.gpuledger.io", "pool": NODE,
        "device": n.device(1), "shareID": "share-b",
        "consumedCapacity": {"memory": "3000Mi", "cores": "300"}});
    n.api
        .store
        .update(CLAIMS.0, CLAIMS.1, "team-a", "again", |c| {
            c["status"]["allocation"]["devices"]["results"] = json!([b]);
            Ok(())
        })
        .map_err(|e| anyhow::anyhow!("{}", e.message()))?;
    // The kubelet prepares before the allocator has granted the new result.
    let admin = n.allocs.admin(0)?;
    let grant_b = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut admin = admin;
        admin
            .grant_claim(api::GrantClaimRequest {
                grant: Some(n.grant(&claim, 1, "share-b")),
            })
            .await
    };
    let (r, granted) = tokio::join!(n.dra.prepare(std::slice::from_ref(&claim)), grant_b);
    assert!(granted?.into_inner().changed);
    let r = r?;
    let got = &r.claims["claim-uid-3"];
    assert_eq!(got.error, "", "{}", n.log());
    assert_eq!(got.devices.len(), 1);
    assert_eq!(got.devices[0].device_name, n.device(1));
    assert_eq!(got.devices[0].share_id.as_deref(), Some("share-b"));
    Ok(())
}

/// Regression: a request for two GPUs has two results, each its own grant, but the container's
/// environment named only the first grant's allocation id, so enforcement and the user saw one
/// of the two. The container of a request gets every grant's id and every GPU's limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_prepare_of_a_two_gpu_request_names_both_grants() -> Result<()> {
    let n = DraNode::start().await?;
    n.wait_slice(None).await?;
    let request = json!({"name": "c0", "exactly": {"deviceClassName": "gpu.gpuledger.io",
        "allocationMode": "ExactCount", "count": 2}});
    let claim = n.add_claim_with(
        "claim-uid-4",
        "pair",
        request,
        &[("c0", 0, "share-x"), ("c0", 1, "share-y")],
    )?;
    for (gpu, share) in [(0, "share-x"), (1, "share-y")] {
        n.allocs
            .admin(0)?
            .grant_claim(api::GrantClaimRequest {
                grant: Some(n.grant(&claim, gpu, share)),
            })
            .await?;
    }
    let r = n.dra.prepare(std::slice::from_ref(&claim)).await?;
    let got = &r.claims["claim-uid-4"];
    assert_eq!(got.error, "", "{}", n.log());
    assert_eq!(got.devices.len(), 2);
    let l = n.allocs.ledger(0).await?;
    let mut ids: Vec<(String, u64)> = l
        .allocs()
        .values()
        .filter(|a| a.pod.uid == "claim-uid-4")
        .map(|a| (a.shares[0].gpu_uuid.clone(), a.id))
        .collect();
    ids.sort();
    assert_eq!(ids.len(), 2, "two grants: {ids:?}");
    let path = n.cdi_dir().join("gpuledger.io-claim_claim-uid-4.json");
    let spec: Value = serde_json::from_slice(&std::fs::read(&path)?)?;
    let env = env_of(&spec);
    let want_ids = format!("GPULEDGER_ALLOCATION_ID={},{}", ids[0].1, ids[1].1);
    for e in [
        want_ids.as_str(),
        "CUDA_DEVICE_MEMORY_LIMIT_0=3000m",
        "CUDA_DEVICE_MEMORY_LIMIT_1=3000m",
    ] {
        assert!(env.iter().any(|x| x == e), "{e} not in {env:?}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_is_off_while_the_api_server_drops_the_consumable_capacity_fields() -> Result<()> {
    // An API server with DRAConsumableCapacity off: the gated fields vanish on every write.
    let health = format!("127.0.0.1:{}", gpuledger_testkit::free_port()?);
    let n = DraNode::start_with(
        |api| {
            on_each_slice_device(api, |d| {
                if let Some(d) = d.as_object_mut() {
                    d.remove("allowMultipleAllocations");
                }
                for c in d["capacity"]
                    .as_object_mut()
                    .into_iter()
                    .flat_map(|c| c.values_mut())
                {
                    if let Some(c) = c.as_object_mut() {
                        c.remove("requestPolicy");
                    }
                }
            })
        },
        &[format!("--health-listen={health}")],
    )
    .await?;
    n.wait_slice(None).await?;
    let t0 = Instant::now();
    let (code, body) = loop {
        let got = gpuledger_testkit::http::get(&format!("http://{health}/readyz")).await;
        if let Ok((code, body)) = got
            && (body.contains("DRAConsumableCapacity") || t0.elapsed() > Duration::from_secs(10))
        {
            break (code, body);
        }
        if t0.elapsed() > Duration::from_secs(15) {
            bail!("/readyz never answered\n{}", n.log());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(code, 503, "{body}");
    assert!(
        body.contains("allowMultipleAllocations") && body.contains("DRAConsumableCapacity"),
        "{body}"
    );
    let (_, metrics) = gpuledger_testkit::http::get(&format!("http://{health}/metrics")).await?;
    assert!(
        metrics.contains(r#"gpuledger_node_agent_dra_gate_off{gate="DRAConsumableCapacity"} 1"#),
        "{metrics}"
    );
    // Even a granted claim gets no device.
    let claim = n.add_claim("claim-uid-3", "gpu", 0, "share-3")?;
    n.allocs
        .admin(0)?
        .grant_claim(api::GrantClaimRequest {
            grant: Some(n.grant(&claim, 0, "share-3")),
        })
        .await?;
    let r = n.dra.prepare(std::slice::from_ref(&claim)).await?;
    let a = &r.claims["claim-uid-3"];
    assert!(a.devices.is_empty());
    assert!(
        a.error.contains("serves no DRA") && a.error.contains("DRAConsumableCapacity"),
        "{}",
        a.error
    );
    Ok(())
}
