//! Which binary a test starts: the one cargo built from today's sources.
//!
//! A test of the package that owns a binary gets it from `CARGO_BIN_EXE_<name>`, which cargo
//! sets for that package's integration tests after building the binary. Every other binary is
//! taken from beside the running executable (`target/<profile>/`), and only when it is not
//! older than a source cargo's dep-info (`<name>.d` beside it) says it was built from:
//! `cargo test -p X` after an edit of Y rebuilds Y's library but not Y's binary, and a test
//! that quietly ran the old Y would prove nothing. A test cannot run `cargo build` itself
//! (cargo holds the target directory's lock while tests run), so it fails and says to.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use anyhow::{Context, Result, bail};

/// Path of workspace binary `name` (`gpuledger-allocator`, `libnvidia_ml.so`…): cargo's
/// `CARGO_BIN_EXE_<name>` when set, else the one beside the running executable, checked
/// against its sources with [`check_fresh`].
pub fn bin_path(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the running executable")?;
    resolve(
        name,
        std::env::var_os(format!("CARGO_BIN_EXE_{name}")),
        &exe,
    )
}

/// [`bin_path`] with cargo's variable and the running executable given.
fn resolve(name: &str, cargo_bin_exe: Option<OsString>, exe: &Path) -> Result<PathBuf> {
    if let Some(p) = cargo_bin_exe.map(PathBuf::from).filter(|p| p.is_file()) {
        return Ok(p);
    }
    // Tests run from `target/<profile>/deps`, binaries from `target/<profile>`.
    let dirs = exe.parent().into_iter().flat_map(|d| [Some(d), d.parent()]);
    for d in dirs.flatten() {
        let p = d.join(name);
        if p.is_file() {
            check_fresh(&p)?;
            return Ok(p);
        }
    }
    bail!(
        "binary {name} not found next to {} (build it first: cargo build --workspace)",
        exe.display()
    )
}

/// Fail when `bin` is older than a source file its dep-info lists, or a listed file is gone.
/// A binary without dep-info beside it was not built by cargo there and is taken as it is.
pub fn check_fresh(bin: &Path) -> Result<()> {
    let depinfo = bin.with_extension("d");
    let Ok(text) = std::fs::read_to_string(&depinfo) else {
        return Ok(());
    };
    let built = modified(bin)?;
    let mut newer: Vec<(SystemTime, PathBuf)> = Vec::new();
    for src in dep_sources(&text) {
        match modified(&src) {
            Ok(t) if t <= built => {}
            Ok(t) => newer.push((t, src)),
            Err(_) => bail!(
                "{} was built from {}, which is gone: run `cargo build --workspace`",
                shown(bin),
                shown(&src)
            ),
        }
    }
    let Some((_, newest)) = newer.iter().max_by_key(|(t, _)| *t) else {
        return Ok(());
    };
    let name = bin.file_name().map_or_else(
        || bin.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let dir = bin.parent().map_or_else(String::new, shown);
    let more = match newer.len() {
        1 => String::new(),
        n => format!(" (and {} more of its sources)", n - 1),
    };
    bail!(
        "{name} in {dir} is older than {}{more}: run `cargo build --workspace`",
        shown(newest)
    )
}

fn modified(p: &Path) -> Result<SystemTime> {
    std::fs::metadata(p)
        .and_then(|m| m.modified())
        .with_context(|| format!("reading the modification time of {}", p.display()))
}

/// `p` relative to the workspace root when it lies inside it.
fn shown(p: &Path) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap_or(Path::new("/"));
    p.strip_prefix(root).unwrap_or(p).display().to_string()
}

/// Every prerequisite of a Makefile-style dep-info file (`target: a b\ c`), escapes undone.
fn dep_sources(text: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    for line in text.lines() {
        let Some((_, deps)) = split_target(line) else {
            continue;
        };
        let mut cur = String::new();
        let mut chars = deps.chars();
        while let Some(c) = chars.next() {
            match c {
                '\\' => cur.extend(chars.next()),
                ' ' | '\t' => {
                    if !cur.is_empty() {
                        out.push(PathBuf::from(std::mem::take(&mut cur)));
                    }
                }
                c => cur.push(c),
            }
        }
        if !cur.is_empty() {
            out.push(PathBuf::from(cur));
        }
    }
    out.sort();
    out.dedup();
    out
}

/// The target and the prerequisites of one rule: split at the first `: ` not escaped.
fn split_target(line: &str) -> Option<(&str, &str)> {
    let b = line.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b':' if b.get(i + 1).is_none_or(|c| *c == b' ' || *c == b'\t') => {
                return Some((&line[..i], &line[i + 1..]));
            }
            _ => i += 1,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn touch(p: &Path, t: SystemTime) {
        if let Some(d) = p.parent() {
            std::fs::create_dir_all(d).expect("dir");
        }
        std::fs::write(p, b"x").expect("write");
        let f = std::fs::File::options().write(true).open(p).expect("open");
        f.set_modified(t).expect("set mtime");
    }

    /// A target dir with binary `gpuledger-x` built at `built` from `a.rs` and `b c.rs`.
    fn built_from(dir: &Path, built: SystemTime) -> (PathBuf, PathBuf, PathBuf) {
        let bin = dir.join("target/debug/gpuledger-x");
        let a = dir.join("x/src/a.rs");
        let b = dir.join("x/src/b c.rs");
        touch(&a, built - Duration::from_secs(60));
        touch(&b, built - Duration::from_secs(30));
        touch(&bin, built);
        let depinfo = format!(
            "{}: {} {}\n",
            bin.display(),
            a.display(),
            b.display().to_string().replace(' ', "\\ ")
        );
        std::fs::write(bin.with_extension("d"), depinfo).expect("dep-info");
        (bin, a, b)
    }

    #[test]
    fn dep_info_lists_every_source_with_escapes_undone() {
        let d = "/t/debug/x: /s/a.rs /s/my\\ dir/b.rs\n\n/t/debug/libx.so: /s/a.rs /s/c.rs\n";
        let got = dep_sources(d);
        let want: Vec<PathBuf> = ["/s/a.rs", "/s/c.rs", "/s/my dir/b.rs"]
            .iter()
            .map(PathBuf::from)
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn a_binary_newer_than_its_sources_is_taken() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (bin, _, _) = built_from(dir.path(), SystemTime::now());
        check_fresh(&bin).expect("fresh");
        let exe = dir.path().join("target/debug/deps/some_test-0123");
        assert_eq!(resolve("gpuledger-x", None, &exe).expect("found"), bin);
    }

    #[test]
    fn a_binary_older_than_a_source_is_refused_with_the_command_that_fixes_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let now = SystemTime::now();
        let (bin, a, b) = built_from(dir.path(), now - Duration::from_secs(10));
        touch(&b, now);
        let e = format!("{:#}", check_fresh(&bin).expect_err("stale"));
        assert!(e.starts_with("gpuledger-x in "), "{e}");
        assert!(e.contains("target/debug is older than"), "{e}");
        assert!(e.contains("x/src/b c.rs"), "{e}");
        assert!(e.ends_with("run `cargo build --workspace`"), "{e}");
        // Two newer sources: the newest is named, the other counted.
        touch(&a, now - Duration::from_secs(5));
        let e = format!("{:#}", check_fresh(&bin).expect_err("stale"));
        assert!(e.contains("b c.rs (and 1 more of its sources)"), "{e}");
        // Through bin_path's lookup too.
        let exe = dir.path().join("target/debug/deps/some_test-0123");
        assert!(resolve("gpuledger-x", None, &exe).is_err());
    }

    #[test]
    fn a_source_that_is_gone_makes_the_binary_stale() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (bin, a, _) = built_from(dir.path(), SystemTime::now());
        std::fs::remove_file(&a).expect("rm");
        let e = format!("{:#}", check_fresh(&bin).expect_err("stale"));
        assert!(e.contains("which is gone"), "{e}");
    }

    #[test]
    fn cargos_own_path_wins_and_needs_no_dep_info() {
        let dir = tempfile::tempdir().expect("tempdir");
        let now = SystemTime::now();
        let (bin, _, b) = built_from(dir.path(), now - Duration::from_secs(10));
        touch(&b, now);
        let own = dir.path().join("elsewhere/gpuledger-x");
        touch(&own, now);
        let exe = dir.path().join("target/debug/deps/some_test-0123");
        let got = resolve("gpuledger-x", Some(own.clone().into_os_string()), &exe);
        assert_eq!(got.expect("cargo's binary"), own);
        // A variable naming no file falls back to the lookup (and its check).
        let gone = Some(dir.path().join("nothing").into_os_string());
        assert!(resolve("gpuledger-x", gone, &exe).is_err());
        assert!(bin.is_file());
    }

    #[test]
    fn a_binary_without_dep_info_is_taken_as_it_is() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bin = dir.path().join("gpuledger-y");
        touch(&bin, SystemTime::now());
        check_fresh(&bin).expect("nothing to compare");
    }
}
