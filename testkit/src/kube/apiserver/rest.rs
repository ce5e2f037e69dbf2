//! The REST routes: paths and verbs as kube-rs and kubectl send them, onto the store.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::watch::watch;
use crate::kube::store::{ApiError, ApiRequest, Filter, Scope, Store, kind_of};

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let code = StatusCode::from_u16(self.code()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (code, axum::Json(self.status())).into_response()
    }
}

/// Query parameters of a request (percent-decoded, `+` as space).
fn query(uri: &Uri) -> BTreeMap<String, String> {
    form_urlencoded::parse(uri.query().unwrap_or("").as_bytes())
        .into_owned()
        .collect()
}

/// Where a request points: a resource (in a namespace), maybe one object and a subresource.
struct Target {
    gv: String,
    resource: String,
    namespace: String,
    name: Option<String>,
    sub: Option<String>,
}

impl Target {
    fn scope(&self) -> Scope {
        Scope {
            gv: self.gv.clone(),
            resource: self.resource.clone(),
            namespace: self.namespace.clone(),
        }
    }
}

/// The target of a request path, or None outside `/api` and `/apis`.
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

/// Serve one request and note it in RBAC terms.
pub(super) async fn handle(
    store: Arc<Store>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mut r = rbac_request(&method, &uri, &headers);
    if let Some(user) = store.token_user(&r.user) {
        r.user = user;
    }
    let fault = store.fault(&r);
    store.record_request(r);
    if let Some(e) = fault {
        return e.into_response();
    }
    match route(store, method, uri, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// The first strategic-merge directive (`$patch`, `$retainKeys`…) anywhere in `patch`.
fn directive(patch: &Value) -> Option<String> {
    match patch {
        Value::Object(m) => m.iter().find_map(|(k, v)| {
            if k.starts_with('$') {
                Some(k.clone())
            } else {
                directive(v)
            }
        }),
        Value::Array(a) => a.iter().find_map(directive),
        _ => None,
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
            let f = Filter::parse(
                q.get("fieldSelector").map_or("", String::as_str),
                q.get("labelSelector").map_or("", String::as_str),
            );
            if matches!(q.get("watch").map(String::as_str), Some("true" | "1")) {
                return Ok(watch(store, t.scope(), f, &q));
            }
            let (rv, items) = store.list(&t.scope(), &f);
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
        (&Method::POST, Some(account), Some("token")) if t.resource == "serviceaccounts" => {
            let answer = store.token_request(&t.namespace, account, &body_json(&body)?)?;
            Ok((StatusCode::CREATED, axum::Json(answer)).into_response())
        }
        (&Method::POST, None, None)
            if t.gv == "authentication.k8s.io/v1" && t.resource == "tokenreviews" =>
        {
            let mut review = body_json(&body)?;
            let token = review
                .pointer("/spec/token")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
            let audiences: Vec<String> = review
                .pointer("/spec/audiences")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default();
            review["status"] = store.review_token(&token, &audiences);
            review["apiVersion"] = json!("authentication.k8s.io/v1");
            review["kind"] = json!("TokenReview");
            Ok((StatusCode::CREATED, axum::Json(review)).into_response())
        }
        (&Method::POST, None, None) => {
            let obj = store.create(&t.gv, &t.resource, &t.namespace, body_json(&body)?)?;
            Ok((StatusCode::CREATED, axum::Json(obj)).into_response())
        }
        (&Method::POST, Some(name), Some("binding")) if t.resource == "pods" => {
            store.bind(&t.namespace, name, &body_json(&body)?)?;
            Ok((StatusCode::CREATED, axum::Json(json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}))).into_response())
        }
        (&Method::POST, Some(name), Some("eviction")) if t.resource == "pods" => {
            store.evict(&t.namespace, name, &body_json(&body)?)?;
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
            if ct.starts_with("application/strategic-merge-patch+json")
                && let Some(d) = directive(&p)
            {
                return Err(ApiError::new(
                    415,
                    "UnsupportedMediaType",
                    format!(
                        "strategic-merge directive {d:?} is not supported by the fake API server"
                    ),
                ));
            }
            let status_only = t.sub.is_some();
            Ok(ok(store.update(
                &t.gv,
                &t.resource,
                &t.namespace,
                name,
                |obj| {
                    // A resourceVersion in the patch is a precondition, as on a real server.
                    let want = p.pointer("/metadata/resourceVersion").and_then(Value::as_str).unwrap_or("");
                    let have = obj.pointer("/metadata/resourceVersion").and_then(Value::as_str).unwrap_or("");
                    if !want.is_empty() && want != have {
                        return Err(ApiError::new(409, "Conflict", format!(
                            "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again", t.resource)));
                    }
                    let mut patched = obj.clone();
                    json_patch::merge(&mut patched, &p);
                    if status_only {
                        obj["status"] = patched.get("status").cloned().unwrap_or(Value::Null);
                    } else {
                        *obj = patched;
                    }
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
            r(Method::POST, "/api/v1/namespaces/ns/pods/p/eviction", &h),
            (s("alice"), s("create"), s(""), s("pods/eviction"), s("ns"))
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
    fn strategic_merge_directives_are_found_at_any_depth() {
        assert_eq!(directive(&json!({"a": {"b": [1, 2]}})), None);
        let p = json!({"spec": {"containers": [{"name": "c", "$patch": "delete"}]}});
        assert_eq!(directive(&p).as_deref(), Some("$patch"));
        let p = json!({"metadata": {"$setElementOrder/finalizers": []}});
        assert!(directive(&p).is_some_and(|d| d.starts_with("$setElementOrder")));
    }

    #[test]
    fn queries_and_paths() {
        let q = query(
            &"/api/v1/pods?fieldSelector=spec.nodeName%3Dn1%2Cspec.schedulerName%21%3D&watch=1&x=a+b"
                .parse()
                .expect("uri"),
        );
        assert_eq!(
            q.get("fieldSelector").map(String::as_str),
            Some("spec.nodeName=n1,spec.schedulerName!=")
        );
        assert_eq!(q.get("x").map(String::as_str), Some("a b"));
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
