//! Finding the allocator through the kubeconfig's cluster, as `kubectl gpuledger` does: the
//! Service's port named `grpc`, its ready pods, and a local port-forward to each of them.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::{Pod, Service, ServicePort};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use tokio::net::{TcpListener, TcpStream};
use tracing::Instrument;

/// The Service port that carries the allocator's gRPC API.
pub const GRPC_PORT_NAME: &str = "grpc";

static PLUGIN: AtomicBool = AtomicBool::new(false);

/// Whether this process runs as `kubectl-gpuledger` (kubectl runs plugins by file name).
pub fn is_plugin() -> bool {
    PLUGIN.load(Ordering::Relaxed)
}

/// Decide from argv[0] whether this process runs as the kubectl plugin; returns the answer.
pub fn detect_plugin(argv0: Option<&std::ffi::OsStr>) -> bool {
    let plugin = argv0
        .and_then(|a| std::path::Path::new(a).file_stem())
        .and_then(|s| s.to_str())
        .is_some_and(|s| s == "kubectl-gpuledger");
    PLUGIN.store(plugin, Ordering::Relaxed);
    plugin
}

/// How to find the allocator in a cluster.
#[derive(clap::Args, Debug, Clone)]
pub struct KubeArgs {
    /// Kubeconfig file used to find the allocator in the cluster (default: $KUBECONFIG, then
    /// ~/.kube/config, then the in-cluster service account). Giving it, or --context, makes
    /// `gpuledger` find the allocator this way too; `kubectl gpuledger` always does unless
    /// --allocator is given.
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// Kubeconfig context to use (default: the kubeconfig's current-context).
    #[arg(long, value_name = "NAME")]
    pub context: Option<String>,
    /// Namespace of the allocator's Service.
    #[arg(
        long,
        env = "GPULEDGER_ALLOCATOR_NAMESPACE",
        default_value = "gpuledger-system",
        value_name = "NAMESPACE"
    )]
    pub allocator_namespace: String,
    /// Name of the allocator's Service. Its port named `grpc` is port-forwarded from a local
    /// port to each of the Service's ready pods (one replica per pod).
    #[arg(
        long,
        env = "GPULEDGER_ALLOCATOR_SERVICE",
        default_value = "gpuledger-allocator",
        value_name = "NAME"
    )]
    pub allocator_service: String,
}

impl KubeArgs {
    /// Whether the user asked for a cluster explicitly.
    pub fn given(&self) -> bool {
        self.kubeconfig.is_some() || self.context.is_some()
    }
}

/// A Kubernetes client for the kubeconfig (or in-cluster account) `k` names.
pub async fn client(k: &KubeArgs) -> Result<kube::Client> {
    let opts = KubeConfigOptions {
        context: k.context.clone(),
        ..Default::default()
    };
    let cfg = match (&k.kubeconfig, &k.context) {
        (Some(path), _) => {
            let kc = Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &opts)
                .await
                .with_context(|| format!("kubeconfig {}", path.display()))?
        }
        (None, Some(_)) => kube::Config::from_kubeconfig(&opts)
            .await
            .context("loading the kubeconfig")?,
        (None, None) => kube::Config::infer()
            .await
            .context("no kubeconfig and not in a cluster (or give --allocator)")?,
    };
    kube::Client::try_from(cfg).context("building the Kubernetes client")
}

fn is_ready(p: &Pod) -> bool {
    let Some(st) = &p.status else { return false };
    st.phase.as_deref() == Some("Running")
        && st
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "True")
}

/// The pod's port behind the Service port: a number, or a container port's name.
fn pod_port(sp: &ServicePort, pod: &Pod) -> Result<u16> {
    let name = pod.metadata.name.as_deref().unwrap_or("?");
    let port = match &sp.target_port {
        None => sp.port,
        Some(IntOrString::Int(n)) => *n,
        Some(IntOrString::String(s)) => pod
            .spec
            .iter()
            .flat_map(|s| &s.containers)
            .flat_map(|c| c.ports.iter().flatten())
            .find(|p| p.name.as_deref() == Some(s.as_str()))
            .map(|p| p.container_port)
            .with_context(|| format!("pod {name} has no container port named {s:?}"))?,
    };
    u16::try_from(port)
        .ok()
        .filter(|p| *p > 0)
        .with_context(|| format!("pod {name}: port {port} is not a TCP port"))
}

/// Local addresses (127.0.0.1:<port>) that port-forward to every ready allocator pod.
pub async fn forward_allocators(k: &KubeArgs) -> Result<Vec<String>> {
    let client = client(k).await?;
    let (ns, svc_name) = (&k.allocator_namespace, &k.allocator_service);
    let svc = Api::<Service>::namespaced(client.clone(), ns)
        .get(svc_name)
        .await
        .with_context(|| format!("looking up service {ns}/{svc_name}"))?;
    let spec = svc.spec.unwrap_or_default();
    let ports = spec.ports.unwrap_or_default();
    let Some(sp) = ports
        .iter()
        .find(|p| p.name.as_deref() == Some(GRPC_PORT_NAME))
    else {
        let names: Vec<String> = ports
            .iter()
            .map(|p| format!("{}:{}", p.name.as_deref().unwrap_or(""), p.port))
            .collect();
        bail!(
            "service {ns}/{svc_name} has no port named {GRPC_PORT_NAME:?} (it has [{}])",
            names.join(", ")
        );
    };
    let selector = spec.selector.unwrap_or_default();
    if selector.is_empty() {
        bail!("service {ns}/{svc_name} has no pod selector");
    }
    let labels: Vec<String> = selector.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let pods: Api<Pod> = Api::namespaced(client, ns);
    let all = pods
        .list(&ListParams::default().labels(&labels.join(",")))
        .await
        .with_context(|| format!("listing the pods of service {ns}/{svc_name}"))?
        .items;
    let total = all.len();
    let mut ready: Vec<Pod> = all.into_iter().filter(is_ready).collect();
    ready.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    if ready.is_empty() {
        bail!(
            "service {ns}/{svc_name} has no ready pod ({total} pod(s) match {})",
            labels.join(",")
        );
    }
    let mut addrs = Vec::with_capacity(ready.len());
    for pod in &ready {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let port = pod_port(sp, pod)?;
        addrs.push(listen(pods.clone(), name, port).await?);
    }
    Ok(addrs)
}

/// Accept local connections and forward each through its own port-forward to `pod`:`port`.
async fn listen(pods: Api<Pod>, pod: String, port: u16) -> Result<String> {
    let l = TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding a local port for the port-forward")?;
    let addr = l.local_addr()?.to_string();
    tokio::spawn(async move {
        while let Ok((conn, _)) = l.accept().await {
            let (pods, pod) = (pods.clone(), pod.clone());
            let span = tracing::warn_span!("port_forward", pod = %pod, port);
            tokio::spawn(
                async move {
                    if let Err(e) = forward(&pods, &pod, port, conn).await {
                        tracing::warn!("port-forward failed: {e:#}");
                    }
                }
                .instrument(span),
            );
        }
    });
    Ok(addr)
}

/// One connection through one port-forward. Fails only when the forward cannot be set up or the
/// pod side reports an error; a connection that ends or resets is the client's business.
async fn forward(pods: &Api<Pod>, pod: &str, port: u16, mut conn: TcpStream) -> Result<()> {
    let mut pf = pods.portforward(pod, &[port]).await?;
    let mut remote = pf
        .take_stream(port)
        .context("the port-forward has no stream for the port")?;
    let error = pf
        .take_error(port)
        .context("the port-forward has no error channel for the port")?;
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut conn, &mut remote) => {}
        Some(msg) = error => bail!("{msg}"),
    }
    drop(remote);
    let _ = pf.join().await;
    Ok(())
}

/// The ServiceAccount whose token `kubectl gpuledger` requests for reading the ledger.
pub const VIEWER_ACCOUNT: &str = "gpuledger-viewer";
/// The ConfigMap (in the allocator's namespace) that holds the CA of the allocator's
/// certificate, under `ca.crt`.
pub const CA_CONFIGMAP: &str = "gpuledger-ca";
/// How long the requested token lives (the API server's minimum is 10 minutes).
const TOKEN_SECONDS: i64 = 600;

/// Fill in what `args` lacks through the kubeconfig's cluster: a short-lived token of the
/// `gpuledger-viewer` ServiceAccount for audience `gpuledger` (RBAC decides whether this user
/// may have one: `create` on `serviceaccounts/token`), the CA from the ConfigMap
/// `gpuledger-ca`, and the Service's DNS name as the TLS server name (a port-forward dials
/// 127.0.0.1). The token and CA go to files in a private temporary directory.
pub async fn fill_credentials(
    k: &KubeArgs,
    args: &mut gpuledger_auth::CredentialArgs,
) -> Result<()> {
    use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
    use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
    let client = client(k).await?;
    let ns = &k.allocator_namespace;
    let dir = tempfile::Builder::new()
        .prefix("gpuledger-cli-")
        .tempdir()
        .context("creating a directory for the credentials")?
        .keep();
    if args.ca.is_none() {
        let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
        let cm = cms.get(CA_CONFIGMAP).await.with_context(|| {
            format!(
                "reading ConfigMap {ns}/{CA_CONFIGMAP} (the allocator's CA; or give --allocator-ca)"
            )
        })?;
        let pem = cm
            .data
            .and_then(|d| d.get("ca.crt").cloned())
            .with_context(|| format!("ConfigMap {ns}/{CA_CONFIGMAP} has no ca.crt"))?;
        let path = dir.join("ca.crt");
        std::fs::write(&path, pem)?;
        args.ca = Some(path);
    }
    if args.token_file.is_none() && args.client_cert.is_none() {
        let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
        let req = TokenRequest {
            spec: TokenRequestSpec {
                audiences: vec![gpuledger_auth::token::AUDIENCE.to_string()],
                expiration_seconds: Some(TOKEN_SECONDS),
                ..Default::default()
            },
            ..Default::default()
        };
        let answer = sas
            .create_token_request(VIEWER_ACCOUNT, &kube::api::PostParams::default(), &req)
            .await
            .with_context(|| {
                format!(
                    "requesting a token of ServiceAccount {ns}/{VIEWER_ACCOUNT} (needs RBAC \
                     `create` on serviceaccounts/token; or give --token-file)"
                )
            })?;
        let token = answer.status.map(|s| s.token).unwrap_or_default();
        anyhow::ensure!(!token.is_empty(), "the API server returned an empty token");
        let path = dir.join("token");
        std::fs::write(&path, token)?;
        args.token_file = Some(path);
    }
    if args.server_name.is_none() {
        args.server_name = Some(format!("{}.{ns}.svc", k.allocator_service));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn the_plugin_is_recognised_by_its_file_name() {
        assert!(detect_plugin(Some(OsStr::new(
            "/usr/local/bin/kubectl-gpuledger"
        ))));
        assert!(detect_plugin(Some(OsStr::new("kubectl-gpuledger"))));
        assert!(!detect_plugin(Some(OsStr::new("/usr/bin/gpuledger"))));
        assert!(!detect_plugin(Some(OsStr::new("kubectl-gpuledger-extra"))));
        assert!(!detect_plugin(None));
        assert!(!is_plugin());
    }
}
