//! `View` / `ViewMut`: typed (address, length) borrows of pool buffers, host-visible or not.

use std::marker::PhantomData;
use std::ops::Range;

use bytemuck::Pod;

use crate::memory::Buffer;

/// Where a view's elements are: the first element's address, the element count, and whether
/// the memory is the host's. Shared by `View` and `ViewMut`, which add the borrow.
#[derive(Clone, Copy)]
struct Span {
    address: u64,
    len: usize,
    host_visible: bool,
}

impl Span {
    /// Elements `range` of `buf` as `T`. Panics when out of bounds or misaligned (a caller bug).
    fn of<T>(buf: &Buffer, range: Range<usize>) -> Span {
        let whole = buf.len() / std::mem::size_of::<T>();
        assert!(range.start <= range.end && range.end <= whole, "view {range:?} of {whole} elements");
        assert!(
            (buf.address() as usize).is_multiple_of(std::mem::align_of::<T>()),
            "buffer at {:#x} is not aligned for its element type",
            buf.address()
        );
        Span { address: buf.address(), len: whole, host_visible: buf.host_visible() }.sub::<T>(range)
    }

    /// Elements `range` of this span. Panics when out of bounds.
    fn sub<T>(self, range: Range<usize>) -> Span {
        assert!(range.start <= range.end && range.end <= self.len, "view {range:?} of {} elements", self.len);
        Span {
            address: self.address + (range.start * std::mem::size_of::<T>()) as u64,
            len: range.end - range.start,
            ..self
        }
    }
}

/// A read-only run of `T` elements inside a pool buffer (host or device memory). It borrows
/// the buffer, so the buffer outlives it and is not written meanwhile.
pub struct View<'a, T> {
    span: Span,
    _borrow: PhantomData<&'a [T]>,
}

impl<T> Clone for View<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for View<'_, T> {}

impl<'a, T: Pod> View<'a, T> {
    fn new(span: Span) -> Self {
        View { span, _borrow: PhantomData }
    }

    /// The whole buffer as elements of `T`.
    pub fn of(buf: &'a Buffer) -> Self {
        Self::range(buf, 0..buf.len() / std::mem::size_of::<T>())
    }

    /// Elements `range` of the buffer. Panics when out of bounds (a caller bug).
    pub fn range(buf: &'a Buffer, range: Range<usize>) -> Self {
        Self::new(Span::of::<T>(buf, range))
    }

    /// A read-only view of host memory that is not a pool buffer (e.g. host-resident weights).
    pub fn from_host(s: &'a [T]) -> Self {
        Self::new(Span { address: s.as_ptr() as u64, len: s.len(), host_visible: true })
    }

    /// Elements `range` of this view. Panics when out of bounds.
    pub fn slice(self, range: Range<usize>) -> Self {
        Self::new(self.span.sub::<T>(range))
    }

    /// The first `mid` elements and the rest.
    pub fn split_at(self, mid: usize) -> (Self, Self) {
        (self.slice(0..mid), self.slice(mid..self.len()))
    }

    pub fn len(&self) -> usize {
        self.span.len
    }

    pub fn is_empty(&self) -> bool {
        self.span.len == 0
    }

    /// Whether the elements are in host memory.
    pub fn host_visible(&self) -> bool {
        self.span.host_visible
    }

    /// The elements, for a buffer in host memory. Panics for device memory (a caller bug:
    /// device data is read through the backend's `download`).
    pub fn host(&self) -> &'a [T] {
        assert!(self.span.host_visible, "host read of device memory at {:#x}", self.span.address);
        if self.span.len == 0 {
            return &[];
        }
        // SAFETY: the view was made from a live, aligned, host-visible buffer borrowed for 'a
        // and lies inside it (checked by `Span`); shared borrows only read.
        unsafe { std::slice::from_raw_parts(self.span.address as *const T, self.span.len) }
    }

    /// Address of the first element (host pointer or device pointer).
    pub fn address(&self) -> u64 {
        self.span.address
    }

    /// The same elements marked host-visible: for `DeviceSim`, whose "device" memory is host
    /// memory that only its ops may touch.
    #[cfg(test)]
    pub(crate) fn exposed(self) -> Self {
        Self::new(Span { host_visible: true, ..self.span })
    }
}

/// A writable run of `T` elements inside a pool buffer. It borrows the buffer exclusively;
/// `split_at` / `split_sizes` cut it into disjoint writable parts.
pub struct ViewMut<'a, T> {
    span: Span,
    _borrow: PhantomData<&'a mut [T]>,
}

impl<'a, T: Pod> ViewMut<'a, T> {
    fn new(span: Span) -> Self {
        ViewMut { span, _borrow: PhantomData }
    }

    pub fn of(buf: &'a mut Buffer) -> Self {
        let len = buf.len() / std::mem::size_of::<T>();
        Self::range(buf, 0..len)
    }

    pub fn range(buf: &'a mut Buffer, range: Range<usize>) -> Self {
        Self::new(Span::of::<T>(buf, range))
    }

    /// A view of host memory that is not a pool buffer (e.g. host-resident weights), for a
    /// backend whose pool is host memory too.
    pub fn from_host(s: &'a mut [T]) -> Self {
        Self::new(Span { address: s.as_mut_ptr() as u64, len: s.len(), host_visible: true })
    }

    /// Elements `range` of this view (consuming it: the rest is not reachable meanwhile).
    pub fn slice(self, range: Range<usize>) -> Self {
        Self::new(self.span.sub::<T>(range))
    }

    /// The first `mid` elements and the rest, both writable (they do not overlap).
    pub fn split_at(self, mid: usize) -> (Self, Self) {
        let len = self.len();
        (Self::new(self.span.sub::<T>(0..mid)), Self::new(self.span.sub::<T>(mid..len)))
    }

    /// Consecutive disjoint parts of the given lengths (which must sum to at most `len`).
    pub fn split_sizes(self, sizes: &[usize]) -> Vec<Self> {
        let mut rest = self;
        let mut out = Vec::with_capacity(sizes.len());
        for &n in sizes {
            let (head, tail) = rest.split_at(n);
            out.push(head);
            rest = tail;
        }
        out
    }

    /// The same bytes as elements of another type of the same width (f32 weights of an `E`
    /// that is f32).
    pub fn reinterpret<U: Pod>(self) -> ViewMut<'a, U> {
        assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<U>(), "reinterpret needs equal widths");
        ViewMut::new(self.span)
    }

    /// The same elements, borrowed again for a shorter time (to pass on and keep this view).
    pub fn reborrow(&mut self) -> ViewMut<'_, T> {
        ViewMut::new(self.span)
    }

    pub fn len(&self) -> usize {
        self.span.len
    }

    pub fn is_empty(&self) -> bool {
        self.span.len == 0
    }

    pub fn host_visible(&self) -> bool {
        self.span.host_visible
    }

    /// The elements, for a buffer in host memory (panics for device memory).
    pub fn host_mut(&mut self) -> &mut [T] {
        assert!(self.span.host_visible, "host write of device memory at {:#x}", self.span.address);
        if self.span.len == 0 {
            return &mut [];
        }
        // SAFETY: the view was made from a live, aligned, host-visible buffer borrowed
        // exclusively for 'a; views split from it are disjoint, and &mut self keeps this one
        // the only access for the slice's lifetime.
        unsafe { std::slice::from_raw_parts_mut(self.span.address as *mut T, self.span.len) }
    }

    pub fn address(&self) -> u64 {
        self.span.address
    }

    /// A read-only view of the same elements.
    pub fn as_view(&self) -> View<'_, T> {
        View::new(self.span)
    }

    /// The same elements marked host-visible (see `View::exposed`).
    #[cfg(test)]
    pub(crate) fn exposed(self) -> Self {
        Self::new(Span { host_visible: true, ..self.span })
    }
}
