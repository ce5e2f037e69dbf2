//! The device backend: GPUs, their processes and Xid errors, read through nvml-wrapper.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// One GPU as NVML reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// `GPU-…` UUID.
    pub uuid: String,
    /// NVML index.
    pub index: u32,
    /// Model name.
    pub model: String,
    /// Memory in MiB that processes can use: NVML's total less what the driver reserves (on an
    /// idle H100 80GB HBM3: 81559 − 480). This is the capacity registered in the ledger, so
    /// the allocator never hands out memory no process can ever get.
    pub memory_mib: u64,
    /// What the driver reserves, in MiB (logged; not allocatable).
    pub reserved_mib: u64,
    /// CUDA compute capability "major.minor"; empty when NVML does not report it.
    pub compute_capability: String,
}

/// One GPU and whether it is fit to be handed out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuState {
    /// What NVML says about it.
    pub info: GpuInfo,
    /// False after a critical Xid, while NVML answers that it is lost, or when the ledger
    /// has it unhealthy.
    pub healthy: bool,
    /// Unhealthy because NVML answered `GPU_IS_LOST`: healthy again once it answers.
    pub lost: bool,
}

impl GpuState {
    /// A GPU NVML just listed: healthy.
    pub fn new(info: GpuInfo) -> GpuState {
        GpuState {
            info,
            healthy: true,
            lost: false,
        }
    }

    /// What a probe that found the GPU lost (`lost_now`) or answering changes: `Some(true)`
    /// it is newly lost, `Some(false)` a lost one answers again; an unhealthy GPU that is not
    /// lost (a critical Xid) stays so.
    pub fn probed(&self, lost_now: bool) -> Option<bool> {
        match (self.lost, lost_now) {
            (false, true) => Some(true),
            (true, false) => Some(false),
            _ => None,
        }
    }
}

/// A process with a compute context on a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuProcess {
    /// UUID of the GPU.
    pub gpu: String,
    /// Process id.
    pub pid: u32,
    /// Used GPU memory in MiB (0 when NVML cannot say).
    pub used_mib: u64,
}

/// An Xid error NVML reported on a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XidEvent {
    /// UUID of the GPU.
    pub gpu: String,
    /// The Xid number.
    pub xid: u64,
}

/// Why talking to NVML failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The library file does not exist. Not retryable.
    #[error(
        "NVML library {path} does not exist (install the NVIDIA driver, or pass --nvml-lib PATH)"
    )]
    Missing {
        /// The library path given.
        path: String,
    },
    /// The library could not be loaded or initialised. Not retryable: the node has no usable
    /// driver, or --nvml-lib is wrong.
    #[error(
        "cannot load or initialise NVML from {path}: {cause} (is the NVIDIA driver installed and loaded? --nvml-lib selects the library)"
    )]
    Load {
        /// The library path tried.
        path: String,
        /// NVML's error.
        cause: NvmlError,
    },
    /// A call failed. Retryable on the next tick; persistent failures mean a lost GPU.
    #[error("NVML {what}: {source}")]
    Call {
        /// Which call.
        what: &'static str,
        /// NVML's error.
        source: NvmlError,
    },
}

fn call<T>(what: &'static str, r: Result<T, NvmlError>) -> Result<T, Error> {
    r.map_err(|source| Error::Call { what, source })
}

/// Xids that are the application's fault or informational; every other Xid marks the GPU
/// unhealthy (the NVIDIA device plugin skips the same set).
pub const NON_CRITICAL_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// Whether an Xid takes the GPU out of service.
pub fn is_critical_xid(xid: u64) -> bool {
    !NON_CRITICAL_XIDS.contains(&xid)
}

/// The NVML library, loaded once and shared.
#[derive(Clone)]
pub struct NvmlBackend {
    nvml: Arc<Nvml>,
}

impl NvmlBackend {
    /// Load and initialise NVML from `path` (the system library when `None`).
    pub fn open(path: Option<&Path>) -> Result<NvmlBackend, Error> {
        let shown = path.map_or_else(
            || "libnvidia-ml.so.1".to_string(),
            |p| p.display().to_string(),
        );
        let nvml = match path {
            Some(p) => {
                if !p.exists() {
                    return Err(Error::Missing { path: shown });
                }
                let p: PathBuf = p.to_path_buf();
                Nvml::builder().lib_path(p.as_os_str()).init()
            }
            None => Nvml::init(),
        }
        .map_err(|cause| Error::Load { path: shown, cause })?;
        Ok(NvmlBackend {
            nvml: Arc::new(nvml),
        })
    }

    /// The node's GPUs in index order.
    pub fn gpus(&self) -> Result<Vec<GpuInfo>, Error> {
        let n = call("device count", self.nvml.device_count())?;
        let mut out = Vec::with_capacity(n as usize);
        for i in 0..n {
            let d = call("device by index", self.nvml.device_by_index(i))?;
            let mem = call("memory info", d.memory_info())?;
            out.push(GpuInfo {
                uuid: call("device uuid", d.uuid())?,
                index: i,
                model: call("device name", d.name())?,
                memory_mib: mem.total.saturating_sub(mem.reserved) >> 20,
                reserved_mib: mem.reserved >> 20,
                // Optional: a driver that does not say leaves it empty, the GPU is still served.
                compute_capability: d
                    .cuda_compute_capability()
                    .map(|c| format!("{}.{}", c.major, c.minor))
                    .unwrap_or_default(),
            });
        }
        Ok(out)
    }

    /// Which of `uuids` NVML answers `GPU_IS_LOST` for (fallen off the bus). Blocking: one
    /// NVML call or two per GPU.
    pub fn lost(&self, uuids: &[String]) -> Vec<String> {
        uuids
            .iter()
            .filter(|u| {
                matches!(
                    self.nvml
                        .device_by_uuid(u.as_str())
                        .and_then(|d| d.memory_info()),
                    Err(NvmlError::GpuLost)
                )
            })
            .cloned()
            .collect()
    }

    /// The driver's version (`580.95.05`).
    pub fn driver_version(&self) -> Result<String, Error> {
        call("driver version", self.nvml.sys_driver_version())
    }

    /// The UUIDs of the GPUs whose MIG mode is on (now or after the next reset). A GPU or a
    /// library that has no MIG answers "not supported": MIG is off there.
    pub fn mig_on(&self) -> Result<Vec<String>, Error> {
        let n = call("device count", self.nvml.device_count())?;
        let mut on = Vec::new();
        for i in 0..n {
            let d = call("device by index", self.nvml.device_by_index(i))?;
            match d.mig_mode() {
                Ok(m) if m.current != 0 || m.pending != 0 => {
                    on.push(call("device uuid", d.uuid())?)
                }
                Ok(_) | Err(NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)) => {}
                Err(source) => {
                    return Err(Error::Call {
                        what: "MIG mode",
                        source,
                    });
                }
            }
        }
        Ok(on)
    }

    /// Put GPU `uuid` in `exclusive` (EXCLUSIVE_PROCESS: one context, the MPS server's) or
    /// DEFAULT compute mode. Needs root on a real node.
    pub fn set_exclusive_process(&self, uuid: &str, exclusive: bool) -> Result<(), Error> {
        use nvml_wrapper::enum_wrappers::device::ComputeMode;
        let mut d = call("device by uuid", self.nvml.device_by_uuid(uuid))?;
        let mode = if exclusive {
            ComputeMode::ExclusiveProcess
        } else {
            ComputeMode::Default
        };
        call("set compute mode", d.set_compute_mode(mode))
    }

    /// Whether GPU `uuid` is in EXCLUSIVE_PROCESS compute mode.
    pub fn is_exclusive_process(&self, uuid: &str) -> Result<bool, Error> {
        use nvml_wrapper::enum_wrappers::device::ComputeMode;
        let d = call("device by uuid", self.nvml.device_by_uuid(uuid))?;
        Ok(call("compute mode", d.compute_mode())? == ComputeMode::ExclusiveProcess)
    }

    /// Each GPU's UUID and PCI bus id (`00000000:3B:00.0`).
    pub fn bus_ids(&self) -> Result<Vec<(String, String)>, Error> {
        let n = call("device count", self.nvml.device_count())?;
        (0..n)
            .map(|i| {
                let d = call("device by index", self.nvml.device_by_index(i))?;
                Ok((
                    call("device uuid", d.uuid())?,
                    call("PCI info", d.pci_info())?.bus_id,
                ))
            })
            .collect()
    }

    /// Every compute process on every GPU that answers, with its memory use (a lost GPU is
    /// passed by: its health probe takes it out of service).
    pub fn processes(&self) -> Result<Vec<GpuProcess>, Error> {
        let n = call("device count", self.nvml.device_count())?;
        let mut out = Vec::new();
        for i in 0..n {
            let one = || {
                let d = call("device by index", self.nvml.device_by_index(i))?;
                let uuid = call("device uuid", d.uuid())?;
                let ps = call("running compute processes", d.running_compute_processes())?;
                Ok::<_, Error>((uuid, ps))
            };
            let (uuid, ps) = match one() {
                Ok(x) => x,
                Err(Error::Call {
                    source: NvmlError::GpuLost,
                    ..
                }) => continue,
                Err(e) => return Err(e),
            };
            for p in ps {
                let used_mib = match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => b >> 20,
                    UsedGpuMemory::Unavailable => 0,
                };
                out.push(GpuProcess {
                    gpu: uuid.clone(),
                    pid: p.pid,
                    used_mib,
                });
            }
        }
        Ok(out)
    }

    /// Watch Xid errors on every GPU until `stop` is cancelled or `tx` closes; events go to
    /// `tx`. Blocks (NVML's event wait does): run it with `spawn_blocking`.
    pub fn watch_xids(&self, tx: mpsc::Sender<XidEvent>, stop: &CancellationToken) {
        if let Err(e) = xid_loop(&self.nvml, &tx, stop) {
            tracing::warn!("Xid events unavailable, GPU health is not watched: {e}");
        }
    }
}

fn xid_loop(
    nvml: &Nvml,
    tx: &mpsc::Sender<XidEvent>,
    stop: &CancellationToken,
) -> Result<(), Error> {
    let mut set = call("event set create", nvml.create_event_set())?;
    let n = call("device count", nvml.device_count())?;
    for i in 0..n {
        let d = call("device by index", nvml.device_by_index(i))?;
        set = d
            .register_events(EventTypes::CRITICAL_XID_ERROR, set)
            .map_err(|e| Error::Call {
                what: "register events",
                source: e.error,
            })?;
    }
    while !stop.is_cancelled() && !tx.is_closed() {
        match set.wait(500) {
            Ok(ev) => {
                let xid = match ev.event_data {
                    Some(XidError::Value(x)) => x,
                    Some(XidError::Unknown) | None => 0,
                };
                let gpu = match ev.device.uuid() {
                    Ok(u) => u,
                    Err(e) => {
                        tracing::warn!("Xid {xid} on a GPU whose UUID NVML cannot give: {e}");
                        continue;
                    }
                };
                if tx.blocking_send(XidEvent { gpu, xid }).is_err() {
                    break;
                }
            }
            Err(NvmlError::Timeout) => {}
            Err(e) => {
                tracing::warn!("NVML event wait: {e}");
                std::thread::sleep(Duration::from_secs(1));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn application_xids_do_not_make_a_gpu_unhealthy() {
        assert!(!is_critical_xid(13));
        assert!(!is_critical_xid(43));
        assert!(!is_critical_xid(109));
        assert!(is_critical_xid(79));
        assert!(is_critical_xid(48));
    }

    #[test]
    fn a_probe_recovers_only_what_it_found_lost() {
        let info = GpuInfo {
            uuid: "GPU-A".into(),
            index: 0,
            model: "H100".into(),
            memory_mib: 81_079,
            reserved_mib: 480,
            compute_capability: "9.0".into(),
        };
        let mut g = GpuState::new(info);
        assert_eq!(g.probed(false), None, "healthy and answering");
        assert_eq!(g.probed(true), Some(true), "newly lost");
        g.lost = true;
        g.healthy = false;
        assert_eq!(g.probed(true), None, "still lost: nothing new");
        assert_eq!(g.probed(false), Some(false), "answers again");
        g.lost = false;
        assert_eq!(
            g.probed(false),
            None,
            "unhealthy by an Xid, answering: stays unhealthy"
        );
    }
}
