//! A fake `libnvidia-ml.so` for tests: the NVML entry points nvml-wrapper calls, answered from a
//! JSON file named by the env var `FAKE_NVML_CONFIG`.
//!
//! Tests rewrite the file while the node agent runs (write a temp file, then rename): GPUs,
//! processes with their used memory, and Xid events. The file is re-read whenever its mtime, size
//! or inode changes, so every NVML call sees the latest state at the cost of one `stat`.
//!
//! Every exported function is a C ABI entry point with NVML's own safety contract (valid, aligned
//! pointers of the documented types, or null where NVML allows it); that is why the crate opts out
//! of the workspace's `unsafe_code = "forbid"`.

#![allow(clippy::missing_safety_doc)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong, c_void};
use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// The state the fake library reports, as stored in the `FAKE_NVML_CONFIG` file.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct FakeConfig {
    /// What `nvmlSystemGetDriverVersion` answers.
    #[serde(default = "default_driver")]
    pub driver_version: String,
    /// The GPUs, in index order.
    #[serde(default)]
    pub gpus: Vec<FakeGpu>,
    /// Processes with a compute context, and the memory each uses.
    #[serde(default)]
    pub processes: Vec<FakeProcess>,
    /// Xid errors, in the order they happened. Each event set delivers each entry once.
    #[serde(default)]
    pub xids: Vec<FakeXid>,
}

/// One fake GPU.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FakeGpu {
    /// `GPU-…` UUID.
    pub uuid: String,
    /// Model name.
    pub name: String,
    /// Total memory in MiB.
    pub memory_mib: u64,
    /// Memory the driver reserves, in MiB: `nvmlDeviceGetMemoryInfo_v2` reports it apart, v1
    /// counts it as used (a real H100 80GB HBM3 on driver 580: 480 of 81559).
    #[serde(default)]
    pub reserved_mib: u64,
    /// The CUDA context each process carries on this GPU, in MiB: NVML charges it to the
    /// process, on top of what the process allocated (a real H100: ~518).
    #[serde(default)]
    pub context_mib: u64,
    /// GPU utilization percent reported by `nvmlDeviceGetUtilizationRates`.
    #[serde(default)]
    pub util_percent: u32,
    /// CUDA compute capability `(major, minor)` reported by
    /// `nvmlDeviceGetCudaComputeCapability`; None: the call answers NOT_SUPPORTED.
    #[serde(default)]
    pub compute_capability: Option<(u32, u32)>,
    /// Fallen off the bus: every call on the device answers `NVML_ERROR_GPU_IS_LOST` until the
    /// test sets it back.
    #[serde(default)]
    pub lost: bool,
}

/// One process using a GPU.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FakeProcess {
    /// Process id (as seen from the node agent).
    pub pid: u32,
    /// GPU memory the process allocated, in MiB; NVML reports it plus the GPU's `context_mib`.
    pub used_mib: u64,
    /// UUID of the GPU it runs on.
    pub gpu: String,
}

/// One Xid error on a GPU.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FakeXid {
    /// UUID of the GPU.
    pub gpu: String,
    /// The Xid number (e.g. 79: fallen off the bus).
    pub xid: u64,
}

fn default_driver() -> String {
    "550.54.15".into()
}

impl FakeConfig {
    /// Write the config atomically (temp file + rename) so a concurrent reader never sees half.
    pub fn write_to(&self, path: &std::path::Path) -> std::io::Result<()> {
        let tmp = path.with_extension("tmp");
        let body = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(&tmp, body)?;
        std::fs::rename(&tmp, path)
    }
}

// NVML return codes (nvml.h).
const SUCCESS: u32 = 0;
const ERROR_UNINITIALIZED: u32 = 1;
const ERROR_INVALID_ARGUMENT: u32 = 2;
const ERROR_NOT_FOUND: u32 = 6;
const ERROR_NOT_SUPPORTED: u32 = 3;
const ERROR_INSUFFICIENT_SIZE: u32 = 7;
const ERROR_DRIVER_NOT_LOADED: u32 = 9;
const ERROR_TIMEOUT: u32 = 10;
const ERROR_GPU_IS_LOST: u32 = 15;
const ERROR_UNKNOWN: u32 = 999;

/// `nvmlEventTypeXidCriticalError`.
const EVENT_XID: u64 = 8;

/// `nvmlMemory_t`.
#[repr(C)]
pub struct Memory {
    total: c_ulonglong,
    free: c_ulonglong,
    used: c_ulonglong,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
pub struct MemoryV2 {
    version: c_uint,
    total: c_ulonglong,
    reserved: c_ulonglong,
    free: c_ulonglong,
    used: c_ulonglong,
}

/// `nvmlProcessInfo_t` as the `_v3` process calls fill it (pid, used bytes, GI, CI).
#[repr(C)]
pub struct ProcessInfo {
    pid: c_uint,
    used_gpu_memory: c_ulonglong,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

/// `nvmlUtilization_t`.
#[repr(C)]
pub struct Utilization {
    gpu: c_uint,
    memory: c_uint,
}

/// `nvmlEventData_t`.
#[repr(C)]
pub struct EventData {
    device: *mut c_void,
    event_type: c_ulonglong,
    event_data: c_ulonglong,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

/// What an `nvmlEventSet_t` points to.
struct EventSet {
    devices: Vec<usize>,
    /// How many entries of `xids` this set has already looked at.
    seen: usize,
}

type CacheKey = (i64, i64, u64, u64);

static CACHE: Mutex<Option<(CacheKey, Arc<FakeConfig>)>> = Mutex::new(None);
static INIT: Mutex<u32> = Mutex::new(0);

fn load() -> Result<Arc<FakeConfig>, u32> {
    let path = std::env::var_os("FAKE_NVML_CONFIG").ok_or(ERROR_DRIVER_NOT_LOADED)?;
    let meta = std::fs::metadata(&path).map_err(|_| ERROR_DRIVER_NOT_LOADED)?;
    let key = (meta.mtime(), meta.mtime_nsec(), meta.len(), meta.ino());
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((k, c)) = cache.as_ref()
        && *k == key
    {
        return Ok(c.clone());
    }
    let bytes = std::fs::read(&path).map_err(|_| ERROR_UNKNOWN)?;
    let cfg: FakeConfig = serde_json::from_slice(&bytes).map_err(|_| ERROR_UNKNOWN)?;
    let cfg = Arc::new(cfg);
    *cache = Some((key, cfg.clone()));
    Ok(cfg)
}

fn initialized() -> Result<Arc<FakeConfig>, u32> {
    if *INIT.lock().unwrap_or_else(|e| e.into_inner()) == 0 {
        return Err(ERROR_UNINITIALIZED);
    }
    load()
}

fn ret(r: Result<(), u32>) -> u32 {
    match r {
        Ok(()) => SUCCESS,
        Err(e) => e,
    }
}

/// Device handles are `index + 1` disguised as pointers: never dereferenced, never null.
fn handle(index: usize) -> *mut c_void {
    (index + 1) as *mut c_void
}

fn index_of(device: *mut c_void, cfg: &FakeConfig) -> Result<usize, u32> {
    let i = (device as usize)
        .checked_sub(1)
        .ok_or(ERROR_INVALID_ARGUMENT)?;
    match cfg.gpus.get(i) {
        Some(g) if g.lost => Err(ERROR_GPU_IS_LOST),
        Some(_) => Ok(i),
        None => Err(ERROR_INVALID_ARGUMENT),
    }
}

/// Copy `s` NUL-terminated into `buf` of `len` bytes.
///
/// # Safety
/// `buf` must be null or valid for `len` bytes of writes.
unsafe fn write_str(s: &str, buf: *mut c_char, len: c_uint) -> Result<(), u32> {
    if buf.is_null() {
        return Err(ERROR_INVALID_ARGUMENT);
    }
    let b = s.as_bytes();
    if b.len() + 1 > len as usize {
        return Err(ERROR_INSUFFICIENT_SIZE);
    }
    // SAFETY: the caller guarantees `buf` holds `len` bytes, and `b.len() + 1 <= len`.
    unsafe {
        std::ptr::copy_nonoverlapping(b.as_ptr(), buf.cast::<u8>(), b.len());
        *buf.add(b.len()) = 0;
    }
    Ok(())
}

fn init() -> u32 {
    match load() {
        Ok(_) => {
            *INIT.lock().unwrap_or_else(|e| e.into_inner()) += 1;
            SUCCESS
        }
        Err(e) => e,
    }
}

/// `nvmlInit_v2`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> u32 {
    init()
}

/// `nvmlInit` (v1).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit() -> u32 {
    init()
}

/// `nvmlInitWithFlags`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> u32 {
    init()
}

/// `nvmlShutdown`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> u32 {
    let mut n = INIT.lock().unwrap_or_else(|e| e.into_inner());
    if *n == 0 {
        return ERROR_UNINITIALIZED;
    }
    *n -= 1;
    SUCCESS
}

/// `nvmlErrorString`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(result: u32) -> *const c_char {
    let s: &'static CStr = match result {
        SUCCESS => c"Success",
        ERROR_UNINITIALIZED => c"Uninitialized",
        ERROR_INVALID_ARGUMENT => c"Invalid Argument",
        ERROR_NOT_FOUND => c"Not Found",
        ERROR_INSUFFICIENT_SIZE => c"Insufficient Size",
        ERROR_DRIVER_NOT_LOADED => {
            c"Driver Not Loaded (fake NVML: FAKE_NVML_CONFIG unset or unreadable)"
        }
        ERROR_TIMEOUT => c"Timeout",
        ERROR_GPU_IS_LOST => c"GPU is lost",
        _ => c"Unknown Error",
    };
    s.as_ptr()
}

/// `nvmlSystemGetDriverVersion`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(buf: *mut c_char, len: c_uint) -> u32 {
    ret(initialized().and_then(|c| {
        // SAFETY: NVML's contract: `buf` holds `len` bytes.
        unsafe { write_str(&c.driver_version, buf, len) }
    }))
}

/// `nvmlSystemGetNVMLVersion`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(buf: *mut c_char, len: c_uint) -> u32 {
    ret(initialized().and_then(|_| {
        // SAFETY: NVML's contract: `buf` holds `len` bytes.
        unsafe { write_str("12.550.54.15", buf, len) }
    }))
}

/// `nvmlDeviceGetCount_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> u32 {
    ret(initialized().and_then(|c| {
        if count.is_null() {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null, and NVML's contract makes it a valid `unsigned int*`.
        unsafe { *count = c.gpus.len() as c_uint };
        Ok(())
    }))
}

/// `nvmlDeviceGetHandleByIndex_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut *mut c_void,
) -> u32 {
    ret(initialized().and_then(|c| {
        if device.is_null() {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        if index as usize >= c.gpus.len() {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null, and NVML's contract makes it a valid `nvmlDevice_t*`.
        unsafe { *device = handle(index as usize) };
        Ok(())
    }))
}

/// `nvmlDeviceGetHandleByUUID`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut *mut c_void,
) -> u32 {
    ret(initialized().and_then(|c| {
        if uuid.is_null() || device.is_null() {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null, and NVML's contract makes it a NUL-terminated string.
        let want = unsafe { CStr::from_ptr(uuid) }.to_string_lossy();
        let i = c
            .gpus
            .iter()
            .position(|g| g.uuid == want)
            .ok_or(ERROR_NOT_FOUND)?;
        if c.gpus[i].lost {
            return Err(ERROR_GPU_IS_LOST);
        }
        // SAFETY: non-null, and NVML's contract makes it a valid `nvmlDevice_t*`.
        unsafe { *device = handle(i) };
        Ok(())
    }))
}

/// `nvmlDeviceGetIndex`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(device: *mut c_void, index: *mut c_uint) -> u32 {
    ret(initialized().and_then(|c| {
        let i = index_of(device, &c)?;
        if index.is_null() {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null, and NVML's contract makes it a valid `unsigned int*`.
        unsafe { *index = i as c_uint };
        Ok(())
    }))
}

/// `nvmlDeviceGetUUID`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: *mut c_void,
    buf: *mut c_char,
    len: c_uint,
) -> u32 {
    ret(initialized().and_then(|c| {
        let i = index_of(device, &c)?;
        // SAFETY: NVML's contract: `buf` holds `len` bytes.
        unsafe { write_str(&c.gpus[i].uuid, buf, len) }
    }))
}

/// `nvmlDeviceGetName`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: *mut c_void,
    buf: *mut c_char,
    len: c_uint,
) -> u32 {
    ret(initialized().and_then(|c| {
        let i = index_of(device, &c)?;
        // SAFETY: NVML's contract: `buf` holds `len` bytes.
        unsafe { write_str(&c.gpus[i].name, buf, len) }
    }))
}

/// What NVML reports a process on GPU `g` to use, in bytes: its allocations and its context.
fn process_bytes(g: &FakeGpu, p: &FakeProcess) -> u64 {
    (p.used_mib + g.context_mib) << 20
}

/// Memory the processes on GPU `i` use, in bytes.
fn used_bytes(c: &FakeConfig, i: usize) -> u64 {
    let g = &c.gpus[i];
    c.processes
        .iter()
        .filter(|p| p.gpu == g.uuid)
        .map(|p| process_bytes(g, p))
        .sum()
}

/// `nvmlDeviceGetCudaComputeCapability`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(
    device: *mut c_void,
    major: *mut c_int,
    minor: *mut c_int,
) -> u32 {
    ret(initialized().and_then(|c| {
        let i = index_of(device, &c)?;
        if major.is_null() || minor.is_null() {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        let (ma, mi) = c.gpus[i].compute_capability.ok_or(ERROR_NOT_SUPPORTED)?;
        // SAFETY: non-null, and NVML's contract makes them valid `int*`.
        unsafe {
            *major = c_int::try_from(ma).map_err(|_| ERROR_UNKNOWN)?;
            *minor = c_int::try_from(mi).map_err(|_| ERROR_UNKNOWN)?;
        }
        Ok(())
    }))
}

/// `nvmlDeviceGetMemoryInfo`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(device: *mut c_void, mem: *mut Memory) -> u32 {
    ret(initialized().and_then(|c| {
        let i = index_of(device, &c)?;
        if mem.is_null() {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        let total = c.gpus[i].memory_mib << 20;
        // v1 counts the driver's reserve as used.
        let used = ((c.gpus[i].reserved_mib << 20) + used_bytes(&c, i)).min(total);
        // SAFETY: non-null, and NVML's contract makes it a valid `nvmlMemory_t*`.
        unsafe {
            *mem = Memory {
                total,
                free: total - used,
                used,
            }
        };
        Ok(())
    }))
}

/// `nvmlDeviceGetMemoryInfo_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: *mut c_void,
    mem: *mut MemoryV2,
) -> u32 {
    ret(initialized().and_then(|c| {
        let i = index_of(device, &c)?;
        if mem.is_null() {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        let total = c.gpus[i].memory_mib << 20;
        let reserved = (c.gpus[i].reserved_mib << 20).min(total);
        let used = used_bytes(&c, i).min(total - reserved);
        // SAFETY: non-null, and NVML's contract makes it a valid `nvmlMemory_v2_t*` whose
        // `version` the caller set.
        unsafe {
            let version = (*mem).version;
            *mem = MemoryV2 {
                version,
                total,
                reserved,
                free: total - reserved - used,
                used,
            };
        }
        Ok(())
    }))
}

/// Fill `infos` (capacity `*count`) with the compute processes of the GPU.
///
/// # Safety
/// `count` must be a valid pointer; `infos` null or valid for `*count` entries.
unsafe fn processes(device: *mut c_void, count: *mut c_uint, infos: *mut ProcessInfo) -> u32 {
    ret(initialized().and_then(|c| {
        let i = index_of(device, &c)?;
        if count.is_null() {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        let g = &c.gpus[i];
        let procs: Vec<&FakeProcess> = c.processes.iter().filter(|p| p.gpu == g.uuid).collect();
        // SAFETY: non-null, and NVML's contract makes it a valid `unsigned int*`.
        let cap = unsafe { *count } as usize;
        // SAFETY: as above.
        unsafe { *count = procs.len() as c_uint };
        if procs.is_empty() {
            return Ok(());
        }
        if infos.is_null() || cap < procs.len() {
            return Err(ERROR_INSUFFICIENT_SIZE);
        }
        for (k, p) in procs.iter().enumerate() {
            // SAFETY: `k < procs.len() <= cap`, and the caller's buffer holds `cap` entries.
            unsafe {
                *infos.add(k) = ProcessInfo {
                    pid: p.pid,
                    used_gpu_memory: process_bytes(g, p),
                    gpu_instance_id: u32::MAX,
                    compute_instance_id: u32::MAX,
                };
            }
        }
        Ok(())
    }))
}

/// `nvmlDeviceGetComputeRunningProcesses_v3`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: *mut c_void,
    count: *mut c_uint,
    infos: *mut ProcessInfo,
) -> u32 {
    // SAFETY: forwarded under NVML's contract for this entry point.
    unsafe { processes(device, count, infos) }
}

/// `nvmlDeviceGetComputeRunningProcesses_v2` (same struct layout in the fake).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v2(
    device: *mut c_void,
    count: *mut c_uint,
    infos: *mut ProcessInfo,
) -> u32 {
    // SAFETY: forwarded under NVML's contract for this entry point.
    unsafe { processes(device, count, infos) }
}

/// `nvmlDeviceGetUtilizationRates`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: *mut c_void,
    util: *mut Utilization,
) -> u32 {
    ret(initialized().and_then(|c| {
        let i = index_of(device, &c)?;
        if util.is_null() {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        let total = c.gpus[i].memory_mib.max(1) << 20;
        let mem_pct = (used_bytes(&c, i) * 100 / total) as c_uint;
        // SAFETY: non-null, and NVML's contract makes it a valid `nvmlUtilization_t*`.
        unsafe {
            *util = Utilization {
                gpu: c.gpus[i].util_percent,
                memory: mem_pct,
            }
        };
        Ok(())
    }))
}

/// `nvmlDeviceGetSupportedEventTypes`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: *mut c_void,
    types: *mut c_ulonglong,
) -> u32 {
    ret(initialized().and_then(|c| {
        index_of(device, &c)?;
        if types.is_null() {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-null, and NVML's contract makes it a valid `unsigned long long*`.
        unsafe { *types = EVENT_XID };
        Ok(())
    }))
}

/// `nvmlEventSetCreate`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut *mut c_void) -> u32 {
    ret(initialized().and_then(|_| {
        if set.is_null() {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        let s = Box::new(Mutex::new(EventSet {
            devices: Vec::new(),
            seen: 0,
        }));
        // SAFETY: non-null, and NVML's contract makes it a valid `nvmlEventSet_t*`. The box is
        // freed by `nvmlEventSetFree`.
        unsafe { *set = Box::into_raw(s).cast::<c_void>() };
        Ok(())
    }))
}

/// The event set behind a handle from `nvmlEventSetCreate`.
///
/// # Safety
/// `set` must come from `nvmlEventSetCreate` and not be freed yet.
unsafe fn event_set<'a>(set: *mut c_void) -> Result<&'a Mutex<EventSet>, u32> {
    if set.is_null() {
        return Err(ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: the caller guarantees the handle is a live `Box<Mutex<EventSet>>`.
    Ok(unsafe { &*set.cast::<Mutex<EventSet>>() })
}

/// `nvmlDeviceRegisterEvents`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceRegisterEvents(
    device: *mut c_void,
    types: c_ulonglong,
    set: *mut c_void,
) -> u32 {
    ret(initialized().and_then(|c| {
        let i = index_of(device, &c)?;
        // SAFETY: NVML's contract: `set` is a live handle from `nvmlEventSetCreate`.
        let s = unsafe { event_set(set) }?;
        if types & EVENT_XID != 0 {
            let mut s = s.lock().unwrap_or_else(|e| e.into_inner());
            if !s.devices.contains(&i) {
                s.devices.push(i);
            }
        }
        Ok(())
    }))
}

/// `nvmlEventSetWait_v2`: polls the config every 20 ms for an Xid not yet delivered.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: *mut c_void,
    data: *mut EventData,
    timeout_ms: c_uint,
) -> u32 {
    let deadline = Instant::now() + Duration::from_millis(u64::from(timeout_ms));
    // SAFETY: NVML's contract: `set` is a live handle from `nvmlEventSetCreate`.
    let s = match unsafe { event_set(set) } {
        Ok(s) => s,
        Err(e) => return e,
    };
    if data.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    loop {
        let c = match initialized() {
            Ok(c) => c,
            Err(e) => return e,
        };
        {
            let mut st = s.lock().unwrap_or_else(|e| e.into_inner());
            while st.seen < c.xids.len() {
                let x = &c.xids[st.seen];
                st.seen += 1;
                let Some(i) = c.gpus.iter().position(|g| g.uuid == x.gpu) else {
                    continue;
                };
                if st.devices.contains(&i) {
                    // SAFETY: non-null, and NVML's contract makes it a valid `nvmlEventData_t*`.
                    unsafe {
                        *data = EventData {
                            device: handle(i),
                            event_type: EVENT_XID,
                            event_data: x.xid,
                            gpu_instance_id: u32::MAX,
                            compute_instance_id: u32::MAX,
                        };
                    }
                    return SUCCESS;
                }
            }
        }
        let now = Instant::now();
        if now >= deadline {
            return ERROR_TIMEOUT;
        }
        std::thread::sleep((deadline - now).min(Duration::from_millis(20)));
    }
}

/// `nvmlEventSetFree`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetFree(set: *mut c_void) -> u32 {
    if set.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: NVML's contract: `set` came from `nvmlEventSetCreate` (a leaked box) and is freed
    // exactly once, here.
    drop(unsafe { Box::from_raw(set.cast::<Mutex<EventSet>>()) });
    SUCCESS
}

/// `NVML_COMPUTEMODE_DEFAULT`: what a GPU whose mode was never set reports.
pub const COMPUTE_MODE_DEFAULT: u32 = 0;
/// `NVML_COMPUTEMODE_EXCLUSIVE_PROCESS`.
pub const COMPUTE_MODE_EXCLUSIVE_PROCESS: u32 = 3;
/// `NVML_COMPUTEMODE_COUNT`: modes at or above are invalid.
const COMPUTE_MODE_COUNT: u32 = 4;

/// Where the fake records the compute modes set through it: beside the state file, so a test
/// that rewrites the state (processes, Xids) does not erase what the agent set.
pub fn compute_mode_path(config: &std::path::Path) -> std::path::PathBuf {
    let mut p = config.as_os_str().to_owned();
    p.push(".compute-mode");
    p.into()
}

/// The compute mode of each GPU set through `nvmlDeviceSetComputeMode`, by UUID; a GPU not in
/// it is in [`COMPUTE_MODE_DEFAULT`].
pub fn compute_modes(config: &std::path::Path) -> std::collections::BTreeMap<String, u32> {
    std::fs::read(compute_mode_path(config))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// The recorded modes of the running fake, and where they are written.
fn recorded_modes() -> Result<(std::path::PathBuf, std::collections::BTreeMap<String, u32>), u32> {
    let config = std::env::var_os("FAKE_NVML_CONFIG").ok_or(ERROR_DRIVER_NOT_LOADED)?;
    let config = std::path::PathBuf::from(config);
    Ok((compute_mode_path(&config), compute_modes(&config)))
}

/// `nvmlDeviceGetComputeMode`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeMode(device: *mut c_void, mode: *mut c_uint) -> u32 {
    ret(initialized().and_then(|c| {
        let i = index_of(device, &c)?;
        if mode.is_null() {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        let (_, modes) = recorded_modes()?;
        let m = modes
            .get(&c.gpus[i].uuid)
            .copied()
            .unwrap_or(COMPUTE_MODE_DEFAULT);
        // SAFETY: non-null, and NVML's contract makes it a valid `nvmlComputeMode_t*`.
        unsafe { *mode = m };
        Ok(())
    }))
}

/// `nvmlDeviceSetComputeMode`: recorded in the file [`compute_mode_path`] names (temp file +
/// rename, so a reader never sees half).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceSetComputeMode(device: *mut c_void, mode: c_uint) -> u32 {
    ret(initialized().and_then(|c| {
        let i = index_of(device, &c)?;
        if mode >= COMPUTE_MODE_COUNT {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        let (path, mut modes) = recorded_modes()?;
        modes.insert(c.gpus[i].uuid.clone(), mode);
        let body = serde_json::to_vec(&modes).map_err(|_| ERROR_UNKNOWN)?;
        let tmp = path.with_extension("tmp-mode");
        std::fs::write(&tmp, body).map_err(|_| ERROR_UNKNOWN)?;
        std::fs::rename(&tmp, &path).map_err(|_| ERROR_UNKNOWN)
    }))
}

/// `nvmlPciInfo_t`.
#[repr(C)]
pub struct PciInfo {
    bus_id_legacy: [c_char; 16],
    domain: c_uint,
    bus: c_uint,
    device: c_uint,
    pci_device_id: c_uint,
    pci_sub_system_id: c_uint,
    bus_id: [c_char; 32],
}

/// The PCI bus id the fake gives GPU `i`: domain 0, bus `i + 1`, as NVML writes it.
pub fn bus_id(i: usize) -> String {
    format!("00000000:{:02X}:00.0", i + 1)
}

/// `nvmlDeviceGetPciInfo_v3`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(device: *mut c_void, pci: *mut PciInfo) -> u32 {
    ret(initialized().and_then(|c| {
        let i = index_of(device, &c)?;
        if pci.is_null() {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        let mut info = PciInfo {
            bus_id_legacy: [0; 16],
            domain: 0,
            bus: c_uint::try_from(i + 1).map_err(|_| ERROR_UNKNOWN)?,
            device: 0,
            pci_device_id: 0x20b0_10de,
            pci_sub_system_id: 0,
            bus_id: [0; 32],
        };
        let id = bus_id(i);
        // The legacy field has room for a 4-digit domain only.
        let legacy = &id[4..];
        // SAFETY: both buffers are ours, of the lengths given.
        unsafe {
            write_str(&id, info.bus_id.as_mut_ptr(), 32)?;
            write_str(legacy, info.bus_id_legacy.as_mut_ptr(), 16)?;
        }
        // SAFETY: non-null, and NVML's contract makes it a valid `nvmlPciInfo_t*`.
        unsafe { *pci = info };
        Ok(())
    }))
}
