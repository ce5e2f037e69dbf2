//! The Kubernetes binaries the tier runs: built from Debian's source package by
//! `e2e/kube/build.sh`, cached under `~/.cache/gpuledger/kube/<source version>-<patch>/`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use anyhow::{Context, Result, bail};

/// Where the binaries are: `$GPULEDGER_KUBE_BIN` when set, else the directory `build.sh`
/// prints (it builds on first use, ~15 min on 2 cores, and prints its progress).
#[derive(Debug, Clone)]
pub struct KubeBins {
    dir: PathBuf,
}

/// The programs a complete directory holds.
pub const PROGRAMS: [&str; 5] = [
    "kube-apiserver",
    "kube-scheduler",
    "kubectl",
    "kubelet",
    "kubelet-unpatched",
];

impl KubeBins {
    /// Locate (or build) the binaries once per process.
    pub fn get() -> Result<KubeBins> {
        static DIR: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
        let dir = DIR.get_or_init(|| locate().map_err(|e| format!("{e:#}")));
        match dir {
            Ok(d) => Ok(KubeBins { dir: d.clone() }),
            Err(e) => bail!("{e}"),
        }
    }

    /// Path of one program.
    pub fn path(&self, program: &str) -> PathBuf {
        self.dir.join(program)
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

fn locate() -> Result<PathBuf> {
    let dir = match std::env::var_os("GPULEDGER_KUBE_BIN") {
        Some(d) => PathBuf::from(d),
        None => {
            let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("kube/build.sh");
            eprintln!(
                "GPULEDGER_KUBE_BIN is not set: {} (cached after the first build)",
                script.display()
            );
            let out = Command::new(&script)
                .stderr(Stdio::inherit())
                .output()
                .with_context(|| format!("running {}", script.display()))?;
            if !out.status.success() {
                bail!(
                    "{} failed ({}); see its output above",
                    script.display(),
                    out.status
                );
            }
            PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
        }
    };
    for p in PROGRAMS {
        if !dir.join(p).is_file() {
            bail!(
                "{} has no {p}: build the Kubernetes binaries with e2e/kube/build.sh (or `make test-e2e`)",
                dir.display()
            );
        }
    }
    Ok(dir)
}
