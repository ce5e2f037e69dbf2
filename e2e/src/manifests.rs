//! The shipped manifests on this cluster: `deploy/kustomize/overlays/kube-1.20` rendered by
//! kustomize v5 (as an operator would), its RBAC and admission webhooks applied by kubectl 1.20.
//! The components themselves run as processes here, so Deployments, DaemonSets and Services are
//! left out, and the webhooks point at the extender's address instead of its Service.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::kubectl::Kubectl;

/// The overlay for Kubernetes clusters without webhook `matchConditions` (< 1.28).
pub const OVERLAY: &str = "deploy/kustomize/overlays/kube-1.20";

/// Kinds taken from the rendered overlay.
const APPLIED: [&str; 9] = [
    "Namespace",
    "CustomResourceDefinition",
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
];

/// What the installed webhooks select.
#[derive(Debug, Clone)]
pub struct Installed {
    /// The namespace label (key, value) that opts a namespace into the webhooks.
    pub webhook_label: (String, String),
    /// Names of the objects applied, as `Kind/name`.
    pub objects: Vec<String>,
}

/// A kubectl whose `kustomize` is kustomize v5 (the shipped kustomizations need it):
/// `$GPULEDGER_KUSTOMIZE`, the `kubectl` on PATH, or the one `make deploy-check` installs.
pub fn kustomize_kubectl() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("GPULEDGER_KUSTOMIZE") {
        return Ok(PathBuf::from(p));
    }
    let tools = std::env::var_os("GPULEDGER_DEPLOY_TOOLS")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::repo_root().join("target/deploy-tools"));
    for cand in [
        PathBuf::from("kubectl"),
        tools.join("layer/kubectl/kubectl"),
    ] {
        let v = Command::new(&cand).args(["version", "--client"]).output();
        if let Ok(o) = v
            && String::from_utf8_lossy(&o.stdout).contains("Kustomize Version: v5")
        {
            return Ok(cand);
        }
    }
    bail!(
        "no kubectl with kustomize v5 found (PATH, {}): run `make deploy-check` once (it installs one) or set GPULEDGER_KUSTOMIZE",
        tools.display()
    )
}

/// Render the overlay, then apply its RBAC and webhooks with the webhooks served at
/// `https://127.0.0.1:<webhook_port>` and trusted through `ca_bundle`.
pub fn install(kubectl: &Kubectl, webhook_port: u16, ca_bundle: &str) -> Result<Installed> {
    let overlay = crate::repo_root().join(OVERLAY);
    let kz = kustomize_kubectl()?;
    let out = Command::new(&kz)
        .arg("kustomize")
        .arg(&overlay)
        .output()
        .with_context(|| format!("running {} kustomize", kz.display()))?;
    if !out.status.success() {
        bail!(
            "kustomize {}: {}",
            overlay.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let yaml = String::from_utf8_lossy(&out.stdout).into_owned();
    // kubectl (1.20, the server's own version) turns the YAML into JSON without applying it.
    let conv = kubectl.run_with_input(
        &["create", "--dry-run=client", "-o", "json", "-f", "-"],
        Some(&yaml),
    )?;
    if !conv.ok {
        bail!(
            "kubectl 1.20 cannot read the rendered {OVERLAY}: {}",
            conv.stderr
        );
    }
    // One JSON object per manifest, one after the other.
    let items = serde_json::Deserializer::from_str(&conv.stdout)
        .into_iter::<Value>()
        .collect::<Result<Vec<_>, _>>()
        .context("reading kubectl's JSON")?;
    let mut keep = Vec::new();
    let mut all = Vec::new();
    let mut label = None;
    for mut o in items {
        all.push(o.clone());
        let kind = o["kind"].as_str().unwrap_or_default().to_string();
        if !APPLIED.contains(&kind.as_str()) {
            continue;
        }
        if kind.ends_with("WebhookConfiguration") {
            let hooks = o["webhooks"]
                .as_array_mut()
                .context("a webhook configuration without webhooks")?;
            for h in hooks {
                let path = h
                    .pointer("/clientConfig/service/path")
                    .and_then(Value::as_str)
                    .context("a webhook without clientConfig.service.path")?
                    .to_string();
                h["clientConfig"] = json!({
                    "url": format!("https://127.0.0.1:{webhook_port}{path}"),
                    "caBundle": ca_bundle,
                });
                let sel = h
                    .pointer("/namespaceSelector/matchLabels")
                    .and_then(Value::as_object);
                let exprs = h.pointer("/namespaceSelector/matchExpressions");
                match (sel, exprs) {
                    (Some(m), None) if m.len() == 1 => {
                        let (k, v) = m.iter().next().expect("one entry");
                        let l = (k.clone(), v.as_str().unwrap_or_default().to_string());
                        if label.as_ref().is_some_and(|x| *x != l) {
                            bail!("the webhooks of {OVERLAY} select different namespace labels");
                        }
                        label = Some(l);
                    }
                    _ => bail!(
                        "{OVERLAY}: webhook {} must select namespaces by exactly one opt-in label (namespaceSelector.matchLabels), got {}",
                        h["name"],
                        h.get("namespaceSelector").unwrap_or(&Value::Null)
                    ),
                }
            }
        }
        keep.push(o);
    }
    let objects: Vec<String> = keep
        .iter()
        .map(|o| {
            format!(
                "{}/{}",
                o["kind"].as_str().unwrap_or("?"),
                o["metadata"]["name"].as_str().unwrap_or("?")
            )
        })
        .collect();
    let (namespaces, rest): (Vec<Value>, Vec<Value>) =
        keep.into_iter().partition(|o| o["kind"] == "Namespace");
    create(kubectl, &namespaces, false)?;
    // Every other object of the overlay, workloads included, must be one 1.20 accepts.
    let others: Vec<Value> = all
        .into_iter()
        .filter(|o| o["kind"] != "Namespace")
        .collect();
    create(kubectl, &others, true)
        .with_context(|| format!("kube-apiserver 1.20 refuses objects of {OVERLAY}"))?;
    create(kubectl, &rest, false)?;
    Ok(Installed {
        webhook_label: label.with_context(|| format!("{OVERLAY} has no admission webhook"))?,
        objects,
    })
}

/// `kubectl create` the objects (server-side dry run: validated and admitted, not stored).
fn create(kubectl: &Kubectl, objects: &[Value], dry_run: bool) -> Result<()> {
    if objects.is_empty() {
        return Ok(());
    }
    let list = json!({"apiVersion": "v1", "kind": "List", "items": objects});
    let mut args = vec!["create", "-f", "-"];
    if dry_run {
        args.push("--dry-run=server");
    }
    let o = kubectl.run_with_input(&args, Some(&list.to_string()))?;
    anyhow::ensure!(o.ok, "kubectl {}: {}{}", args.join(" "), o.stdout, o.stderr);
    Ok(())
}
