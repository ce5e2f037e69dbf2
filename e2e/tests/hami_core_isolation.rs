//! `--isolation=hami-core` on a stock kubelet (containerd 2 with CDI, runc): the agent puts
//! HAMi-core into each GPU container as HAMi's own device plugin does, and the container's
//! dynamic loader really loads it. The library is a stand-in built here with `cc`: its
//! constructor prints that it ran and the limits it saw, and appends the same line to the
//! shared-cache file the agent named. The image holds a dynamically linked program and the
//! host's glibc (the tier's busybox is static, and a static program never reads
//! `/etc/ld.so.preload`).
//!
//! On the device-plugin path a container then escapes: `/etc/ld.so.preload` cannot be removed
//! (a read-only bind mount), so it unsets HAMi-core's variables and runs the program again,
//! which then uses more than its share on the fake NVML. The NVML backstop kills it, and the
//! pod's Event says it escaped `hami-core`. On the DRA path the claim's CDI spec carries the
//! same edits, and the library loads with the grant's limits.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use gpuledger_e2e::real_node::{RealNode, host_network};
use gpuledger_e2e::{E2e, Options, images, pods, until};
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use serde_json::json;

const IMAGE: &str = "e2e.local/gpu-app:1";

const STANDIN: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
static const char *v(const char *k) { const char *s = getenv(k); return s ? s : "unset"; }
__attribute__((constructor)) static void hami_standin(void) {
    char line[512];
    snprintf(line, sizeof line,
        "hami-standin loaded pid=%d mem_limit_0=%s sm_limit=%s cache=%s\n", (int)getpid(),
        v("CUDA_DEVICE_MEMORY_LIMIT_0"), v("CUDA_DEVICE_SM_LIMIT"),
        v("CUDA_DEVICE_MEMORY_SHARED_CACHE"));
    fputs(line, stderr);
    const char *cache = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    FILE *f = cache ? fopen(cache, "a") : NULL;
    if (f) { fputs(line, f); fclose(f); }
}
"#;

const APP: &str = r#"
#include <stdio.h>
#include <string.h>
#include <unistd.h>
int main(int argc, char **argv) {
    printf("gpu-app running\n");
    fflush(stdout);
    if (argc > 1 && strcmp(argv[1], "once") == 0) return 0;
    for (;;) pause();
}
"#;

/// The stand-in library and the image archive of the dynamically linked program, built in `dir`.
fn build(dir: &Path) -> Result<(PathBuf, PathBuf)> {
    let cc = |args: &[&str]| -> Result<()> {
        let out = Command::new("cc").current_dir(dir).args(args).output()?;
        if !out.status.success() {
            bail!("cc {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    };
    std::fs::write(dir.join("standin.c"), STANDIN)?;
    std::fs::write(dir.join("app.c"), APP)?;
    cc(&["-shared", "-fPIC", "-o", "libstandin.so", "standin.c"])?;
    cc(&["-o", "gpu-app", "app.c"])?;
    let app = dir.join("gpu-app");
    // The program's loader and libraries, at the paths the program names them.
    let ldd = Command::new("ldd").arg(&app).output()?;
    let text = String::from_utf8_lossy(&ldd.stdout).into_owned();
    let libs: Vec<String> = text
        .lines()
        .filter_map(|l| {
            let path = l.split("=>").last()?.split_whitespace().next()?;
            path.starts_with('/').then(|| path.to_string())
        })
        .collect();
    ensure!(libs.len() >= 2, "ldd named no loader and libc: {text}");
    let mut files: Vec<(&Path, &str)> = vec![(app.as_path(), "/bin/gpu-app")];
    for l in &libs {
        files.push((Path::new(l), l.as_str()));
    }
    let archive = images::build_with(dir, IMAGE, &["sh"], &files)?;
    Ok((dir.join("libstandin.so"), archive))
}

/// A tier whose real node runs `--isolation=hami-core` with the stand-in library, the image
/// imported; and the agent's HAMi-core directory.
async fn start(dir: &Path, dra: bool) -> Result<(E2e, PathBuf)> {
    let (lib, archive) = build(dir)?;
    let hami_dir = dir.join("hami-core");
    let flags = vec![
        "--isolation=hami-core".into(),
        format!("--hami-core-lib={}", lib.display()),
        format!("--hami-core-dir={}", hami_dir.display()),
    ];
    let e = if dra {
        crate::dra_claims::dra_node_with(flags).await?
    } else {
        let e = E2e::start(Options {
            real_node: true,
            agent_flags: flags,
            ..Options::default()
        })
        .await?;
        let node = e.node.as_ref().context("no real node")?;
        node.wait_advertised(&e.client, 128, Duration::from_secs(60))
            .await
            .with_context(|| e.log_tails(20))?;
        e
    };
    e.node
        .as_ref()
        .context("no real node")?
        .import_image(&archive)?;
    Ok((e, hami_dir))
}

fn gpu_pod(name: &str, script: &str) -> serde_json::Value {
    let mut p = host_network(pods::pod(
        name,
        &[
            ("gpuledger.io/gpu-mem", "2048"),
            ("gpuledger.io/gpu-core", "25"),
        ],
        Some(&["sh", "-c", script]),
    ));
    p["spec"]["containers"][0]["image"] = json!(IMAGE);
    p
}

async fn log_with(e: &E2e, ns: &str, pod: &str, uid: &str, what: &str, n: usize) -> Result<String> {
    let node = e.node.as_ref().context("no real node")?;
    until(
        &format!("{pod} prints {what} {n} time(s)"),
        Duration::from_secs(120),
        || async {
            let text = node.container_log(ns, pod, uid, "main").unwrap_or_default();
            Ok((text.matches(what).count() >= n).then_some(text))
        },
    )
    .await
    .with_context(|| e.log_tails(30))
}

/// The host pid of the live `gpu-app` process holding allocation `id` (the tier's kubelet
/// makes no pod cgroups, so its environment says which container it is).
fn host_pid_of_app(id: u64) -> Option<u32> {
    let want = format!("GPULEDGER_ALLOCATION_ID={id}");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|p| {
        let pid: u32 = p.file_name().to_str()?.parse().ok()?;
        let comm = std::fs::read_to_string(p.path().join("comm")).ok()?;
        let env = std::fs::read(p.path().join("environ")).ok()?;
        (comm.trim() == "gpu-app" && env.split(|b| *b == 0).any(|v| v == want.as_bytes()))
            .then_some(pid)
    })
}

fn loaded_line<'a>(logs: &'a str, limit: &str) -> Option<&'a str> {
    logs.lines()
        .find(|l| l.contains("hami-standin loaded") && l.contains(&format!("mem_limit_0={limit} ")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes with a real kubelet, containerd and root: make test-e2e"]
async fn hami_core_loads_in_the_container_and_an_escape_is_killed_by_the_backstop() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let (mut e, hami_dir) = start(tmp.path(), false).await?;
    e.namespace("hami").await?;
    let script = "gpu-app once; busybox rm -f /etc/ld.so.preload && echo preload=removed || echo preload=kept; \
                  env -u CUDA_DEVICE_MEMORY_LIMIT_0 -u CUDA_DEVICE_SM_LIMIT -u CUDA_DEVICE_MEMORY_SHARED_CACHE gpu-app";
    let uid = pods::create(&e.client, "hami", &gpu_pod("escape", script))
        .await?
        .metadata
        .uid
        .unwrap_or_default();
    let logs = log_with(&e, "hami", "escape", &uid, "gpu-app running", 2).await?;

    let ledger = e.gl.ledger().await?;
    let a = ledger.allocs_of_pod(&uid);
    ensure!(a.len() == 1, "{} allocations for the pod", a.len());
    let (id, gpu) = (a[0].id, a[0].shares[0].gpu_uuid.clone());
    // The loader loaded the library with the share's limits and the allocation's cache file,
    // which is the agent's directory for that allocation on the host.
    let loaded = loaded_line(&logs, "2048m")
        .with_context(|| format!("the library did not load with the limits:\n{logs}"))?;
    ensure!(
        loaded.contains("sm_limit=25 ")
            && loaded.contains(&format!("cache=/usr/local/vgpu/{id}.cache")),
        "{loaded}"
    );
    let record = std::fs::read_to_string(hami_dir.join(format!("containers/{id}/{id}.cache")))
        .context("the cache file on the host")?;
    ensure!(record.contains("mem_limit_0=2048m"), "{record}");
    ensure!(
        logs.contains("preload=kept"),
        "/etc/ld.so.preload was removed:\n{logs}"
    );
    ensure!(
        loaded_line(&logs, "unset").is_some(),
        "the escaped run did not start without the limits:\n{logs}"
    );

    // The escaped process goes over its share: the backstop kills it and says what it escaped.
    let pid = until(
        "the escaped gpu-app's host pid",
        Duration::from_secs(30),
        || async { Ok(host_pid_of_app(id)) },
    )
    .await?;
    let node: &mut RealNode = e.node.as_mut().context("no real node")?;
    node.nvml.set_process(pid, 5000, &gpu)?;
    let events = until(
        "the GpuLimitExceeded Event",
        Duration::from_secs(60),
        || async {
            let t = pods::events_text(&e.client, "hami", "escape").await?;
            Ok(t.contains("GpuLimitExceeded").then_some(t))
        },
    )
    .await
    .with_context(|| e.log_tails(30))?;
    ensure!(
        events.contains("escaped this node's first isolation layer, hami-core"),
        "{events}"
    );
    let pods: Api<Pod> = Api::namespaced(e.client.clone(), "hami");
    until(
        "the killed container ends",
        Duration::from_secs(60),
        || async {
            let p = pods.get("escape").await?;
            Ok((p.status.and_then(|s| s.phase).as_deref() == Some("Failed")).then_some(()))
        },
    )
    .await?;
    ensure!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "the escaped process {pid} is still alive"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real Kubernetes with a real kubelet, containerd and root: make test-e2e"]
async fn hami_core_loads_in_a_dra_claims_container() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let (e, _) = start(tmp.path(), true).await?;
    e.namespace("hamidra").await?;
    let uid = pods::create(
        &e.client,
        "hamidra",
        &gpu_pod("claim", "gpu-app once; sleep 3600"),
    )
    .await?
    .metadata
    .uid
    .unwrap_or_default();
    let logs = log_with(&e, "hamidra", "claim", &uid, "gpu-app running", 1).await?;
    let loaded = loaded_line(&logs, "2048m")
        .with_context(|| format!("the library did not load with the grant's limits:\n{logs}"))?;
    ensure!(
        loaded.contains("sm_limit=25 ") && loaded.contains("cache=/usr/local/vgpu/"),
        "{loaded}"
    );
    Ok(())
}
