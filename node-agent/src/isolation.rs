//! The node's first isolation layer (`--isolation`), in front of the NVML sampling and pidfd
//! kill that stand behind every mode: what each needs from the node, checked once at start so
//! that an agent never runs with weaker isolation than it was told to, and what each adds to a
//! container (HAMi-core's library, preload file, limits and shared-cache file).

use std::path::{Path, PathBuf};

use clap::ValueEnum;
use gpuledger_proto::deviceplugin::v1beta1 as dp;

/// The first layer in front of a container's share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum Isolation {
    /// NVML sampling and a kill only: a process can exceed its share until the next sample.
    #[default]
    Nvml,
    /// HAMi-core (`libvgpu.so`) preloaded into every container: CUDA allocations beyond the
    /// share fail inside the process.
    HamiCore,
    /// The CUDA MPS server, run by the agent, holding each client to its share.
    Mps,
    /// The kernel's dmem cgroup controller: the pod's cgroup `dmem.max`.
    Dmem,
}

impl Isolation {
    /// The name on the command line, in the inventory, the metrics and the Events.
    pub fn as_str(self) -> &'static str {
        match self {
            Isolation::Nvml => "nvml",
            Isolation::HamiCore => "hami-core",
            Isolation::Mps => "mps",
            Isolation::Dmem => "dmem",
        }
    }
}

/// Where HAMi-core's library is inside a container, as HAMi's device plugin mounts it.
pub const HAMI_LIB_IN_CONTAINER: &str = "/usr/local/vgpu/libvgpu.so";
/// The container directory holding the library and the shared-cache file.
pub const HAMI_DIR_IN_CONTAINER: &str = "/usr/local/vgpu";
/// HAMi-core's lock directory inside a container.
pub const HAMI_LOCK_IN_CONTAINER: &str = "/tmp/vgpulock";
/// The loader's preload list.
pub const LD_SO_PRELOAD: &str = "/etc/ld.so.preload";
/// The oldest driver branch whose kernel module registers GPU memory with the dmem controller.
pub const DMEM_MIN_DRIVER: u32 = 615;

/// HAMi-core on this node: the library on the host and the agent's directory for the preload
/// file, the lock directory and each container's shared-cache directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HamiCore {
    /// The host's `libvgpu.so`.
    pub lib: PathBuf,
    /// The agent's directory (`ld.so.preload`, `vgpulock/`, `containers/<allocation>/`).
    pub dir: PathBuf,
}

impl HamiCore {
    /// The preload file the containers get as `/etc/ld.so.preload`.
    pub fn preload(&self) -> PathBuf {
        self.dir.join("ld.so.preload")
    }

    /// The host directory of allocation `id`'s shared-cache file.
    pub fn cache_dir(&self, id: u64) -> PathBuf {
        self.dir.join("containers").join(id.to_string())
    }

    /// Put the library, its preload list and its files into a container holding allocation
    /// `id` (the first of its grants), as HAMi's device plugin does: the library read-only at
    /// [`HAMI_LIB_IN_CONTAINER`], the preload file read-only at `/etc/ld.so.preload` (a read-only
    /// bind mount: the container cannot edit or remove it), the allocation's own cache
    /// directory at [`HAMI_DIR_IN_CONTAINER`] with `CUDA_DEVICE_MEMORY_SHARED_CACHE` in it, and
    /// the node's lock directory. The limit variables are set whatever the mode.
    pub fn edit(&self, id: u64, r: &mut dp::ContainerAllocateResponse) {
        r.envs.insert(
            "CUDA_DEVICE_MEMORY_SHARED_CACHE".into(),
            format!("{HAMI_DIR_IN_CONTAINER}/{id}.cache"),
        );
        let mount = |host: &Path, container: &str, read_only| dp::Mount {
            container_path: container.into(),
            host_path: host.display().to_string(),
            read_only,
        };
        r.mounts.extend([
            mount(&self.cache_dir(id), HAMI_DIR_IN_CONTAINER, false),
            mount(&self.lib, HAMI_LIB_IN_CONTAINER, true),
            mount(&self.dir.join("vgpulock"), HAMI_LOCK_IN_CONTAINER, false),
            mount(&self.preload(), LD_SO_PRELOAD, true),
        ]);
    }

    /// Create allocation `id`'s cache directory (writable by the container's user, whoever it
    /// is, as HAMi's device plugin makes it).
    pub fn make_cache_dir(&self, id: u64) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let d = self.cache_dir(id);
        std::fs::create_dir_all(&d)?;
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777))
    }

    /// Remove allocation `id`'s cache directory; one that is not there is removed already.
    pub fn remove_cache_dir(&self, id: u64) -> std::io::Result<()> {
        match std::fs::remove_dir_all(self.cache_dir(id)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Remove the cache directories of allocations not in `live` (released); the names it
    /// could not remove, with why.
    pub fn sweep(&self, live: &std::collections::HashSet<u64>) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(self.dir.join("containers")) else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u64>().ok())
            .filter(|id| !live.contains(id))
            .filter_map(|id| {
                self.remove_cache_dir(id)
                    .err()
                    .map(|e| format!("{}: {e}", self.cache_dir(id).display()))
            })
            .collect()
    }

    /// Check the library and write the preload file and the lock directory.
    fn install(&self) -> Result<(), String> {
        use std::os::unix::fs::PermissionsExt;
        let meta = std::fs::metadata(&self.lib).map_err(|e| {
            format!(
                "--isolation=hami-core: no HAMi-core library at --hami-core-lib {}: {e} (install HAMi-core's libvgpu.so there, or choose another --isolation)",
                self.lib.display()
            )
        })?;
        if !meta.is_file() {
            return Err(format!(
                "--isolation=hami-core: --hami-core-lib {} is not a file",
                self.lib.display()
            ));
        }
        let io = |what: &str, p: &Path, e: std::io::Error| {
            format!(
                "--isolation=hami-core: cannot write {what} {}: {e} (--hami-core-dir must be a writable host directory)",
                p.display()
            )
        };
        let lock = self.dir.join("vgpulock");
        std::fs::create_dir_all(self.dir.join("containers"))
            .map_err(|e| io("the directory", &self.dir, e))?;
        std::fs::create_dir_all(&lock).map_err(|e| io("the lock directory", &lock, e))?;
        std::fs::set_permissions(&lock, std::fs::Permissions::from_mode(0o777))
            .map_err(|e| io("the lock directory", &lock, e))?;
        crate::dra::cdi::write_atomic(
            &self.preload(),
            format!("{HAMI_LIB_IN_CONTAINER}\n").as_bytes(),
        )
        .map_err(|e| io("the preload file", &self.preload(), e))
    }
}

/// What the node offers, as read at start.
#[derive(Debug, Clone, Default)]
pub struct NodeFacts {
    /// NVML's driver version (`580.95.05`).
    pub driver_version: String,
    /// GPUs with MIG mode on, by UUID.
    pub mig_on: Vec<String>,
    /// The text of `<cgroup root>/cgroup.controllers`; None: no such file (cgroup v1).
    pub cgroup2_controllers: Option<String>,
}

/// What a mode needs, given the flags.
#[derive(Debug, Clone)]
pub struct Wanted {
    /// The mode.
    pub isolation: Isolation,
    /// HAMi-core's paths (--isolation=hami-core).
    pub hami_core: HamiCore,
    /// The cgroup v2 mount (--isolation=dmem).
    pub cgroup_root: PathBuf,
    /// `nvidia-cuda-mps-control` (--isolation=mps); `nvidia-cuda-mps-server` beside it.
    pub mps_control: PathBuf,
}

/// Whether the MPS control program and the server it starts (from the same directory) are
/// there and executable.
fn mps_binaries(control: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let server = control.with_file_name("nvidia-cuda-mps-server");
    for (what, p) in [("control daemon", control), ("server", server.as_path())] {
        let ok = std::fs::metadata(p)
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .map_err(|e| e.to_string());
        match ok {
            Ok(true) => {}
            Ok(false) => {
                return Err(format!(
                    "--isolation=mps: the MPS {what} {} is not an executable file",
                    p.display()
                ));
            }
            Err(e) => {
                return Err(format!(
                    "--isolation=mps: no MPS {what} at {}: {e} (install the NVIDIA driver's nvidia-cuda-mps-control and nvidia-cuda-mps-server there, point --mps-control at them, or choose another --isolation)",
                    p.display()
                ));
            }
        }
    }
    Ok(())
}

/// The driver branch of a version string (`580` of `580.95.05`).
pub fn driver_branch(version: &str) -> Option<u32> {
    version.split('.').next()?.trim().parse().ok()
}

/// Whether the node can serve `w`, and make it ready (HAMi-core's preload file); the refusal
/// says what is missing. Never a weaker mode instead.
pub fn check(w: &Wanted, facts: &NodeFacts) -> Result<(), String> {
    let mode = w.isolation.as_str();
    let no_mig = || match facts.mig_on.as_slice() {
        [] => Ok(()),
        on => Err(format!(
            "--isolation={mode}: MIG mode is on for {on:?}; {mode} cannot hold a share of a MIG-partitioned GPU (turn MIG off, or run --isolation=nvml)"
        )),
    };
    match w.isolation {
        Isolation::Nvml => Ok(()),
        Isolation::HamiCore => {
            no_mig()?;
            w.hami_core.install()
        }
        Isolation::Mps => {
            no_mig()?;
            mps_binaries(&w.mps_control)
        }
        Isolation::Dmem => {
            let Some(controllers) = &facts.cgroup2_controllers else {
                return Err(format!(
                    "--isolation=dmem: {} is not a cgroup v2 mount (no cgroup.controllers): the dmem controller exists only in cgroup v2",
                    w.cgroup_root.display()
                ));
            };
            if !controllers.split_whitespace().any(|c| c == "dmem") {
                return Err(format!(
                    "--isolation=dmem: the kernel offers no dmem controller in {}/cgroup.controllers ({:?}): a kernel 6.14 or newer with CONFIG_CGROUP_DMEM is needed",
                    w.cgroup_root.display(),
                    controllers.trim()
                ));
            }
            match driver_branch(&facts.driver_version) {
                Some(b) if b >= DMEM_MIN_DRIVER => {}
                _ => {
                    return Err(format!(
                        "--isolation=dmem: driver {:?} does not register GPU memory with the dmem controller (r{DMEM_MIN_DRIVER} or newer is needed)",
                        facts.driver_version
                    ));
                }
            }
            no_mig()
        }
    }
}

/// Read the cgroup half of the node's facts under `cgroup_root`.
pub fn cgroup2_controllers(cgroup_root: &Path) -> Option<String> {
    std::fs::read_to_string(cgroup_root.join("cgroup.controllers")).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wanted(dir: &Path, isolation: Isolation) -> Wanted {
        Wanted {
            isolation,
            hami_core: HamiCore {
                lib: dir.join("libvgpu.so"),
                dir: dir.join("state"),
            },
            cgroup_root: dir.join("cgroup"),
            mps_control: dir.join("mps/nvidia-cuda-mps-control"),
        }
    }

    fn facts(driver: &str, controllers: Option<&str>) -> NodeFacts {
        NodeFacts {
            driver_version: driver.into(),
            mig_on: Vec::new(),
            cgroup2_controllers: controllers.map(str::to_string),
        }
    }

    #[test]
    fn hami_core_is_refused_without_its_library_and_installs_its_preload_with_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let w = wanted(dir.path(), Isolation::HamiCore);
        let e = check(&w, &facts("580.1", None)).expect_err("no library");
        assert!(e.contains("no HAMi-core library at --hami-core-lib"), "{e}");
        assert!(!w.hami_core.preload().exists());
        std::fs::write(&w.hami_core.lib, b"\x7fELF").expect("lib");
        check(&w, &facts("580.1", None)).expect("the library is there");
        assert_eq!(
            std::fs::read_to_string(w.hami_core.preload()).expect("preload"),
            "/usr/local/vgpu/libvgpu.so\n"
        );
        w.hami_core.make_cache_dir(3).expect("cache 3");
        w.hami_core.make_cache_dir(4).expect("cache 4");
        let errors = w.hami_core.sweep(&[4].into_iter().collect());
        assert!(errors.is_empty(), "{errors:?}");
        assert!(
            !w.hami_core.cache_dir(3).exists(),
            "a released allocation's cache stays"
        );
        assert!(
            w.hami_core.cache_dir(4).exists(),
            "a live allocation's cache was removed"
        );
        let mut f = facts("580.1", None);
        f.mig_on = vec!["GPU-1".into()];
        assert!(check(&w, &f).expect_err("MIG").contains("MIG mode is on"));
    }

    #[test]
    fn dmem_needs_cgroup_v2_its_controller_and_driver_615() {
        let dir = tempfile::tempdir().expect("tempdir");
        let w = wanted(dir.path(), Isolation::Dmem);
        let v1 = check(&w, &facts("615.1", None)).expect_err("v1");
        assert!(v1.contains("not a cgroup v2 mount"), "{v1}");
        let no = check(&w, &facts("615.1", Some("cpu memory pids\n"))).expect_err("no dmem");
        assert!(no.contains("no dmem controller"), "{no}");
        let old = check(&w, &facts("580.95.05", Some("cpu dmem\n"))).expect_err("old");
        assert!(old.contains("r615 or newer"), "{old}");
        check(&w, &facts("615.0", Some("cpu memory dmem\n"))).expect("served");
        let mut f = facts("615.0", Some("cpu memory dmem\n"));
        f.mig_on = vec!["GPU-1".into()];
        assert!(check(&w, &f).expect_err("MIG").contains("MIG mode is on"));
    }

    #[test]
    fn nvml_always_serves_and_mps_needs_both_binaries() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        check(&wanted(dir.path(), Isolation::Nvml), &facts("", None)).expect("nvml");
        let w = wanted(dir.path(), Isolation::Mps);
        let e = check(&w, &facts("580.1", None)).expect_err("no binaries");
        assert!(e.contains("no MPS control daemon at"), "{e}");
        std::fs::create_dir_all(dir.path().join("mps")).expect("mkdir");
        let exe = |name: &str, mode| {
            let p = dir.path().join("mps").join(name);
            std::fs::write(&p, "#!/bin/sh\n").expect("write");
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).expect("chmod");
        };
        exe("nvidia-cuda-mps-control", 0o755);
        let e = check(&w, &facts("580.1", None)).expect_err("no server");
        assert!(e.contains("no MPS server at"), "{e}");
        exe("nvidia-cuda-mps-server", 0o644);
        let e = check(&w, &facts("580.1", None)).expect_err("not executable");
        assert!(e.contains("not an executable file"), "{e}");
        exe("nvidia-cuda-mps-server", 0o755);
        check(&w, &facts("580.1", None)).expect("both there");
        let mut f = facts("580.1", None);
        f.mig_on = vec!["GPU-1".into()];
        assert!(check(&w, &f).expect_err("MIG").contains("MIG mode is on"));
    }

    #[test]
    fn a_hami_core_container_gets_the_library_its_preload_and_its_own_cache() {
        let h = HamiCore {
            lib: "/opt/hami/libvgpu.so".into(),
            dir: "/var/lib/gpuledger/hami-core".into(),
        };
        let mut r = dp::ContainerAllocateResponse::default();
        h.edit(7, &mut r);
        assert_eq!(
            r.envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"],
            "/usr/local/vgpu/7.cache"
        );
        let m = |c: &str| {
            r.mounts
                .iter()
                .find(|m| m.container_path == c)
                .map(|m| (m.host_path.as_str(), m.read_only))
        };
        assert_eq!(
            m("/usr/local/vgpu/libvgpu.so"),
            Some(("/opt/hami/libvgpu.so", true))
        );
        assert_eq!(
            m("/etc/ld.so.preload"),
            Some(("/var/lib/gpuledger/hami-core/ld.so.preload", true))
        );
        assert_eq!(
            m("/usr/local/vgpu"),
            Some(("/var/lib/gpuledger/hami-core/containers/7", false))
        );
    }
}
