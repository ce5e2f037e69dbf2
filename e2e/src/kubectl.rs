//! kubectl as a user runs it: what `kubectl create` refuses and what `kubectl describe` shows
//! are part of what the tier asserts.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{Context, Result};

/// A kubectl binary with a kubeconfig.
#[derive(Debug, Clone)]
pub struct Kubectl {
    bin: PathBuf,
    kubeconfig: PathBuf,
}

/// What one kubectl run did.
#[derive(Debug, Clone)]
pub struct Output {
    /// Exit status 0.
    pub ok: bool,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

impl Kubectl {
    /// `bin` talking to the cluster of `kubeconfig`.
    pub fn new(bin: PathBuf, kubeconfig: PathBuf) -> Kubectl {
        Kubectl { bin, kubeconfig }
    }

    /// Run with `args`.
    pub fn run(&self, args: &[&str]) -> Result<Output> {
        self.run_with_input(args, None)
    }

    /// Run with `args`, `input` on standard input (for `-f -`).
    pub fn run_with_input(&self, args: &[&str], input: Option<&str>) -> Result<Output> {
        let mut cmd = Command::new(&self.bin);
        cmd.arg(format!("--kubeconfig={}", self.kubeconfig.display()))
            .args(args)
            .stdin(if input.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {}", self.bin.display()))?;
        if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
            stdin
                .write_all(text.as_bytes())
                .context("writing to kubectl")?;
        }
        let out = child.wait_with_output().context("waiting for kubectl")?;
        Ok(Output {
            ok: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }

    /// Run and fail unless it succeeds; its standard output.
    pub fn ok(&self, args: &[&str]) -> Result<String> {
        let o = self.run(args)?;
        anyhow::ensure!(
            o.ok,
            "kubectl {} failed: {}{}",
            args.join(" "),
            o.stdout,
            o.stderr
        );
        Ok(o.stdout)
    }

    /// Apply a ClusterRole `role` with `rules`, bound to ServiceAccount `account`'s identity
    /// on the tier (a peer's RBAC, as its chart grants it), with `more` objects in the same
    /// apply; `what` names it in the error.
    pub fn grant(
        &self,
        what: &str,
        (role, account): (&str, &str),
        rules: serde_json::Value,
        more: Vec<serde_json::Value>,
    ) -> Result<()> {
        let (user, _) = crate::pki::Identity::ServiceAccount(account.into()).user();
        let mut items = more;
        items.push(
            serde_json::json!({"apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole", "metadata": {"name": role}, "rules": rules}),
        );
        items.push(serde_json::json!({"apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding", "metadata": {"name": role},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]}));
        let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items});
        let o = self.run_with_input(&["apply", "-f", "-"], Some(&list.to_string()))?;
        anyhow::ensure!(o.ok, "applying {what}: {}{}", o.stdout, o.stderr);
        Ok(())
    }
}
