//! NCCL behind `DeviceCollectives`: one communicator per rank for ranks on distinct GPUs of this
//! process (`ncclCommInitAll`), or for this process's rank of a group of rank processes
//! (`ncclCommInitRank`, with the unique id rank 0 made and sent at the rendezvous); each rank's
//! collectives issued on its compute stream, so they
//! are ordered with its kernels and the pool's stream-ordered reuse stays safe.
//!
//! libnccl (`libnccl.so.2`: pip's `nvidia-nccl-cu13` / `-cu12`, or a system install) is loaded
//! at run time by its own name — cudarc's loader does not try `.so.2` — and only the nine
//! entry points used here are looked up. NCCL refuses two ranks on one GPU, so a group on a
//! single GPU keeps the host-staged collectives.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Arc, OnceLock};

use cudarc::driver::CudaContext;

use super::{libraries, CudaBackend, CudaError};
use crate::engine::backend::collectives::{DeviceCollectives, Dtype};
use crate::engine::backend::{BackendError, BackendResult};

type Comm = *mut c_void;
type Stream = *mut c_void;
/// `ncclResult_t`; 0 is success.
type Status = c_int;

const NCCL_SUM: c_int = 0;
/// `NCCL_UNIQUE_ID_BYTES`: the size of `ncclUniqueId`.
pub const UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`, passed by value to `ncclCommInitRank`.
#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId {
    internal: [c_char; UNIQUE_ID_BYTES],
}

/// `ncclDataType_t` of a dtype (nccl.h: ncclFloat16 = 6, ncclFloat32 = 7, ncclBfloat16 = 9).
fn data_type(dtype: Dtype) -> c_int {
    match dtype {
        Dtype::F16 => 6,
        Dtype::F32 => 7,
        Dtype::Bf16 => 9,
    }
}

/// The entry points of a loaded libnccl.
struct Library {
    _lib: libloading::Library,
    version: String,
    init_all: unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> Status,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> Status,
    init_rank: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> Status,
    all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> Status,
    reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, c_int, Comm, Stream) -> Status,
    broadcast: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> Status,
    destroy: unsafe extern "C" fn(Comm) -> Status,
    /// `ncclCommSplit` (NCCL >= 2.18; absent before: sub-groups stage through the host).
    split: Option<unsafe extern "C" fn(Comm, c_int, c_int, *mut Comm, *mut c_void) -> Status>,
    error_string: unsafe extern "C" fn(Status) -> *const c_char,
}

const NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

impl Library {
    /// libnccl, loaded once per process; the error says where a copy was found if it was not.
    fn get() -> Result<&'static Library, String> {
        static LIB: OnceLock<Result<Library, String>> = OnceLock::new();
        LIB.get_or_init(Library::load).as_ref().map_err(Clone::clone)
    }

    fn load() -> Result<Library, String> {
        // SAFETY: loading libnccl runs only its initialisers.
        let lib = NAMES.iter().find_map(|&name| unsafe { libloading::Library::new(name) }.ok()).ok_or_else(|| {
            format!(
                "libnccl (libnccl.so.2) not found on the library path{}",
                libraries::hint("libnccl.so", &["2"], "nvidia-nccl-cu13")
            )
        })?;
        // SAFETY: each symbol is looked up with the signature nccl.h declares for it.
        unsafe {
            let get_version = *lib
                .get::<unsafe extern "C" fn(*mut c_int) -> Status>(b"ncclGetVersion\0")
                .map_err(|e| format!("libnccl: {e}"))?;
            let mut code = 0;
            get_version(&mut code);
            // NCCL >= 2.9 encodes major*10000 + minor*100 + patch.
            let version = format!("NCCL {}.{}.{}", code / 10000, code % 10000 / 100, code % 100);
            macro_rules! symbol {
                ($name:literal) => {
                    *lib.get($name).map_err(|e| format!("libnccl: {e}"))?
                };
            }
            Ok(Library {
                version,
                init_all: symbol!(b"ncclCommInitAll\0"),
                get_unique_id: symbol!(b"ncclGetUniqueId\0"),
                init_rank: symbol!(b"ncclCommInitRank\0"),
                all_reduce: symbol!(b"ncclAllReduce\0"),
                reduce: symbol!(b"ncclReduce\0"),
                broadcast: symbol!(b"ncclBroadcast\0"),
                destroy: symbol!(b"ncclCommDestroy\0"),
                split: lib.get(b"ncclCommSplit\0").ok().map(|s| *s),
                error_string: symbol!(b"ncclGetErrorString\0"),
                _lib: lib,
            })
        }
    }

    fn check(&self, status: Status) -> Result<(), String> {
        if status == 0 {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static string for any code.
        let text = unsafe { CStr::from_ptr((self.error_string)(status)) };
        Err(format!("NCCL error {status}: {}", text.to_string_lossy()))
    }
}

/// One rank's communicator.
pub struct NcclRank {
    lib: &'static Library,
    comm: Comm,
    device: String,
    ctx: Arc<CudaContext>,
    /// The rank's compute stream (its backend's).
    stream: Stream,
}

// SAFETY: a communicator belongs to one rank, whose backend (and so this) is used by that
// rank's thread alone; NCCL allows a communicator to be used from any thread, one at a time.
unsafe impl Send for NcclRank {}
unsafe impl Sync for NcclRank {}

impl NcclRank {
    /// `comm`, used on `backend`'s device and compute stream.
    fn on(lib: &'static Library, comm: Comm, backend: &CudaBackend) -> NcclRank {
        NcclRank {
            lib,
            comm,
            device: format!("cuda:{}", backend.index),
            ctx: backend.ctx.clone(),
            stream: backend.stream.cu_stream() as Stream,
        }
    }

    fn call(&self, op: &'static str, f: impl FnOnce() -> Status) -> BackendResult {
        let error = |detail: String| BackendError::Device { op, device: self.device.clone(), detail };
        self.ctx.bind_to_thread().map_err(|e| error(format!("{e:?}")))?;
        self.lib.check(f()).map_err(error)
    }
}

impl DeviceCollectives for NcclRank {
    fn split(&self, color: u64, key: usize) -> BackendResult<Option<Arc<dyn DeviceCollectives>>> {
        let Some(split) = self.lib.split else { return Ok(None) };
        let error = |detail: String| BackendError::Device { op: "nccl split", device: self.device.clone(), detail };
        let color = c_int::try_from(color).map_err(|_| error(format!("color {color} is not an int")))?;
        let key = c_int::try_from(key).map_err(|_| error(format!("key {key} is not an int")))?;
        let mut comm: Comm = std::ptr::null_mut();
        // SAFETY: `self.comm` is a live communicator; NULL config takes NCCL's defaults.
        self.call("nccl split", || unsafe { split(self.comm, color, key, &mut comm, std::ptr::null_mut()) })?;
        Ok(Some(Arc::new(NcclRank {
            lib: self.lib,
            comm,
            device: self.device.clone(),
            ctx: self.ctx.clone(),
            stream: self.stream,
        })))
    }

    fn all_reduce_sum(&self, buf: u64, count: usize, dtype: Dtype) -> BackendResult {
        let ptr = buf as *mut c_void;
        // SAFETY: `buf` holds `count` elements of `dtype` on this rank's device (the contract).
        self.call("nccl all_reduce", || unsafe {
            (self.lib.all_reduce)(ptr, ptr, count, data_type(dtype), NCCL_SUM, self.comm, self.stream)
        })
    }

    fn reduce_sum(&self, send: u64, recv: Option<u64>, count: usize, dtype: Dtype, root: usize) -> BackendResult {
        // recvbuff is only read on the root; the others pass their send buffer.
        let recv = recv.unwrap_or(send) as *mut c_void;
        // SAFETY: as above, for `send` and (on the root) `recv`.
        self.call("nccl reduce", || unsafe {
            (self.lib.reduce)(
                send as *const c_void,
                recv,
                count,
                data_type(dtype),
                NCCL_SUM,
                root as c_int,
                self.comm,
                self.stream,
            )
        })
    }

    fn broadcast(&self, send: Option<u64>, recv: u64, count: usize, dtype: Dtype, root: usize) -> BackendResult {
        // sendbuff is only read on the root; the others pass their receive buffer.
        let send = send.unwrap_or(recv) as *const c_void;
        // SAFETY: as above.
        self.call("nccl broadcast", || unsafe {
            (self.lib.broadcast)(
                send,
                recv as *mut c_void,
                count,
                data_type(dtype),
                root as c_int,
                self.comm,
                self.stream,
            )
        })
    }
}

impl Drop for NcclRank {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: the communicator was created by ncclCommInitAll and is destroyed once.
            let _ = unsafe { (self.lib.destroy)(self.comm) };
        }
    }
}

/// The version of libnccl, loading it; or why it does not load.
pub fn version() -> Result<String, String> {
    Library::get().map(|lib| lib.version.clone())
}

/// Give every rank of `backends` (rank r = `backends[r]`, each on its own GPU) an NCCL
/// communicator of the group; returns the NCCL version. An error leaves the backends without
/// one (their collectives stay staged through the host).
pub fn attach(backends: &mut [CudaBackend]) -> Result<String, CudaError> {
    let devices: Vec<c_int> = backends.iter().map(|b| b.index as c_int).collect();
    let comms = communicators(&devices).map_err(|detail| CudaError::Nccl { detail })?;
    let lib = Library::get().map_err(|detail| CudaError::Nccl { detail })?;
    for (backend, comm) in backends.iter_mut().zip(comms) {
        backend.nccl = Some(NcclRank::on(lib, comm, backend));
    }
    Ok(lib.version.clone())
}

/// A new group's unique id (rank 0 of a group of rank processes makes it and sends it to the
/// others at the rendezvous).
pub fn unique_id() -> Result<Vec<u8>, CudaError> {
    let lib = Library::get().map_err(|detail| CudaError::Nccl { detail })?;
    let mut id = UniqueId { internal: [0; UNIQUE_ID_BYTES] };
    // SAFETY: one output id.
    lib.check(unsafe { (lib.get_unique_id)(&mut id) }).map_err(|detail| CudaError::Nccl { detail })?;
    Ok(id.internal.iter().map(|&b| b as u8).collect())
}

/// Give this process's rank `rank` of a group of `world` rank processes (each on its own GPU,
/// `backend`'s) its communicator, from the group's unique `id`. Every rank of the group must
/// call it (NCCL waits for all of them); returns the NCCL version.
pub fn attach_rank(backend: &mut CudaBackend, id: &[u8], rank: usize, world: usize) -> Result<String, CudaError> {
    let lib = Library::get().map_err(|detail| CudaError::Nccl { detail })?;
    let id = unique_id_of(id).map_err(|detail| CudaError::Nccl { detail })?;
    backend.ctx.bind_to_thread().map_err(|e| CudaError::Nccl { detail: format!("{e:?}") })?;
    let mut comm: Comm = std::ptr::null_mut();
    // SAFETY: one output communicator; the id is passed by value as nccl.h declares.
    lib.check(unsafe { (lib.init_rank)(&mut comm, world as c_int, id, rank as c_int) })
        .map_err(|detail| CudaError::Nccl { detail })?;
    backend.nccl = Some(NcclRank::on(lib, comm, backend));
    Ok(lib.version.clone())
}

/// The `ncclUniqueId` held in `bytes` (as `unique_id` made them).
fn unique_id_of(bytes: &[u8]) -> Result<UniqueId, String> {
    if bytes.len() != UNIQUE_ID_BYTES {
        return Err(format!("an NCCL unique id of {} bytes (NCCL's are {UNIQUE_ID_BYTES})", bytes.len()));
    }
    let mut id = UniqueId { internal: [0; UNIQUE_ID_BYTES] };
    for (d, &b) in id.internal.iter_mut().zip(bytes) {
        *d = b as c_char;
    }
    Ok(id)
}

/// One communicator per device of `devices` (rank r on `devices[r]`), all of one group.
fn communicators(devices: &[c_int]) -> Result<Vec<Comm>, String> {
    if let Some(d) = devices.iter().enumerate().find_map(|(i, d)| devices[..i].contains(d).then_some(d)) {
        return Err(format!("two ranks on cuda:{d}: NCCL needs a GPU per rank"));
    }
    let lib = Library::get()?;
    let mut comms: Vec<Comm> = vec![std::ptr::null_mut(); devices.len()];
    // SAFETY: one output slot per device.
    lib.check(unsafe { (lib.init_all)(comms.as_mut_ptr(), devices.len() as c_int, devices.as_ptr()) })?;
    Ok(comms)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Loads libnccl and looks up every entry point, and a group without a usable GPU is an
    /// error naming NCCL's reason, not a crash. Required in CI (HEADROOM_NCCL_TEST=1, set by
    /// .ci/run after installing pip's libnccl, which loads without a GPU).
    #[test]
    fn libnccl_loads_and_a_group_without_a_gpu_is_an_error() {
        let required = std::env::var("HEADROOM_NCCL_TEST").is_ok_and(|v| v == "1");
        let lib = match Library::get() {
            Ok(lib) => lib,
            Err(e) => {
                assert!(!required, "HEADROOM_NCCL_TEST=1 but {e}");
                assert!(e.starts_with("libnccl (libnccl.so.2) not found on the library path: "), "{e}");
                eprintln!("skipped: {e}");
                return;
            }
        };
        eprintln!("{}", lib.version);
        assert!(lib.version.starts_with("NCCL 2."), "{}", lib.version);
        // Sub-group communicators (tensor- and pipeline-parallel groups) need ncclCommSplit,
        // NCCL 2.18 and later: pip's libnccl has it.
        let minor: u32 = lib.version.split('.').nth(1).and_then(|m| m.parse().ok()).unwrap_or(0);
        assert_eq!(lib.split.is_some(), minor >= 18, "{}: ncclCommSplit resolved iff NCCL >= 2.18", lib.version);
        if required {
            assert!(lib.split.is_some(), "CI's libnccl resolves ncclCommSplit ({})", lib.version);
        }
        // The process-group path: a unique id is made without a GPU (NCCL's bootstrap is the
        // network) and a wrong-sized one is refused before NCCL sees it.
        match unique_id() {
            Ok(id) => {
                assert_eq!(id.len(), UNIQUE_ID_BYTES);
                assert!(id.iter().any(|&b| b != 0), "an id with content");
                assert_eq!(unique_id_of(&id).unwrap().internal.map(|b| b as u8).to_vec(), id);
            }
            Err(e) => eprintln!("ncclGetUniqueId here: {e}"),
        }
        assert!(unique_id_of(&[1; 12]).err().unwrap().contains("12 bytes"));
        let err = communicators(&[0, 1, 0]).unwrap_err();
        assert_eq!(err, "two ranks on cuda:0: NCCL needs a GPU per rank");
        if !super::super::driver_present() {
            let err = communicators(&[0]).unwrap_err();
            assert!(err.starts_with("NCCL error "), "{err}");
            eprintln!("without a driver: {err}");
        }
    }
}
