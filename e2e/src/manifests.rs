//! The shipped install on this cluster: `deploy/kustomize/overlays/default-scheduler` rendered
//! by kustomize (the cluster's own kubectl, as an operator would run `kubectl apply -k`) and
//! applied server-side, unchanged but for addresses. The components run as processes of the
//! test (there is no image registry), so the workloads (Deployments, the DaemonSet, the etcd
//! StatefulSet) are only admitted by a server-side dry run; every other object is applied as
//! rendered. Two addresses change: the webhooks keep their Service reference and call the
//! extender's webhook port of this run, and the Service `gpuledger-extender` is an
//! ExternalName of `localhost`, so the API server dials the extender on loopback while it
//! still checks the extender's certificate for `gpuledger-extender.gpuledger-system.svc`, the
//! name the shipped certificates carry.

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::kubectl::Kubectl;

/// The overlay for clusters whose default kube-scheduler calls the extender (the shipped
/// `deploy/scheduler/default-scheduler-config.yaml`).
pub const OVERLAY: &str = "deploy/kustomize/overlays/default-scheduler";

/// The overlay of DRA mode: the second scheduler with DynamicResources, the DeviceClass, the
/// webhook turning GPU pods into claims.
pub const DRA_OVERLAY: &str = "deploy/kustomize/overlays/dra";

/// Kinds that run gpuledger's images: admitted by a dry run only (the tier runs the
/// components as processes).
const WORKLOADS: [&str; 3] = ["Deployment", "DaemonSet", "StatefulSet"];

/// The Service the webhooks call.
const WEBHOOK_SERVICE: &str = "gpuledger-extender";

/// What the install applied.
#[derive(Debug, Clone)]
pub struct Installed {
    /// The namespaces whose pods the webhooks never see (their `namespaceSelector`).
    pub webhook_excluded: Vec<String>,
    /// The objects applied, as `Kind/name`.
    pub objects: Vec<String>,
    /// The workloads admitted by a server-side dry run, as `Kind/name`.
    pub dry_run: Vec<String>,
}

/// Render `overlay` ([`OVERLAY`] or [`DRA_OVERLAY`]) and apply it, the webhooks calling
/// `https://localhost:<webhook_port>` through their Service.
pub fn install(kubectl: &Kubectl, webhook_port: u16, overlay_dir: &str) -> Result<Installed> {
    let overlay = crate::repo_root().join(overlay_dir);
    let rendered = kubectl.run(&["kustomize", &overlay.display().to_string()])?;
    if !rendered.ok {
        bail!(
            "kubectl kustomize {}: {}",
            overlay.display(),
            rendered.stderr
        );
    }
    // The cluster's kubectl turns the YAML into JSON without applying it.
    let conv = kubectl.run_with_input(
        &["create", "--dry-run=client", "-o", "json", "-f", "-"],
        Some(&rendered.stdout),
    )?;
    if !conv.ok {
        bail!(
            "kubectl cannot read the rendered {overlay_dir}: {}",
            conv.stderr
        );
    }
    // One JSON object per manifest, one after the other.
    let items = serde_json::Deserializer::from_str(&conv.stdout)
        .into_iter::<Value>()
        .collect::<Result<Vec<_>, _>>()
        .context("reading kubectl's JSON")?;
    let (mut apply, mut workloads, mut excluded) = (Vec::new(), Vec::new(), None);
    for mut o in items {
        let kind = o["kind"].as_str().unwrap_or_default().to_string();
        if WORKLOADS.contains(&kind.as_str()) {
            workloads.push(o);
            continue;
        }
        if kind.ends_with("WebhookConfiguration") {
            let ns = webhook_at(&mut o, webhook_port).with_context(|| overlay_dir.to_string())?;
            if excluded.as_ref().is_some_and(|x| *x != ns) {
                bail!("the webhooks of {overlay_dir} exclude different namespaces");
            }
            excluded = Some(ns);
        }
        if kind == "Service" && o["metadata"]["name"] == WEBHOOK_SERVICE {
            let ports: Vec<Value> = o["spec"]["ports"]
                .as_array()
                .context("Service gpuledger-extender has no ports")?
                .iter()
                .map(|p| json!({"name": p["name"], "port": p["port"], "targetPort": p["targetPort"]}))
                .collect();
            o["spec"] =
                json!({"type": "ExternalName", "externalName": "localhost", "ports": ports});
        }
        apply.push(o);
    }
    let name = |o: &Value| {
        format!(
            "{}/{}",
            o["kind"].as_str().unwrap_or("?"),
            o["metadata"]["name"].as_str().unwrap_or("?")
        )
    };
    let installed = Installed {
        webhook_excluded: excluded
            .with_context(|| format!("{overlay_dir} has no admission webhook"))?,
        objects: apply.iter().map(name).collect(),
        dry_run: workloads.iter().map(name).collect(),
    };
    // Namespaces and CRDs first: the rest lives in the one or is watched through the other.
    let (first, rest): (Vec<Value>, Vec<Value>) = apply.into_iter().partition(|o| {
        matches!(
            o["kind"].as_str(),
            Some("Namespace" | "CustomResourceDefinition")
        )
    });
    server_side(kubectl, &first, false)?;
    server_side(kubectl, &rest, false)?;
    server_side(kubectl, &workloads, true)
        .with_context(|| format!("kube-apiserver refuses the workloads of {overlay_dir}"))?;
    Ok(installed)
}

/// Point a webhook configuration's Service references at `port`; the namespaces its
/// `namespaceSelector` leaves out (every webhook of the configuration must agree).
fn webhook_at(o: &mut Value, port: u16) -> Result<Vec<String>> {
    let hooks = o["webhooks"]
        .as_array_mut()
        .context("a webhook configuration without webhooks")?;
    let mut excluded: Option<Vec<String>> = None;
    for h in hooks {
        let hook = h["name"].clone();
        let svc = h
            .pointer_mut("/clientConfig/service")
            .context("a webhook without clientConfig.service")?;
        if svc["name"] != WEBHOOK_SERVICE {
            bail!(
                "webhook {hook} calls {} instead of {WEBHOOK_SERVICE}",
                svc["name"]
            );
        }
        svc["port"] = json!(port);
        let exprs = h
            .pointer("/namespaceSelector/matchExpressions")
            .and_then(Value::as_array)
            .context("a webhook without namespaceSelector.matchExpressions")?;
        let ns: Vec<String> = exprs
            .iter()
            .filter(|e| e["key"] == "kubernetes.io/metadata.name" && e["operator"] == "NotIn")
            .flat_map(|e| e["values"].as_array().cloned().unwrap_or_default())
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect();
        if excluded.as_ref().is_some_and(|x| *x != ns) {
            bail!(
                "the webhooks of {} exclude different namespaces",
                o["metadata"]["name"]
            );
        }
        excluded = Some(ns);
    }
    excluded.context("a webhook configuration without webhooks")
}

/// `kubectl apply --server-side` the objects, or only their server-side dry run.
fn server_side(kubectl: &Kubectl, objects: &[Value], dry_run: bool) -> Result<()> {
    if objects.is_empty() {
        return Ok(());
    }
    let list = json!({"apiVersion": "v1", "kind": "List", "items": objects});
    let mut args = vec![
        "apply",
        "--server-side",
        "--field-manager=gpuledger-e2e",
        "-f",
        "-",
    ];
    if dry_run {
        args.push("--dry-run=server");
    }
    let o = kubectl.run_with_input(&args, Some(&list.to_string()))?;
    anyhow::ensure!(o.ok, "kubectl {}: {}{}", args.join(" "), o.stdout, o.stderr);
    Ok(())
}
