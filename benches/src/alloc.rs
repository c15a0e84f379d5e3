//! The programs' allocator, counting allocations while a latency row runs.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The programs' allocator (their allocator's doc says why): mimalloc, with received
/// datagrams in pinned memory once a GPU row opens its device, counting allocations (and
/// reallocations) while a latency row runs, so the rows can print them per message. Raw quinn,
/// TCP+TLS and tensorwire run on it alike.
pub(crate) struct CountingAllocator {
    pub(crate) counting: AtomicBool,
    pub(crate) allocations: AtomicU64,
}

/// What [`CountingAllocator`] passes every call on to.
pub(crate) static PROGRAMS_ALLOCATOR: tensorwire::gpu::PinnedDatagrams<mimalloc::MiMalloc> =
    tensorwire::gpu::PinnedDatagrams::new(mimalloc::MiMalloc);

#[global_allocator]
pub(crate) static ALLOCATOR: CountingAllocator = CountingAllocator {
    counting: AtomicBool::new(false),
    allocations: AtomicU64::new(0),
};

impl CountingAllocator {
    pub(crate) fn note(&self) {
        // Read-only between latency rows: throughput runs share no written cache line.
        if self.counting.load(Ordering::Relaxed) {
            self.allocations.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts while `on`.
    pub(crate) fn count(&self, on: Counting) {
        self.counting
            .store(matches!(on, Counting::On), Ordering::Relaxed);
    }

    /// Allocations counted so far.
    pub(crate) fn allocations(&self) -> u64 {
        self.allocations.load(Ordering::Relaxed)
    }
}

/// Whether [`CountingAllocator`] counts.
#[derive(Clone, Copy)]
pub(crate) enum Counting {
    On,
    Off,
}

#[allow(unsafe_code)]
// SAFETY: every call is passed on unchanged to the programs' allocator, which upholds
// `GlobalAlloc`'s contract; the counting touches only two atomics and never allocates.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        self.note();
        // SAFETY: the caller's contract for `alloc`, passed on.
        unsafe { PROGRAMS_ALLOCATOR.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        self.note();
        // SAFETY: the caller's contract for `alloc_zeroed`, passed on.
        unsafe { PROGRAMS_ALLOCATOR.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract for `dealloc`, passed on.
        unsafe { PROGRAMS_ALLOCATOR.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        self.note();
        // SAFETY: the caller's contract for `realloc`, passed on.
        unsafe { PROGRAMS_ALLOCATOR.realloc(ptr, layout, new_size) }
    }
}
