//! ServiceAccount tokens as a real API server hands them out (TokenRequest) and checks them
//! (TokenReview): JWT-shaped, with audiences, an expiry and, for a bound token, the pod it
//! belongs to — a token stops authenticating once its pod is gone or replaced.

use base64::Engine;
use rand::RngCore;
use serde_json::{Value, json};

use super::{ApiError, Store};

/// What the store remembers of a token it issued.
#[derive(Debug, Clone)]
pub(crate) struct Issued {
    namespace: String,
    account: String,
    audiences: Vec<String>,
    exp_unix: u64,
    /// (name, uid) of the pod a bound token belongs to.
    pod: Option<(String, String)>,
}

/// The audiences the API server accepts for a review that names none (its own).
const API_SERVER_AUDIENCE: &str = "https://kubernetes.default.svc";

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn b64(v: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v)
}

impl Store {
    /// Issue a token for ServiceAccount `namespace/account`, valid for `audiences` during
    /// `ttl_s` seconds, bound to `pod` (name, uid) when given.
    pub fn issue_token(
        &self,
        namespace: &str,
        account: &str,
        audiences: &[&str],
        ttl_s: u64,
        pod: Option<&(String, String)>,
    ) -> Result<String, ApiError> {
        let now = now_unix();
        let exp = now + ttl_s;
        let mut claims = json!({
            "iss": API_SERVER_AUDIENCE,
            "aud": audiences,
            "exp": exp,
            "iat": now,
            "nbf": now,
            "sub": format!("system:serviceaccount:{namespace}:{account}"),
            "kubernetes.io": {"namespace": namespace, "serviceaccount": {"name": account}},
        });
        if let Some((name, uid)) = pod {
            claims["kubernetes.io"]["pod"] = json!({"name": name, "uid": uid});
        }
        let mut sig = [0u8; 32];
        rand::rng().fill_bytes(&mut sig);
        let token = format!(
            "{}.{}.{}",
            b64(br#"{"alg":"RS256","kid":"fake"}"#),
            b64(claims.to_string().as_bytes()),
            b64(&sig)
        );
        self.tokens
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                token.clone(),
                Issued {
                    namespace: namespace.into(),
                    account: account.into(),
                    audiences: audiences.iter().map(|a| a.to_string()).collect(),
                    exp_unix: exp,
                    pod: pod.cloned(),
                },
            );
        Ok(token)
    }

    /// The ServiceAccount user name a token stands for (None: not a token issued here).
    pub fn token_user(&self, token: &str) -> Option<String> {
        let t = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
        t.get(token)
            .map(|i| format!("system:serviceaccount:{}:{}", i.namespace, i.account))
    }

    /// TokenReviews answered so far.
    pub fn token_reviews(&self) -> u64 {
        self.token_reviews
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// What a TokenReview of `token` for `audiences` answers: its `status`.
    pub fn review_token(&self, token: &str, audiences: &[String]) -> Value {
        self.token_reviews
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let refused = |why: String| json!({"authenticated": false, "user": {}, "error": why});
        let issued = self
            .tokens
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(token)
            .cloned();
        let Some(i) = issued else {
            return refused("[invalid bearer token, token not issued by this API server]".into());
        };
        if i.exp_unix <= now_unix() {
            return refused("[invalid bearer token, token is expired (exp)]".into());
        }
        let wanted: Vec<String> = if audiences.is_empty() {
            vec![API_SERVER_AUDIENCE.to_string()]
        } else {
            audiences.to_vec()
        };
        let both: Vec<&String> = wanted.iter().filter(|a| i.audiences.contains(a)).collect();
        if both.is_empty() {
            return refused(format!(
                "[invalid bearer token, token audiences {:?} is invalid for the target audiences {:?}]",
                i.audiences, wanted
            ));
        }
        let mut user = json!({
            "username": format!("system:serviceaccount:{}:{}", i.namespace, i.account),
            "groups": ["system:serviceaccounts", format!("system:serviceaccounts:{}", i.namespace), "system:authenticated"],
        });
        if let Some((name, uid)) = &i.pod {
            let live = self
                .get("v1", "pods", &i.namespace, name)
                .ok()
                .and_then(|p| {
                    p.pointer("/metadata/uid")
                        .and_then(Value::as_str)
                        .map(String::from)
                });
            if live.as_deref() != Some(uid.as_str()) {
                return refused(format!(
                    "[invalid bearer token, pod {}/{name} (uid {uid}) the token is bound to does not exist]",
                    i.namespace
                ));
            }
            user["extra"] = json!({
                "authentication.kubernetes.io/pod-name": [name],
                "authentication.kubernetes.io/pod-uid": [uid],
            });
        }
        json!({"authenticated": true, "user": user, "audiences": both})
    }

    /// The node agent's pod on `node` in `namespace` (created, running and scheduled there,
    /// when missing), as (name, uid): what a node agent's bound token names.
    pub fn node_agent_pod(&self, namespace: &str, node: &str) -> anyhow::Result<(String, String)> {
        let name = format!("gpuledger-node-agent-{node}");
        let pod = match self.get("v1", "pods", namespace, &name) {
            Ok(p) => p,
            Err(_) => self
                .create(
                    "v1",
                    "pods",
                    namespace,
                    json!({
                        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "gpuledger-node-agent"}},
                        "spec": {"nodeName": node, "serviceAccountName": "gpuledger-node-agent",
                                 "schedulerName": "default-scheduler",
                                 "containers": [{"name": "agent", "image": "gpuledger"}]},
                        "status": {"phase": "Running"},
                    }),
                )
                .map_err(|e| anyhow::anyhow!("{}", e.message()))?,
        };
        let uid = pod
            .pointer("/metadata/uid")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        Ok((name, uid))
    }

    /// Answer a TokenRequest body for ServiceAccount `namespace/account`.
    pub(crate) fn token_request(
        &self,
        namespace: &str,
        account: &str,
        body: &Value,
    ) -> Result<Value, ApiError> {
        if self
            .get("v1", "serviceaccounts", namespace, account)
            .is_err()
        {
            return Err(ApiError::new(
                404,
                "NotFound",
                format!("serviceaccounts \"{account}\" not found"),
            ));
        }
        let spec = body.get("spec").cloned().unwrap_or(json!({}));
        let audiences: Vec<String> = spec
            .get("audiences")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(String::from))
                    .collect()
            })
            .filter(|a: &Vec<String>| !a.is_empty())
            .unwrap_or_else(|| vec![API_SERVER_AUDIENCE.to_string()]);
        let ttl = spec
            .get("expirationSeconds")
            .and_then(Value::as_u64)
            .unwrap_or(3600)
            .max(600);
        let pod = match spec.get("boundObjectRef") {
            Some(r) if r.get("kind").and_then(Value::as_str) == Some("Pod") => {
                let name = r.get("name").and_then(Value::as_str).unwrap_or_default();
                let uid = r.get("uid").and_then(Value::as_str).unwrap_or_default();
                Some((name.to_string(), uid.to_string()))
            }
            _ => None,
        };
        let refs: Vec<&str> = audiences.iter().map(String::as_str).collect();
        let token = self.issue_token(namespace, account, &refs, ttl, pod.as_ref())?;
        let exp = k8s_openapi::jiff::Timestamp::now()
            + k8s_openapi::jiff::SignedDuration::from_secs(ttl as i64);
        Ok(json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "metadata": {"name": account, "namespace": namespace},
            "spec": spec,
            "status": {"token": token, "expirationTimestamp": format!("{}", exp.round(k8s_openapi::jiff::Unit::Second).unwrap_or(exp))},
        }))
    }
}
