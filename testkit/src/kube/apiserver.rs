//! The fake kube-apiserver: an in-memory object store with a global resourceVersion, an event
//! history for watches, and the REST routes kube-rs uses.

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::sync::broadcast;

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

#[derive(Debug, Clone)]
struct Change {
    rv: u64,
    kind: &'static str,
    key: Key,
    object: Value,
    old: Option<Value>,
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
    requests: Mutex<std::collections::BTreeSet<ApiRequest>>,
}

/// One kind of request a client made, in RBAC terms: who (the bearer token of its
/// kubeconfig, see [`FakeApiServer::kubeconfig_as`]), which verb on which resource, where.
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

    fn status(&self) -> Value {
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "message": self.message, "reason": self.reason, "code": self.code})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let code = StatusCode::from_u16(self.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (code, axum::Json(self.status())).into_response()
    }
}

fn cluster_scoped(resource: &str) -> bool {
    matches!(
        resource,
        "nodes" | "namespaces" | "persistentvolumes" | "clusterroles" | "priorityclasses"
    )
}

fn kind_of(resource: &str) -> String {
    match resource {
        "pods" => "Pod".into(),
        "nodes" => "Node".into(),
        "events" => "Event".into(),
        "leases" => "Lease".into(),
        "namespaces" => "Namespace".into(),
        "configmaps" => "ConfigMap".into(),
        "bindings" => "Binding".into(),
        other => {
            let s = other.strip_suffix('s').unwrap_or(other);
            let mut c = s.chars();
            c.next()
                .map(|f| f.to_uppercase().collect::<String>() + c.as_str())
                .unwrap_or_default()
        }
    }
}

/// RFC 7386 JSON merge patch.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    if let Value::Object(p) = patch {
        if !target.is_object() {
            *target = json!({});
        }
        let t = target.as_object_mut().expect("made an object above");
        for (k, v) in p {
            if v.is_null() {
                t.remove(k);
            } else {
                merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
    } else {
        *target = patch.clone();
    }
}

fn now_rfc3339() -> String {
    let ts = k8s_openapi::jiff::Timestamp::now();
    format!(
        "{}",
        ts.round(k8s_openapi::jiff::Unit::Second).unwrap_or(ts)
    )
}

/// One term of a field or label selector.
#[derive(Debug, Clone)]
enum Term {
    Eq(String, String),
    Ne(String, String),
    Exists(String),
    NotExists(String),
}

fn parse_selector(s: &str) -> Vec<Term> {
    s.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            if let Some((k, v)) = t.split_once("!=") {
                Term::Ne(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = t.split_once("==") {
                Term::Eq(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = t.split_once('=') {
                Term::Eq(k.trim().into(), v.trim().into())
            } else if let Some(k) = t.strip_prefix('!') {
                Term::NotExists(k.trim().into())
            } else {
                Term::Exists(t.into())
            }
        })
        .collect()
}

fn field_value(obj: &Value, path: &str) -> String {
    let ptr = format!("/{}", path.replace('.', "/"));
    match obj.pointer(&ptr) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => String::new(),
        Some(v) => v.to_string(),
    }
}

fn label_value(obj: &Value, k: &str) -> Option<String> {
    obj.get("metadata")?
        .get("labels")?
        .get(k)?
        .as_str()
        .map(String::from)
}

#[derive(Debug, Clone, Default)]
struct Filter {
    fields: Vec<Term>,
    labels: Vec<Term>,
}

impl Filter {
    fn matches(&self, obj: &Value) -> bool {
        self.fields.iter().all(|t| match t {
            Term::Eq(k, v) => field_value(obj, k) == *v,
            Term::Ne(k, v) => field_value(obj, k) != *v,
            Term::Exists(_) | Term::NotExists(_) => true,
        }) && self.labels.iter().all(|t| match t {
            Term::Eq(k, v) => label_value(obj, k).as_deref() == Some(v),
            Term::Ne(k, v) => label_value(obj, k).as_deref() != Some(v),
            Term::Exists(k) => label_value(obj, k).is_some(),
            Term::NotExists(k) => label_value(obj, k).is_none(),
        })
    }
}

impl Default for Store {
    fn default() -> Self {
        let (tx, _) = broadcast::channel(65_536);
        Store {
            inner: Mutex::new(Inner::default()),
            tx,
            requests: Mutex::default(),
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

    fn list(&self, gv: &str, resource: &str, namespace: &str, f: &Filter) -> (u64, Vec<Value>) {
        let inner = self.lock();
        let items = inner
            .objects
            .iter()
            .filter(|(k, _)| {
                k.gv == gv
                    && k.resource == resource
                    && (namespace.is_empty() || k.namespace == namespace)
            })
            .map(|(_, v)| v)
            .filter(|v| f.matches(v))
            .cloned()
            .collect();
        (inner.rv, items)
    }

    /// Every distinct kind of request served so far (for RBAC checks).
    pub fn requests(&self) -> Vec<ApiRequest> {
        let r = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        r.iter().cloned().collect()
    }

    /// Current objects of a resource (all namespaces), for tests.
    pub fn objects(&self, gv: &str, resource: &str) -> Vec<Value> {
        self.list(gv, resource, "", &Filter::default()).1
    }
}

/// Query parameters of a request.
fn query(uri: &Uri) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for kv in uri
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|s| !s.is_empty())
    {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        out.insert(decode(k), decode(v));
    }
    out
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(x) => {
                        out.push(x);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

struct Target {
    gv: String,
    resource: String,
    namespace: String,
    name: Option<String>,
    sub: Option<String>,
}

fn target(path: &str) -> Option<Target> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (gv, rest) = match *segs.first()? {
        "api" => (segs.get(1)?.to_string(), &segs[2..]),
        "apis" => (format!("{}/{}", segs.get(1)?, segs.get(2)?), &segs[3..]),
        _ => return None,
    };
    let (namespace, rest) = if rest.first() == Some(&"namespaces") && rest.len() >= 3 {
        (rest[1].to_string(), &rest[2..])
    } else {
        (String::new(), rest)
    };
    Some(Target {
        gv,
        resource: rest.first()?.to_string(),
        namespace,
        name: rest.get(1).map(|s| s.to_string()),
        sub: rest.get(2).map(|s| s.to_string()),
    })
}

/// The request in RBAC terms.
fn rbac_request(method: &Method, uri: &Uri, headers: &HeaderMap) -> ApiRequest {
    let user = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("anonymous")
        .to_string();
    let watch = matches!(
        query(uri).get("watch").map(String::as_str),
        Some("true" | "1")
    );
    let Some(t) = target(uri.path()) else {
        return ApiRequest {
            user,
            verb: method.as_str().to_ascii_lowercase(),
            group: String::new(),
            resource: uri.path().to_string(),
            namespace: String::new(),
        };
    };
    let verb = match (method, t.name.is_some()) {
        (&Method::GET, true) => "get",
        (&Method::GET, false) if watch => "watch",
        (&Method::GET, false) => "list",
        (&Method::POST, _) => "create",
        (&Method::PUT, _) => "update",
        (&Method::PATCH, _) => "patch",
        (&Method::DELETE, true) => "delete",
        (&Method::DELETE, false) => "deletecollection",
        (m, _) => m.as_str(),
    };
    let group = t.gv.rsplit_once('/').map_or("", |(g, _)| g).to_string();
    let resource = match &t.sub {
        Some(sub) => format!("{}/{sub}", t.resource),
        None => t.resource.clone(),
    };
    ApiRequest {
        user,
        verb: verb.to_string(),
        group,
        resource,
        namespace: t.namespace,
    }
}

async fn handle(
    store: Arc<Store>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let r = rbac_request(&method, &uri, &headers);
    store
        .requests
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(r);
    match route(store, method, uri, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

fn body_json(body: &Bytes) -> Result<Value, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::new(400, "BadRequest", format!("invalid JSON body: {e}")))
}

async fn route(
    store: Arc<Store>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let path = uri.path();
    if path == "/version" {
        return Ok(
            axum::Json(json!({"major": "1", "minor": "33", "gitVersion": "v1.33.0-fake"}))
                .into_response(),
        );
    }
    if path == "/healthz" || path == "/readyz" {
        return Ok("ok".into_response());
    }
    let t =
        target(path).ok_or_else(|| ApiError::new(404, "NotFound", format!("no route {path}")))?;
    let q = query(&uri);
    let ok = |v: Value| axum::Json(v).into_response();
    match (&method, t.name.as_deref(), t.sub.as_deref()) {
        (&Method::GET, None, None) => {
            let f = Filter {
                fields: parse_selector(q.get("fieldSelector").map_or("", String::as_str)),
                labels: parse_selector(q.get("labelSelector").map_or("", String::as_str)),
            };
            if matches!(q.get("watch").map(String::as_str), Some("true" | "1")) {
                return Ok(watch(store, t, f, &q));
            }
            let (rv, items) = store.list(&t.gv, &t.resource, &t.namespace, &f);
            Ok(ok(json!({
                "apiVersion": t.gv,
                "kind": format!("{}List", kind_of(&t.resource)),
                "metadata": {"resourceVersion": rv.to_string()},
                "items": items,
            })))
        }
        (&Method::GET, Some(name), None | Some("status")) => {
            Ok(ok(store.get(&t.gv, &t.resource, &t.namespace, name)?))
        }
        (&Method::POST, None, None) if t.resource == "bindings" => {
            let b = body_json(&body)?;
            let name = b
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            store.bind(&t.namespace, &name, &b)?;
            Ok((StatusCode::CREATED, axum::Json(json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}))).into_response())
        }
        (&Method::POST, None, None) => {
            let obj = store.create(&t.gv, &t.resource, &t.namespace, body_json(&body)?)?;
            Ok((StatusCode::CREATED, axum::Json(obj)).into_response())
        }
        (&Method::POST, Some(name), Some("binding")) if t.resource == "pods" => {
            store.bind(&t.namespace, name, &body_json(&body)?)?;
            Ok((StatusCode::CREATED, axum::Json(json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}))).into_response())
        }
        (&Method::PUT, Some(name), None | Some("status")) => {
            let new = body_json(&body)?;
            let status_only = t.sub.is_some();
            Ok(ok(store.update(&t.gv, &t.resource, &t.namespace, name, |obj| {
                let want = new.pointer("/metadata/resourceVersion").and_then(Value::as_str).unwrap_or("");
                let have = obj.pointer("/metadata/resourceVersion").and_then(Value::as_str).unwrap_or("");
                if !want.is_empty() && want != have {
                    return Err(ApiError::new(409, "Conflict", format!(
                        "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again", t.resource)));
                }
                if status_only {
                    obj["status"] = new.get("status").cloned().unwrap_or(Value::Null);
                } else {
                    *obj = new.clone();
                }
                Ok(())
            })?))
        }
        (&Method::PATCH, Some(name), None | Some("status")) => {
            let ct = headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            if !(ct.starts_with("application/merge-patch+json")
                || ct.starts_with("application/strategic-merge-patch+json"))
            {
                return Err(ApiError::new(
                    415,
                    "UnsupportedMediaType",
                    format!("patch type {ct:?} is not supported by the fake API server"),
                ));
            }
            let p = body_json(&body)?;
            Ok(ok(store.update(
                &t.gv,
                &t.resource,
                &t.namespace,
                name,
                |obj| {
                    merge_patch(obj, &p);
                    Ok(())
                },
            )?))
        }
        (&Method::DELETE, Some(name), None) => {
            Ok(ok(store.delete(&t.gv, &t.resource, &t.namespace, name)?))
        }
        _ => Err(ApiError::new(
            405,
            "MethodNotAllowed",
            format!("{method} {path} is not supported by the fake API server"),
        )),
    }
}

fn event_line(kind: &str, obj: &Value) -> Bytes {
    let mut v =
        serde_json::to_vec(&json!({"type": kind, "object": obj})).expect("JSON values serialize");
    v.push(b'\n');
    Bytes::from(v)
}

/// How a change looks through a selector: ADDED/MODIFIED/DELETED, or nothing.
fn through(c: &Change, f: &Filter) -> Option<&'static str> {
    let now = f.matches(&c.object);
    let before = c.old.as_ref().map(|o| f.matches(o));
    match (c.kind, before, now) {
        ("MODIFIED", Some(true), true) => Some("MODIFIED"),
        ("MODIFIED", Some(false), true) => Some("ADDED"),
        ("MODIFIED", Some(true), false) => Some("DELETED"),
        ("MODIFIED", _, _) => None,
        (k, _, true) => Some(k),
        _ => None,
    }
}

fn watch(store: Arc<Store>, t: Target, f: Filter, q: &BTreeMap<String, String>) -> Response {
    let mut rx = store.tx.subscribe();
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|s| s.parse().ok())
        .map_or(Duration::from_secs(1800), Duration::from_secs);
    let relevant = move |k: &Key| {
        k.gv == t.gv
            && k.resource == t.resource
            && (t.namespace.is_empty() || k.namespace == t.namespace)
    };
    let mut first: Vec<Bytes> = Vec::new();
    let mut last;
    {
        let inner = store.lock();
        last = inner.rv;
        if from == 0 {
            for (k, v) in &inner.objects {
                if relevant(k) && f.matches(v) {
                    first.push(event_line("ADDED", v));
                }
            }
        } else {
            let oldest = inner.history.front().map_or(inner.rv + 1, |c| c.rv);
            if from + 1 < oldest {
                let e = ApiError::new(
                    410,
                    "Expired",
                    format!("too old resource version: {from} ({})", oldest - 1),
                );
                first.push(event_line("ERROR", &e.status()));
                let s = futures::stream::iter(first.into_iter().map(Ok::<_, Infallible>));
                return Response::new(Body::from_stream(s));
            }
            for c in inner.history.iter().filter(|c| c.rv > from) {
                if relevant(&c.key)
                    && let Some(kind) = through(c, &f)
                {
                    first.push(event_line(kind, &c.object));
                }
            }
        }
    }
    let deadline = tokio::time::Instant::now() + timeout;
    let live = async_stream(move |tx| async move {
        for b in first {
            if tx.send(b).await.is_err() {
                return;
            }
        }
        loop {
            let c = tokio::select! {
                r = rx.recv() => r,
                _ = tokio::time::sleep_until(deadline) => return,
            };
            match c {
                Ok(c) => {
                    if c.rv <= last {
                        continue;
                    }
                    last = c.rv;
                    if relevant(&c.key)
                        && let Some(kind) = through(&c, &f)
                        && tx.send(event_line(kind, &c.object)).await.is_err()
                    {
                        return;
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    let e = ApiError::new(410, "Expired", "watch fell behind; relist");
                    let _ = tx.send(event_line("ERROR", &e.status())).await;
                    return;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            }
        }
    });
    let mut r = Response::new(Body::from_stream(live.map(Ok::<_, Infallible>)));
    r.headers_mut().insert(
        "content-type",
        "application/json".parse().expect("static header"),
    );
    r
}

/// A stream fed by a task through a channel.
fn async_stream<F, Fut>(f: F) -> impl futures::Stream<Item = Bytes>
where
    F: FnOnce(tokio::sync::mpsc::Sender<Bytes>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(256);
    tokio::spawn(f(tx));
    tokio_stream_from(rx)
}

fn tokio_stream_from(
    mut rx: tokio::sync::mpsc::Receiver<Bytes>,
) -> impl futures::Stream<Item = Bytes> {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

/// A running fake API server on 127.0.0.1 with a kubeconfig file that points at it.
pub struct FakeApiServer {
    /// The object store (tests may read and change it directly).
    pub store: Arc<Store>,
    url: String,
    kubeconfig: PathBuf,
    dir: PathBuf,
    task: tokio::task::JoinHandle<()>,
}

impl FakeApiServer {
    /// Start on a free loopback port; write `<dir>/kubeconfig`.
    pub async fn start(dir: &Path) -> Result<FakeApiServer> {
        let store = Arc::new(Store::default());
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the fake API server")?;
        let url = format!("http://{}", l.local_addr()?);
        let s = store.clone();
        let app = Router::new()
            .merge(super::portforward::routes(store.clone()))
            .fallback(
                move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
                    let s = s.clone();
                    async move { handle(s, method, uri, headers, body).await }
                },
            );
        let l = axum::serve::ListenerExt::tap_io(l, |tcp: &mut tokio::net::TcpStream| {
            let _ = tcp.set_nodelay(true);
        });
        let task = tokio::spawn(async move {
            let _ = axum::serve(l, app).await;
        });
        std::fs::create_dir_all(dir)?;
        let kubeconfig = dir.join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {url}\n\
                 contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\n\
                 current-context: fake\nusers:\n- name: fake\n  user: {{}}\n"
            ),
        )?;
        Ok(FakeApiServer {
            store,
            url,
            kubeconfig,
            dir: dir.to_path_buf(),
            task,
        })
    }

    /// The server URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Path of the kubeconfig file that reaches this server.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// Write a kubeconfig whose requests carry `user` as their bearer token, so that
    /// [`Store::requests`] tells this client's requests apart (one per component, e.g.
    /// `system:serviceaccount:gpuledger-system:gpuledger-extender`).
    pub fn kubeconfig_as(&self, user: &str) -> Result<PathBuf> {
        let file: String = user
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let path = self.dir.join(format!("kubeconfig-{file}"));
        let token = serde_json::to_string(user)?;
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
                 contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: u\n    namespace: default\n\
                 current-context: fake\nusers:\n- name: u\n  user:\n    token: {token}\n",
                self.url
            ),
        )?;
        Ok(path)
    }

    /// A kube-rs client through the kubeconfig, as a component would build it.
    pub async fn client(&self) -> Result<kube::Client> {
        let kc = kube::config::Kubeconfig::read_from(&self.kubeconfig)?;
        let cfg =
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await?;
        Ok(kube::Client::try_from(cfg)?)
    }

    /// Add a ready node advertising `gpuledger.io/gpu` slots.
    pub fn add_node(&self, name: &str, gpu_slots: u32) -> Result<Value> {
        self.store
            .create("v1", "nodes", "", json!({
                "metadata": {"name": name, "labels": {"gpuledger.io/enabled": "true"}},
                "status": {
                    "capacity": {"cpu": "64", "memory": "512Gi", "pods": "110", "gpuledger.io/gpu": gpu_slots.to_string()},
                    "allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110", "gpuledger.io/gpu": gpu_slots.to_string()},
                    "conditions": [{"type": "Ready", "status": "True"}],
                },
            }))
            .map_err(|e| anyhow::anyhow!("{}", e.message))
    }

    /// Create a pod from its JSON (server fields such as uid are set here).
    pub fn add_pod(&self, pod: Value) -> Result<Value> {
        let ns = pod
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .unwrap_or("default")
            .to_string();
        self.store
            .create("v1", "pods", &ns, pod)
            .map_err(|e| anyhow::anyhow!("{}", e.message))
    }

    /// Get a pod.
    pub fn pod(&self, ns: &str, name: &str) -> Option<Value> {
        self.store.get("v1", "pods", ns, name).ok()
    }

    /// Delete a pod.
    pub fn delete_pod(&self, ns: &str, name: &str) -> Result<()> {
        self.store
            .delete("v1", "pods", ns, name)
            .map(|_| ())
            .map_err(|e| anyhow::anyhow!("{}", e.message))
    }

    /// Delete a node.
    pub fn delete_node(&self, name: &str) -> Result<()> {
        self.store
            .delete("v1", "nodes", "", name)
            .map(|_| ())
            .map_err(|e| anyhow::anyhow!("{}", e.message))
    }

    /// Set a pod's phase (as the kubelet would).
    pub fn set_pod_phase(&self, ns: &str, name: &str, phase: &str) -> Result<()> {
        self.store
            .update("v1", "pods", ns, name, |p| {
                p["status"]["phase"] = json!(phase);
                Ok(())
            })
            .map(|_| ())
            .map_err(|e| anyhow::anyhow!("{}", e.message))
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_in_rbac_terms() {
        let mut h = HeaderMap::new();
        h.insert("authorization", "Bearer alice".parse().expect("header"));
        let r = |m: Method, u: &str, h: &HeaderMap| {
            let x = rbac_request(&m, &u.parse().expect("uri"), h);
            (x.user, x.verb, x.group, x.resource, x.namespace)
        };
        let s = |v: &str| v.to_string();
        assert_eq!(
            r(Method::GET, "/api/v1/pods?watch=true&resourceVersion=3", &h),
            (s("alice"), s("watch"), s(""), s("pods"), s(""))
        );
        assert_eq!(
            r(Method::GET, "/api/v1/nodes", &HeaderMap::new()),
            (s("anonymous"), s("list"), s(""), s("nodes"), s(""))
        );
        assert_eq!(
            r(Method::POST, "/api/v1/namespaces/ns/pods/p/binding", &h).3,
            "pods/binding"
        );
        assert_eq!(
            r(
                Method::PATCH,
                "/apis/events.k8s.io/v1/namespaces/ns/events/e",
                &h
            ),
            (
                s("alice"),
                s("patch"),
                s("events.k8s.io"),
                s("events"),
                s("ns")
            )
        );
        assert_eq!(r(Method::GET, "/version", &h).3, "/version");
    }

    #[test]
    fn merge_patch_follows_rfc7386() {
        let mut t = json!({"a": "b", "c": {"d": "e", "f": "g"}});
        merge_patch(&mut t, &json!({"a": "z", "c": {"f": null}}));
        assert_eq!(t, json!({"a": "z", "c": {"d": "e"}}));
    }

    #[test]
    fn selectors_and_paths() {
        let pod = json!({"metadata": {"name": "p", "labels": {"app": "x"}}, "spec": {"schedulerName": "s"}});
        let f = Filter {
            fields: parse_selector("spec.schedulerName=s,spec.nodeName="),
            labels: parse_selector("app=x"),
        };
        assert!(f.matches(&pod));
        let g = Filter {
            fields: parse_selector("spec.nodeName!="),
            labels: vec![],
        };
        assert!(!g.matches(&pod));
        assert_eq!(
            decode("spec.nodeName%3Dn1%2Cspec.schedulerName%21%3D"),
            "spec.nodeName=n1,spec.schedulerName!="
        );
        let t = target("/api/v1/namespaces/default/pods/p/binding").expect("route");
        assert_eq!(
            (t.gv.as_str(), t.resource.as_str(), t.namespace.as_str()),
            ("v1", "pods", "default")
        );
        assert_eq!(
            (t.name.as_deref(), t.sub.as_deref()),
            (Some("p"), Some("binding"))
        );
        let t =
            target("/apis/coordination.k8s.io/v1/namespaces/kube-system/leases").expect("route");
        assert_eq!(t.gv, "coordination.k8s.io/v1");
        let t = target("/api/v1/nodes/n1").expect("route");
        assert_eq!(
            (t.resource.as_str(), t.name.as_deref()),
            ("nodes", Some("n1"))
        );
    }
}
