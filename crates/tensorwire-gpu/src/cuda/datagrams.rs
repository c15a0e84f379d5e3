//! Received datagrams in pinned memory: a global allocator that lends the allocations of a
//! datagram's size from a region page-locked for the GPU's copy engines.
//!
//! quinn copies each received datagram (or GRO batch, at most 64 KiB) into an allocation of
//! its own, decrypts it there, and hands out the STREAM data as slices of it. Where that
//! allocation is pinned, a GPU sink copies a payload to the device straight from it: the
//! receiving host's only pass over the bytes is then quinn's decryption, as for a receiver
//! that never reads them (spec §7.3's checksum over the landed bytes needs no other). Other
//! allocations, and these once the region is full, come from the wrapped allocator; their
//! payloads go through staging as before.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use cudarc::driver::{result, sys};

use super::GpuDevice;
use crate::error::GpuError;

/// One slot of the region: the largest datagram (or GRO batch) quinn receives.
pub(crate) const SLOT: usize = 64 << 10;

/// The smallest allocation lent a slot: below it, a slot would hold mostly nothing, and such
/// payloads are short anyway.
const SMALLEST_LENT: usize = 8 << 10;

/// The largest region: 1 GiB of slots, one bit each.
const MOST_SLOTS: usize = 16 << 10;

const WORDS: usize = MOST_SLOTS / 64;

/// The region's size unless [`PinnedDatagrams::with_capacity_mib`] says otherwise.
const DEFAULT_CAPACITY: usize = 256 << 20;

/// A global allocator that serves allocations of 8 to 64 KiB (a received datagram's) from a
/// region pinned for the GPU, once a GPU receiver has opened a device, and everything else
/// from `A`. Install it in a program that receives into GPU memory:
///
/// ```ignore
/// #[global_allocator]
/// static ALLOCATOR: tensorwire_gpu::PinnedDatagrams<std::alloc::System> =
///     tensorwire_gpu::PinnedDatagrams::new(std::alloc::System);
/// ```
///
/// A [`GpuSinkFactory`](crate::GpuSinkFactory) pins the region when it opens its
/// device (its capacity, 256 MiB by default, is then locked in host memory for the life of
/// the process), and its sinks copy payloads received there to the device with no copy into
/// staging. Until then, and in a process without a GPU, every allocation comes from `A`.
#[derive(Debug)]
pub struct PinnedDatagrams<A> {
    inner: A,
    capacity: usize,
}

impl<A> PinnedDatagrams<A> {
    /// Wraps `inner`, with a 256 MiB region.
    pub const fn new(inner: A) -> Self {
        Self {
            inner,
            capacity: DEFAULT_CAPACITY,
        }
    }

    /// Sets the region's size (at most 1 GiB; 0 lends nothing): the received bytes that can
    /// wait for their copy to the device at once without passing through staging.
    pub const fn with_capacity_mib(mut self, mib: usize) -> Self {
        let bytes = mib << 20;
        self.capacity = if bytes > MOST_SLOTS * SLOT {
            MOST_SLOTS * SLOT
        } else {
            bytes
        };
        self
    }

    /// A slot for an allocation of `layout`, where it is a datagram's size and the region
    /// has one free; first tells [`pin_region`] the capacity to pin, as this allocator is
    /// the process's.
    fn lend_for(&self, layout: Layout) -> Option<*mut u8> {
        if INSTALLED.load(Ordering::Relaxed) == 0 {
            INSTALLED.store(self.capacity.max(1), Ordering::Relaxed);
        }
        if !lent_a_slot(layout) {
            return None;
        }
        REGION.lend().map(|slot| slot as *mut u8)
    }
}

/// How the region has been used: for tests and diagnostics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PinnedDatagramStats {
    /// The region's size in bytes; 0 until a GPU receiver pinned it.
    pub capacity: usize,
    /// Slots lent now.
    pub lent: usize,
    /// Allocations ever served from the region.
    pub served: u64,
    /// Allocations of a datagram's size that found the region full.
    pub overflowed: u64,
    /// How far into the region a slot has ever been lent, in bytes. The lowest free slot is
    /// lent first, so this is about the most received bytes that waited for their copy at
    /// once: a region this size would have served them all.
    pub reached: usize,
}

/// The region of the installed allocator, and its slots in use.
struct Region {
    /// The first slot's address; 0 until pinned.
    base: AtomicUsize,
    slots: AtomicUsize,
    /// One bit per slot, set while lent; the bits past `slots` stay set.
    lent: [AtomicU64; WORDS],
    /// Set in a forked child: the region is the parent's, pinned for its CUDA context, and
    /// the child's copy of these bits says nothing of the parent's use of the slots since.
    /// Its slots are still told apart there, never lent again.
    forked: AtomicBool,
    served: AtomicU64,
    overflowed: AtomicU64,
    /// One past the highest slot ever lent.
    reached: AtomicUsize,
}

impl Region {
    const fn new() -> Self {
        Self {
            base: AtomicUsize::new(0),
            slots: AtomicUsize::new(0),
            lent: [const { AtomicU64::new(u64::MAX) }; WORDS],
            forked: AtomicBool::new(false),
            served: AtomicU64::new(0),
            overflowed: AtomicU64::new(0),
            reached: AtomicUsize::new(0),
        }
    }

    /// Starts lending `slots` slots from `base`, which must stay valid for the process.
    fn open(&self, base: usize, slots: usize) {
        let slots = slots.min(MOST_SLOTS);
        for (word, bits) in self.lent.iter().enumerate() {
            bits.store(!slots_of_word(slots, word), Ordering::Relaxed);
        }
        self.slots.store(slots, Ordering::Relaxed);
        // Release: a thread that sees the base sees the bits.
        self.base.store(base, Ordering::Release);
    }

    /// Whether `ptr..ptr + len` lies inside the region.
    fn holds(&self, ptr: usize, len: usize) -> bool {
        let base = self.base.load(Ordering::Acquire);
        base != 0
            && ptr >= base
            && ptr
                .checked_add(len)
                .is_some_and(|end| end <= base + self.slots.load(Ordering::Relaxed) * SLOT)
    }

    /// The lowest free slot's address, or `None` when the region is full or not open.
    ///
    /// Lowest first, so that the slots in use stay as few as the datagrams waiting for their
    /// copy, and a slot is lent again soon after its copy: quinn's write into it then finds
    /// its lines in the CPU's cache. Searching on from the last slot lent instead walks the
    /// whole region, and quinn's copies then miss the cache.
    fn lend(&self) -> Option<usize> {
        let base = self.base.load(Ordering::Acquire);
        if base == 0 || self.forked.load(Ordering::Relaxed) {
            return None;
        }
        let words = self.slots.load(Ordering::Relaxed).div_ceil(64);
        for (word, bits) in self.lent[..words].iter().enumerate() {
            let mut now = bits.load(Ordering::Relaxed);
            while now != u64::MAX {
                let bit = (!now).trailing_zeros() as usize;
                match bits.compare_exchange_weak(
                    now,
                    now | 1 << bit,
                    Ordering::Acquire,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        self.served.fetch_add(1, Ordering::Relaxed);
                        let slot = word * 64 + bit;
                        // Read first: the line is written only while the mark rises.
                        if slot >= self.reached.load(Ordering::Relaxed) {
                            self.reached.fetch_max(slot + 1, Ordering::Relaxed);
                        }
                        return Some(base + slot * SLOT);
                    }
                    Err(changed) => now = changed,
                }
            }
        }
        self.overflowed.fetch_add(1, Ordering::Relaxed);
        None
    }

    /// Takes back the slot at `ptr`, which [`lend`](Self::lend) gave.
    fn take_back(&self, ptr: usize) {
        let slot = (ptr - self.base.load(Ordering::Relaxed)) / SLOT;
        // Release: the slot's last writes happen before its next lending.
        self.lent[slot / 64].fetch_and(!(1 << (slot % 64)), Ordering::Release);
    }

    /// Lends no slot from now on (in a forked child); taking back and telling apart go on.
    fn stop_lending(&self) {
        self.forked.store(true, Ordering::Relaxed);
    }

    fn stats(&self) -> PinnedDatagramStats {
        let slots = self.slots.load(Ordering::Relaxed);
        let lent = (0..slots.div_ceil(64))
            .map(|word| {
                let bits = self.lent[word].load(Ordering::Relaxed);
                (bits & slots_of_word(slots, word)).count_ones() as usize
            })
            .sum();
        PinnedDatagramStats {
            capacity: slots * SLOT,
            lent,
            served: self.served.load(Ordering::Relaxed),
            overflowed: self.overflowed.load(Ordering::Relaxed),
            reached: self.reached.load(Ordering::Relaxed) * SLOT,
        }
    }
}

/// The bits of `word` that stand for one of `slots` slots (the rest stay set, never lent).
fn slots_of_word(slots: usize, word: usize) -> u64 {
    match slots.saturating_sub(word * 64) {
        0 => 0,
        n if n >= 64 => u64::MAX,
        n => !(u64::MAX << n),
    }
}

static REGION: Region = Region::new();

/// The capacity the installed allocator asks for; 0 while none is installed.
static INSTALLED: AtomicUsize = AtomicUsize::new(0);

fn lent_a_slot(layout: Layout) -> bool {
    (SMALLEST_LENT..=SLOT).contains(&layout.size()) && layout.align() <= 4096
}

// SAFETY: every allocation comes either from `inner`, under its own contract, or is a slot of
// the region: `SLOT` bytes at a 64 KiB-aligned offset from a page-aligned base that is never
// freed, lent to one allocation at a time (its bit is set by a compare-and-swap), so it is
// valid for `layout` (at most `SLOT` bytes, alignment at most 4096) until taken back.
// Deallocation and reallocation tell the two apart by address: `inner` never returns memory
// inside the region, which the CUDA driver allocated and which is never freed.
unsafe impl<A: GlobalAlloc> GlobalAlloc for PinnedDatagrams<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if let Some(slot) = self.lend_for(layout) {
            return slot;
        }
        // SAFETY: the caller's contract for `layout`, passed on.
        unsafe { self.inner.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if let Some(slot) = self.lend_for(layout) {
            // SAFETY: a slot holds at least `layout.size()` bytes; a reused one is not zero.
            unsafe { std::ptr::write_bytes(slot, 0, layout.size()) };
            return slot;
        }
        // SAFETY: the caller's contract for `layout`, passed on: the wrapped allocator zeroes
        // its own way (fresh pages need no second pass).
        unsafe { self.inner.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if REGION.holds(ptr as usize, 1) {
            return REGION.take_back(ptr as usize);
        }
        // SAFETY: not the region's, so `inner` allocated it with `layout`.
        unsafe { self.inner.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !REGION.holds(ptr as usize, 1) {
            // SAFETY: `inner` allocated it with `layout`; the caller's contract holds.
            return unsafe { self.inner.realloc(ptr, layout, new_size) };
        }
        if new_size <= SLOT {
            return ptr;
        }
        // SAFETY: the caller's contract makes this layout valid (non-zero, not overflowing).
        let grown =
            unsafe { self.alloc(Layout::from_size_align_unchecked(new_size, layout.align())) };
        if !grown.is_null() {
            // SAFETY: both are live allocations of at least `layout.size()` bytes, distinct.
            unsafe { std::ptr::copy_nonoverlapping(ptr, grown, layout.size()) };
            REGION.take_back(ptr as usize);
        }
        grown
    }
}

/// Whether `bytes` lie in the pinned region, so the copy engines may read them directly.
pub(crate) fn holds(bytes: &[u8]) -> bool {
    REGION.holds(bytes.as_ptr() as usize, bytes.len())
}

/// How the installed allocator's region has been used (all zeros where none is installed).
pub fn pinned_datagram_stats() -> PinnedDatagramStats {
    REGION.stats()
}

/// Pins the installed allocator's region on `device`'s context, once per process; does
/// nothing where no [`PinnedDatagrams`] is the global allocator or its capacity is 0.
pub(crate) fn pin_region(device: &GpuDevice) -> Result<(), GpuError> {
    static PINNING: Mutex<()> = Mutex::new(());
    let capacity = INSTALLED.load(Ordering::Relaxed);
    if capacity < SLOT {
        return Ok(());
    }
    let _one_at_a_time = PINNING.lock().unwrap_or_else(|e| e.into_inner());
    if REGION.base.load(Ordering::Acquire) != 0 {
        return Ok(());
    }
    let slots = (capacity / SLOT).min(MOST_SLOTS);
    device.bind()?;
    // SAFETY: the context is current (bound above). The memory is never freed: the region
    // lives as long as the process, as the addresses the allocator lends and recognises
    // require. PORTABLE makes it page-locked for every context of the process; it is not
    // write-combined, so quinn reads and writes it at ordinary speed.
    let base = unsafe { result::malloc_host(slots * SLOT, sys::CU_MEMHOSTALLOC_PORTABLE) }
        .map_err(super::cuda("cuMemHostAlloc"))?;
    // The allocation ends with the context: keep the primary context for the process.
    std::mem::forget(device.cuda_context().clone());
    REGION.open(base as usize, slots);
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe as a forked
    // child's handler must be; registering it has no other precondition.
    let registered = unsafe { libc::pthread_atfork(None, None, Some(stop_lending_in_child)) };
    if registered != 0 {
        tracing::warn!(
            errno = registered,
            "pthread_atfork failed: a forked child would lend the parent's pinned memory"
        );
    }
    Ok(())
}

/// Runs in a child right after `fork`: the region is the parent's.
extern "C" fn stop_lending_in_child() {
    REGION.stop_lending();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A region over `slots` slots of ordinary memory (pinning is the GPU tests' to check).
    fn region(slots: usize) -> (Region, Vec<u8>) {
        let memory = vec![0u8; slots * SLOT + SLOT];
        let base = (memory.as_ptr() as usize).next_multiple_of(SLOT);
        let region = Region::new();
        region.open(base, slots);
        (region, memory)
    }

    #[test]
    fn a_closed_region_lends_nothing_and_holds_nothing() {
        let region = Region::new();
        assert_eq!(region.lend(), None);
        assert!(!region.holds(4096, 1));
        assert_eq!(region.stats(), PinnedDatagramStats::default());
    }

    #[test]
    fn every_slot_is_lent_once_until_taken_back() {
        let (region, _memory) = region(70);
        let mut lent: Vec<usize> = (0..70).map(|_| region.lend().unwrap()).collect();
        assert_eq!(region.lend(), None, "70 slots, the 71st overflows");
        let stats = region.stats();
        assert_eq!((stats.lent, stats.served, stats.overflowed), (70, 70, 1));
        assert_eq!((stats.capacity, stats.reached), (70 * SLOT, 70 * SLOT));
        lent.sort_unstable();
        lent.dedup();
        assert_eq!(lent.len(), 70, "no slot lent twice");
        for &slot in &lent {
            assert!(region.holds(slot, SLOT));
        }
        let (first, last) = (lent[0], lent[69]);
        assert!(!region.holds(first - 1, 1), "before the region");
        assert!(!region.holds(last + 1, SLOT), "past the region's end");
        region.take_back(lent[33]);
        assert_eq!(region.lend(), Some(lent[33]));
        for &slot in &lent {
            region.take_back(slot);
        }
        assert_eq!(region.stats().lent, 0, "all back");
    }

    #[test]
    fn the_lowest_free_slot_is_lent_first() {
        let (region, _memory) = region(200);
        let lent: Vec<usize> = (0..150).map(|_| region.lend().unwrap()).collect();
        assert!(lent.windows(2).all(|w| w[0] < w[1]), "in address order");
        // Freed in the order their copies complete: oldest first.
        for &slot in &lent[..100] {
            region.take_back(slot);
        }
        assert_eq!(
            region.lend(),
            Some(lent[0]),
            "the lowest slot again, not the next unused one"
        );
        // A slot freed just now, above free ones, waits.
        region.take_back(lent[120]);
        assert_eq!(region.lend(), Some(lent[1]));
        assert_eq!(region.stats().lent, 51);
        assert_eq!(
            region.stats().reached,
            150 * SLOT,
            "no slot past the 150th lent"
        );
    }

    #[test]
    fn a_forked_child_lends_nothing_but_takes_back_what_was_lent() {
        let (region, _memory) = region(4);
        let before = region.lend().unwrap();
        region.stop_lending();
        assert_eq!(region.lend(), None);
        assert_eq!(region.stats().overflowed, 0, "not full: closed");
        assert!(
            region.holds(before, SLOT),
            "still told apart from the wrapped allocator's"
        );
        region.take_back(before);
        assert_eq!(region.stats().lent, 0);
    }

    #[test]
    fn only_a_datagrams_size_is_lent_a_slot() {
        let sized = |size| lent_a_slot(Layout::from_size_align(size, 1).unwrap());
        assert!(!sized(SMALLEST_LENT - 1));
        assert!(sized(SMALLEST_LENT));
        assert!(sized(65_507));
        assert!(sized(SLOT));
        assert!(!sized(SLOT + 1));
        assert!(!lent_a_slot(Layout::from_size_align(SLOT, 8192).unwrap()));
    }

    #[test]
    fn slots_lent_from_many_threads_are_distinct() {
        let (region, _memory) = region(512);
        let region = &region;
        let lent: Vec<usize> = std::thread::scope(|s| {
            let threads: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(move || {
                        let mut mine = Vec::new();
                        for _ in 0..1000 {
                            let slot = region.lend().unwrap();
                            mine.push(slot);
                            if mine.len() > 32 {
                                region.take_back(mine.remove(0));
                            }
                        }
                        mine
                    })
                })
                .collect();
            threads
                .into_iter()
                .flat_map(|t| t.join().unwrap())
                .collect()
        });
        let mut distinct = lent.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), lent.len(), "a slot held by two threads");
        assert_eq!(region.stats().lent, lent.len());
    }
}
