//! The fake API server's object store: objects by group/version, resource, namespace and name,
//! one global resourceVersion, and the history of changes a watch resumes from.

pub mod selector;
mod tokens;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use tokio::sync::broadcast;

pub use selector::Filter;

/// How many past events a watch can resume from.
const HISTORY: usize = 200_000;

/// A stored object's identity.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Key {
    /// "v1" or "group/version".
    gv: String,
    /// Plural resource name ("pods").
    resource: String,
    /// Empty for cluster-scoped resources.
    namespace: String,
    name: String,
}

/// Which objects a list or a watch is about: one resource, in one namespace or in all.
#[derive(Debug, Clone)]
pub struct Scope {
    /// "v1" or "group/version".
    pub gv: String,
    /// Plural resource name ("pods").
    pub resource: String,
    /// Empty for all namespaces (and for cluster-scoped resources).
    pub namespace: String,
}

impl Scope {
    fn contains(&self, k: &Key) -> bool {
        k.gv == self.gv
            && k.resource == self.resource
            && (self.namespace.is_empty() || k.namespace == self.namespace)
    }
}

/// One change to the store, as the watch history keeps it.
#[derive(Debug, Clone)]
pub(crate) struct Change {
    /// The resourceVersion it made.
    pub(crate) rv: u64,
    kind: &'static str,
    key: Key,
    /// The object after the change (the last state, for a deletion).
    pub(crate) object: Value,
    old: Option<Value>,
}

impl Change {
    /// How the change looks to a watch of `scope` through `f`: ADDED/MODIFIED/DELETED, or
    /// nothing. An object that starts or stops matching is ADDED or DELETED for it.
    pub(crate) fn seen_by(&self, scope: &Scope, f: &Filter) -> Option<&'static str> {
        if !scope.contains(&self.key) {
            return None;
        }
        let now = f.matches(&self.object);
        let before = self.old.as_ref().map(|o| f.matches(o));
        match (self.kind, before, now) {
            ("MODIFIED", Some(true), true) => Some("MODIFIED"),
            ("MODIFIED", Some(false), true) => Some("ADDED"),
            ("MODIFIED", Some(true), false) => Some("DELETED"),
            ("MODIFIED", _, _) => None,
            (k, _, true) => Some(k),
            _ => None,
        }
    }
}

/// Where a watch starts: the events it sends first, the resourceVersion they reach, and the
/// changes after them as they come.
pub(crate) struct WatchStart {
    /// `(type, object)` to send before anything live.
    pub(crate) first: Vec<(&'static str, Value)>,
    /// The resourceVersion `first` brings the watcher to.
    pub(crate) rv: u64,
    /// Every later change to the store (of any scope).
    pub(crate) rx: broadcast::Receiver<Arc<Change>>,
}

#[derive(Default)]
struct Inner {
    rv: u64,
    uid: u64,
    objects: BTreeMap<Key, Value>,
    history: VecDeque<Change>,
}

/// The object store behind the fake API server.
pub struct Store {
    inner: Mutex<Inner>,
    tx: broadcast::Sender<Arc<Change>>,
    requests: Mutex<BTreeSet<ApiRequest>>,
    tokens: Mutex<std::collections::HashMap<String, tokens::Issued>>,
    /// TokenReviews answered so far.
    token_reviews: std::sync::atomic::AtomicU64,
}

/// One kind of request a client made, in RBAC terms: who (the bearer token of its
/// kubeconfig, see [`super::FakeApiServer::kubeconfig_as`]), which verb on which resource, where.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ApiRequest {
    /// The bearer token, or "anonymous" without one.
    pub user: String,
    /// RBAC verb: get, list, watch, create, update, patch, delete, deletecollection.
    pub verb: String,
    /// API group ("" for the core group).
    pub group: String,
    /// Resource, with its subresource after a slash ("pods/binding"); for paths outside
    /// the resource API, the path itself ("/version").
    pub resource: String,
    /// Namespace; empty for cluster-scoped resources and requests across all namespaces.
    pub namespace: String,
}

/// A request the store refuses, as an HTTP status and a Kubernetes `Status` reason.
#[derive(Debug)]
pub struct ApiError {
    code: u16,
    reason: &'static str,
    message: String,
}

impl ApiError {
    /// A refusal with HTTP status `code` and Kubernetes reason `reason`.
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            code,
            reason,
            message: message.into(),
        }
    }

    /// The human-readable message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The HTTP status code.
    pub fn code(&self) -> u16 {
        self.code
    }

    /// The Kubernetes `Status` object a client gets for it.
    pub fn status(&self) -> Value {
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "message": self.message, "reason": self.reason, "code": self.code})
    }
}

fn cluster_scoped(resource: &str) -> bool {
    matches!(
        resource,
        "nodes" | "namespaces" | "persistentvolumes" | "clusterroles" | "priorityclasses"
    )
}

/// The `kind` of a resource's objects ("pods" → "Pod").
pub(crate) fn kind_of(resource: &str) -> String {
    match resource {
        "pods" => "Pod".into(),
        "nodes" => "Node".into(),
        "events" => "Event".into(),
        "leases" => "Lease".into(),
        "namespaces" => "Namespace".into(),
        "configmaps" => "ConfigMap".into(),
        "bindings" => "Binding".into(),
        "priorityclasses" => "PriorityClass".into(),
        "gpubudgets" => "GPUBudget".into(),
        "poddisruptionbudgets" => "PodDisruptionBudget".into(),
        "resourceclaimtemplates" => "ResourceClaimTemplate".into(),
        "resourceclaims" => "ResourceClaim".into(),
        other => {
            let s = other.strip_suffix('s').unwrap_or(other);
            let mut c = s.chars();
            c.next()
                .map(|f| f.to_uppercase().collect::<String>() + c.as_str())
                .unwrap_or_default()
        }
    }
}

/// Now, as Kubernetes timestamps are written (RFC 3339, whole seconds, UTC).
pub(crate) fn now_rfc3339() -> String {
    let ts = k8s_openapi::jiff::Timestamp::now();
    format!(
        "{}",
        ts.round(k8s_openapi::jiff::Unit::Second).unwrap_or(ts)
    )
}

impl Default for Store {
    fn default() -> Self {
        let (tx, _) = broadcast::channel(65_536);
        Store {
            inner: Mutex::new(Inner::default()),
            tx,
            requests: Mutex::default(),
            tokens: Mutex::default(),
            token_reviews: Default::default(),
        }
    }
}

impl Store {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn record(
        &self,
        inner: &mut Inner,
        kind: &'static str,
        key: Key,
        object: Value,
        old: Option<Value>,
    ) {
        let c = Change {
            rv: inner.rv,
            kind,
            key,
            object,
            old,
        };
        inner.history.push_back(c.clone());
        if inner.history.len() > HISTORY {
            inner.history.pop_front();
        }
        let _ = self.tx.send(Arc::new(c));
    }

    fn set_meta(inner: &mut Inner, key: &Key, obj: &mut Value) {
        inner.rv += 1;
        let kind = kind_of(&key.resource);
        let o = obj.as_object_mut().expect("objects are JSON objects");
        o.insert("apiVersion".into(), json!(key.gv));
        o.insert("kind".into(), json!(kind));
        let meta = o.entry("metadata").or_insert_with(|| json!({}));
        meta["name"] = json!(key.name);
        if !key.namespace.is_empty() {
            meta["namespace"] = json!(key.namespace);
        }
        meta["resourceVersion"] = json!(inner.rv.to_string());
    }

    /// Create an object (namespace empty for cluster-scoped resources).
    pub fn create(
        &self,
        gv: &str,
        resource: &str,
        namespace: &str,
        mut obj: Value,
    ) -> Result<Value, ApiError> {
        if !obj.is_object() {
            return Err(ApiError::new(
                400,
                "BadRequest",
                "the body is not a JSON object",
            ));
        }
        let mut inner = self.lock();
        let meta = obj
            .as_object_mut()
            .expect("checked above")
            .entry("metadata")
            .or_insert_with(|| json!({}));
        let mut name = meta
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        if name.is_empty() {
            let Some(prefix) = meta.get("generateName").and_then(Value::as_str) else {
                return Err(ApiError::new(
                    400,
                    "BadRequest",
                    "metadata.name is required",
                ));
            };
            name = format!("{prefix}{:05x}", inner.uid + 1);
        }
        let ns = if cluster_scoped(resource) {
            String::new()
        } else if namespace.is_empty() {
            meta.get("namespace")
                .and_then(Value::as_str)
                .unwrap_or("default")
                .to_string()
        } else {
            namespace.to_string()
        };
        let key = Key {
            gv: gv.into(),
            resource: resource.into(),
            namespace: ns,
            name,
        };
        if inner.objects.contains_key(&key) {
            return Err(ApiError::new(
                409,
                "AlreadyExists",
                format!("{resource} \"{}\" already exists", key.name),
            ));
        }
        inner.uid += 1;
        // A uid the client set is kept (a real server ignores it) so that recorded requests
        // naming a pod uid can be replayed against this server.
        if meta
            .get("uid")
            .and_then(Value::as_str)
            .is_none_or(str::is_empty)
        {
            let uid = format!(
                "{:08x}-fa4e-4a91-8000-{:012x}",
                rand::random::<u32>(),
                inner.uid
            );
            meta["uid"] = json!(uid);
        }
        meta["creationTimestamp"] = json!(now_rfc3339());
        if resource == "pods" {
            let spec = obj
                .as_object_mut()
                .expect("object")
                .entry("spec")
                .or_insert_with(|| json!({}));
            if spec.get("schedulerName").is_none() {
                spec["schedulerName"] = json!("default-scheduler");
            }
            let st = obj
                .as_object_mut()
                .expect("object")
                .entry("status")
                .or_insert_with(|| json!({}));
            if st.get("phase").is_none() {
                st["phase"] = json!("Pending");
            }
        }
        Self::set_meta(&mut inner, &key, &mut obj);
        inner.objects.insert(key.clone(), obj.clone());
        self.record(&mut inner, "ADDED", key, obj.clone(), None);
        Ok(obj)
    }

    fn key(gv: &str, resource: &str, namespace: &str, name: &str) -> Key {
        Key {
            gv: gv.into(),
            resource: resource.into(),
            namespace: if cluster_scoped(resource) {
                String::new()
            } else {
                namespace.into()
            },
            name: name.into(),
        }
    }

    /// Get one object.
    pub fn get(
        &self,
        gv: &str,
        resource: &str,
        namespace: &str,
        name: &str,
    ) -> Result<Value, ApiError> {
        self.lock()
            .objects
            .get(&Self::key(gv, resource, namespace, name))
            .cloned()
            .ok_or_else(|| {
                ApiError::new(404, "NotFound", format!("{resource} \"{name}\" not found"))
            })
    }

    /// Change one object with `f` (which may refuse), bumping its resourceVersion.
    pub fn update(
        &self,
        gv: &str,
        resource: &str,
        namespace: &str,
        name: &str,
        f: impl FnOnce(&mut Value) -> Result<(), ApiError>,
    ) -> Result<Value, ApiError> {
        let key = Self::key(gv, resource, namespace, name);
        let mut inner = self.lock();
        let old = inner.objects.get(&key).cloned().ok_or_else(|| {
            ApiError::new(404, "NotFound", format!("{resource} \"{name}\" not found"))
        })?;
        let mut obj = old.clone();
        f(&mut obj)?;
        // Identity fields are the server's.
        for k in ["uid", "creationTimestamp"] {
            if let Some(v) = old.pointer(&format!("/metadata/{k}")) {
                obj["metadata"][k] = v.clone();
            }
        }
        Self::set_meta(&mut inner, &key, &mut obj);
        inner.objects.insert(key.clone(), obj.clone());
        self.record(&mut inner, "MODIFIED", key, obj.clone(), Some(old));
        Ok(obj)
    }

    /// Delete one object.
    pub fn delete(
        &self,
        gv: &str,
        resource: &str,
        namespace: &str,
        name: &str,
    ) -> Result<Value, ApiError> {
        let key = Self::key(gv, resource, namespace, name);
        let mut inner = self.lock();
        let Some(mut obj) = inner.objects.remove(&key) else {
            return Err(ApiError::new(
                404,
                "NotFound",
                format!("{resource} \"{name}\" not found"),
            ));
        };
        inner.rv += 1;
        obj["metadata"]["resourceVersion"] = json!(inner.rv.to_string());
        self.record(&mut inner, "DELETED", key, obj.clone(), None);
        Ok(obj)
    }

    /// Bind a pod to a node, as `POST pods/{name}/binding` does.
    pub fn bind(&self, namespace: &str, name: &str, binding: &Value) -> Result<(), ApiError> {
        let node = binding
            .pointer("/target/name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| ApiError::new(400, "BadRequest", "binding has no target.name"))?
            .to_string();
        let want_uid = binding
            .pointer("/metadata/uid")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        self.update("v1", "pods", namespace, name, |pod| {
            let uid = pod.pointer("/metadata/uid").and_then(Value::as_str).unwrap_or("");
            if !want_uid.is_empty() && want_uid != uid {
                return Err(ApiError::new(
                    409,
                    "Conflict",
                    format!("Precondition failed: UID in precondition: {want_uid}, UID in object meta: {uid}"),
                ));
            }
            if let Some(n) = pod.pointer("/spec/nodeName").and_then(Value::as_str).filter(|n| !n.is_empty()) {
                return Err(ApiError::new(
                    409,
                    "Conflict",
                    format!("Operation cannot be fulfilled on pods/binding \"{name}\": pod {name} is already assigned to node \"{n}\""),
                ));
            }
            pod["spec"]["nodeName"] = json!(node);
            let cond = json!({"type": "PodScheduled", "status": "True", "lastProbeTime": null,
                              "lastTransitionTime": now_rfc3339()});
            let st = pod.as_object_mut().expect("object").entry("status").or_insert_with(|| json!({}));
            let conds = st.as_object_mut().expect("status is an object").entry("conditions").or_insert_with(|| json!([]));
            if let Some(a) = conds.as_array_mut() {
                a.retain(|c| c.get("type") != Some(&json!("PodScheduled")));
                a.push(cond);
            }
            Ok(())
        })?;
        Ok(())
    }

    /// Evict a pod, as `POST pods/{name}/eviction` (policy/v1) does: refused with 429 when a
    /// PodDisruptionBudget of its namespace that selects it allows no disruption (else one
    /// fewer is allowed), with 409 when the body's UID precondition names another pod; then
    /// the pod is deleted (as this server deletes: at once).
    pub fn evict(&self, namespace: &str, name: &str, eviction: &Value) -> Result<(), ApiError> {
        use kube::core::{Selector, SelectorExt};
        let pod = self.get("v1", "pods", namespace, name)?;
        let uid = pod
            .pointer("/metadata/uid")
            .and_then(Value::as_str)
            .unwrap_or("");
        if let Some(want) = eviction
            .pointer("/deleteOptions/preconditions/uid")
            .and_then(Value::as_str)
            .filter(|w| *w != uid)
        {
            return Err(ApiError::new(
                409,
                "Conflict",
                format!(
                    "Precondition failed: UID in precondition: {want}, UID in object meta: {uid}"
                ),
            ));
        }
        let labels: std::collections::BTreeMap<String, String> = pod
            .pointer("/metadata/labels")
            .and_then(|l| serde_json::from_value(l.clone()).ok())
            .unwrap_or_default();
        let scope = Scope {
            gv: "policy/v1".into(),
            resource: "poddisruptionbudgets".into(),
            namespace: namespace.into(),
        };
        let (_, pdbs) = self.list(&scope, &Filter::default());
        for b in pdbs {
            let Some(sel) = b
                .pointer("/spec/selector")
                .and_then(|s| {
                    serde_json::from_value::<
                        k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector,
                    >(s.clone())
                    .ok()
                })
                .and_then(|s| Selector::try_from(s).ok())
            else {
                continue;
            };
            if !sel.matches(&labels) {
                continue;
            }
            let pdb = b
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            let allowed = b
                .pointer("/status/disruptionsAllowed")
                .and_then(Value::as_i64)
                .unwrap_or(0);
            if allowed < 1 {
                return Err(ApiError::new(
                    429,
                    "TooManyRequests",
                    format!(
                        "Cannot evict pod as it would violate the pod's disruption budget. The disruption budget {pdb} needs 1 healthy pods and has 0 currently"
                    ),
                ));
            }
            self.update("policy/v1", "poddisruptionbudgets", namespace, &pdb, |o| {
                o["status"]["disruptionsAllowed"] = json!(allowed - 1);
                Ok(())
            })?;
        }
        self.delete("v1", "pods", namespace, name).map(|_| ())
    }

    /// The objects of `scope` that `f` matches, and the resourceVersion of the list.
    pub fn list(&self, scope: &Scope, f: &Filter) -> (u64, Vec<Value>) {
        let inner = self.lock();
        let items = inner
            .objects
            .iter()
            .filter(|(k, v)| scope.contains(k) && f.matches(v))
            .map(|(_, v)| v.clone())
            .collect();
        (inner.rv, items)
    }

    /// Start a watch of `scope` through `f` from resourceVersion `from`: 0 sends every
    /// current object as ADDED, a later one replays the history after it. 410 Expired when
    /// the history no longer reaches back to `from`.
    pub(crate) fn watch_from(
        &self,
        scope: &Scope,
        f: &Filter,
        from: u64,
    ) -> Result<WatchStart, ApiError> {
        // Subscribed under the lock: no change falls between the backlog and the live feed.
        let inner = self.lock();
        let rx = self.tx.subscribe();
        let mut first = Vec::new();
        if from == 0 {
            for (k, v) in &inner.objects {
                if scope.contains(k) && f.matches(v) {
                    first.push(("ADDED", v.clone()));
                }
            }
        } else {
            let oldest = inner.history.front().map_or(inner.rv + 1, |c| c.rv);
            if from + 1 < oldest {
                return Err(ApiError::new(
                    410,
                    "Expired",
                    format!("too old resource version: {from} ({})", oldest - 1),
                ));
            }
            for c in inner.history.iter().filter(|c| c.rv > from) {
                if let Some(kind) = c.seen_by(scope, f) {
                    first.push((kind, c.object.clone()));
                }
            }
        }
        Ok(WatchStart {
            first,
            rv: inner.rv,
            rx,
        })
    }

    /// Note a request in RBAC terms (see [`Store::requests`]).
    pub(crate) fn record_request(&self, r: ApiRequest) {
        self.requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(r);
    }

    /// Every distinct kind of request served so far (for RBAC checks).
    pub fn requests(&self) -> Vec<ApiRequest> {
        let r = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        r.iter().cloned().collect()
    }

    /// Current objects of a resource (all namespaces), for tests.
    pub fn objects(&self, gv: &str, resource: &str) -> Vec<Value> {
        let scope = Scope {
            gv: gv.into(),
            resource: resource.into(),
            namespace: String::new(),
        };
        self.list(&scope, &Filter::default()).1
    }
}

#[cfg(test)]
mod tests;
