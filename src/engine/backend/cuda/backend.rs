//! `CudaBackend`: the `Backend` ops on one CUDA device — a pool over cuMemAlloc'd segments,
//! every kernel family compiled by NVRTC for the device's architecture and loaded once, matmuls
//! and attention products through cuBLAS (fp32 accumulation, no TF32), all on one compute
//! stream; offload prefetch (`upload_ahead`) on a second, copy stream, ordered by events.
//!
//! Status: compile-checked only. It has not yet run on a GPU; `headroom gpu-check` (and
//! `scripts/gpu-check.sh`) compares every op against `CpuBackend` on a machine that has one.
//!
//! Stream ordering makes the pool's reuse safe: a block freed after an op was issued is only
//! handed to ops issued later on the same stream. A copy ahead first waits for everything
//! issued on the compute stream (its destination may be memory freed by those ops), and the
//! compute stream waits for the copy (`wait_copy`) before using it. Its source is staged
//! through page-locked host memory so the copy engine reads it while the host goes on.
//! Downloads ahead (gradients leaving during backward) ride the same copy stream after an event
//! of the compute stream, into host memory the caller page-locks (`pin_host`).
//! Synchronous host copies synchronise before returning.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytemuck::Pod;
use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    result as drv, CudaContext, CudaEvent, CudaFunction, CudaStream, DriverError, LaunchConfig, PushKernelArg,
};

use crate::memory::{Buffer, Category, Pool, SegmentSource};

use super::{
    compile, cublas_present, driver_present, no_cublas, no_nvrtc, nvrtc_present, signatures, CudaError, Param, KERNELS,
};
use crate::engine::backend::collectives::DeviceCollectives;
use crate::engine::backend::layers::Elem;
use crate::engine::backend::optim::{AdamW, BETA1, BETA2, EPS};
use crate::engine::backend::workspace::{
    cuda_column_bands, cuda_order_keys, CudaAttention, CudaAttentionKernels, WorkspaceModel, CUDA_ORDER_CHUNK,
};
use crate::engine::backend::{shapes, Backend, BackendError, BackendResult, HostPin, View, ViewMut};

/// Threads per block of the elementwise kernels (the workspace declarations size reductions'
/// partial sums by it).
const THREADS: u32 = crate::engine::backend::workspace::CUDA_THREADS as u32;
/// The most threads any launch puts in a block (cross-entropy rows, column sums): every
/// kernel's registers must fit 64K per block at this size (tested from ptxas's report).
pub(super) const MAX_BLOCK_THREADS: u32 = 512;

/// Page-locked host memory that copies ahead are staged through; reused once the copy that
/// last read it has completed.
struct Staging {
    ptr: *mut u8,
    bytes: usize,
    /// Recorded on the copy stream after the last copy out of this buffer.
    done: CudaEvent,
}

// SAFETY: the pointer is page-locked host memory owned by this value alone, touched only under
// the backend's staging lock.
unsafe impl Send for Staging {}

/// Staging buffers are rounded up to this, so segments of similar size share one.
const STAGING_ROUND: usize = 1 << 20;

impl Staging {
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Staging, DriverError> {
        let bytes = bytes.div_ceil(STAGING_ROUND) * STAGING_ROUND;
        let done = ctx.new_event(None)?;
        // SAFETY: a plain page-locked allocation; freed in Drop.
        let ptr = unsafe { drv::malloc_host(bytes, 0) }? as *mut u8;
        Ok(Staging { ptr, bytes, done })
    }

    /// No copy is reading it (an event never recorded counts as complete).
    fn idle(&self) -> bool {
        self.done.is_complete()
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = self.done.synchronize();
        let _ = self.done.context().bind_to_thread();
        // SAFETY: allocated by malloc_host in `new`; the copy reading it has completed.
        let _ = unsafe { drv::free_host(self.ptr as *mut std::ffi::c_void) };
    }
}

/// Host memory page-locked by `pin_host`; unregistered when dropped.
struct Registered {
    ptr: usize,
    ctx: Arc<CudaContext>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: registered by `pin_host`, still allocated (its contract).
        let _ = unsafe { cudarc::driver::sys::cuMemHostUnregister(self.ptr as *mut std::ffi::c_void) };
    }
}

/// One kernel argument, by the C type of its parameter.
#[derive(Clone, Copy)]
enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

impl Arg {
    fn param(&self) -> Param {
        match self {
            Arg::Ptr(_) => Param::Ptr,
            Arg::I32(_) => Param::I32,
            Arg::I64(_) => Param::I64,
            Arg::F32(_) => Param::F32,
        }
    }
}

/// The storage types the kernels are compiled for: (`Elem::NAME`, entry-point suffix).
pub(crate) const DTYPES: &[(&str, &str)] = &[("fp32", "f32"), ("bf16", "bf16"), ("fp16", "f16")];

/// The entry-point suffix of `E`, or the op's "unsupported" error.
fn suffix<E: Elem>(backend: &CudaBackend, op: &'static str) -> BackendResult<&'static str> {
    DTYPES
        .iter()
        .find(|(name, _)| *name == E::NAME)
        .map(|&(_, suffix)| suffix)
        .ok_or_else(|| BackendError::Unsupported { backend: backend.device(), op, dtype: E::NAME })
}

fn data_type<E: Elem>() -> blas_sys::cudaDataType {
    match E::NAME {
        "fp16" => blas_sys::cudaDataType::CUDA_R_16F,
        "bf16" => blas_sys::cudaDataType::CUDA_R_16BF,
        _ => blas_sys::cudaDataType::CUDA_R_32F,
    }
}

const F32: blas_sys::cudaDataType = blas_sys::cudaDataType::CUDA_R_32F;

/// A value that must fit a kernel's `int` parameter.
fn int(op: &'static str, what: &str, v: usize) -> BackendResult<Arg> {
    i32::try_from(v)
        .map(Arg::I32)
        .map_err(|_| BackendError::Shape { op, detail: format!("{what} = {v} exceeds the kernel's int range") })
}

fn long(v: usize) -> Arg {
    Arg::I64(v as i64)
}

/// One block of `MAX_BLOCK_THREADS` per row (the cross-entropy's rows of V logits).
pub(crate) fn block_rows(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (MAX_BLOCK_THREADS, 1, 1), shared_mem_bytes: 0 }
}

pub(crate) fn elementwise(n: usize) -> LaunchConfig {
    LaunchConfig {
        // In usize: n itself may pass u32 (logits of B·T·V elements); the block count cannot
        // in any buffer that fits a device.
        grid_dim: (n.div_ceil(THREADS as usize).max(1) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One launch of the embedding backward's token sort (`encoder.cu`: a bitonic network over
/// `cuda_order_keys(B·T)` keys, chunks of up to `CUDA_ORDER_CHUNK` in shared memory).
#[derive(Debug, Clone, Copy)]
pub(crate) enum OrderLaunch {
    /// `encoder_order_chunks(keys, inp, BT, chunk)`: fill the keys and sort each chunk.
    Chunks { cfg: LaunchConfig, chunk: usize },
    /// `encoder_order_merge(keys, N, j, k)`: stage k's stride j, which spans chunks.
    Merge { cfg: LaunchConfig, n: usize, j: usize, k: usize },
    /// `encoder_order_merge_chunk(keys, chunk, k)`: stage k's strides within each chunk.
    MergeChunks { cfg: LaunchConfig, chunk: usize, k: usize },
}

/// The token sort's launches for `bt` positions, in order: a block per chunk, a thread per
/// pair of keys up to `MAX_BLOCK_THREADS`.
pub(crate) fn encoder_order_plan(bt: usize) -> Vec<OrderLaunch> {
    let n = cuda_order_keys(bt);
    let chunk = n.min(CUDA_ORDER_CHUNK);
    let threads = (chunk / 2).min(MAX_BLOCK_THREADS as usize) as u32;
    let cfg = LaunchConfig { grid_dim: ((n / chunk) as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
    let mut plan = vec![OrderLaunch::Chunks { cfg, chunk }];
    let mut k = 2 * chunk;
    while k <= n {
        let mut j = k / 2;
        while j >= chunk {
            plan.push(OrderLaunch::Merge { cfg: elementwise(n / 2), n, j, k });
            j /= 2;
        }
        plan.push(OrderLaunch::MergeChunks { cfg, chunk, k });
        k *= 2;
    }
    plan
}

/// The element-wise kernels' launch over `n` elements of `elem_bytes` each: a thread per pack
/// of 16 bytes (`PACK(T)` in `common.cuh`: 8 16-bit elements, 4 f32), the last one partial.
pub(crate) fn packed(n: usize, elem_bytes: usize) -> LaunchConfig {
    elementwise(n.div_ceil(16 / elem_bytes))
}

/// One warp per row, eight rows per block.
pub(crate) fn warp_rows(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows.div_ceil(8).max(1) as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// The fused attention kernels: 64 rows (queries, or keys) of one (batch, head) per block of
/// 4 warps, grid (⌈T/64⌉, B·NH).
pub(crate) fn flash_blocks(b: usize, t: usize, nh: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (t.div_ceil(64) as u32, (b * nh) as u32, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 }
}

/// Column sums' first stage over `cols` columns of `elem_bytes` each: blocks of 32 packs of
/// columns (16 bytes of them, `PACK(T)`) × 16 row strides, one row of blocks per band.
pub(crate) fn column_sums(cols: usize, bands: usize, elem_bytes: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (cols.div_ceil(32 * (16 / elem_bytes)).max(1) as u32, bands.max(1) as u32, 1),
        block_dim: (32, MAX_BLOCK_THREADS / 32, 1),
        shared_mem_bytes: 0,
    }
}

/// One GEMM (or a strided batch of them) in cuBLAS's column-major terms.
struct Gemm {
    trans_a: bool,
    trans_b: bool,
    m: usize,
    n: usize,
    k: usize,
    a: (u64, blas_sys::cudaDataType, usize, usize),
    b: (u64, blas_sys::cudaDataType, usize, usize),
    c: (u64, blas_sys::cudaDataType, usize, usize),
    beta: f32,
    batch: usize,
}

/// Sequences `first..first + count` of the batch: one chunk of the attention's heads.
struct HeadChunk {
    first: usize,
    count: usize,
    nh: usize,
}

impl HeadChunk {
    /// Heads in the chunk: the products' batch count.
    fn heads(&self) -> usize {
        self.count * self.nh
    }

    /// Rows of its (T,T) matrices: one per (head, query).
    fn rows(&self, t: usize) -> usize {
        self.heads() * t
    }

    /// Its first row in a (B,NH,T) tensor (the log-sum-exp), in elements.
    fn row_offset(&self, t: usize) -> u64 {
        (self.first * self.nh * t) as u64
    }
}

/// The attention's strided-batched products over head-major (B·NH, T, HS) tensors in `E`, one
/// chunk of sequences at a time, with the chunk's (chunk·NH, T, T) matrices at the start of
/// their scratch buffers (f32 scores, probabilities in `E`).
struct HeadChunks<E> {
    b: usize,
    t: usize,
    hs: usize,
    nh: usize,
    chunk: usize,
    elem: std::marker::PhantomData<E>,
}

impl<E: Elem> HeadChunks<E> {
    fn new(b: usize, t: usize, c: usize, nh: usize, chunk: usize) -> Self {
        HeadChunks { b, t, hs: c / nh, nh, chunk: chunk.max(1), elem: std::marker::PhantomData }
    }

    fn chunks(&self) -> impl Iterator<Item = HeadChunk> + '_ {
        (0..self.b).step_by(self.chunk).map(|first| HeadChunk {
            first,
            count: self.chunk.min(self.b - first),
            nh: self.nh,
        })
    }

    /// The address of the chunk's first head in a (B·NH, T, HS) tensor of `bytes`-wide elements.
    fn at(&self, chunk: &HeadChunk, base: u64, bytes: usize) -> u64 {
        base + (chunk.first * self.nh * self.t * self.hs * bytes) as u64
    }

    /// out (chunk·NH, T, T) f32 per head, out[i][j] = rows_i · columns_j: the scores (rows q,
    /// columns k) or the probabilities' gradient (rows dy, columns v).
    fn scores(&self, chunk: &HeadChunk, columns: u64, rows: u64, out: u64) -> Gemm {
        let (t, hs, ty) = (self.t, self.hs, data_type::<E>());
        Gemm {
            trans_a: true,
            trans_b: false,
            m: t,
            n: t,
            k: hs,
            a: (self.at(chunk, columns, E::BYTES), ty, hs, t * hs),
            b: (self.at(chunk, rows, E::BYTES), ty, hs, t * hs),
            c: (out, F32, t, t * t),
            beta: 0.0,
            batch: chunk.heads(),
        }
    }

    /// out (chunk·NH, T, HS) = m · x per head, or mᵀ · x when `transposed`, m a (T,T) matrix in
    /// `E` at the start of its scratch: forward's y = p · v (out in `E`); backward's dv = pᵀ · dy,
    /// dq = ds · k and dk = dsᵀ · q (out in f32 when `out_f32`).
    fn weighted(&self, chunk: &HeadChunk, x: u64, m: u64, out: u64, transposed: bool, out_f32: bool) -> Gemm {
        let (t, hs, ty) = (self.t, self.hs, data_type::<E>());
        let (out_ty, out_bytes) = if out_f32 { (F32, 4) } else { (ty, E::BYTES) };
        Gemm {
            trans_a: false,
            trans_b: transposed,
            m: hs,
            n: t,
            k: t,
            a: (self.at(chunk, x, E::BYTES), ty, hs, t * hs),
            b: (m, ty, t, t * t),
            c: (self.at(chunk, out, out_bytes), out_ty, hs, t * hs),
            beta: 0.0,
            batch: chunk.heads(),
        }
    }
}

pub struct CudaBackend {
    /// Collectives with the other ranks' GPUs, when the group has them (dropped first).
    pub(super) nccl: Option<super::nccl::NcclRank>,
    pub(super) index: u32,
    name: String,
    pub(super) ctx: Arc<CudaContext>,
    /// The compute stream: every op, and NCCL's collectives.
    pub(super) stream: Arc<CudaStream>,
    /// Offload prefetch: host→device copies that overlap the compute stream.
    copy: Arc<CudaStream>,
    staging: Mutex<Vec<Staging>>,
    blas: CudaBlas,
    /// Every entry point, with its parameters' C types (each launch is checked against them).
    functions: HashMap<String, (CudaFunction, Vec<Param>)>,
    pool: Pool,
    /// Which kernels run attention in 16-bit storage (`HEADROOM_CUDA_ATTENTION`).
    attention: CudaAttentionKernels,
}

/// The fused attention `kernel`'s entry point (`forward`, `backward_dq`, `backward_dkv`) for
/// storage `E` (entry-point suffix `dt`) and head size `hs`, when `kernels` runs it.
pub(super) fn fused_entry<E: Elem>(kernels: CudaAttentionKernels, kernel: &str, hs: usize, dt: &str) -> Option<String> {
    kernels.fused::<E>(hs).then(|| format!("flash_attention_{kernel}_hs{hs}_{dt}"))
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend").field("device", &self.index).field("name", &self.name).finish()
    }
}

impl CudaBackend {
    /// Open device `index`: probe the libraries, create the context and stream, compile and load
    /// every kernel family, and make a pool of `device_memory` bytes (default: the free memory),
    /// with expandable segments when `expandable` and the device supports virtual memory
    /// management (else fixed segments from `cuMemAlloc`).
    pub fn new(index: u32, device_memory: Option<usize>, expandable: bool) -> Result<CudaBackend, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver { index });
        }
        if !nvrtc_present() {
            return Err(no_nvrtc());
        }
        if !cublas_present() {
            return Err(no_cublas());
        }
        let err =
            |op: &'static str| move |e: &dyn std::fmt::Debug| CudaError::Driver { index, op, detail: format!("{e:?}") };
        let ctx = CudaContext::new(index as usize).map_err(|e| err("context creation")(&e))?;
        let name = ctx.name().unwrap_or_else(|_| format!("cuda:{index}"));
        let (major, minor) = ctx.compute_capability().map_err(|e| err("compute capability query")(&e))?;
        let arch = format!("sm_{major}{minor}");
        let stream = ctx.default_stream();
        let copy = ctx.new_stream().map_err(|e| err("copy stream creation")(&e))?;
        let attention = CudaAttentionKernels::from_env().map_err(|value| CudaError::Setting {
            name: CudaAttentionKernels::VARIABLE,
            value,
            expected: CudaAttentionKernels::EXPECTED,
        })?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| err("cuBLAS handle creation")(&e))?;
        let mut functions = HashMap::new();
        for (family, _) in KERNELS {
            let cubin = compile(family, &arch)?;
            let module =
                ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin.to_vec())).map_err(|e| CudaError::Driver {
                    index,
                    op: "kernel module load",
                    detail: format!(
                        "{e:?} ({family} for {arch}; NVRTC {}, driver CUDA {})",
                        super::nvrtc_version().map_or("?".into(), super::dotted),
                        super::driver_version().map_or("?".into(), super::dotted),
                    ),
                })?;
            for (ep, params) in signatures(family)? {
                let f = module.load_function(&ep).map_err(|e| err("kernel lookup")(&e))?;
                functions.insert(ep, (f, params));
            }
        }
        let (free, _total) = ctx.mem_get_info().map_err(|e| err("memory query")(&e))?;
        let capacity = device_memory.unwrap_or(free);
        let source: Arc<dyn SegmentSource> = match expandable.then(|| super::vmm::CudaVmm::new(ctx.clone())).flatten() {
            Some(vmm) => Arc::new(vmm),
            None => Arc::new(super::vmm::CudaSegments { ctx: ctx.clone() }),
        };
        let pool = Pool::with_source(&format!("cuda:{index}"), capacity, source);
        Ok(CudaBackend {
            nccl: None,
            index,
            name,
            ctx,
            stream,
            copy,
            staging: Mutex::new(Vec::new()),
            blas,
            functions,
            pool,
            attention,
        })
    }

    /// Whether the kernels are built for the storage type called `dtype` (`Elem::NAME`:
    /// fp32, bf16, fp16), and its names.
    pub fn supports(dtype: &str) -> bool {
        DTYPES.iter().any(|(name, _)| *name == dtype)
    }

    /// The storage types the kernels are built for, e.g. for an error message.
    pub fn dtypes() -> Vec<&'static str> {
        DTYPES.iter().map(|(name, _)| *name).collect()
    }

    /// Which kernels run attention in 16-bit storage.
    pub fn attention_kernels(&self) -> CudaAttentionKernels {
        self.attention
    }

    /// The device's marketing name, e.g. "NVIDIA H200".
    pub fn name(&self) -> &str {
        &self.name
    }

    fn device_err(&self, op: &'static str, e: impl std::fmt::Debug) -> BackendError {
        BackendError::Device { op, device: self.device(), detail: format!("{e:?}") }
    }

    fn launch(&self, op: &'static str, kernel: &str, cfg: LaunchConfig, args: &[Arg]) -> BackendResult {
        let (f, params) =
            self.functions.get(kernel).ok_or_else(|| self.device_err(op, format!("no kernel {kernel}")))?;
        let given: Vec<Param> = args.iter().map(Arg::param).collect();
        if &given != params {
            return Err(self.device_err(op, format!("kernel {kernel} takes {params:?}, was given {given:?}")));
        }
        let mut builder = self.stream.launch_builder(f);
        for a in args {
            match a {
                Arg::Ptr(v) => builder.arg(v),
                Arg::I32(v) => builder.arg(v),
                Arg::I64(v) => builder.arg(v),
                Arg::F32(v) => builder.arg(v),
            };
        }
        // SAFETY: every caller checks the views' lengths against the shapes it passes, and the
        // argument list matches the kernel's C signature (checked above).
        unsafe { builder.launch(cfg) }.map(|_| ()).map_err(|e| self.device_err(op, e))
    }

    /// Make this device's context current on the calling thread (a rank's ops run on its own
    /// thread). Kernel launches do it through cudarc; raw driver and cuBLAS calls come here first.
    fn bind(&self, op: &'static str) -> BackendResult {
        self.ctx.bind_to_thread().map_err(|e| self.device_err(op, e))
    }

    fn gemm(&self, op: &'static str, g: Gemm) -> BackendResult {
        self.bind(op)?;
        let t = |x: bool| {
            if x {
                blas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let alpha = 1.0f32;
        let beta = g.beta;
        let i = |v: usize| v as std::ffi::c_int;
        let l = |v: usize| v as std::ffi::c_longlong;
        // SAFETY: operand extents are checked by the callers; alpha/beta are host f32 as
        // CUBLAS_COMPUTE_32F expects.
        unsafe {
            blas::gemm_strided_batched_ex(
                *self.blas.handle(),
                t(g.trans_a),
                t(g.trans_b),
                i(g.m),
                i(g.n),
                i(g.k),
                &alpha as *const f32 as *const _,
                g.a.0 as *const _,
                g.a.1,
                i(g.a.2),
                l(g.a.3),
                g.b.0 as *const _,
                g.b.1,
                i(g.b.2),
                l(g.b.3),
                &beta as *const f32 as *const _,
                g.c.0 as *mut _,
                g.c.1,
                i(g.c.2),
                l(g.c.3),
                i(g.batch),
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        }
        .map_err(|e| self.device_err(op, e))
    }

    /// An elementwise op `<op>_<dtype>(out, inp, n)` over two views of equal length (GELU
    /// forward / backward in place, residual add in place).
    fn pointwise<E: Elem>(&self, op: &'static str, what: &str, out: ViewMut<E>, inp: View<E>) -> BackendResult {
        let dt = suffix::<E>(self, op)?;
        shapes::same(op, what, out.len(), inp.len())?;
        self.launch(
            op,
            &format!("{op}_{dt}"),
            packed(inp.len(), E::BYTES),
            &[Arg::Ptr(out.address()), Arg::Ptr(inp.address()), long(inp.len())],
        )
    }

    /// A softmax cross-entropy kernel, `<op>_<dtype>(logits, losses, targets, [dloss,] N, V,
    /// VP)`, one block per row: probabilities written over the logits, or (`dloss`) their
    /// gradient.
    #[allow(clippy::too_many_arguments)]
    fn crossentropy<E: Elem>(
        &self,
        op: &'static str,
        logits: ViewMut<E>,
        losses: ViewMut<f32>,
        targets: View<u32>,
        dloss: Option<f32>,
        v: usize,
        vp: usize,
    ) -> BackendResult {
        let dt = suffix::<E>(self, op)?;
        let n = shapes::crossentropy(op, logits.len(), losses.len(), targets, v, vp)?;
        if n == 0 {
            return Ok(()); // no grid of zero blocks
        }
        let mut args = vec![Arg::Ptr(logits.address()), Arg::Ptr(losses.address()), Arg::Ptr(targets.address())];
        args.extend(dloss.map(Arg::F32));
        args.extend([int(op, "N", n)?, int(op, "V", v)?, int(op, "VP", vp)?]);
        self.launch(op, &format!("{op}_{dt}"), block_rows(n), &args)
    }

    fn scratch(&self, bytes: usize) -> BackendResult<Buffer> {
        Ok(self.pool.alloc(bytes, Category::Workspace)?)
    }

    /// One of the attention's causal-softmax row kernels, `kernel(p0, p1, p2, scale, rows, T)`,
    /// over a chunk's (head, query) rows, one warp per row.
    fn softmax_rows(
        &self,
        op: &'static str,
        kernel: &str,
        chunk: &HeadChunk,
        t: usize,
        ptrs: [u64; 3],
        scale: f32,
    ) -> BackendResult {
        let rows = chunk.rows(t);
        let [p0, p1, p2] = ptrs.map(Arg::Ptr);
        let args = [p0, p1, p2, Arg::F32(scale), int(op, "chunk·NH·T", rows)?, int(op, "T", t)?];
        self.launch(op, kernel, warp_rows(rows), &args)
    }

    /// A column sum's second stage: dst (C) += Σ over `bands` rows of `partial` (bands, C) f32.
    fn add_column_partials<E: Elem>(
        &self,
        op: &'static str,
        dst: u64,
        partial: &Buffer,
        bands: usize,
        c: usize,
    ) -> BackendResult {
        let dt = suffix::<E>(self, op)?;
        let args = [Arg::Ptr(dst), Arg::Ptr(partial.address()), int(op, "bands", bands)?, int(op, "C", c)?];
        self.launch(op, &format!("column_partials_add_{dt}"), elementwise(c), &args)
    }

    /// Bind the context and make the copy stream start its next copy only after everything
    /// issued on the compute stream so far (a copy ahead's ordering against the ops).
    fn copy_after_compute(&self, op: &'static str) -> BackendResult {
        let e = |err: DriverError| self.device_err(op, err);
        self.ctx.bind_to_thread().map_err(e)?;
        let issued = self.stream.record_event(None).map_err(e)?;
        self.copy.wait(&issued).map_err(e)
    }

    /// n elements from `src` to `dst` between f32 and `E` (`to_f32`: from `E` to f32): a copy
    /// when `E` is f32, else the cast kernel (`cast_f32_to_<dt>` or `cast_<dt>_to_f32`).
    fn convert<E: Elem>(&self, op: &'static str, to_f32: bool, dst: u64, src: u64, n: usize) -> BackendResult {
        if E::is_f32() {
            self.bind(op)?;
            // SAFETY: both ranges hold n f32 (checked by the caller).
            unsafe { drv::memcpy_dtod_async(dst, src, n * 4, self.stream.cu_stream()) }
                .map_err(|e| self.device_err(op, e))
        } else {
            let dt = suffix::<E>(self, op)?;
            let kernel = if to_f32 { format!("cast_{dt}_to_f32") } else { format!("cast_f32_to_{dt}") };
            self.launch(op, &kernel, packed(n, E::BYTES), &[Arg::Ptr(dst), Arg::Ptr(src), long(n)])
        }
    }
}

impl Backend for CudaBackend {
    type Fence = CudaEvent;

    fn device(&self) -> String {
        format!("cuda:{}", self.index)
    }

    fn pool(&self) -> &Pool {
        &self.pool
    }

    fn collectives(&self) -> Option<&dyn DeviceCollectives> {
        self.nccl.as_ref().map(|n| n as &dyn DeviceCollectives)
    }

    fn synchronize(&self) -> BackendResult {
        self.copy.synchronize().map_err(|e| self.device_err("synchronize", e))?;
        self.stream.synchronize().map_err(|e| self.device_err("synchronize", e))
    }

    fn upload_ahead<T: Pod>(&self, dst: ViewMut<T>, src: &[T]) -> BackendResult<CudaEvent> {
        const OP: &str = "upload_ahead";
        shapes::same(OP, "destination", dst.len(), src.len())?;
        let e = |err: DriverError| self.device_err(OP, err);
        // The destination may be pool memory that ops issued until now still use.
        self.copy_after_compute(OP)?;
        let bytes: &[u8] = bytemuck::cast_slice(src);
        if !bytes.is_empty() {
            let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
            let at = match staging.iter().position(|s| s.bytes >= bytes.len() && s.idle()) {
                Some(i) => i,
                None => {
                    // Every idle buffer is too small: replace them with one that fits.
                    staging.retain(|s| !s.idle());
                    staging.push(Staging::new(&self.ctx, bytes.len()).map_err(e)?);
                    staging.len() - 1
                }
            };
            let slot = &staging[at];
            // SAFETY: the slot holds at least bytes.len() bytes and no copy reads it (idle).
            let staged = unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), slot.ptr, bytes.len());
                std::slice::from_raw_parts(slot.ptr as *const u8, bytes.len())
            };
            // SAFETY: dst holds bytes.len() bytes and stays allocated until `wait_copy` (the
            // contract); the staged source stays untouched until `slot.done` completes.
            unsafe { drv::memcpy_htod_async(dst.address(), staged, self.copy.cu_stream()) }.map_err(e)?;
            slot.done.record(&self.copy).map_err(e)?;
        }
        self.copy.record_event(None).map_err(e)
    }

    fn wait_copy(&self, fence: CudaEvent) -> BackendResult {
        self.stream.wait(&fence).map_err(|e| self.device_err("wait_copy", e))
    }

    unsafe fn download_ahead<T: Pod>(&self, src: View<T>, dst: &mut [T]) -> BackendResult<CudaEvent> {
        const OP: &str = "download_ahead";
        shapes::same(OP, "destination", dst.len(), src.len())?;
        let e = |err: DriverError| self.device_err(OP, err);
        // The source is written by ops issued until now.
        self.copy_after_compute(OP)?;
        if !dst.is_empty() {
            // SAFETY: src holds dst.len() elements; the caller keeps dst alive and untouched
            // until the fence is waited on (the contract). Into page-locked memory the copy is
            // asynchronous; into pageable memory the driver stages it.
            unsafe { drv::memcpy_dtoh_async(dst, src.address(), self.copy.cu_stream()) }.map_err(e)?;
        }
        self.copy.record_event(None).map_err(e)
    }

    fn wait_host(&self, fence: CudaEvent) -> BackendResult {
        fence.synchronize().map_err(|e| self.device_err("wait_host", e))
    }

    fn pin_host(&self, mem: &mut [u8]) -> BackendResult<HostPin> {
        if mem.is_empty() {
            return Ok(HostPin::default());
        }
        self.bind("pin_host")?;
        let ptr = mem.as_mut_ptr();
        // SAFETY: `mem` is live host memory; the pin unregisters it before the caller frees it
        // (the contract of `pin_host`).
        unsafe { cudarc::driver::sys::cuMemHostRegister_v2(ptr as *mut std::ffi::c_void, mem.len(), 0) }
            .result()
            .map_err(|e| self.device_err("pin_host", e))?;
        Ok(HostPin::new(Registered { ptr: ptr as usize, ctx: self.ctx.clone() }))
    }

    fn upload<T: Pod>(&self, dst: ViewMut<T>, src: &[T]) -> BackendResult {
        shapes::same("upload", "destination", dst.len(), src.len())?;
        self.bind("upload")?;
        // SAFETY: dst holds src.len() elements; the synchronize keeps `src` borrowed until done.
        unsafe { drv::memcpy_htod_async(dst.address(), src, self.stream.cu_stream()) }
            .map_err(|e| self.device_err("upload", e))?;
        self.synchronize()
    }

    fn download<T: Pod>(&self, src: View<T>, dst: &mut [T]) -> BackendResult {
        shapes::same("download", "destination", dst.len(), src.len())?;
        self.bind("download")?;
        // SAFETY: as for upload.
        unsafe { drv::memcpy_dtoh_async(dst, src.address(), self.stream.cu_stream()) }
            .map_err(|e| self.device_err("download", e))?;
        self.synchronize()
    }

    fn copy<T: Pod>(&self, dst: ViewMut<T>, src: View<T>) -> BackendResult {
        shapes::same("copy", "destination", dst.len(), src.len())?;
        self.bind("copy")?;
        // SAFETY: both views' bytes lie inside their buffers (same length, checked above).
        unsafe {
            drv::memcpy_dtod_async(
                dst.address(),
                src.address(),
                std::mem::size_of::<T>() * src.len(),
                self.stream.cu_stream(),
            )
        }
        .map_err(|e| self.device_err("copy", e))
    }

    fn zero<T: Pod>(&self, dst: ViewMut<T>) -> BackendResult {
        let bytes = dst.len() * std::mem::size_of::<T>();
        self.bind("zero")?;
        // SAFETY: the view's bytes lie inside its buffer.
        unsafe { drv::memset_d8_async(dst.address(), 0, bytes, self.stream.cu_stream()) }
            .map_err(|e| self.device_err("zero", e))
    }

    fn encoder_forward<E: Elem>(
        &self,
        out: ViewMut<E>,
        inp: View<u32>,
        wte: View<E>,
        wpe: View<E>,
        t: usize,
        c: usize,
    ) -> BackendResult {
        const OP: &str = "encoder_forward";
        let dt = suffix::<E>(self, OP)?;
        shapes::encoder_forward(out.len(), inp, wte.len(), wpe.len(), t, c)?;
        let bt = inp.len();
        let args = [
            Arg::Ptr(out.address()),
            Arg::Ptr(inp.address()),
            Arg::Ptr(wte.address()),
            Arg::Ptr(wpe.address()),
            int(OP, "B·T", bt)?,
            int(OP, "T", t)?,
            int(OP, "C", c)?,
        ];
        self.launch(OP, &format!("encoder_forward_{dt}"), elementwise(bt * c), &args)
    }

    fn encoder_backward<E: Elem>(
        &self,
        dwte: ViewMut<E>,
        dwpe: ViewMut<E>,
        dout: View<E>,
        inp: View<u32>,
        t: usize,
        c: usize,
    ) -> BackendResult {
        const OP: &str = "encoder_backward";
        let dt = suffix::<E>(self, OP)?;
        shapes::encoder_backward(dwte.len(), dwpe.len(), dout.len(), inp, t, c)?;
        let bt = inp.len();
        if bt == 0 {
            return Ok(()); // no grid of zero blocks
        }
        // Tokens: the positions sorted by token (keys, as declared:
        // `WorkspaceModel::encoder_backward`), then each token's rows summed in order.
        let declared = WorkspaceModel::CUDA.encoder_backward(bt);
        let keys = self.scratch(declared[0])?;
        for launch in encoder_order_plan(bt) {
            match launch {
                OrderLaunch::Chunks { cfg, chunk } => {
                    let args = [
                        Arg::Ptr(keys.address()),
                        Arg::Ptr(inp.address()),
                        int(OP, "B·T", bt)?,
                        int(OP, "chunk", chunk)?,
                    ];
                    self.launch(OP, "encoder_order_chunks", cfg, &args)?;
                }
                OrderLaunch::Merge { cfg, n, j, k } => {
                    let args = [Arg::Ptr(keys.address()), int(OP, "N", n)?, int(OP, "j", j)?, int(OP, "k", k)?];
                    self.launch(OP, "encoder_order_merge", cfg, &args)?;
                }
                OrderLaunch::MergeChunks { cfg, chunk, k } => {
                    let args = [Arg::Ptr(keys.address()), int(OP, "chunk", chunk)?, int(OP, "k", k)?];
                    self.launch(OP, "encoder_order_merge_chunk", cfg, &args)?;
                }
            }
        }
        let args = [
            Arg::Ptr(dwte.address()),
            Arg::Ptr(dout.address()),
            Arg::Ptr(keys.address()),
            int(OP, "B·T", bt)?,
            int(OP, "C", c)?,
        ];
        self.launch(OP, &format!("encoder_backward_wte_{dt}"), elementwise(bt * c), &args)?;
        // Positions: the batch summed in order per (t, c), no atomics (bit for bit the CPU's).
        let args = [
            Arg::Ptr(dwpe.address()),
            Arg::Ptr(dout.address()),
            int(OP, "B", bt / t)?,
            int(OP, "T", t)?,
            int(OP, "C", c)?,
        ];
        self.launch(OP, &format!("encoder_backward_wpe_{dt}"), elementwise(t * c), &args)
    }

    fn layernorm_forward<E: Elem>(
        &self,
        out: ViewMut<E>,
        mean: ViewMut<f32>,
        rstd: ViewMut<f32>,
        inp: View<E>,
        weight: View<E>,
        bias: View<E>,
        c: usize,
    ) -> BackendResult {
        const OP: &str = "layernorm_forward";
        let dt = suffix::<E>(self, OP)?;
        let n = shapes::layernorm_forward(out.len(), mean.len(), rstd.len(), inp.len(), weight.len(), bias.len(), c)?;
        let args = [
            Arg::Ptr(out.address()),
            Arg::Ptr(mean.address()),
            Arg::Ptr(rstd.address()),
            Arg::Ptr(inp.address()),
            Arg::Ptr(weight.address()),
            Arg::Ptr(bias.address()),
            int(OP, "N", n)?,
            int(OP, "C", c)?,
        ];
        self.launch(OP, &format!("layernorm_forward_{dt}"), warp_rows(n), &args)
    }

    fn layernorm_recompute<E: Elem>(
        &self,
        out: ViewMut<E>,
        inp: View<E>,
        weight: View<E>,
        bias: View<E>,
        mean: View<f32>,
        rstd: View<f32>,
        c: usize,
    ) -> BackendResult {
        const OP: &str = "layernorm_recompute";
        let dt = suffix::<E>(self, OP)?;
        let n = shapes::layernorm_recompute(out.len(), inp.len(), weight.len(), bias.len(), mean.len(), rstd.len(), c)?;
        let args = [
            Arg::Ptr(out.address()),
            Arg::Ptr(inp.address()),
            Arg::Ptr(weight.address()),
            Arg::Ptr(bias.address()),
            Arg::Ptr(mean.address()),
            Arg::Ptr(rstd.address()),
            int(OP, "N", n)?,
            int(OP, "C", c)?,
        ];
        self.launch(OP, &format!("layernorm_recompute_{dt}"), packed(n * c, E::BYTES), &args)
    }

    fn layernorm_backward<E: Elem>(
        &self,
        dinp: ViewMut<E>,
        dweight: ViewMut<E>,
        dbias: ViewMut<E>,
        dout: View<E>,
        inp: View<E>,
        weight: View<E>,
        mean: View<f32>,
        rstd: View<f32>,
        c: usize,
    ) -> BackendResult {
        const OP: &str = "layernorm_backward";
        let dt = suffix::<E>(self, OP)?;
        let n = shapes::layernorm_backward(
            dinp.len(),
            dweight.len(),
            dbias.len(),
            dout.len(),
            inp.len(),
            weight.len(),
            mean.len(),
            rstd.len(),
            c,
        )?;
        let (nn, cc) = (int(OP, "N", n)?, int(OP, "C", c)?);
        let args = [
            Arg::Ptr(dinp.address()),
            Arg::Ptr(dout.address()),
            Arg::Ptr(inp.address()),
            Arg::Ptr(weight.address()),
            Arg::Ptr(mean.address()),
            Arg::Ptr(rstd.address()),
            nn,
            cc,
        ];
        self.launch(OP, &format!("layernorm_backward_{dt}"), warp_rows(n), &args)?;
        // Scratch sized by the declaration the estimator sums (`WorkspaceModel::layernorm_backward`).
        let bands = cuda_column_bands(n);
        let (pw, pb) = (self.scratch(bands * c * 4)?, self.scratch(bands * c * 4)?);
        let args = [
            Arg::Ptr(pw.address()),
            Arg::Ptr(pb.address()),
            Arg::Ptr(dout.address()),
            Arg::Ptr(inp.address()),
            Arg::Ptr(mean.address()),
            Arg::Ptr(rstd.address()),
            nn,
            cc,
            int(OP, "band", n.div_ceil(bands))?,
        ];
        self.launch(OP, &format!("layernorm_param_backward_partial_{dt}"), column_sums(c, bands, E::BYTES), &args)?;
        self.add_column_partials::<E>(OP, dweight.address(), &pw, bands, c)?;
        self.add_column_partials::<E>(OP, dbias.address(), &pb, bands, c)
    }

    fn matmul_forward<E: Elem>(
        &self,
        out: ViewMut<E>,
        inp: View<E>,
        weight: View<E>,
        bias: Option<View<E>>,
        n: usize,
        c: usize,
        oc: usize,
    ) -> BackendResult {
        const OP: &str = "matmul_forward";
        let dt = suffix::<E>(self, OP)?;
        shapes::matmul_forward(out.len(), inp.len(), weight.len(), bias.map(|b| b.len()), n, c, oc)?;
        // The bias goes in first and the GEMM accumulates onto it: one rounding, as on CPU.
        if let Some(b) = bias {
            let args = [Arg::Ptr(out.address()), Arg::Ptr(b.address()), long(n), int(OP, "OC", oc)?];
            self.launch(OP, &format!("bias_broadcast_{dt}"), packed(n * oc, E::BYTES), &args)?;
        }
        // out (N,OC) row-major = (weight (OC,C) row-major)ᵀ-applied: C_cm (OC×N) = Wᵀ_cm · inp_cm.
        self.gemm(
            OP,
            Gemm {
                trans_a: true,
                trans_b: false,
                m: oc,
                n,
                k: c,
                a: (weight.address(), data_type::<E>(), c, 0),
                b: (inp.address(), data_type::<E>(), c, 0),
                c: (out.address(), data_type::<E>(), oc, 0),
                beta: if bias.is_some() { 1.0 } else { 0.0 },
                batch: 1,
            },
        )
    }

    fn matmul_backward<E: Elem>(
        &self,
        dinp: ViewMut<E>,
        dweight: ViewMut<E>,
        dbias: Option<ViewMut<E>>,
        dout: View<E>,
        inp: View<E>,
        weight: View<E>,
        n: usize,
        c: usize,
        oc: usize,
    ) -> BackendResult {
        const OP: &str = "matmul_backward";
        let dt = suffix::<E>(self, OP)?;
        shapes::matmul_backward(
            dinp.len(),
            dweight.len(),
            dbias.as_ref().map(|b| b.len()),
            dout.len(),
            inp.len(),
            weight.len(),
            n,
            c,
            oc,
        )?;
        let ty = data_type::<E>();
        // dinp (N,C) = dout (N,OC) · weight (OC,C)
        self.gemm(
            OP,
            Gemm {
                trans_a: false,
                trans_b: false,
                m: c,
                n,
                k: oc,
                a: (weight.address(), ty, c, 0),
                b: (dout.address(), ty, oc, 0),
                c: (dinp.address(), ty, c, 0),
                beta: 0.0,
                batch: 1,
            },
        )?;
        // dweight (OC,C) += doutᵀ · inp
        self.gemm(
            OP,
            Gemm {
                trans_a: false,
                trans_b: true,
                m: c,
                n: oc,
                k: n,
                a: (inp.address(), ty, c, 0),
                b: (dout.address(), ty, oc, 0),
                c: (dweight.address(), ty, c, 0),
                beta: 1.0,
                batch: 1,
            },
        )?;
        if let Some(db) = dbias {
            // Scratch sized by the declaration the estimator sums (`WorkspaceModel::matmul_backward`).
            let bands = cuda_column_bands(n);
            let partial = self.scratch(bands * oc * 4)?;
            let args = [
                Arg::Ptr(partial.address()),
                Arg::Ptr(dout.address()),
                int(OP, "N", n)?,
                int(OP, "OC", oc)?,
                int(OP, "band", n.div_ceil(bands))?,
            ];
            self.launch(OP, &format!("bias_backward_partial_{dt}"), column_sums(oc, bands, E::BYTES), &args)?;
            self.add_column_partials::<E>(OP, db.address(), &partial, bands, oc)?;
        }
        Ok(())
    }

    fn attention_forward<E: Elem>(
        &self,
        out: ViewMut<E>,
        lse: ViewMut<f32>,
        qkv: View<E>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> BackendResult {
        const OP: &str = "attention_forward";
        let dt = suffix::<E>(self, OP)?;
        shapes::attention_forward(out.len(), lse.len(), qkv.len(), b, t, c, nh)?;
        if b * t == 0 {
            return Ok(()); // nothing to attend to (and no grid of zero blocks to launch)
        }
        let hs = c / nh;
        let dims = [int(OP, "B", b)?, int(OP, "T", t)?, int(OP, "NH", nh)?, int(OP, "HS", hs)?];
        let scale = 1.0 / (hs as f32).sqrt();
        // The fused kernel reads q and k in 32-bit pairs: qkv 4-byte aligned (pool memory is).
        if let Some(kernel) =
            fused_entry::<E>(self.attention, "forward", hs, dt).filter(|_| qkv.address().is_multiple_of(4))
        {
            // No scratch (`WorkspaceModel::attention_forward` declares none).
            let mut args = vec![Arg::Ptr(out.address()), Arg::Ptr(lse.address()), Arg::Ptr(qkv.address())];
            args.extend([dims[0], dims[1], dims[2]]);
            args.push(Arg::F32(scale));
            return self.launch(OP, &kernel, flash_blocks(b, t, nh), &args);
        }
        // Scratch sized by the declaration the estimator sums (`workspace::CudaAttention`).
        let ws = CudaAttention::of::<E>(b, t, c, nh);
        let (q, k, v) = (self.scratch(ws.heads)?, self.scratch(ws.heads)?, self.scratch(ws.heads)?);
        let mut args =
            vec![Arg::Ptr(q.address()), Arg::Ptr(k.address()), Arg::Ptr(v.address()), Arg::Ptr(qkv.address())];
        args.extend(dims);
        self.launch(OP, &format!("permute_qkv_{dt}"), packed(b * t * c, E::BYTES), &args)?;
        let (scores, probs) = (self.scratch(ws.scores)?, self.scratch(ws.probs)?);
        let heads = HeadChunks::<E>::new(b, t, c, nh, ws.chunk);
        for chunk in heads.chunks() {
            // scores (chunk·NH, T, T) f32 = q · kᵀ
            self.gemm(OP, heads.scores(&chunk, k.address(), q.address(), scores.address()))?;
            // probabilities in E and each row's log-sum-exp
            let lse_rows = lse.address() + chunk.row_offset(t) * 4;
            let ptrs = [probs.address(), lse_rows, scores.address()];
            self.softmax_rows(OP, &format!("softmax_causal_forward_{dt}"), &chunk, t, ptrs, scale)?;
            // y (chunk·NH, T, HS) = p · v, over this chunk's q (no longer needed)
            self.gemm(OP, heads.weighted(&chunk, v.address(), probs.address(), q.address(), false, false))?;
        }
        drop((scores, probs));
        let mut args = vec![Arg::Ptr(out.address()), Arg::Ptr(q.address())];
        args.extend(dims);
        args.push(Arg::I32(1));
        self.launch(OP, &format!("heads_permute_{dt}"), packed(b * t * c, E::BYTES), &args)
    }

    fn attention_cached<E: Elem>(
        &self,
        out: ViewMut<E>,
        cache: ViewMut<E>,
        qkv: View<E>,
        d: shapes::CachedAttention,
    ) -> BackendResult {
        const OP: &str = "attention_cached";
        let dt = suffix::<E>(self, OP)?;
        shapes::attention_cached(out.len(), cache.len(), qkv.len(), d)?;
        let (b, tn, start, context) =
            (int(OP, "B", d.b)?, int(OP, "Tn", d.tn)?, int(OP, "start", d.start)?, int(OP, "context", d.context)?);
        let args = [Arg::Ptr(cache.address()), Arg::Ptr(qkv.address()), b, tn, start, context, int(OP, "C", d.c)?];
        self.launch(OP, &format!("kv_append_{dt}"), elementwise(d.b * d.tn * d.c), &args)?;
        // Scratch sized by the declaration the estimator sums.
        let scores = self.scratch(WorkspaceModel::CUDA.attention_cached(d)[0])?;
        let args = [
            Arg::Ptr(out.address()),
            Arg::Ptr(scores.address()),
            Arg::Ptr(cache.address()),
            Arg::Ptr(qkv.address()),
            b,
            tn,
            start,
            context,
            int(OP, "NH", d.nh)?,
            int(OP, "HS", d.c / d.nh)?,
        ];
        self.launch(OP, &format!("attention_cached_{dt}"), warp_rows(d.b * d.nh * d.tn), &args)
    }

    fn attention_backward<E: Elem>(
        &self,
        dqkv: ViewMut<E>,
        dout: View<E>,
        qkv: View<E>,
        lse: View<f32>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> BackendResult {
        const OP: &str = "attention_backward";
        let dt = suffix::<E>(self, OP)?;
        shapes::attention_backward(dqkv.len(), dout.len(), qkv.len(), lse.len(), b, t, c, nh)?;
        if b * t == 0 {
            return Ok(());
        }
        let hs = c / nh;
        let elems = b * t * c;
        let dims = [int(OP, "B", b)?, int(OP, "T", t)?, int(OP, "NH", nh)?, int(OP, "HS", hs)?];
        let scale = 1.0 / (hs as f32).sqrt();
        // The fused kernels read q, k, v and dout in 32-bit pairs: both 4-byte aligned.
        let aligned = qkv.address().is_multiple_of(4) && dout.address().is_multiple_of(4);
        if let (Some(dq_kernel), Some(dkv_kernel), true) = (
            fused_entry::<E>(self.attention, "backward_dq", hs, dt),
            fused_entry::<E>(self.attention, "backward_dkv", hs, dt),
            aligned,
        ) {
            // The one scratch, as declared: each row's D = Σ p·datt (B,NH,T) f32, from the dq
            // kernel to the dk/dv kernel (the compute stream orders them).
            let declared = WorkspaceModel::Cuda(self.attention).attention_backward::<E>(b, t, c, nh);
            let delta = self.scratch(declared[0])?;
            let (dx, d, dy, x, l) = (dqkv.address(), delta.address(), dout.address(), qkv.address(), lse.address());
            let mut args = vec![Arg::Ptr(dx), Arg::Ptr(d), Arg::Ptr(dy), Arg::Ptr(x), Arg::Ptr(l)];
            args.extend([dims[0], dims[1], dims[2], Arg::F32(scale)]);
            self.launch(OP, &dq_kernel, flash_blocks(b, t, nh), &args)?;
            let mut args = vec![Arg::Ptr(dx), Arg::Ptr(dy), Arg::Ptr(x), Arg::Ptr(l), Arg::Ptr(d)];
            args.extend([dims[0], dims[1], dims[2], Arg::F32(scale)]);
            return self.launch(OP, &dkv_kernel, flash_blocks(b, t, nh), &args);
        }
        // Scratch sized by the declaration the estimator sums, allocated in the order
        // `CudaAttention::backward_peak` lists it.
        let ws = CudaAttention::of::<E>(b, t, c, nh);
        // Heads of q, k, v (again from qkv) and of dout.
        let (q, k, v, dy) =
            (self.scratch(ws.heads)?, self.scratch(ws.heads)?, self.scratch(ws.heads)?, self.scratch(ws.heads)?);
        let mut args =
            vec![Arg::Ptr(q.address()), Arg::Ptr(k.address()), Arg::Ptr(v.address()), Arg::Ptr(qkv.address())];
        args.extend(dims);
        self.launch(OP, &format!("permute_qkv_{dt}"), packed(elems, E::BYTES), &args)?;
        let mut args = vec![Arg::Ptr(dy.address()), Arg::Ptr(dout.address())];
        args.extend(dims);
        args.push(Arg::I32(0));
        self.launch(OP, &format!("heads_permute_{dt}"), packed(elems, E::BYTES), &args)?;
        let (dq, dk, dv) = (self.scratch(ws.heads_f32)?, self.scratch(ws.heads_f32)?, self.scratch(ws.heads_f32)?);
        let (scores, probs) = (self.scratch(ws.scores)?, self.scratch(ws.probs)?);
        let heads = HeadChunks::<E>::new(b, t, c, nh, ws.chunk);
        for chunk in heads.chunks() {
            // The probabilities forward used: the same scores product, exp(s − lse) in E.
            self.gemm(OP, heads.scores(&chunk, k.address(), q.address(), scores.address()))?;
            let lse_rows = lse.address() + chunk.row_offset(t) * 4;
            let ptrs = [probs.address(), scores.address(), lse_rows];
            self.softmax_rows(OP, &format!("softmax_causal_probs_{dt}"), &chunk, t, ptrs, scale)?;
            // datt (chunk·NH, T, T) f32 = dy · vᵀ, over the scores; dv f32 = pᵀ · dy
            self.gemm(OP, heads.scores(&chunk, v.address(), dy.address(), scores.address()))?;
            self.gemm(OP, heads.weighted(&chunk, dy.address(), probs.address(), dv.address(), true, true))?;
            // ds = p · (datt − Σ p·datt) · scale in E, in place over p (each row read before it
            // is written, by the same lanes)
            let ptrs = [probs.address(), scores.address(), probs.address()];
            self.softmax_rows(OP, &format!("softmax_causal_backward_{dt}"), &chunk, t, ptrs, scale)?;
            // dq = ds · k ; dk = dsᵀ · q, 16-bit products into f32 where E is 16-bit
            self.gemm(OP, heads.weighted(&chunk, k.address(), probs.address(), dq.address(), false, true))?;
            self.gemm(OP, heads.weighted(&chunk, q.address(), probs.address(), dk.address(), true, true))?;
        }
        drop((scores, probs, q, k, v, dy));
        let mut args =
            vec![Arg::Ptr(dqkv.address()), Arg::Ptr(dq.address()), Arg::Ptr(dk.address()), Arg::Ptr(dv.address())];
        args.extend(dims);
        self.launch(OP, &format!("permute_qkv_backward_{dt}"), packed(elems, E::BYTES), &args)
    }

    fn gelu_forward<E: Elem>(&self, out: ViewMut<E>, inp: View<E>) -> BackendResult {
        self.pointwise("gelu_forward", "out", out, inp)
    }

    fn gelu_backward_inplace<E: Elem>(&self, dinout: ViewMut<E>, inp: View<E>) -> BackendResult {
        self.pointwise("gelu_backward", "dinout", dinout, inp)
    }

    fn residual_forward_inplace<E: Elem>(&self, out: ViewMut<E>, inp: View<E>) -> BackendResult {
        self.pointwise("residual_forward", "out", out, inp)
    }

    fn crossentropy_forward<E: Elem>(
        &self,
        logits: ViewMut<E>,
        losses: ViewMut<f32>,
        targets: View<u32>,
        v: usize,
        vp: usize,
    ) -> BackendResult {
        self.crossentropy("crossentropy_forward", logits, losses, targets, None, v, vp)
    }

    fn crossentropy_forward_backward<E: Elem>(
        &self,
        logits: ViewMut<E>,
        losses: ViewMut<f32>,
        targets: View<u32>,
        dloss: f32,
        v: usize,
        vp: usize,
    ) -> BackendResult {
        self.crossentropy("crossentropy_forward_backward", logits, losses, targets, Some(dloss), v, vp)
    }

    fn adamw<E: Elem>(
        &self,
        master: ViewMut<f32>,
        params: Option<ViewMut<E>>,
        grads: View<E>,
        m: ViewMut<f32>,
        v: ViewMut<f32>,
        step: &AdamW,
        decay: bool,
        grad_mult: f32,
    ) -> BackendResult {
        const OP: &str = "adamw";
        let dt = suffix::<E>(self, OP)?;
        let n = master.len();
        shapes::adamw::<E>(n, params.as_ref().map(|p| p.len()), grads.len(), m.len(), v.len())?;
        let p = params.as_ref().map(|p| p.address()).unwrap_or(master.address());
        let bc1 = 1.0 - BETA1.powi(step.t as i32);
        let bc2 = 1.0 - BETA2.powi(step.t as i32);
        let wd = if decay { step.weight_decay } else { 0.0 };
        let args = [
            Arg::Ptr(master.address()),
            Arg::Ptr(p),
            Arg::Ptr(grads.address()),
            Arg::Ptr(m.address()),
            Arg::Ptr(v.address()),
            long(n),
            Arg::F32(step.lr),
            Arg::F32(BETA1),
            Arg::F32(BETA2),
            Arg::F32(EPS),
            Arg::F32(wd),
            Arg::F32(bc1),
            Arg::F32(bc2),
            Arg::F32(grad_mult),
        ];
        self.launch(OP, &format!("adamw_{dt}"), packed(n, E::BYTES), &args)
    }

    fn sum_squares<E: Elem>(&self, x: View<E>) -> BackendResult<f64> {
        const OP: &str = "sum_squares";
        let dt = suffix::<E>(self, OP)?;
        // Scratch sized by the declaration the estimator sums (`WorkspaceModel::sum_squares`).
        let blocks = crate::engine::backend::workspace::cuda_norm_blocks(x.len());
        let partial = self.scratch(blocks * 4)?;
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        self.launch(
            OP,
            &format!("sum_squares_{dt}"),
            cfg,
            &[Arg::Ptr(partial.address()), Arg::Ptr(x.address()), long(x.len())],
        )?;
        let mut host = vec![0f32; blocks];
        self.download(View::of(&partial), &mut host)?;
        Ok(host.iter().map(|&p| p as f64).sum())
    }

    fn narrow<E: Elem>(&self, dst: ViewMut<E>, src: View<f32>) -> BackendResult {
        const OP: &str = "narrow";
        suffix::<E>(self, OP)?;
        shapes::same(OP, "dst", dst.len(), src.len())?;
        self.convert::<E>(OP, false, dst.address(), src.address(), src.len())
    }

    fn widen<E: Elem>(&self, dst: ViewMut<f32>, src: View<E>) -> BackendResult {
        const OP: &str = "widen";
        suffix::<E>(self, OP)?;
        shapes::same(OP, "dst", dst.len(), src.len())?;
        self.convert::<E>(OP, true, dst.address(), src.address(), src.len())
    }

    fn pack_int8<E: Elem>(&self, q: ViewMut<i8>, scales: ViewMut<f32>, x: View<E>, c: usize) -> BackendResult {
        const OP: &str = "pack_int8";
        let dt = suffix::<E>(self, OP)?;
        let n = shapes::int8("pack_int8", x.len(), q.len(), scales.len(), c)?;
        let args = [
            Arg::Ptr(q.address()),
            Arg::Ptr(scales.address()),
            Arg::Ptr(x.address()),
            int(OP, "N", n)?,
            int(OP, "C", c)?,
        ];
        self.launch(OP, &format!("pack_int8_{dt}"), warp_rows(n), &args)
    }

    fn unpack_int8<E: Elem>(&self, x: ViewMut<E>, q: View<i8>, scales: View<f32>, c: usize) -> BackendResult {
        const OP: &str = "unpack_int8";
        let dt = suffix::<E>(self, OP)?;
        let n = shapes::int8("unpack_int8", x.len(), q.len(), scales.len(), c)?;
        let args = [
            Arg::Ptr(x.address()),
            Arg::Ptr(q.address()),
            Arg::Ptr(scales.address()),
            int(OP, "N", n)?,
            int(OP, "C", c)?,
        ];
        self.launch(OP, &format!("unpack_int8_{dt}"), elementwise(n * c), &args)
    }

    fn unpack_int4<E: Elem>(&self, x: ViewMut<E>, packed: View<u8>, scales: View<f32>, group: usize) -> BackendResult {
        const OP: &str = "unpack_int4";
        let dt = suffix::<E>(self, OP)?;
        shapes::int4(OP, x.len(), packed.len(), scales.len(), group)?;
        let n = x.len();
        let args = [
            Arg::Ptr(x.address()),
            Arg::Ptr(packed.address()),
            Arg::Ptr(scales.address()),
            long(n),
            int(OP, "group", group)?,
        ];
        self.launch(OP, &format!("unpack_int4_{dt}"), elementwise(n), &args)
    }
}

#[cfg(test)]
mod tests {
    //! The attention's cuBLAS descriptors and kernels, run on the host: each `Gemm` by cuBLAS's
    //! column-major reading of it, each kernel by a line-for-line port, in the backend's order
    //! and over several chunks (the last one short) — so operand shapes, leading dimensions,
    //! strides and chunk offsets are checked against the CPU reference without a GPU.

    use super::*;
    use crate::engine::backend::layers;
    use crate::engine::rng::Rng;

    /// The embedding backward's token sort, its launches ported line for line to the host
    /// (each kernel's exchanges in thread order; the network's result does not depend on it),
    /// sorts every length: one chunk, a padded one, several chunks with strides across them.
    #[test]
    fn the_token_sort_plan_sorts_every_length() {
        let exchange = |keys: &mut [u64], i: usize, l: usize, gi: usize, k: usize| {
            if (keys[i] > keys[l]) == (gi & k == 0) {
                keys.swap(i, l);
            }
        };
        let stage = |keys: &mut [u64], base: usize, chunk: usize, k: usize, j_from: usize| {
            let mut j = j_from;
            while j > 0 {
                for p in 0..chunk / 2 {
                    let i = 2 * j * (p / j) + p % j;
                    exchange(&mut keys[base..base + chunk], i, i + j, base + i, k);
                }
                j /= 2;
            }
        };
        let mut rng = Rng::new(5);
        for bt in [1, 2, 3, 1000, 2048, 2049, 5000, 16384, 70000] {
            let tokens: Vec<u32> = (0..bt).map(|_| (rng.uniform() * rng.uniform() * 300.0) as u32).collect();
            let n = cuda_order_keys(bt);
            let mut keys = vec![0u64; n];
            let plan = encoder_order_plan(bt);
            for launch in &plan {
                match *launch {
                    OrderLaunch::Chunks { cfg, chunk } => {
                        assert_eq!(cfg.grid_dim.0 as usize * chunk, n, "bt {bt}: the chunks cover the keys");
                        assert!(chunk <= CUDA_ORDER_CHUNK && cfg.block_dim.0 <= MAX_BLOCK_THREADS);
                        for (g, key) in keys.iter_mut().enumerate() {
                            *key = if g < bt { (u64::from(tokens[g]) << 32) | g as u64 } else { u64::MAX };
                        }
                        let mut k = 2;
                        while k <= chunk {
                            for base in (0..n).step_by(chunk) {
                                stage(&mut keys, base, chunk, k, k / 2);
                            }
                            k *= 2;
                        }
                    }
                    OrderLaunch::Merge { cfg, n: len, j, k } => {
                        assert_eq!(len, n);
                        assert!(cfg.grid_dim.0 as usize * cfg.block_dim.0 as usize >= n / 2, "a thread per pair");
                        for p in 0..n / 2 {
                            let i = 2 * j * (p / j) + p % j;
                            exchange(&mut keys, i, i + j, i, k);
                        }
                    }
                    OrderLaunch::MergeChunks { cfg, chunk, k } => {
                        assert_eq!(cfg.grid_dim.0 as usize * chunk, n, "bt {bt}: the chunks cover the keys");
                        for base in (0..n).step_by(chunk) {
                            stage(&mut keys, base, chunk, k, chunk / 2);
                        }
                    }
                }
            }
            let (order, _) = layers::token_order(&tokens, 300);
            let want: Vec<u64> = order.iter().map(|&p| (u64::from(tokens[p as usize]) << 32) | u64::from(p)).collect();
            assert_eq!(keys[..bt], want[..], "bt {bt}");
            let merges = plan.iter().filter(|l| matches!(l, OrderLaunch::Merge { .. })).count();
            let steps = |x: usize| x.trailing_zeros() as usize;
            let across = steps(n).saturating_sub(steps(CUDA_ORDER_CHUNK));
            assert_eq!(merges, across * (across + 1) / 2, "bt {bt}: one launch per stride across chunks");
        }
    }

    /// `cublasGemmStridedBatchedEx` on host f32 memory (addresses are host pointers).
    fn host_gemm(g: &Gemm) {
        assert!(g.a.1 == F32 && g.b.1 == F32 && g.c.1 == F32, "f32 operands only");
        let (lda, ldb, ldc) = (g.a.2, g.b.2, g.c.2);
        for batch in 0..g.batch {
            // SAFETY: the test's buffers hold every element the descriptors address (an
            // out-of-range descriptor is what this test exists to catch, as a wrong result or
            // an index past a Vec the allocator would not hand out in one piece).
            unsafe {
                let a = (g.a.0 as *const f32).add(batch * g.a.3);
                let b = (g.b.0 as *const f32).add(batch * g.b.3);
                let c = (g.c.0 as *mut f32).add(batch * g.c.3);
                for j in 0..g.n {
                    for i in 0..g.m {
                        let mut acc = 0.0f32;
                        for p in 0..g.k {
                            let av = if g.trans_a { *a.add(p + i * lda) } else { *a.add(i + p * lda) };
                            let bv = if g.trans_b { *b.add(j + p * ldb) } else { *b.add(p + j * ldb) };
                            acc += av * bv;
                        }
                        let at = c.add(i + j * ldc);
                        *at = acc + g.beta * *at;
                    }
                }
            }
        }
    }

    fn ptr(v: &[f32]) -> u64 {
        v.as_ptr() as u64
    }

    /// An output's address (the host product writes through it).
    fn out(v: &mut [f32]) -> u64 {
        v.as_mut_ptr() as u64
    }

    /// `permute_qkv`: qkv (B,T,3,NH,HS) -> q, k, v (B,NH,T,HS).
    fn permute_qkv(qkv: &[f32], b: usize, t: usize, nh: usize, hs: usize) -> [Vec<f32>; 3] {
        let c = nh * hs;
        let mut out = [vec![0.0; b * t * c], vec![0.0; b * t * c], vec![0.0; b * t * c]];
        for idx in 0..b * t * c {
            let (d, tt, h, bb) = (idx % hs, (idx / hs) % t, (idx / (hs * t)) % nh, idx / (hs * t * nh));
            let src = ((bb * t + tt) * 3 * nh + h) * hs + d;
            for (part, o) in out.iter_mut().enumerate() {
                o[idx] = qkv[src + part * c];
            }
        }
        out
    }

    /// `heads_permute`: (B,NH,T,HS) -> (B,T,C) when `merge`, the inverse otherwise.
    fn heads_permute(x: &[f32], t: usize, nh: usize, hs: usize, merge: bool) -> Vec<f32> {
        let mut out = vec![0.0; x.len()];
        for idx in 0..x.len() {
            let (d, tt, h, bb) = (idx % hs, (idx / hs) % t, (idx / (hs * t)) % nh, idx / (hs * t * nh));
            let btc = ((bb * t + tt) * nh + h) * hs + d;
            if merge {
                out[btc] = x[idx];
            } else {
                out[idx] = x[btc];
            }
        }
        out
    }

    #[test]
    fn the_attention_descriptors_and_kernels_compute_the_reference_in_chunks() {
        let (b, t, nh, hs) = (5, 7, 3, 4);
        let c = nh * hs;
        let chunk = 2; // chunks of 2, 2 and 1 sequences
        let mut rng = Rng::new(11);
        let qkv: Vec<f32> = (0..b * t * 3 * c).map(|_| rng.normal() as f32).collect();
        let dout: Vec<f32> = (0..b * t * c).map(|_| rng.normal() as f32).collect();
        let heads = HeadChunks::<f32>::new(b, t, c, nh, chunk);
        assert_eq!(heads.chunks().map(|h| h.count).collect::<Vec<_>>(), [2, 2, 1]);
        let scale = 1.0 / (hs as f32).sqrt();
        let [mut q, k, v] = permute_qkv(&qkv, b, t, nh, hs);
        let (mut scores, mut probs) = (vec![0.0f32; chunk * nh * t * t], vec![0.0f32; chunk * nh * t * t]);

        // Forward, as `attention_forward` issues it.
        let mut lse = vec![0.0f32; b * nh * t];
        for ch in heads.chunks() {
            host_gemm(&heads.scores(&ch, ptr(&k), ptr(&q), out(&mut scores)));
            for row in 0..ch.rows(t) {
                // softmax_causal_forward
                let (tq, base) = (row % t, row * t);
                let mx = (0..=tq).fold(f32::NEG_INFINITY, |m, i| m.max(scores[base + i] * scale));
                let s: f32 = (0..=tq).map(|i| (scores[base + i] * scale - mx).exp()).sum();
                let l = mx + s.ln();
                lse[ch.row_offset(t) as usize + row] = l;
                for i in 0..t {
                    probs[base + i] = if i <= tq { (scores[base + i] * scale - l).exp() } else { 0.0 };
                }
            }
            host_gemm(&heads.weighted(&ch, ptr(&v), ptr(&probs), out(&mut q), false, false));
        }
        let merged = heads_permute(&q, t, nh, hs, true);
        let (mut ref_out, mut ref_lse) = (vec![0.0f32; b * t * c], vec![0.0f32; b * nh * t]);
        layers::attention_forward(
            &mut ref_out,
            &mut ref_lse,
            &qkv,
            &mut vec![0.0; layers::attention_forward_scratch::<f32>(b, t, c, nh)],
            b,
            t,
            c,
            nh,
        );
        let close = |x: &[f32], y: &[f32], what: &str| {
            for (i, (x, y)) in x.iter().zip(y).enumerate() {
                assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{what}[{i}]: {x} vs reference {y}");
            }
        };
        close(&merged, &ref_out, "out");
        close(&lse, &ref_lse, "lse");

        // Backward, as `attention_backward` issues it.
        let [q, k, v] = permute_qkv(&qkv, b, t, nh, hs);
        let dy = heads_permute(&dout, t, nh, hs, false);
        let (mut dq, mut dk, mut dv) = (vec![0.0f32; b * t * c], vec![0.0f32; b * t * c], vec![0.0f32; b * t * c]);
        for ch in heads.chunks() {
            host_gemm(&heads.scores(&ch, ptr(&k), ptr(&q), out(&mut scores)));
            for row in 0..ch.rows(t) {
                // softmax_causal_probs
                let (tq, base, l) = (row % t, row * t, lse[ch.row_offset(t) as usize + row]);
                for i in 0..t {
                    probs[base + i] = if i <= tq { (scores[base + i] * scale - l).exp() } else { 0.0 };
                }
            }
            host_gemm(&heads.scores(&ch, ptr(&v), ptr(&dy), out(&mut scores)));
            host_gemm(&heads.weighted(&ch, ptr(&dy), ptr(&probs), out(&mut dv), true, true));
            for row in 0..ch.rows(t) {
                // softmax_causal_backward, in place over the probabilities
                let (tq, base) = (row % t, row * t);
                let s: f32 = (0..=tq).map(|i| probs[base + i] * scores[base + i]).sum();
                for i in 0..t {
                    let p = probs[base + i];
                    probs[base + i] = if i <= tq { p * (scores[base + i] - s) * scale } else { 0.0 };
                }
            }
            host_gemm(&heads.weighted(&ch, ptr(&k), ptr(&probs), out(&mut dq), false, true));
            host_gemm(&heads.weighted(&ch, ptr(&q), ptr(&probs), out(&mut dk), true, true));
        }
        // permute_qkv_backward
        let mut dqkv = vec![0.0f32; b * t * 3 * c];
        for (part, d) in [&dq, &dk, &dv].into_iter().enumerate() {
            let merged = heads_permute(d, t, nh, hs, true);
            for row in 0..b * t {
                dqkv[row * 3 * c + part * c..][..c].copy_from_slice(&merged[row * c..][..c]);
            }
        }
        let mut ref_dqkv = vec![0.0f32; b * t * 3 * c];
        let mut scratch = vec![0.0; layers::attention_backward_scratch::<f32>(b, t, c, nh)];
        layers::attention_backward(&mut ref_dqkv, &mut scratch, &dout, &qkv, &ref_lse, b, t, c, nh);
        close(&dqkv, &ref_dqkv, "dqkv");
    }
}
