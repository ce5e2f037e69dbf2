//! The kernel's dmem cgroup controller (cgroup v2, Linux 6.14+), as its interface files are
//! documented in `Documentation/admin-guide/cgroup-v2.rst`: `dmem.capacity` in the root cgroup
//! lists each device memory region and its size (`drm/0000:03:00.0/vram0 8514437120`);
//! `dmem.max` in a non-root cgroup is a nested-keyed file, read as one `<region> <bytes|max>`
//! line per region and written one `<region> <bytes|max>` line at a time; `dmem.current` is
//! what the cgroup uses. The controller must be enabled in the parent's
//! `cgroup.subtree_control` (`+dmem`) for a cgroup to have the files.
//!
//! NVIDIA's driver (r615+) names each GPU's region `nvidia/<PCI address>/vidmem`; DRM drivers
//! `drm/<PCI address>/vram0`.
//!
//! This module decides each pod's limits from the view ([`wanted`]), writes a limit and reads
//! back what the kernel kept; [`limits`] keeps the pods' cgroups equal to the ledger.

pub mod limits;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

/// A region's limit: bytes, or `max` (none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// At most this many bytes.
    Bytes(u64),
    /// No limit.
    Max,
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Limit::Bytes(b) => write!(f, "{b}"),
            Limit::Max => f.write_str("max"),
        }
    }
}

/// Parse a nested-keyed dmem file (`dmem.capacity`, `dmem.max`, `dmem.current`): region →
/// value. A line that is not `<region> <bytes|max>` is an error naming it.
pub fn parse(text: &str) -> Result<BTreeMap<String, Limit>, String> {
    let mut out = BTreeMap::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let mut parts = line.split_whitespace();
        let (Some(region), Some(value), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(format!("{line:?} is not `<region> <bytes|max>`"));
        };
        let limit = match value {
            "max" => Limit::Max,
            v => Limit::Bytes(
                v.parse()
                    .map_err(|_| format!("{line:?}: {v:?} is neither bytes nor max"))?,
            ),
        };
        out.insert(region.to_string(), limit);
    }
    Ok(out)
}

/// The dmem region of the GPU at PCI address `bus_id` among those of `dmem.capacity`: NVML
/// writes the domain with 8 digits (`00000000:03:00.0`), the kernel with 4 (`0000:03:00.0`).
/// The region of the device's video memory (`…/vram0`) when there are several.
pub fn region_of<'a>(capacity: &'a BTreeMap<String, Limit>, bus_id: &str) -> Option<&'a str> {
    let bus = bus_id.to_ascii_lowercase();
    let short = match bus.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => {
            format!("{}:{rest}", &domain[domain.len() - 4..])
        }
        _ => bus,
    };
    let mut of_device = capacity
        .keys()
        .filter(|r| r.split('/').nth(1) == Some(short.as_str()));
    let all: Vec<&String> = of_device.by_ref().collect();
    all.iter()
        .find(|r| r.ends_with("/vidmem") || r.ends_with("/vram0"))
        .or(all.first())
        .map(|r| r.as_str())
}

/// The dmem region of each GPU (`(UUID, NVML PCI bus id)`) in the root's `dmem.capacity`
/// text; a GPU the driver did not register is an error naming it.
pub fn regions(
    capacity: &str,
    gpus: &[(String, String)],
) -> Result<BTreeMap<String, String>, String> {
    let cap = parse(capacity).map_err(|e| format!("dmem.capacity: {e}"))?;
    gpus.iter()
        .map(|(uuid, bus)| {
            region_of(&cap, bus)
                .map(|r| (uuid.clone(), r.to_string()))
                .ok_or_else(|| {
                    format!(
                        "dmem.capacity names no region of {uuid} (PCI {bus}): its driver did not register the GPU's memory with the dmem controller ({:?})",
                        cap.keys().collect::<Vec<_>>()
                    )
                })
        })
        .collect()
}

/// Each pod's limit per region from the view: the sum of its allocations' shares on each GPU
/// of `regions` (the pod's containers share the pod's cgroup), in bytes. Keyed by pod UID.
/// A DRA claim's grant names the claim, not a pod: its share counts for each pod the claim is
/// reserved for (its consumers, the claim's `reservedFor`), as enforcement charges it.
pub fn wanted(
    view: &crate::view::View,
    regions: &BTreeMap<String, String>,
) -> BTreeMap<String, BTreeMap<String, u64>> {
    let mut out: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    for a in view.allocs.values() {
        let pods: Vec<&str> = match &a.claim {
            Some(c) => c.consumers.iter().map(|p| p.uid.as_str()).collect(),
            None => a.pod.iter().map(|p| p.uid.as_str()).collect(),
        };
        for s in &a.shares {
            let Some(region) = regions.get(&s.gpu_uuid) else {
                continue;
            };
            for pod in &pods {
                let e = out
                    .entry((*pod).to_string())
                    .or_default()
                    .entry(region.clone())
                    .or_default();
                *e = e.saturating_add(s.mem_mib.saturating_mul(1 << 20));
            }
        }
    }
    out
}

/// Write `limit` for `region` into `<cgroup>/dmem.max` and read back what the kernel kept for
/// it: the answer is what the cgroup is now held to, which the caller reports (a kernel that
/// rounds or refuses the value shows it here).
pub fn apply(cgroup: &Path, region: &str, limit: Limit) -> Result<Limit, String> {
    let path = cgroup.join("dmem.max");
    // O_TRUNC is ignored by cgroup files, and keeps a plain file (tests) to the last write.
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&path)
        .map_err(|e| {
            format!(
                "opening {}: {e} (is +dmem in the parent's cgroup.subtree_control?)",
                path.display()
            )
        })?;
    // One write per line: the kernel parses each write(2) on its own.
    f.write_all(format!("{region} {limit}\n").as_bytes())
        .map_err(|e| format!("writing {region} {limit} to {}: {e}", path.display()))?;
    drop(f);
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("reading back {}: {e}", path.display()))?;
    parse(&text)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .get(region)
        .copied()
        .ok_or_else(|| {
            format!(
                "{} has no line for {region} after the write",
                path.display()
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAPACITY: &str = "drm/0000:03:00.0/vram0 85899345920\ndrm/0000:03:00.0/stolen 8650752\ndrm/0000:41:00.0/vram0 85899345920\n";

    /// A cgroup v2 tree as the kernel shows one with the dmem controller on: the root's
    /// capacity, and a pod cgroup whose `dmem.max` starts at `max` for every region. A plain
    /// file cannot parse writes, so the test writes what a write leaves: the region's line.
    fn tree() -> tempfile::TempDir {
        let d = tempfile::tempdir().expect("tempdir");
        std::fs::write(d.path().join("cgroup.controllers"), "cpu memory dmem\n").expect("w");
        std::fs::write(d.path().join("dmem.capacity"), CAPACITY).expect("w");
        let pod = d.path().join("kubepods/podabc");
        std::fs::create_dir_all(&pod).expect("mkdir");
        std::fs::write(pod.join("dmem.max"), "").expect("w");
        d
    }

    #[test]
    fn capacity_is_parsed_and_a_gpu_is_found_by_its_nvml_bus_id() {
        let cap = parse(CAPACITY).expect("parse");
        assert_eq!(cap["drm/0000:03:00.0/vram0"], Limit::Bytes(85_899_345_920));
        assert_eq!(
            region_of(&cap, "00000000:03:00.0"),
            Some("drm/0000:03:00.0/vram0")
        );
        assert_eq!(
            region_of(&cap, "0000:41:00.0"),
            Some("drm/0000:41:00.0/vram0")
        );
        assert_eq!(region_of(&cap, "00000000:99:00.0"), None);
        assert!(
            parse("drm/x/vram0 lots\n")
                .expect_err("bad")
                .contains("neither bytes nor max")
        );
        assert!(parse("drm/x/vram0\n").is_err());
        assert_eq!(
            parse("drm/x/vram0 max\n").expect("max")["drm/x/vram0"],
            Limit::Max
        );
    }

    #[test]
    fn nvidia_regions_are_found_and_a_pod_is_held_to_the_sum_of_its_shares() {
        use gpuledger_proto::ledger::v1 as pb;
        let cap =
            "nvidia/0000:3b:00.0/vidmem 85899345920\nnvidia/0000:86:00.0/vidmem 85899345920\n";
        let gpus = vec![
            ("GPU-0".to_string(), "00000000:3B:00.0".to_string()),
            ("GPU-1".to_string(), "00000000:86:00.0".to_string()),
        ];
        let r = regions(cap, &gpus).expect("regions");
        assert_eq!(r["GPU-0"], "nvidia/0000:3b:00.0/vidmem");
        let missing = vec![("GPU-9".to_string(), "00000000:99:00.0".to_string())];
        assert!(regions(cap, &missing).expect_err("none").contains("GPU-9"));
        let mut v = crate::view::View::default();
        let alloc = |id, uid: &str, gpu: &str, mem_mib| pb::Allocation {
            id,
            pod: Some(pb::PodRef {
                uid: uid.into(),
                ..Default::default()
            }),
            shares: vec![pb::GpuShare {
                gpu_uuid: gpu.into(),
                mem_mib,
                core_milli: 0,
            }],
            ..Default::default()
        };
        v.allocs.insert(1, alloc(1, "a", "GPU-0", 1024));
        v.allocs.insert(2, alloc(2, "a", "GPU-0", 2048));
        v.allocs.insert(3, alloc(3, "b", "GPU-1", 512));
        let w = wanted(&v, &r);
        assert_eq!(w["a"]["nvidia/0000:3b:00.0/vidmem"], 3072 << 20);
        assert_eq!(w["b"]["nvidia/0000:86:00.0/vidmem"], 512 << 20);
        assert_eq!(w.len(), 2);
    }

    /// Regression: a claim grant's `pod` names the claim, so a DRA pod's cgroup got no limit.
    #[test]
    fn a_claims_share_counts_for_each_pod_that_consumes_it() {
        use gpuledger_proto::ledger::v1 as pb;
        let r: BTreeMap<String, String> = [("GPU-0".to_string(), "nvidia/r0".to_string())].into();
        let pod_ref = |uid: &str| pb::PodRef {
            uid: uid.into(),
            ..Default::default()
        };
        let claim = |id, claim_uid: &str, consumers: &[&str], mem_mib| pb::Allocation {
            id,
            pod: Some(pod_ref(claim_uid)),
            shares: vec![pb::GpuShare {
                gpu_uuid: "GPU-0".into(),
                mem_mib,
                core_milli: 0,
            }],
            claim: Some(Box::new(pb::ClaimGrant {
                consumers: consumers.iter().map(|u| pod_ref(u)).collect(),
                ..Default::default()
            })),
            ..Default::default()
        };
        let mut v = crate::view::View::default();
        v.allocs.insert(1, claim(1, "claim-1", &["p"], 1024));
        v.allocs.insert(2, claim(2, "claim-2", &["p", "q"], 2048));
        // Reserved for no pod yet: no cgroup to hold to it.
        v.allocs.insert(3, claim(3, "claim-3", &[], 4096));
        let w = wanted(&v, &r);
        assert_eq!(w["p"]["nvidia/r0"], 3072 << 20);
        assert_eq!(w["q"]["nvidia/r0"], 2048 << 20);
        assert_eq!(w.len(), 2, "a claim's own uid is no pod: {w:?}");
    }

    #[test]
    fn a_share_is_written_as_one_line_and_read_back() {
        let d = tree();
        let pod = d.path().join("kubepods/podabc");
        let got = apply(&pod, "drm/0000:03:00.0/vram0", Limit::Bytes(4 << 30)).expect("apply");
        assert_eq!(got, Limit::Bytes(4 << 30));
        assert_eq!(
            std::fs::read_to_string(pod.join("dmem.max")).expect("read"),
            "drm/0000:03:00.0/vram0 4294967296\n"
        );
        // A cgroup without the controller has no dmem.max: the error says where to look.
        let bare = d.path().join("kubepods");
        let e = apply(&bare, "drm/0000:03:00.0/vram0", Limit::Max).expect_err("no file");
        assert!(e.contains("cgroup.subtree_control"), "{e}");
    }
}
