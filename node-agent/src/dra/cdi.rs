//! Per-claim CDI specs: one file per prepared claim, `gpuledger.io-claim_<claim UID>.json`,
//! kind `gpuledger.io/claim`, one device per request (`<claim UID>-<request>`) whose
//! container edits carry the environment (and MPS mount) the device plugin's Allocate exports
//! for the same shares. Written atomically: a runtime never reads half a spec.

use std::io::Write;
use std::path::{Path, PathBuf};

use gpuledger_proto::deviceplugin::v1beta1 as dp;
use serde_json::{Value, json};

/// The CDI kind of the claim devices (`<vendor>/<class>`).
pub const KIND: &str = "gpuledger.io/claim";

/// The CDI specification version the specs declare (containerd 2 and CRI-O read it).
pub const SPEC_VERSION: &str = "0.6.0";

/// The spec file of claim `uid` in `dir`.
pub fn spec_path(dir: &Path, uid: &str) -> PathBuf {
    dir.join(format!("gpuledger.io-claim_{uid}.json"))
}

/// The CDI device name of a claim's request: `<claim UID>-<request>`, a subrequest's `/`
/// written `_` (CDI names allow letters, digits, `-`, `_`, `.` and `:`).
pub fn device_name(uid: &str, request: &str) -> String {
    format!("{uid}-{}", request.replace('/', "_"))
}

/// The fully qualified CDI device id the kubelet hands the runtime.
pub fn device_id(uid: &str, request: &str) -> String {
    format!("{KIND}={}", device_name(uid, request))
}

/// A claim's spec: one device per `(request, container edits)`, the edits being what
/// Allocate answers for that request's shares.
pub fn spec(uid: &str, devices: &[(String, dp::ContainerAllocateResponse)]) -> Value {
    let devices: Vec<Value> = devices
        .iter()
        .map(|(request, r)| {
            let mut env: Vec<String> = r.envs.iter().map(|(k, v)| format!("{k}={v}")).collect();
            env.sort();
            let mounts: Vec<Value> = r
                .mounts
                .iter()
                .map(|m| {
                    json!({
                        "hostPath": m.host_path,
                        "containerPath": m.container_path,
                        "options": [if m.read_only { "ro" } else { "rw" }, "nosuid", "nodev", "bind"],
                    })
                })
                .collect();
            let mut edits = json!({ "env": env });
            if !mounts.is_empty() {
                edits["mounts"] = Value::Array(mounts);
            }
            json!({ "name": device_name(uid, request), "containerEdits": edits })
        })
        .collect();
    json!({ "cdiVersion": SPEC_VERSION, "kind": KIND, "devices": devices })
}

/// Write `bytes` as `path` atomically: a temporary name that does not end in `.json` (the
/// runtime's CDI cache reads only `*.json` and `*.yaml`), fsync, rename, fsync the directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| std::io::Error::other("a spec path needs a directory"))?;
    std::fs::create_dir_all(dir)?;
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::other("a spec path needs a file name"))?;
    let tmp = dir.join(format!(".{}.tmp", name.to_string_lossy()));
    let written = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Remove claim `uid`'s spec from `dir`; a spec that is not there is removed already.
pub fn remove(dir: &Path, uid: &str) -> std::io::Result<()> {
    match std::fs::remove_file(spec_path(dir, uid)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => match std::fs::File::open(dir) {
            Ok(d) => d.sync_all(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_names_its_devices_by_claim_and_request_and_is_written_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut r = dp::ContainerAllocateResponse::default();
        r.envs.insert("GPULEDGER_GPU_MEM_MIB".into(), "3000".into());
        let s = spec("u-1", &[("c0/big".into(), r)]);
        assert_eq!(s["kind"], KIND);
        assert_eq!(s["devices"][0]["name"], "u-1-c0_big");
        assert_eq!(
            s["devices"][0]["containerEdits"]["env"][0],
            "GPULEDGER_GPU_MEM_MIB=3000"
        );
        assert_eq!(device_id("u-1", "c0"), "gpuledger.io/claim=u-1-c0");
        let path = spec_path(&dir.path().join("cdi"), "u-1");
        write_atomic(&path, b"{}").expect("write");
        write_atomic(&path, b"{\"again\":1}").expect("rewrite");
        let names: Vec<String> = std::fs::read_dir(dir.path().join("cdi"))
            .expect("dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            ["gpuledger.io-claim_u-1.json"],
            "no temporary file left"
        );
        assert_eq!(
            std::fs::read_to_string(&path).expect("read"),
            "{\"again\":1}"
        );
        remove(&dir.path().join("cdi"), "u-1").expect("remove");
        remove(&dir.path().join("cdi"), "u-1").expect("a missing spec is removed already");
        assert!(!path.exists());
    }
}
