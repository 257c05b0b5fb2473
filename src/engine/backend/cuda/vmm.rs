//! The CUDA pool's segment sources: fixed segments from `cuMemAlloc` ([`CudaSegments`]), and
//! expandable segments on a CUDA device: address space from `cuMemAddressReserve`, one physical
//! allocation per page (`cuMemCreate`) mapped into it on demand and unmapped when the pool
//! releases its cache — PyTorch's `expandable_segments:True`, for [`crate::memory::Pool`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{result as drv, sys, CudaContext};

use crate::memory::{AddressSpace, SegmentSource, LARGE_ROUND};

/// Segments from cuMemAlloc on one context.
pub(super) struct CudaSegments {
    pub(super) ctx: Arc<CudaContext>,
}

impl SegmentSource for CudaSegments {
    fn reserve(&self, size: usize) -> Option<u64> {
        self.ctx.bind_to_thread().ok()?;
        // SAFETY: a plain allocation; a failure (out of memory included) is None, i.e. an OOM.
        unsafe { drv::malloc_sync(size) }.ok()
    }

    fn release(&self, address: u64, _size: usize) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `address` came from `reserve` and the pool holds no live block in it.
            // cuMemFree waits for work still using it. An error here (context torn down) leaks
            // nothing the process keeps.
            let _ = unsafe { drv::free_sync(address) };
        }
    }

    fn host_visible(&self) -> bool {
        false
    }
}

/// Segments and pages of one device's context. Small segments still come from `cuMemAlloc`.
pub(super) struct CudaVmm {
    ctx: Arc<CudaContext>,
    ordinal: i32,
    page: usize,
    /// The physical allocation behind each mapped page, by the page's address.
    handles: Mutex<HashMap<u64, sys::CUmemGenericAllocationHandle>>,
    /// Small segments (and any fixed one), from cuMemAlloc.
    small: CudaSegments,
}

impl CudaVmm {
    /// The device's virtual memory management, when the driver supports it on this device.
    pub(super) fn new(ctx: Arc<CudaContext>) -> Option<CudaVmm> {
        ctx.bind_to_thread().ok()?;
        let ordinal = ctx.ordinal() as i32;
        let device = drv::device::get(ordinal).ok()?;
        // SAFETY: a plain attribute query of a valid device.
        let supported = unsafe {
            drv::device::get_attribute(
                device,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            )
        }
        .ok()?;
        if supported == 0 {
            return None;
        }
        let mut granularity = 0usize;
        let prop = Self::prop(ordinal);
        // SAFETY: out-pointer to a local; `prop` describes plain device memory.
        let rc = unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        };
        if rc != sys::CUresult::CUDA_SUCCESS || granularity == 0 || !granularity.is_power_of_two() {
            return None;
        }
        // Pages at least as large as the pool's large-segment rounding, so the estimator's
        // allowance (2 MiB pages) holds.
        let page = granularity.max(LARGE_ROUND);
        let small = CudaSegments { ctx: ctx.clone() };
        Some(CudaVmm { ctx, ordinal, page, handles: Mutex::new(HashMap::new()), small })
    }

    fn prop(ordinal: i32) -> sys::CUmemAllocationProp {
        // SAFETY: a plain C struct for which all-zero is the documented "no flags" value.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = ordinal;
        prop
    }

    /// Unmap and free the pages at `address..address + size` that were mapped.
    fn unmap_pages(&self, address: u64, size: usize) {
        let mut handles = self.handles.lock().unwrap_or_else(|e| e.into_inner());
        for page in (0..size / self.page).map(|i| address + (i * self.page) as u64) {
            if let Some(handle) = handles.remove(&page) {
                // SAFETY: this page was mapped to `handle` by `map` and holds no live block;
                // errors leave at worst a leak the context's teardown reclaims.
                unsafe {
                    sys::cuMemUnmap(page, self.page);
                    sys::cuMemRelease(handle);
                }
            }
        }
    }
}

impl SegmentSource for CudaVmm {
    fn reserve(&self, size: usize) -> Option<u64> {
        self.small.reserve(size)
    }

    fn release(&self, address: u64, size: usize) {
        self.small.release(address, size)
    }

    fn host_visible(&self) -> bool {
        false
    }

    fn address_space(&self) -> Option<&dyn AddressSpace> {
        Some(self)
    }
}

impl AddressSpace for CudaVmm {
    fn page(&self) -> usize {
        self.page
    }

    fn reserve_range(&self, size: usize) -> Option<u64> {
        self.ctx.bind_to_thread().ok()?;
        let mut address: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer to a local; reserves addresses only.
        let rc = unsafe { sys::cuMemAddressReserve(&mut address, size, self.page, 0, 0) };
        (rc == sys::CUresult::CUDA_SUCCESS).then_some(address)
    }

    fn release_range(&self, address: u64, size: usize) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: reserved by `reserve_range` with this size; the pool unmapped every page.
            unsafe { sys::cuMemAddressFree(address, size) };
        }
    }

    fn map(&self, address: u64, size: usize) -> bool {
        if self.ctx.bind_to_thread().is_err() {
            return false;
        }
        let prop = Self::prop(self.ordinal);
        let access = sys::CUmemAccessDesc {
            location: prop.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        for i in 0..size / self.page {
            let page = address + (i * self.page) as u64;
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: out-pointer to a local; `page` lies in our reserved range and is not
            // mapped (the pool maps only unmapped pages); access is granted to this device.
            let ok = unsafe {
                sys::cuMemCreate(&mut handle, self.page, &prop, 0) == sys::CUresult::CUDA_SUCCESS
                    && {
                        let mapped = sys::cuMemMap(page, self.page, 0, handle, 0) == sys::CUresult::CUDA_SUCCESS;
                        if !mapped {
                            sys::cuMemRelease(handle);
                        }
                        mapped
                    }
                    && {
                        let accessible =
                            sys::cuMemSetAccess(page, self.page, &access, 1) == sys::CUresult::CUDA_SUCCESS;
                        if !accessible {
                            sys::cuMemUnmap(page, self.page);
                            sys::cuMemRelease(handle);
                        }
                        accessible
                    }
            };
            if !ok {
                // The device is full: give back what this call mapped, the pool retries or OOMs.
                self.unmap_pages(address, i * self.page);
                return false;
            }
            self.handles.lock().unwrap_or_else(|e| e.into_inner()).insert(page, handle);
        }
        true
    }

    fn unmap(&self, address: u64, size: usize) {
        if self.ctx.bind_to_thread().is_ok() {
            // Work still reading these pages must finish before they go (cuMemFree's implicit
            // synchronisation, made explicit).
            let _ = self.ctx.synchronize();
            self.unmap_pages(address, size);
        }
    }
}
