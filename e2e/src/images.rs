//! Container images without a registry: Debian's static busybox packed as OCI images with
//! `umoci`, turned into an archive with `skopeo` and imported into containerd with its `ctr`.
//! The pause image is the same busybox, sleeping.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The sandbox ("pause") image containerd starts for every pod.
pub const PAUSE_IMAGE: &str = "e2e.local/pause:1";

/// The static busybox from Debian's `busybox-static`.
pub const BUSYBOX: &str = "/bin/busybox";

fn run(cmd: &mut Command) -> Result<()> {
    let what = format!("{cmd:?}");
    let out = cmd.output().with_context(|| format!("running {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Build `name` (e.g. `e2e.local/busybox:1`) from busybox with `cmd` as its command, as a
/// docker-archive under `dir`; the archive's path.
pub fn build(dir: &Path, name: &str, cmd: &[&str]) -> Result<std::path::PathBuf> {
    build_with(dir, name, cmd, &[])
}

/// [`build`], with host files copied into the image: `(host path, path in the image)`.
pub fn build_with(
    dir: &Path,
    name: &str,
    cmd: &[&str],
    files: &[(&Path, &str)],
) -> Result<std::path::PathBuf> {
    if !Path::new(BUSYBOX).is_file() {
        bail!("{BUSYBOX} missing: apt-get install -y busybox-static (or `make test-e2e`)");
    }
    let tag = name.rsplit('/').next().unwrap_or(name).replace(':', "-");
    let work = dir.join(format!("image-{tag}"));
    let (layout, bundle) = (work.join("oci"), work.join("bundle"));
    std::fs::create_dir_all(&work)?;
    let image = format!("{}:img", layout.display());
    run(Command::new("umoci")
        .args(["init", "--layout"])
        .arg(&layout))?;
    run(Command::new("umoci").args(["new", "--image", &image]))?;
    run(Command::new("umoci")
        .args(["unpack", "--image", &image])
        .arg(&bundle))?;
    let bin = bundle.join("rootfs/bin");
    std::fs::create_dir_all(&bin)?;
    std::fs::copy(BUSYBOX, bin.join("busybox")).context("copying busybox into the image")?;
    for applet in ["sh", "sleep", "env", "cat", "echo", "ls", "test"] {
        std::os::unix::fs::symlink("busybox", bin.join(applet))?;
    }
    for (host, at) in files {
        let to = bundle.join("rootfs").join(at.trim_start_matches('/'));
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::copy(host, &to)
            .with_context(|| format!("copying {} into the image", host.display()))?;
    }
    run(Command::new("umoci")
        .args(["repack", "--image", &image])
        .arg(&bundle))?;
    let mut config = Command::new("umoci");
    config.args(["config", "--image", &image, "--config.env=PATH=/bin"]);
    for c in cmd {
        config.arg(format!("--config.cmd={c}"));
    }
    run(&mut config)?;
    let archive = dir.join(format!("{tag}.tar"));
    run(Command::new("skopeo")
        .args(["copy", "--quiet", &format!("oci:{image}")])
        .arg(format!("docker-archive:{}:{name}", archive.display())))?;
    let _ = std::fs::remove_dir_all(&work);
    Ok(archive)
}

/// Import an archive into containerd's `k8s.io` namespace (the one the CRI plugin uses) with
/// `ctr`, containerd's own client.
pub fn import(ctr: &Path, containerd_sock: &Path, archive: &Path) -> Result<()> {
    run(Command::new(ctr)
        .arg(format!("--address={}", containerd_sock.display()))
        .args(["-n", "k8s.io", "images", "import"])
        .arg(archive))
}

/// Build and import the test image and the pause image.
pub fn prepare(dir: &Path, ctr: &Path, containerd_sock: &Path) -> Result<()> {
    let busybox = build(dir, crate::pods::IMAGE, &["sh"])?;
    let pause = build(dir, PAUSE_IMAGE, &["sleep", "2147483647"])?;
    import(ctr, containerd_sock, &busybox)?;
    import(ctr, containerd_sock, &pause)?;
    Ok(())
}
