//! Talking to an extender the way kube-scheduler does: its `extenders[]` configuration, the
//! HTTP calls with their JSON, and the answers decoded as kube-scheduler decodes them.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::{Value, json};

/// `enableHTTPS` + `tlsConfig` of an `extenders[]` entry: the CA that signed the extender's
/// certificate, and the scheduler's client certificate the extender demands.
#[derive(Debug, Clone)]
pub struct ExtenderTls {
    /// `caFile`.
    pub ca: std::path::PathBuf,
    /// `certFile`.
    pub cert: std::path::PathBuf,
    /// `keyFile`.
    pub key: std::path::PathBuf,
}

/// The `extenders[]` entry of a KubeSchedulerConfiguration.
#[derive(Debug, Clone)]
pub struct ExtenderConfig {
    /// e.g. `https://127.0.0.1:28888/gpuledger`.
    pub url_prefix: String,
    /// `enableHTTPS` with its `tlsConfig` (None: plain HTTP, which gpuledger's extender refuses).
    pub tls: Option<ExtenderTls>,
    /// Send `NodeNames` (true) or full `Nodes` (false).
    pub node_cache_capable: bool,
    /// Only pods requesting one of these go to the extender.
    pub managed_resources: Vec<String>,
    /// Whether the extender binds (bindVerb set).
    pub bind: bool,
    /// Whether the extender answers preemption (preemptVerb set).
    pub preempt: bool,
    /// The managed resources marked `ignoredByScheduler`: the scheduler's own filters and its
    /// preemption dry run do not count them.
    pub ignored_by_scheduler: Vec<String>,
    /// Per-call timeout (kube-scheduler's httpTimeout, 5 s by default).
    pub timeout: Duration,
    /// The profile's `percentageOfNodesToScore`: 0 = kube-scheduler's adaptive default
    /// (50% − nodes/125, at least 5% and 100 nodes), 100 = every node goes to the extender.
    pub percentage_of_nodes_to_score: u32,
}

impl ExtenderConfig {
    /// gpuledger's configuration (as in `scheduler-config.yaml`).
    pub fn gpuledger(url_prefix: &str, tls: Option<ExtenderTls>) -> ExtenderConfig {
        ExtenderConfig {
            url_prefix: url_prefix.trim_end_matches('/').to_string(),
            tls,
            node_cache_capable: true,
            managed_resources: [
                "gpuledger.io/gpu",
                "gpuledger.io/gpu-mem",
                "gpuledger.io/gpu-mem-percent",
                "gpuledger.io/gpu-core",
            ]
            .map(String::from)
            .to_vec(),
            bind: true,
            preempt: true,
            ignored_by_scheduler: [
                "gpuledger.io/gpu-mem",
                "gpuledger.io/gpu-mem-percent",
                "gpuledger.io/gpu-core",
            ]
            .map(String::from)
            .to_vec(),
            timeout: Duration::from_secs(5),
            percentage_of_nodes_to_score: 100,
        }
    }
}

/// An HTTP client speaking to an extender like kube-scheduler does.
#[derive(Clone)]
pub struct ExtenderClient {
    http: HttpClient<HttpsConnector<HttpConnector>, Full<Bytes>>,
    /// The extender's configuration.
    pub cfg: ExtenderConfig,
}

impl ExtenderClient {
    /// A client for `cfg` (HTTPS with the client certificate of `cfg.tls`, when set).
    pub fn new(cfg: ExtenderConfig) -> Result<ExtenderClient> {
        let mut conn = HttpConnector::new();
        conn.set_nodelay(true);
        conn.enforce_http(false);
        let https = match &cfg.tls {
            Some(t) => {
                let tls = gpuledger_auth::tls::client_config(
                    &t.ca,
                    Some((&t.cert, &t.key)),
                    // hyper-rustls offers the protocols it enables itself.
                    &[],
                )?;
                hyper_rustls::HttpsConnectorBuilder::new()
                    .with_tls_config((*tls.current()).clone())
                    .https_or_http()
                    .enable_http1()
                    .wrap_connector(conn)
            }
            None => hyper_rustls::HttpsConnectorBuilder::new()
                .with_tls_config(
                    rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
                        rustls::crypto::ring::default_provider(),
                    ))
                    .with_safe_default_protocol_versions()?
                    .with_root_certificates(rustls::RootCertStore::empty())
                    .with_no_client_auth(),
                )
                .https_or_http()
                .enable_http1()
                .wrap_connector(conn),
        };
        let http = HttpClient::builder(TokioExecutor::new())
            .pool_max_idle_per_host(64)
            .build(https);
        Ok(ExtenderClient { http, cfg })
    }

    /// POST `body` to `<urlPrefix>/<verb>`; the HTTP status and the body.
    pub async fn post_raw(&self, verb: &str, body: Vec<u8>) -> Result<(u16, Vec<u8>)> {
        let req = hyper::Request::post(format!("{}/{verb}", self.cfg.url_prefix))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))?;
        let fut = async {
            let resp = self.http.request(req).await?;
            let status = resp.status().as_u16();
            let body = resp.into_body().collect().await?.to_bytes().to_vec();
            anyhow::Ok((status, body))
        };
        tokio::time::timeout(self.cfg.timeout, fut)
            .await
            .with_context(|| {
                format!(
                    "{verb}: extender did not answer within {:?}",
                    self.cfg.timeout
                )
            })?
    }

    /// POST JSON and parse the JSON answer; non-200 is an error, as for kube-scheduler.
    pub async fn post(&self, verb: &str, body: &Value) -> Result<Value> {
        self.post_as(verb, body).await
    }

    /// POST JSON and decode the answer into `T` (kube-scheduler decodes into its own types).
    pub async fn post_as<T: serde::de::DeserializeOwned>(
        &self,
        verb: &str,
        body: &Value,
    ) -> Result<T> {
        let (status, b) = self.post_raw(verb, serde_json::to_vec(body)?).await?;
        if status != 200 {
            bail!("{verb}: HTTP {status}: {}", String::from_utf8_lossy(&b));
        }
        serde_json::from_slice(&b).with_context(|| format!("{verb}: decoding the answer"))
    }

    /// Whether kube-scheduler would send this pod to the extender.
    pub fn interested(&self, pod: &Pod) -> bool {
        let Some(spec) = pod.spec.as_ref() else {
            return false;
        };
        spec.containers
            .iter()
            .chain(spec.init_containers.iter().flatten())
            .filter_map(|c| c.resources.as_ref())
            .any(|r| {
                [r.requests.as_ref(), r.limits.as_ref()]
                    .into_iter()
                    .flatten()
                    .any(|m| m.keys().any(|k| self.cfg.managed_resources.contains(k)))
            })
    }

    /// ExtenderArgs for `pod` and `nodes`.
    pub fn args<N: std::borrow::Borrow<Node> + k8s_openapi::serde::Serialize>(
        &self,
        pod: &Pod,
        nodes: &[N],
    ) -> Result<Value> {
        let pod = serde_json::to_value(pod)?;
        Ok(if self.cfg.node_cache_capable {
            let names: Vec<&str> = nodes
                .iter()
                .filter_map(|n| n.borrow().metadata.name.as_deref())
                .collect();
            json!({"Pod": pod, "Nodes": null, "NodeNames": names})
        } else {
            json!({"Pod": pod, "Nodes": {"metadata": {}, "items": nodes}, "NodeNames": null})
        })
    }
}

/// Whether `e` means the extender could not even be reached (nothing was sent, so another
/// replica may be asked at once).
pub(super) fn unreachable(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<hyper_util::client::legacy::Error>()
            .is_some_and(hyper_util::client::legacy::Error::is_connect)
    })
}

/// `ExtenderFilterResult` as kube-scheduler decodes it.
#[derive(serde::Deserialize)]
#[serde(rename_all = "PascalCase")]
pub(super) struct FilterAnswer {
    #[serde(default)]
    pub(super) node_names: Option<Vec<String>>,
    #[serde(default)]
    pub(super) nodes: Option<NodeItems>,
    #[serde(default)]
    pub(super) failed_nodes: Value,
    #[serde(default)]
    pub(super) failed_and_unresolvable_nodes: Value,
    #[serde(default)]
    pub(super) error: String,
}

/// `v1.NodeList` in a filter answer, of which only the names count.
#[derive(serde::Deserialize)]
pub(super) struct NodeItems {
    #[serde(default)]
    pub(super) items: Vec<NamedObject>,
}

/// An object of which only the metadata counts.
#[derive(serde::Deserialize)]
pub(super) struct NamedObject {
    #[serde(default)]
    pub(super) metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
}

/// One entry of `HostPriorityList`.
#[derive(serde::Deserialize)]
#[serde(rename_all = "PascalCase")]
pub(super) struct HostScore {
    pub(super) host: String,
    pub(super) score: i64,
}
