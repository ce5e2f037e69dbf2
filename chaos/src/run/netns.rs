//! A network namespace of the run's own, so it may partition an allocator from etcd with
//! iptables: the rules die with the namespace and the host's network is never touched.

use anyhow::{Context, Result, bail};

use super::RunArgs;

/// Set inside the network namespace a run created for itself (its name).
pub(super) const NETNS_ENV: &str = "GPULEDGER_CHAOS_NETNS";

/// Why this process cannot put a run in a network namespace of its own, if it cannot.
pub(super) fn can_netns() -> Result<(), String> {
    if !nix::unistd::geteuid().is_root() {
        return Err("not root (partitions need a network namespace and iptables)".into());
    }
    for (tool, version) in [("ip", "-V"), ("iptables", "--version")] {
        let found = std::process::Command::new(tool)
            .arg(version)
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            return Err(format!(
                "`{tool}` not found (apt-get install -y iproute2 iptables)"
            ));
        }
    }
    Ok(())
}

fn sh(args: &[&str]) -> Result<()> {
    let out = std::process::Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("running {}", args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "`{}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Create a network namespace with loopback up, run this same command inside it, delete the
/// namespace (also on Ctrl-C), and end as the inner run ended.
pub(super) async fn in_own_netns(a: &RunArgs) -> Result<()> {
    let name = format!("gpuledger-chaos-{}", std::process::id());
    if let Err(e) = sh(&["ip", "netns", "add", &name])
        .and_then(|()| sh(&["ip", "-n", &name, "link", "set", "lo", "up"]))
    {
        let _ = sh(&["ip", "netns", "del", &name]);
        println!("partitions skipped: cannot create a network namespace: {e:#}");
        let mut inner = a.clone();
        inner.no_netns = true;
        return Box::pin(super::run(inner)).await;
    }
    let exe = std::env::current_exe().context("finding this executable")?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut child = tokio::process::Command::new("ip")
        .args(["netns", "exec", &name])
        .arg(&exe)
        .args(&args)
        .env(NETNS_ENV, &name)
        .spawn()
        .context("starting the run inside its network namespace")?;
    let status = tokio::select! {
        s = child.wait() => s,
        _ = tokio::signal::ctrl_c() => {
            // The inner run got the same SIGINT; let it stop its processes.
            child.wait().await
        }
    };
    let _ = sh(&["ip", "netns", "del", &name]);
    let status = status.context("waiting for the run")?;
    if status.success() {
        Ok(())
    } else {
        bail!("the run failed ({status})")
    }
}

/// iptables rules that cut loopback address `host` off.
pub(super) fn partition_rules(host: &str) -> [Vec<String>; 2] {
    ["-s", "-d"].map(|dir| {
        ["INPUT", dir, host, "-j", "DROP"]
            .iter()
            .map(|s| (*s).to_string())
            .collect()
    })
}

pub(super) fn iptables(op: &str, rule: &[String]) -> Result<()> {
    let mut args = vec!["iptables", "-w", op];
    args.extend(rule.iter().map(String::as_str));
    sh(&args)
}

/// Remove every partition rule this run may have left (it runs in its own namespace).
pub(super) fn heal_all() {
    let _ = sh(&["iptables", "-w", "-F", "INPUT"]);
}
