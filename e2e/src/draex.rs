//! kubernetes-sigs/dra-example-driver (commit 31914ce) beside gpuledger on the tier's control
//! plane: its real `dra-example-controller` (built by `e2e/peers/build.sh`) with its
//! `BindingConditions` plugin, which marks each binding condition of an allocated device True
//! as soon as it sees the allocation; its DeviceClass; and kubelet-less nodes whose
//! ResourceSlices are written as its kubelet plugin publishes them with `--device-profile gpu
//! --gpu-allow-multiple-allocations --binding-conditions` (`internal/profiles/gpu/gpu.go`):
//! one device `gpu-<i>` per GPU, shared (`allowMultipleAllocations`), with consumable
//! `memory` (80Gi, requested in steps of 1Gi) and `compute` (100, steps of 1) and the binding
//! conditions `BindingConditions` / `BindingFailureConditions`. The kubelet plugin itself is
//! not run: it needs a kubelet (its registration and NodePrepareResources), which these nodes
//! do not have; pods bound there never start. The devices' `uuid` attributes are
//! `gpu-<node>-<i>`, not the plugin's seeded random UUIDs. Test material for the `versus`
//! bench's DRA twin: nothing of the driver is in the product.

use anyhow::{Context, Result, ensure};
use gpuledger_testkit::Proc;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DynamicObject, PostParams};
use kube::discovery::ApiResource;
use serde_json::{Value, json};

use crate::E2e;
use crate::peers::{DRAEX_CONTROLLER, PeerBins};
use crate::pki::Identity;

/// The driver's name (its default `--driver-name`), also its DeviceClass's.
pub const DRIVER: &str = "gpu.example.com";
/// The binding condition its devices carry and its controller sets.
pub const BINDING_CONDITION: &str = "BindingConditions";
/// The identity its controller runs as, authorized by [`CLUSTER_ROLE`] only.
pub const SERVICE_ACCOUNT: &str = "dra-example-driver";
/// The label of its kubelet-less nodes.
pub const NODE_LABEL: (&str, &str) = ("gpuledger.io/e2e", "draex");
/// Memory of each device, GiB (the profile's 80Gi).
pub const DEVICE_GIB: u64 = 80;

/// What its controller may do: read ResourceClaims and write their status.
const CLUSTER_ROLE: &str = "e2e-dra-example-controller";

/// The API resource of a ResourceSlice / ResourceClaim (`resource.k8s.io/v1`).
pub fn resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: "resource.k8s.io".into(),
        version: "v1".into(),
        api_version: "resource.k8s.io/v1".into(),
        kind: kind.into(),
        plural: plural.into(),
    }
}

/// One device as the plugin's gpu profile publishes it with multiple allocations and binding
/// conditions.
pub fn device(node: &str, i: u32) -> Value {
    let mem = format!("{DEVICE_GIB}Gi");
    json!({
        "name": format!("gpu-{i}"),
        "attributes": {
            "index": {"int": i},
            "uuid": {"string": format!("gpu-{node}-{i}")},
            "model": {"string": "LATEST-GPU-MODEL"},
            "driverVersion": {"version": "1.0.0"},
        },
        "allowMultipleAllocations": true,
        "capacity": {
            "memory": {"value": mem, "requestPolicy": {"default": mem,
                "validRange": {"min": "1Gi", "step": "1Gi", "max": mem}}},
            "compute": {"value": "100", "requestPolicy": {"default": "100",
                "validRange": {"min": "1", "step": "1", "max": "100"}}},
        },
        "bindingConditions": [BINDING_CONDITION],
        "bindingFailureConditions": ["BindingFailureConditions"],
    })
}

/// The node's ResourceSlice, as the plugin's resourceslice controller writes it (one pool
/// named for the node, one slice).
pub fn slice(node: &str, gpus: u32) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"generateName": format!("{node}-{DRIVER}-")},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": (0..gpus).map(|i| device(node, i)).collect::<Vec<_>>(),
        },
    })
}

/// A ResourceClaimTemplate `name` asking one shared device of the driver's class with
/// `mem_gib` of its memory and `compute` of its compute.
pub fn claim_template(name: &str, mem_gib: u64, compute: u32) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": DRIVER,
            "capacity": {"requests": {"memory": format!("{mem_gib}Gi"), "compute": compute.to_string()}},
        }}]}}},
    })
}

/// A pod whose container uses a claim made from `template`, on the driver's nodes.
pub fn pod(name: &str, template: &str) -> Value {
    let mut p = crate::pods::pod(name, &[], None);
    p["spec"]["resourceClaims"] = json!([{"name": "gpu", "resourceClaimTemplateName": template}]);
    p["spec"]["containers"][0]["resources"] = json!({"claims": [{"name": "gpu"}]});
    p["spec"]["nodeSelector"] = json!({NODE_LABEL.0: NODE_LABEL.1});
    p
}

/// dra-example-driver's controller, running, and the stand-in that does its binding-condition
/// plugin's work on shared devices (see [`mark_binding_conditions`]). Dropping it stops both.
pub struct Draex {
    /// `dra-example-controller --enable-plugin=BindingConditions`.
    pub controller: Proc,
    marker: tokio::task::JoinHandle<()>,
}

impl Drop for Draex {
    fn drop(&mut self) {
        self.marker.abort();
    }
}

impl Draex {
    /// Install the driver's DeviceClass and its controller's RBAC, and start the controller
    /// as ServiceAccount [`SERVICE_ACCOUNT`].
    pub fn start(e: &E2e) -> Result<Draex> {
        let bins = PeerBins::get()?;
        let dir = e.dir().join("draex");
        std::fs::create_dir_all(&dir)?;
        install(&e.kubectl())?;
        let kubeconfig = e.cp.pki.kubeconfig(
            &e.cp.server,
            &Identity::ServiceAccount(SERVICE_ACCOUNT.into()),
        )?;
        let controller = Proc::spawn(
            &dir,
            "dra-example-controller",
            &bins.path(DRAEX_CONTROLLER),
            vec![
                format!("--driver-name={DRIVER}"),
                format!("--enable-plugin={BINDING_CONDITION}"),
            ],
            vec![("KUBECONFIG".into(), kubeconfig.display().to_string())],
        )?;
        let marker = tokio::spawn(mark_binding_conditions(e.client.clone()));
        Ok(Draex { controller, marker })
    }

    /// Create `names` as kubelet-less nodes of the driver with `gpus` devices each, their
    /// Leases renewed by `e`'s heartbeat and their ResourceSlices written; return once the
    /// node lifecycle controller has lifted their `not-ready` taint.
    pub async fn add_nodes(&self, e: &E2e, names: &[String], gpus: u32) -> Result<()> {
        let nodes: Api<Node> = Api::all(e.client.clone());
        let slices: Api<DynamicObject> = Api::all_with(
            e.client.clone(),
            &resource("ResourceSlice", "resourceslices"),
        );
        for n in names {
            let res = json!({"cpu": "64", "memory": "256Gi", "pods": "110"});
            let node: Node = serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": n, "labels": {"kubernetes.io/hostname": n, NODE_LABEL.0: NODE_LABEL.1}},
                "status": {"capacity": res, "allocatable": res,
                    "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletLess",
                        "message": "created by the e2e tier for dra-example-driver; no kubelet runs here"}]},
            }))?;
            nodes
                .create(&PostParams::default(), &node)
                .await
                .with_context(|| format!("creating dra-example-driver node {n}"))?;
            e.heartbeat.keep(n).await?;
            let s: DynamicObject = serde_json::from_value(slice(n, gpus))?;
            slices
                .create(&PostParams::default(), &s)
                .await
                .with_context(|| format!("creating the ResourceSlice of {n}"))?;
        }
        crate::nodes::wait_untainted(&e.client, names).await
    }

    /// The last lines of the controller's log, for a failure.
    pub fn log_tail(&self, n: usize) -> String {
        format!(
            "--- dra-example-controller:\n{}\n",
            self.controller.log_tail(n)
        )
    }
}

/// What the controller's `BindingConditions` plugin does (`cmd/dra-example-controller/plugins/
/// bindingconditions.go`): once a claim is allocated, set every binding condition of each of
/// the driver's results True, in one status update. The plugin itself cannot do it for a
/// shared device: its status entry names driver, pool and device but not the result's
/// `shareID`, and since 1.36 the API server accepts a device status only for an allocated
/// (device, shareID) pair (`pkg/apis/resource/validation`, "must be an allocated device in
/// the claim"), so every update it makes is refused and the pod is never bound. The
/// stand-in writes the same conditions with the `shareID`. Runs until aborted; a claim whose
/// update fails (deleted meanwhile, a conflict) is retried at its next change.
async fn mark_binding_conditions(client: kube::Client) {
    use futures::TryStreamExt;
    use kube::api::{Patch, PatchParams};
    use kube::runtime::{WatchStreamExt, watcher};
    let api: Api<DynamicObject> =
        Api::all_with(client.clone(), &resource("ResourceClaim", "resourceclaims"));
    let mut s = std::pin::pin!(
        watcher(api, watcher::Config::default())
            .applied_objects()
            .default_backoff()
    );
    loop {
        let claim = match s.try_next().await {
            Ok(Some(c)) => c,
            Ok(None) => return,
            Err(err) => {
                eprintln!("dra-example-driver's binding conditions (stand-in): watch: {err}");
                continue;
            }
        };
        let v = serde_json::to_value(&claim).unwrap_or_default();
        let Some(devices) = conditions_to_set(&v) else {
            continue;
        };
        let (Some(ns), Some(name)) = (claim.metadata.namespace, claim.metadata.name) else {
            continue;
        };
        let claims: Api<DynamicObject> = Api::namespaced_with(
            client.clone(),
            &ns,
            &resource("ResourceClaim", "resourceclaims"),
        );
        let patch = json!({"status": {"devices": devices}});
        if let Err(err) = claims
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            eprintln!(
                "dra-example-driver's binding conditions (stand-in), claim {ns}/{name}: {err}"
            );
        }
    }
}

/// The `status.devices` that mark every binding condition of `claim`'s results of the driver
/// True (with each result's `shareID`), or None when there is nothing to mark: not allocated,
/// no binding conditions, or all of them True already.
pub fn conditions_to_set(claim: &Value) -> Option<Vec<Value>> {
    let results = claim["status"]["allocation"]["devices"]["results"].as_array()?;
    let ours: Vec<&Value> = results
        .iter()
        .filter(|r| r["driver"] == DRIVER)
        .filter(|r| {
            r["bindingConditions"]
                .as_array()
                .is_some_and(|c| !c.is_empty())
        })
        .collect();
    if ours.is_empty() || allocation(claim).is_ok_and(|(_, done)| done) {
        return None;
    }
    let now = "1970-01-01T00:00:00Z";
    let at = claim["metadata"]["creationTimestamp"]
        .as_str()
        .unwrap_or(now);
    Some(
        ours.iter()
            .map(|r| {
                let conditions: Vec<Value> = r["bindingConditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|t| {
                        json!({"type": t, "status": "True", "reason": "Ready",
                            "message": "Device is ready", "lastTransitionTime": at})
                    })
                    .collect();
                let mut d = json!({"driver": r["driver"], "pool": r["pool"],
                    "device": r["device"], "conditions": conditions});
                if let Some(id) = r["shareID"].as_str() {
                    d["shareID"] = json!(id);
                }
                d
            })
            .collect(),
    )
}

/// One device of a claim's allocation: (pool, device, memory GiB, compute) consumed.
pub type Consumed = (String, String, u64, u64);

/// A claim's allocation as the scheduler wrote it and the controller marked it: what each
/// result consumes, and whether every binding condition is True.
pub fn allocation(claim: &Value) -> Result<(Vec<Consumed>, bool)> {
    let results = claim["status"]["allocation"]["devices"]["results"]
        .as_array()
        .context("the claim is not allocated")?;
    let mut out = Vec::new();
    for r in results {
        ensure!(r["driver"] == DRIVER, "a result of another driver: {r}");
        let q = |k: &str| -> Result<u64> {
            let s = r["consumedCapacity"][k]
                .as_str()
                .with_context(|| format!("no consumedCapacity {k} in {r}"))?;
            parse_quantity(s)
        };
        out.push((
            r["pool"].as_str().unwrap_or_default().to_string(),
            r["device"].as_str().unwrap_or_default().to_string(),
            q("memory")? >> 30,
            q("compute")?,
        ));
    }
    let conditions_true = claim["status"]["devices"].as_array().is_some_and(|ds| {
        results.iter().all(|r| {
            ds.iter().any(|d| {
                d["pool"] == r["pool"]
                    && d["device"] == r["device"]
                    && d["shareID"] == r["shareID"]
                    && d["conditions"].as_array().is_some_and(|cs| {
                        cs.iter()
                            .any(|c| c["type"] == BINDING_CONDITION && c["status"] == "True")
                    })
            })
        })
    });
    Ok((out, conditions_true))
}

/// A whole-number Kubernetes quantity (`4Gi`, `25`, `4294967296`).
fn parse_quantity(s: &str) -> Result<u64> {
    let (num, mul) = match s {
        _ if s.ends_with("Gi") => (&s[..s.len() - 2], 1u64 << 30),
        _ if s.ends_with("Mi") => (&s[..s.len() - 2], 1 << 20),
        _ if s.ends_with("Ki") => (&s[..s.len() - 2], 1 << 10),
        _ => (s, 1),
    };
    let n: u64 = num
        .parse()
        .with_context(|| format!("quantity {s:?} is not a whole number of bytes or units"))?;
    n.checked_mul(mul)
        .with_context(|| format!("quantity {s:?} is too large"))
}

/// The DeviceClass, and RBAC for the controller as the driver's chart grants it
/// (resourceclaims: get, list, watch; resourceclaims/status: update, patch), with what 1.37
/// adds for a driver's device status.
fn install(k: &crate::kubectl::Kubectl) -> Result<()> {
    let class = json!({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": {"name": DRIVER},
        "spec": {"selectors": [{"cel": {"expression": format!("device.driver == '{DRIVER}'")}}]}});
    let rules = json!([
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"],
         "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/status"],
         "verbs": ["update", "patch"]},
        // 1.37 authorizes a driver's writes of `status.devices` on this subresource too
        // (verbs per node scope, the driver's name as resource name); 31914ce's chart
        // predates it.
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/driver"],
         "resourceNames": [DRIVER], "verbs": ["arbitrary-node:update", "arbitrary-node:patch"]},
        {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
    ]);
    k.grant(
        "dra-example-driver's DeviceClass and RBAC",
        (CLUSTER_ROLE, SERVICE_ACCOUNT),
        rules,
        vec![class],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slice_carries_shared_consumable_devices_with_binding_conditions() {
        let s = slice("n1", 2);
        assert_eq!(s["spec"]["pool"]["name"], "n1");
        let d = &s["spec"]["devices"][1];
        assert_eq!(d["name"], "gpu-1");
        assert_eq!(d["allowMultipleAllocations"], true);
        assert_eq!(d["capacity"]["memory"]["value"], "80Gi");
        assert_eq!(
            d["capacity"]["memory"]["requestPolicy"]["validRange"]["step"],
            "1Gi"
        );
        assert_eq!(d["bindingConditions"][0], BINDING_CONDITION);
    }

    #[test]
    fn an_allocation_reads_consumed_capacity_and_conditions() -> Result<()> {
        let mut claim = json!({"status": {"allocation": {"devices": {"results": [
            {"driver": DRIVER, "pool": "n1", "device": "gpu-0", "request": "gpu",
             "consumedCapacity": {"memory": "4Gi", "compute": "25"}}]}}}});
        let (r, done) = allocation(&claim)?;
        assert_eq!(r, vec![("n1".into(), "gpu-0".into(), 4, 25)]);
        assert!(!done, "no condition set yet");
        claim["status"]["devices"] = json!([{"driver": DRIVER, "pool": "n1", "device": "gpu-0",
            "conditions": [{"type": BINDING_CONDITION, "status": "True"}]}]);
        assert!(allocation(&claim)?.1);
        assert!(allocation(&json!({"status": {}})).is_err());
        // A shared device's result: its status entry must carry the result's shareID.
        let mut shared = json!({"status": {"allocation": {"devices": {"results": [
            {"driver": DRIVER, "pool": "n1", "device": "gpu-0", "request": "gpu", "shareID": "s-1",
             "bindingConditions": [BINDING_CONDITION],
             "consumedCapacity": {"memory": "4Gi", "compute": "25"}}]}}}});
        let set = conditions_to_set(&shared).expect("conditions to set");
        assert_eq!(set[0]["shareID"], "s-1");
        assert_eq!(set[0]["conditions"][0]["type"], BINDING_CONDITION);
        shared["status"]["devices"] = json!([{"driver": DRIVER, "pool": "n1", "device": "gpu-0",
            "conditions": [{"type": BINDING_CONDITION, "status": "True"}]}]);
        assert!(
            conditions_to_set(&shared).is_some(),
            "an entry without the shareID is not the result's"
        );
        shared["status"]["devices"] = json!(set);
        assert_eq!(conditions_to_set(&shared), None);
        assert!(parse_quantity("4x").is_err());
        assert_eq!(parse_quantity("4294967296")?, 4 << 30);
        Ok(())
    }
}
