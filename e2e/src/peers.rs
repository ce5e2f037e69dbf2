//! The peers' binaries: HAMi's `scheduler` and dra-example-driver's controller and kubelet
//! plugin, built from their source archives by `e2e/peers/build.sh` and cached under
//! `~/.cache/gpuledger/peers/`. Test material: nothing of them is in the product.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{Context, Result, bail};

/// The programs a complete directory holds, by their path in it.
pub const PROGRAMS: [&str; 3] = [
    HAMI_SCHEDULER,
    DRAEX_CONTROLLER,
    "draex/dra-example-kubeletplugin",
];

/// dra-example-driver's controller (`cmd/dra-example-controller`: binding conditions).
pub const DRAEX_CONTROLLER: &str = "draex/dra-example-controller";

/// HAMi's scheduler extender and admission webhook (`cmd/scheduler`).
pub const HAMI_SCHEDULER: &str = "hami/scheduler";

/// How to get the binaries, for every error that finds none.
const HOW: &str = "build them with e2e/peers/build.sh (Go 1.26 on PATH, the archives \
    HAMi-v2.10.0.tar.gz and dra-example-driver-31914ce.tar.gz in GPULEDGER_PEERS_SRC, by default \
    testdata/peers of the checkout; cached in ~/.cache/gpuledger/peers) or set \
    GPULEDGER_PEERS_BIN to a directory that holds hami/scheduler, \
    draex/dra-example-controller and draex/dra-example-kubeletplugin";

/// Where the binaries are: `$GPULEDGER_PEERS_BIN` when set, else the directory `build.sh`
/// prints (the cache at once, or a build of some minutes with its progress on stderr).
#[derive(Debug, Clone)]
pub struct PeerBins {
    dir: PathBuf,
}

impl PeerBins {
    /// Locate (or build) the binaries once per process.
    pub fn get() -> Result<PeerBins> {
        static DIR: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
        let dir = DIR.get_or_init(|| locate().map_err(|e| format!("{e:#}")));
        match dir {
            Ok(d) => Ok(PeerBins { dir: d.clone() }),
            Err(e) => bail!("{e}"),
        }
    }

    /// Path of one program (one of [`PROGRAMS`]).
    pub fn path(&self, program: &str) -> PathBuf {
        self.dir.join(program)
    }
}

fn locate() -> Result<PathBuf> {
    let dir = crate::bins::env_or_build("GPULEDGER_PEERS_BIN", "peers/build.sh")
        .with_context(|| format!("no peer binaries; to get them, {HOW}"))?;
    check(&dir)?;
    Ok(dir)
}

/// Every program of [`PROGRAMS`] is an executable file in `dir`.
fn check(dir: &Path) -> Result<()> {
    for p in PROGRAMS {
        if !dir.join(p).is_file() {
            bail!("{} has no {p}: {HOW}", dir.display());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_without_the_peers_says_how_to_get_them() -> Result<()> {
        let tmp = tempfile::tempdir()?;
        let err = check(tmp.path()).unwrap_err().to_string();
        assert!(err.contains("has no hami/scheduler"), "{err}");
        assert!(err.contains("e2e/peers/build.sh"), "{err}");
        assert!(err.contains("GPULEDGER_PEERS_BIN"), "{err}");
        for p in PROGRAMS {
            let f = tmp.path().join(p);
            std::fs::create_dir_all(f.parent().context("a program has a directory")?)?;
            std::fs::write(&f, "")?;
        }
        check(tmp.path())
    }
}
