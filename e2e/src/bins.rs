//! The binaries the tier runs: Kubernetes (`$KUBE_VERSION`, default in `e2e/kube/build.sh`),
//! containerd 2 and etcd 3.6, built from the Go module proxy by `e2e/kube/build.sh` and cached
//! under `~/.cache/gpuledger/kube/`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use anyhow::{Context, Result, bail};

/// Where the binaries are: `$GPULEDGER_KUBE_BIN` when set, else the directory `build.sh`
/// prints (it builds on first use, tens of minutes on 2 cores, and prints its progress).
#[derive(Debug, Clone)]
pub struct KubeBins {
    dir: PathBuf,
}

/// The feature gates of DRA mode that 1.35 has off (docs/dra.md, "Deploying in DRA mode").
pub const DRA_GATES_1_35: &str =
    "DRAConsumableCapacity=true,DRADeviceBindingConditions=true,DRAExtendedResource=true";

/// The programs a complete directory holds.
pub const PROGRAMS: [&str; 9] = [
    "kube-apiserver",
    "kube-scheduler",
    "kube-controller-manager",
    "kubelet",
    "kubectl",
    "containerd",
    "containerd-shim-runc-v2",
    "ctr",
    "etcd",
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

    /// `--feature-gates` for every Kubernetes component of the tier: on 1.35 the DRA features
    /// gpuledger's DRA mode needs (consumable capacity, binding conditions, extended-resource
    /// mapping; alpha there, on by default from 1.36), nothing on later releases.
    pub fn feature_gate_flags(&self) -> Result<Vec<String>> {
        let v = self.version()?;
        Ok(match v.strip_prefix("v1.35.") {
            Some(_) => vec![format!("--feature-gates={DRA_GATES_1_35}")],
            None => Vec::new(),
        })
    }

    /// The Kubernetes version of these binaries (`v1.37.2`), as kubectl reports it (asked
    /// once per process: every component of every cluster needs it for its flags).
    pub fn version(&self) -> Result<String> {
        static VERSION: OnceLock<std::result::Result<String, String>> = OnceLock::new();
        match VERSION.get_or_init(|| self.ask_version().map_err(|e| format!("{e:#}"))) {
            Ok(v) => Ok(v.clone()),
            Err(e) => bail!("{e}"),
        }
    }

    fn ask_version(&self) -> Result<String> {
        let out = Command::new(self.path("kubectl"))
            .args(["version", "--client", "-o", "json"])
            .output()
            .context("running kubectl version")?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).with_context(|| {
            format!(
                "kubectl version printed {:?}",
                String::from_utf8_lossy(&out.stdout)
            )
        })?;
        v["clientVersion"]["gitVersion"]
            .as_str()
            .map(str::to_string)
            .context("kubectl version printed no clientVersion.gitVersion")
    }
}

fn locate() -> Result<PathBuf> {
    let dir = env_or_build("GPULEDGER_KUBE_BIN", "kube/build.sh")?;
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

/// `$var` when set, else the directory the build script `script` (under `e2e/`) prints on
/// stdout: it builds on first use, its progress on stderr, and answers from its cache after.
pub(crate) fn env_or_build(var: &str, script: &str) -> Result<PathBuf> {
    if let Some(d) = std::env::var_os(var) {
        return Ok(PathBuf::from(d));
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(script);
    eprintln!(
        "{var} is not set: {} (cached after the first build)",
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
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}
