//! The Kubernetes side of the certification: reading ResourceClaims as JSON (so that fields
//! newer than our `k8s-openapi` types survive) and writing our conditions into
//! `status.devices`.
//!
//! The one write: a JSON merge patch of the `status` subresource,
//! `{"metadata": {"resourceVersion": <read>}, "status": {"devices": [<every entry>]}}`. A merge
//! patch replaces a list whole, so it carries every entry, other drivers' exactly as read; the
//! resourceVersion makes it conditional (409 when the claim changed since it was read, and the
//! caller reads it again). Never a full `UpdateStatus`, which would drop what our types lack.

use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::serde_json::{self, Value, json};
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams};

/// The field manager of our status writes.
pub const FIELD_MANAGER: &str = "gpuledger-allocator";
/// Claims per page of a full list.
const PAGE: u32 = 500;

/// resource.k8s.io/v1 ResourceClaims, read and written as JSON.
#[derive(Clone)]
pub struct Claims {
    client: kube::Client,
    ar: ApiResource,
}

impl Claims {
    /// The claims of the cluster `client` talks to.
    pub fn new(client: kube::Client) -> Self {
        Claims {
            client,
            ar: ApiResource::erase::<ResourceClaim>(&()),
        }
    }

    /// Every namespace's claims.
    pub fn all(&self) -> Api<DynamicObject> {
        Api::all_with(self.client.clone(), &self.ar)
    }

    fn within(&self, ns: &str) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), ns, &self.ar)
    }

    /// Claim `ns/name` as the API server has it now; None when it does not exist.
    pub async fn get(&self, ns: &str, name: &str) -> Result<Option<Value>, kube::Error> {
        let o = self.within(ns).get_opt(name).await?;
        Ok(o.map(|o| to_json(&o)))
    }

    /// Every claim of the cluster, page by page.
    pub async fn list(&self) -> Result<Vec<Value>, kube::Error> {
        let api = self.all();
        let mut out = Vec::new();
        let mut lp = ListParams::default().limit(PAGE);
        loop {
            let page = api.list(&lp).await?;
            out.extend(page.items.iter().map(to_json));
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(c) => lp = lp.continue_token(&c),
                None => return Ok(out),
            }
        }
    }

    /// Write `devices` as the claim's `status.devices`, if the claim is still at `rv`.
    pub async fn write_devices(
        &self,
        ns: &str,
        name: &str,
        rv: &str,
        devices: Vec<Value>,
    ) -> Result<(), kube::Error> {
        let pp = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..Default::default()
        };
        self.within(ns)
            .patch_status(name, &pp, &Patch::Merge(&patch_body(rv, devices)))
            .await
            .map(|_| ())
    }
}

/// The status patch: `devices` as the whole list, conditional on `rv`.
pub fn patch_body(rv: &str, devices: Vec<Value>) -> Value {
    json!({"metadata": {"resourceVersion": rv}, "status": {"devices": devices}})
}

/// The object as JSON.
pub fn to_json(o: &DynamicObject) -> Value {
    serde_json::to_value(o).unwrap_or(Value::Null)
}

/// Whether the API server refused a write because the object is gone (404).
pub fn is_gone(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

/// Whether the API server refused a write because the object changed (409).
pub fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}
