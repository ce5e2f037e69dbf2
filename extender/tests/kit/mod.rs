//! Helpers shared by the extender's integration tests: fixtures, TLS, an HTTPS client, and
//! admission as the API server does it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use gpuledger_proto::allocator::v1 as api;
use gpuledger_testkit::allocators::Client;
use gpuledger_testkit::kube::{ExtenderClient, KubeStack};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};

/// `testdata/fixtures/kube-1.20` in the repository; panics with the reason when missing.
pub fn fixtures() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/fixtures/kube-1.20");
    assert!(
        p.join("extender").is_dir() && p.join("webhook").is_dir(),
        "golden fixtures missing: expected {} (testdata/fixtures/kube-1.20 in the repository, \
         with extender/ and webhook/ captured from kube 1.20)",
        p.display()
    );
    p
}

/// Parse a JSON file.
pub fn read_json(p: &Path) -> Result<Value> {
    let b = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
    serde_json::from_slice(&b).with_context(|| format!("parsing {}", p.display()))
}

/// A client that speaks to the stack's extender like kube-scheduler (HTTPS, with the
/// scheduler's client certificate).
pub fn extender(stack: &KubeStack) -> Result<ExtenderClient> {
    ExtenderClient::new(stack.extender_config()?)
}

/// The stack's extender flag serving the webhook on `port` (with the extender's certificate).
pub fn webhook_flag(port: u16) -> String {
    format!("--webhook-listen=127.0.0.1:{port}")
}

/// A client of the stack's webhook on `port`, trusting the stack's CA as the API server
/// trusts the webhook's caBundle.
pub fn webhook_client(stack: &KubeStack, port: u16) -> Result<Https> {
    let ca = stack.ids.pki.ca_file();
    let pem = std::fs::read_to_string(ca).with_context(|| format!("reading {}", ca.display()))?;
    Https::trusting(&pem, port)
}

/// Reserve as the extender, retrying for a few seconds while the allocator's pod watch has
/// not yet seen a pod the test just created in the API server (the allocator admits the
/// extender's Reserve only for a pod it has); every other answer is returned at once.
pub async fn reserve_admitted(
    c: &mut Client,
    req: api::ReserveRequest,
) -> std::result::Result<api::ReserveResponse, tonic::Status> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match c.reserve(req.clone()).await {
            Err(s)
                if s.code() == tonic::Code::PermissionDenied
                    && s.message().contains("has no pod with this UID")
                    && Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            r => return r.map(tonic::Response::into_inner),
        }
    }
}

/// The `PodRequest` the extender makes of a pod's JSON; an error for a pod with no GPU.
pub fn request(p: &Value) -> Result<api::PodRequest> {
    let pod: Pod = serde_json::from_value(p.clone())?;
    gpuledger_extender::resources::pod_request(&pod)?
        .ok_or_else(|| anyhow::anyhow!("not a GPU pod"))
}

/// Every allocation in the ledger, as a viewer dumps it.
pub async fn allocations(
    stack: &KubeStack,
) -> Result<Vec<gpuledger_proto::ledger::v1::Allocation>> {
    let d = stack
        .allocs
        .viewer(0)?
        .dump(api::DumpRequest {})
        .await?
        .into_inner();
    Ok(d.snapshot.map(|s| s.allocations).unwrap_or_default())
}

/// The value of the extender's metric line that starts with `line` (-1 when absent).
pub async fn metric(stack: &KubeStack, line: &str) -> Result<f64> {
    let (_, text) =
        gpuledger_testkit::http::get(&format!("{}/metrics", stack.extender_http_url)).await?;
    Ok(text
        .lines()
        .find_map(|l| l.strip_prefix(line)?.trim().parse().ok())
        .unwrap_or(-1.0))
}

/// Wait until the extender's replica has folded everything the allocator has.
pub async fn caught_up(stack: &KubeStack) -> Result<()> {
    let seq = stack.allocs.status(0).await.map_or(0, |s| s.seq) as f64;
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(stack, "gpuledger_extender_replica_seq ").await? < seq {
        anyhow::ensure!(Instant::now() < deadline, "replica not at seq {seq}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Create `p` in the API server and reserve it on `node` as the extender does.
pub async fn reserve(stack: &KubeStack, p: &Value, node: &str) -> Result<api::ReserveResponse> {
    stack.api.add_pod(p.clone())?;
    let r = reserve_admitted(
        &mut stack.allocs.extender(0)?,
        api::ReserveRequest {
            request: Some(request(p)?),
            node: node.into(),
            ttl_ms: 0,
        },
    )
    .await?;
    Ok(r)
}

/// A self-signed certificate for 127.0.0.1/localhost in a temp dir.
pub struct TestTls {
    dir: tempfile::TempDir,
    /// PEM certificate.
    pub cert_pem: String,
}

impl TestTls {
    /// Generate.
    pub fn new() -> Result<TestTls> {
        let ck = rcgen::generate_simple_self_signed(vec!["localhost".into(), "127.0.0.1".into()])?;
        let dir = tempfile::tempdir()?;
        let cert_pem = ck.cert.pem();
        std::fs::write(dir.path().join("tls.crt"), &cert_pem)?;
        std::fs::write(dir.path().join("tls.key"), ck.signing_key.serialize_pem())?;
        Ok(TestTls { dir, cert_pem })
    }

    /// Replace the pair on disk with a new certificate, as the kubelet updates a Secret volume
    /// (new files, then an atomic rename); returns its PEM.
    pub fn rotate(&mut self) -> Result<String> {
        let ck = rcgen::generate_simple_self_signed(vec!["localhost".into(), "127.0.0.1".into()])?;
        let cert_pem = ck.cert.pem();
        self.replace(
            cert_pem.as_bytes(),
            ck.signing_key.serialize_pem().as_bytes(),
        )?;
        self.cert_pem = cert_pem.clone();
        Ok(cert_pem)
    }

    /// Write `cert` and `key` over the pair, each by an atomic rename.
    pub fn replace(&self, cert: &[u8], key: &[u8]) -> Result<()> {
        for (name, body) in [("tls.key", key), ("tls.crt", cert)] {
            let tmp = self.dir.path().join(format!(".{name}.new"));
            std::fs::write(&tmp, body)?;
            std::fs::rename(&tmp, self.dir.path().join(name))?;
        }
        Ok(())
    }

    /// The certificate file.
    pub fn cert_path(&self) -> PathBuf {
        self.dir.path().join("tls.crt")
    }

    /// The key file.
    pub fn key_path(&self) -> PathBuf {
        self.dir.path().join("tls.key")
    }

    /// Extender flags serving the webhook on `port` with this certificate (it also stands in
    /// for the scheduler's CA and the allocator credentials: these tests reach no allocator).
    pub fn flags(&self, port: u16) -> Vec<String> {
        let (crt, key) = (self.cert_path(), self.key_path());
        vec![
            format!("--webhook-listen=127.0.0.1:{port}"),
            format!("--tls-cert={}", crt.display()),
            format!("--tls-key={}", key.display()),
            format!("--client-ca={}", crt.display()),
            format!("--allocator-ca={}", crt.display()),
            format!("--client-cert={}", crt.display()),
            format!("--client-key={}", key.display()),
            format!(
                "--http-listen=127.0.0.1:{}",
                gpuledger_testkit::free_port().unwrap_or(0)
            ),
        ]
    }
}

/// A minimal HTTPS client trusting only the test certificate (as the API server trusts the
/// webhook's caBundle).
pub struct Https {
    connector: tokio_rustls::TlsConnector,
    port: u16,
}

impl Https {
    /// A client for 127.0.0.1:`port`.
    pub fn new(tls: &TestTls, port: u16) -> Result<Https> {
        Https::trusting(&tls.cert_pem, port)
    }

    /// A client for 127.0.0.1:`port` that trusts only the PEM certificate `ca`.
    pub fn trusting(ca: &str, port: u16) -> Result<Https> {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(ca.as_bytes()) {
            roots.add(c?)?;
        }
        let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
        Ok(Https {
            connector: tokio_rustls::TlsConnector::from(Arc::new(cfg)),
            port,
        })
    }

    /// A TLS connection to the server, handshake done.
    pub async fn connect(&self) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", self.port)).await?;
        let name = rustls::pki_types::ServerName::try_from("localhost")?.to_owned();
        Ok(self.connector.connect(name, tcp).await?)
    }

    /// POST raw bytes; status and body.
    pub async fn post_raw(&self, path: &str, body: Vec<u8>) -> Result<(u16, Vec<u8>)> {
        let tls = self.connect().await?;
        let (mut send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls)).await?;
        tokio::spawn(conn);
        let req = hyper::Request::post(path)
            .header("host", "localhost")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))?;
        let resp = send.send_request(req).await?;
        let status = resp.status().as_u16();
        Ok((
            status,
            resp.into_body().collect().await?.to_bytes().to_vec(),
        ))
    }

    /// POST JSON; status and parsed body (Null when not JSON).
    pub async fn post(&self, path: &str, body: &Value) -> Result<(u16, Value)> {
        let (s, b) = self.post_raw(path, serde_json::to_vec(body)?).await?;
        Ok((s, serde_json::from_slice(&b).unwrap_or(Value::Null)))
    }
}

/// Apply an RFC 6902 JSON Patch, as the API server does.
pub fn apply_patch(mut doc: Value, patch: &Value) -> Result<Value> {
    let p: json_patch::Patch = serde_json::from_value(patch.clone()).context("not a JSON Patch")?;
    json_patch::patch(&mut doc, &p)?;
    Ok(doc)
}

/// An AdmissionReview of creating `obj` (a pod), as the API server sends it.
pub fn review(obj: &Value, uid: &str) -> Value {
    json!({"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1",
           "request": {"uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
                       "resource": {"group": "", "version": "v1", "resource": "pods"},
                       "operation": "CREATE", "userInfo": {"username": "system:admin"},
                       "object": obj}})
}

/// Admit `pod` as the API server would: mutate, apply the patch, validate.
/// Ok(the stored pod) or Err(the denial message).
pub async fn admit(hook: &Https, pod: Value) -> Result<std::result::Result<Value, String>> {
    let (s, m) = hook.post("/mutate", &review(&pod, "m-1")).await?;
    anyhow::ensure!(s == 200, "mutate answered {s}: {m}");
    let pod = match m["response"]["patch"].as_str() {
        None => pod,
        Some(p) => {
            use base64::Engine;
            let patch: Value =
                serde_json::from_slice(&base64::engine::general_purpose::STANDARD.decode(p)?)?;
            apply_patch(pod, &patch)?
        }
    };
    let (s, v) = hook.post("/validate", &review(&pod, "v-1")).await?;
    anyhow::ensure!(s == 200, "validate answered {s}: {v}");
    if v["response"]["allowed"] == true {
        Ok(Ok(pod))
    } else {
        Ok(Err(v["response"]["status"]["message"]
            .as_str()
            .unwrap_or("")
            .to_string()))
    }
}

/// Register `nodes` with replica 0 as their node agents would, one 16,000 MiB `model` GPU each.
pub async fn register_one_gpu_nodes(stack: &KubeStack, nodes: &[&str], model: &str) -> Result<()> {
    for n in nodes {
        stack
            .allocs
            .node_agent(0, n)?
            .register_node(api::RegisterNodeRequest {
                inventory: Some(gpuledger_testkit::workload::inventory(n, 1, 16_000, model)),
            })
            .await?;
    }
    Ok(())
}
