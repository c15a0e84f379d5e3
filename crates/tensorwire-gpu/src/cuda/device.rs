//! One CUDA device: its primary context, a copy stream, and the completion thread that waits
//! for copies in order, runs their completion work and keeps their events for the next copies.

use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::{CudaContext, result, sys};

use super::checksum::ChecksumKernel;
use super::{PinnedAllocation, check_range, cuda, require_driver};
use crate::error::GpuError;
use crate::pool::Pooled;

/// What a device is, for logs and for matching devices across processes (by UUID).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The ordinal in this process.
    pub ordinal: usize,
    /// The device's name, e.g. "NVIDIA H200".
    pub name: String,
    /// The device's UUID (stable across processes, unlike ordinals).
    pub uuid: [u8; 16],
    /// Total memory in bytes.
    pub total_memory: usize,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
}

impl DeviceInfo {
    /// The UUID as `nvidia-smi -L` prints it: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
    pub fn uuid_string(&self) -> String {
        format_uuid(&self.uuid)
    }
}

/// `GPU-` and the UUID's 16 bytes as hex grouped 8-4-4-4-12.
pub(crate) fn format_uuid(uuid: &[u8; 16]) -> String {
    let hex: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// A copy waiting to complete, and what to do once it has.
struct Completion {
    event: sys::CUevent,
    done: Box<dyn FnOnce(Result<(), GpuError>) + Send>,
}

// SAFETY: a CUevent is a driver handle usable from any thread on which its context is
// current; the completion thread binds the context before using it.
unsafe impl Send for Completion {}

/// Events of completed copies, kept for the next copies to record.
///
/// Creating an event per copy cost a median 64 µs with 8 sinks enqueueing at once and 278 µs
/// with 16 (16-core H100 host, traced): a tenth to a third of the sinks' time, contended in
/// the driver. Recording a kept event takes 1–3 µs.
#[derive(Default)]
struct SpareEvents(Mutex<Vec<sys::CUevent>>);

// SAFETY: CUevent handles may be used from any thread on which their context is current;
// every use below binds the device's context first.
unsafe impl Send for SpareEvents {}
// SAFETY: as above; the handles are only moved in and out under the mutex.
unsafe impl Sync for SpareEvents {}

/// Most spare events kept: more than the copies that fit in the staging pool at once (128 MiB
/// of 4 MiB buffers, 32), so the data path creates none after warm-up; the rest are destroyed.
const MAX_SPARE_EVENTS: usize = 1024;

impl SpareEvents {
    /// A spare event, or a new one; the device's context must be current.
    fn take(&self) -> Result<sys::CUevent, GpuError> {
        let spare = self.0.lock().unwrap_or_else(PoisonError::into_inner).pop();
        match spare {
            Some(event) => Ok(event),
            None => result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(cuda("cuEventCreate")),
        }
    }

    /// Keeps `event`, which nothing waits on any more, for another copy (or destroys it).
    fn give_back(&self, event: sys::CUevent) {
        let mut spare = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if spare.len() < MAX_SPARE_EVENTS {
            spare.push(event);
            return;
        }
        drop(spare);
        // SAFETY: the event is live, of the current context, and no one waits on it or will.
        let _ = unsafe { result::event::destroy(event) };
    }
}

/// A CUDA stream owned by this crate.
struct CopyStream(sys::CUstream);

// SAFETY: CUDA streams may be used from any thread with their context current; every use
// below binds the context first.
unsafe impl Send for CopyStream {}
// SAFETY: as above; enqueueing work on a stream from several threads is allowed by the driver.
unsafe impl Sync for CopyStream {}

/// An open device: context, copy stream, completion thread. Shared; see [`GpuDevice::open`].
pub struct GpuDevice {
    info: DeviceInfo,
    ctx: Arc<CudaContext>,
    stream: CopyStream,
    completions: Mutex<mpsc::Sender<Completion>>,
    /// Shared with the completion thread, which gives events back. Like the device (opened
    /// once per process), they live until the process exits.
    events: Arc<SpareEvents>,
    /// The CRC-32C kernel, loaded at its first use.
    checksum: OnceLock<Result<ChecksumKernel, GpuError>>,
}

impl std::fmt::Debug for GpuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GpuDevice(cuda:{} {})",
            self.info.ordinal, self.info.name
        )
    }
}

impl GpuDevice {
    /// The device with this ordinal, opened once per process and shared.
    pub fn open(ordinal: usize) -> Result<Arc<GpuDevice>, GpuError> {
        static OPEN: OnceLock<Mutex<HashMap<usize, Arc<GpuDevice>>>> = OnceLock::new();
        let available = require_driver()?;
        if ordinal >= available {
            return Err(GpuError::NoDevice {
                requested: ordinal,
                available,
            });
        }
        let mut open = OPEN
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(device) = open.get(&ordinal) {
            return Ok(device.clone());
        }
        let device = Arc::new(Self::create(ordinal)?);
        open.insert(ordinal, device.clone());
        Ok(device)
    }

    /// The device whose UUID is `uuid` (as [`DeviceInfo::uuid_string`] writes it, with or
    /// without the `GPU-` prefix). Ordinals differ between processes; UUIDs do not.
    pub fn open_by_uuid(uuid: &str) -> Result<Arc<GpuDevice>, GpuError> {
        let wanted = uuid.trim_start_matches("GPU-").to_ascii_lowercase();
        let count = require_driver()?;
        for ordinal in 0..count {
            let device = i32::try_from(ordinal)
                .map_err(|_| GpuError::UnknownDevice(uuid.into()))
                .and_then(|o| result::device::get(o).map_err(cuda("cuDeviceGet")))?;
            let id = result::device::get_uuid(device).map_err(cuda("cuDeviceGetUuid"))?;
            let formatted = format_uuid(&id.bytes.map(|b| b as u8));
            if formatted.trim_start_matches("GPU-") == wanted {
                return Self::open(ordinal);
            }
        }
        Err(GpuError::UnknownDevice(uuid.into()))
    }

    /// Every GPU of this process, opened.
    pub fn all() -> Result<Vec<Arc<GpuDevice>>, GpuError> {
        (0..require_driver()?).map(Self::open).collect()
    }

    fn create(ordinal: usize) -> Result<Self, GpuError> {
        let ctx = CudaContext::new(ordinal).map_err(cuda("cuDevicePrimaryCtxRetain"))?;
        let uuid = ctx.uuid().map_err(cuda("cuDeviceGetUuid"))?;
        let info = DeviceInfo {
            ordinal,
            name: ctx.name().map_err(cuda("cuDeviceGetName"))?,
            uuid: uuid.bytes.map(|b| b as u8),
            total_memory: ctx.total_mem().map_err(cuda("cuDeviceTotalMem"))?,
            compute_capability: ctx
                .compute_capability()
                .map_err(cuda("cuDeviceGetAttribute"))?,
        };
        ctx.bind_to_thread().map_err(cuda("cuCtxSetCurrent"))?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(cuda("cuStreamCreate"))?;
        let (tx, rx) = mpsc::channel::<Completion>();
        let thread_ctx = ctx.clone();
        let events = Arc::new(SpareEvents::default());
        let spare = events.clone();
        std::thread::Builder::new()
            .name(format!("tensorwire-cuda{ordinal}-completions"))
            .spawn(move || complete_in_order(&thread_ctx, &rx, &spare))
            .map_err(|e| GpuError::Cuda {
                call: "spawn completion thread",
                error: e.to_string(),
            })?;
        Ok(Self {
            info,
            ctx,
            stream: CopyStream(stream),
            completions: Mutex::new(tx),
            events,
            checksum: OnceLock::new(),
        })
    }

    /// The device's description.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The ordinal in this process.
    pub fn ordinal(&self) -> usize {
        self.info.ordinal
    }

    /// Free and total device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize), GpuError> {
        self.bind()?;
        result::mem_get_info().map_err(cuda("cuMemGetInfo"))
    }

    pub(crate) fn cu_device(&self) -> sys::CUdevice {
        self.ctx.cu_device()
    }

    /// Makes this device's context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<(), GpuError> {
        self.ctx.bind_to_thread().map_err(cuda("cuCtxSetCurrent"))
    }

    /// Enqueues a copy of `src`'s bytes into `dst` at byte `offset` on the copy stream,
    /// records an event after it, and once the event has completed (or the copy could not be
    /// made) hands `src`, `dst` and the outcome to `done` on the completion thread.
    ///
    /// Owning both until then is what keeps the host bytes unwritten and the device memory
    /// allocated while the DMA runs: no caller can free or reuse either early. `done` runs
    /// exactly once, on every path.
    pub(crate) fn copy_to_device_async<S: AsRef<[u8]> + Send + 'static>(
        &self,
        src: S,
        dst: crate::buffer::CudaBuffer,
        offset: usize,
        done: impl FnOnce(S, crate::buffer::CudaBuffer, Result<(), GpuError>) + Send + 'static,
    ) {
        // Boxed so the bytes `src` refers to stay put however the box moves.
        let src = Box::new(src);
        let len = (*src).as_ref().len();
        if offset.checked_add(len).is_none_or(|end| end > dst.len()) {
            let err = GpuError::Bounds(format!(
                "copy of {len} bytes at {offset} into a {}-byte buffer",
                dst.len()
            ));
            return done(*src, dst, Err(err));
        }
        let target = dst.device_ptr() + offset as u64;
        let ptr = (*src).as_ref().as_ptr();
        let done: Box<dyn FnOnce(Result<(), GpuError>) + Send> =
            Box::new(move |result| done(*src, dst, result));
        if let Err(e) = self.bind() {
            return done(Err(e));
        }
        // SAFETY: `ptr..ptr + len` are the bytes of the boxed `src`, which `done` owns: they
        // neither move nor change until `done` runs, after the copy's event completed (or
        // right below, if enqueueing failed).
        let src = unsafe { std::slice::from_raw_parts(ptr, len) };
        // SAFETY: `target..target + len` lies inside `dst` (checked above), device memory of
        // this context that `done` keeps allocated; the stream belongs to this context, which
        // is current.
        if let Err(e) = unsafe { result::memcpy_htod_async(target, src, self.stream.0) } {
            return done(Err(cuda("cuMemcpyHtoDAsync")(e)));
        }
        self.complete_after_enqueued(done);
    }

    /// Enqueues a copy of each piece's bytes into `dst` at its byte offset, records one
    /// event after them, and once it has completed (or the copies could not be made) hands
    /// the pieces, `dst` and the outcome to `done` on the completion thread. As for
    /// [`copy_to_device_async`](Self::copy_to_device_async), owning them until then keeps
    /// the host bytes unwritten and the device memory allocated; `done` runs exactly once.
    pub(crate) fn copy_pieces_to_device_async<S: AsRef<[u8]> + Send + 'static>(
        &self,
        pieces: Vec<(S, u64)>,
        dst: crate::buffer::CudaBuffer,
        done: impl FnOnce(Vec<(S, u64)>, crate::buffer::CudaBuffer, Result<(), GpuError>)
        + Send
        + 'static,
    ) {
        if let Err(e) = self.bind() {
            return done(pieces, dst, Err(e));
        }
        let mut batch = CopyBatch::default();
        let enqueued = self.enqueue_pieces(&pieces, &dst, &mut batch);
        // Recorded even after a failure: the pieces enqueued before it must complete before
        // their bytes are let go. The batch's arrays are kept as long: the driver's documents
        // do not say that it has read them when the call returns (letting them go at once
        // made no difference that a run showed).
        self.complete_after_enqueued(Box::new(move |result| {
            drop(batch);
            done(pieces, dst, enqueued.and(result))
        }));
    }

    /// Enqueues the copies of `pieces` into `dst` on the copy stream, in one call where the
    /// driver batches copies (CUDA 12.8 or later) rather than one call per piece: pieces
    /// of a datagram's size make 131,000 calls per 8 GiB, from every connection's sink at
    /// once. The arrays the call reads go into `batch`, which the caller keeps, with the
    /// pieces, until the copies' event completed.
    fn enqueue_pieces<S: AsRef<[u8]>>(
        &self,
        pieces: &[(S, u64)],
        dst: &crate::buffer::CudaBuffer,
        batch: &mut CopyBatch,
    ) -> Result<(), GpuError> {
        for (src, offset) in pieces {
            let src = src.as_ref();
            let at = usize::try_from(*offset)
                .map_err(|_| GpuError::Bounds("offset past the address space".into()))?;
            check_range(at, src.len(), dst.len())?;
            if !src.is_empty() {
                batch.targets.push(dst.device_ptr() + offset);
                batch.sources.push(src.as_ptr() as sys::CUdeviceptr);
                batch.sizes.push(src.len());
            }
        }
        if batch.targets.is_empty() {
            return Ok(());
        }
        if !batched_copies() {
            for (src, offset) in pieces.iter().filter(|(src, _)| !src.as_ref().is_empty()) {
                // SAFETY: the target range lies inside `dst` (checked above), device memory
                // of this context; `src` is a piece the caller keeps unchanged until the
                // copies' event completed; the stream belongs to this context, which is
                // current.
                unsafe {
                    result::memcpy_htod_async(
                        dst.device_ptr() + offset,
                        src.as_ref(),
                        self.stream.0,
                    )
                }
                .map_err(cuda("cuMemcpyHtoDAsync"))?;
            }
            return Ok(());
        }
        let mut attributes = sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
                id: 0,
            },
            dstLocHint: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: i32::try_from(self.info.ordinal).unwrap_or(0),
            },
            flags: 0,
        };
        let calls = batch
            .targets
            .chunks_mut(MOST_COPIES_PER_CALL)
            .zip(batch.sources.chunks_mut(MOST_COPIES_PER_CALL))
            .zip(batch.sizes.chunks_mut(MOST_COPIES_PER_CALL));
        for ((targets, sources), sizes) in calls {
            let mut first_attribute = 0usize;
            let mut failed_at = usize::MAX;
            // SAFETY: the three slices hold `targets.len()` entries each: device ranges
            // inside `dst` (checked above) and host ranges of the pieces, which the caller
            // keeps unchanged, with the arrays, until the copies' event completed; one
            // attribute applies to all of them (index 0). The driver has the call (12.8 or
            // later, checked), the stream belongs to this context, which is current.
            let status = unsafe {
                sys::cuMemcpyBatchAsync(
                    targets.as_mut_ptr(),
                    sources.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    targets.len(),
                    &mut attributes,
                    &mut first_attribute,
                    1,
                    &mut failed_at,
                    self.stream.0,
                )
            };
            status.result().map_err(cuda("cuMemcpyBatchAsync"))?;
        }
        Ok(())
    }

    /// Whether the CRC-32C kernel loads on this device (loading it at the first call); the
    /// error says why not, such as a driver too old for its PTX.
    pub(crate) fn checksum_kernel(&self) -> Result<(), GpuError> {
        self.checksum_kernel_loaded().map(drop)
    }

    fn checksum_kernel_loaded(&self) -> Result<&ChecksumKernel, GpuError> {
        let loaded = self.checksum.get_or_init(|| {
            self.bind()?;
            ChecksumKernel::load()
        });
        loaded.as_ref().map_err(Clone::clone)
    }

    /// Enqueues on the copy stream, after every copy enqueued so far, the CRC-32C of each
    /// `piece` bytes of `src` (the last piece shorter), written to `out` as one native-endian
    /// `u32` per piece; once that completed (or could not be enqueued), hands `out`, `src`
    /// and the outcome to `done` on the completion thread. Owning both until then keeps the
    /// device memory allocated and the results unread while the kernel runs.
    pub(crate) fn checksum_pieces_async(
        &self,
        src: crate::buffer::CudaBuffer,
        piece: usize,
        out: Pooled<PinnedAllocation>,
        done: impl FnOnce(Pooled<PinnedAllocation>, crate::buffer::CudaBuffer, Result<(), GpuError>)
        + Send
        + 'static,
    ) {
        let len = src.len();
        let pieces = len.div_ceil(piece.max(1));
        if piece == 0
            || pieces
                .checked_mul(4)
                .is_none_or(|n| n > out.as_slice().len())
        {
            let err = GpuError::Bounds(format!(
                "checksums of {pieces} pieces of a {len}-byte buffer into {} bytes",
                out.as_slice().len()
            ));
            return done(out, src, Err(err));
        }
        let (data, results) = (src.device_ptr(), out.as_slice().as_ptr());
        let done: Box<dyn FnOnce(Result<(), GpuError>) + Send> =
            Box::new(move |result| done(out, src, result));
        if pieces == 0 {
            return done(Ok(()));
        }
        let kernel = match self.bind().and_then(|()| self.checksum_kernel_loaded()) {
            Ok(kernel) => kernel,
            Err(e) => return done(Err(e)),
        };
        // SAFETY: `data..data + len` is the device memory of `src` and `results` the pinned
        // buffer `out`, holding 4 bytes per piece (checked above); `done` owns both, so they
        // stay allocated and unread until the kernel's event completed. The copy stream is
        // live in this context, which is current.
        if let Err(e) = unsafe { kernel.enqueue(data, len, piece, results, self.stream.0) } {
            return done(Err(e));
        }
        self.complete_after_enqueued(done);
    }

    /// Records an event after the work enqueued on the copy stream and has the completion
    /// thread run `done` once it completed; waits here if the event cannot be tracked.
    fn complete_after_enqueued(&self, done: Box<dyn FnOnce(Result<(), GpuError>) + Send>) {
        let event = match self.events.take() {
            Ok(event) => event,
            Err(e) => {
                // The copy is enqueued but cannot be tracked: wait for the stream instead.
                // SAFETY: the stream is live and its context current.
                let _ = unsafe { result::stream::synchronize(self.stream.0) };
                return done(Err(e));
            }
        };
        // SAFETY: the event and the stream are live handles of the current context; a spare
        // event's last recording has completed, so recording it again is allowed.
        if let Err(e) = unsafe { result::event::record(event, self.stream.0) } {
            // SAFETY: the event is live and not recorded anywhere pending.
            let _ = unsafe { result::event::destroy(event) };
            // The copy is enqueued but cannot be tracked: wait for the stream instead.
            // SAFETY: the stream is live and its context current.
            let _ = unsafe { result::stream::synchronize(self.stream.0) };
            return done(Err(cuda("cuEventRecord")(e)));
        }
        let sender = self
            .completions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Err(mpsc::SendError(job)) = sender.send(Completion { event, done }) {
            // The completion thread is gone (it never exits while the device lives): wait here.
            // SAFETY: the event is live and was recorded on this context's stream.
            let waited = unsafe { result::event::synchronize(job.event) };
            // SAFETY: the event is no longer waited on by anyone.
            let _ = unsafe { result::event::destroy(job.event) };
            (job.done)(waited.map_err(cuda("cuEventSynchronize")));
        }
    }

    /// An event on the copy stream after every copy enqueued so far: it completes when they
    /// all have. Other streams wait on it instead of the host.
    pub(crate) fn record_copies(&self) -> Result<cudarc::driver::CudaEvent, GpuError> {
        let event = self.ctx.new_event(None).map_err(cuda("cuEventCreate"))?;
        // SAFETY: the event (just created, which bound the context) and the copy stream are
        // live handles of this context.
        unsafe { result::event::record(event.cu_event(), self.stream.0) }
            .map_err(cuda("cuEventRecord"))?;
        Ok(event)
    }

    /// Makes copies enqueued from now on wait (on the device) for `event`.
    pub(crate) fn copies_wait_for(
        &self,
        event: &cudarc::driver::CudaEvent,
    ) -> Result<(), GpuError> {
        self.bind()?;
        // SAFETY: the copy stream and the event are live handles; the context is current.
        unsafe {
            result::stream::wait_event(
                self.stream.0,
                event.cu_event(),
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(cuda("cuStreamWaitEvent"))
    }

    /// Fails unless `ctx` is this device's primary context, the one tensorwire's memory and
    /// streams live in; `what` names the caller's object for the message.
    pub(crate) fn require_primary(&self, ctx: &CudaContext, what: &str) -> Result<(), GpuError> {
        if ctx.cu_ctx() == self.ctx.cu_ctx() {
            return Ok(());
        }
        Err(GpuError::InvalidConfig(format!(
            "{what} is not on cuda:{}'s primary context (CudaContext::new({}) gives it)",
            self.ordinal(),
            self.ordinal()
        )))
    }

    /// The device's primary context, shared with cudarc users in this process:
    /// `CudaContext::new(ordinal)` retains the same primary context, so slices and streams of
    /// either work with tensorwire's memory.
    pub fn cuda_context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Waits until every copy enqueued so far has completed.
    pub(crate) fn synchronize_copies(&self) -> Result<(), GpuError> {
        self.bind()?;
        // SAFETY: the stream is live and its context current.
        unsafe { result::stream::synchronize(self.stream.0) }.map_err(cuda("cuStreamSynchronize"))
    }
}

/// The most copies in one `cuMemcpyBatchAsync` call. Calls of about 700 copies (6,000-byte
/// pieces) crashed inside the driver (580.159.04, H200) in 7 of 10 runs; of 64 or 256, none
/// crashed in 8 (benches/results/LOG.md).
const MOST_COPIES_PER_CALL: usize = 256;

/// The arrays of one batch of copies, made in calls of at most [`MOST_COPIES_PER_CALL`]:
/// device targets, host sources, sizes.
#[derive(Default)]
struct CopyBatch {
    targets: Vec<sys::CUdeviceptr>,
    sources: Vec<sys::CUdeviceptr>,
    sizes: Vec<usize>,
}

/// Whether the driver batches copies (`cuMemcpyBatchAsync`, CUDA 12.8 or later), asked once.
fn batched_copies() -> bool {
    static BATCHED: OnceLock<bool> = OnceLock::new();
    *BATCHED.get_or_init(|| super::kernel::driver_version().is_ok_and(|v| v >= (12, 8)))
}

/// The completion thread: copies on one stream finish in order, so waiting on each event in
/// turn runs every completion as soon as its copy is done. A completed event goes back to
/// `spare`; one whose wait failed is destroyed instead.
fn complete_in_order(ctx: &CudaContext, jobs: &mpsc::Receiver<Completion>, spare: &SpareEvents) {
    let bound = ctx.bind_to_thread();
    for job in jobs {
        let waited = match &bound {
            Ok(()) => {
                // SAFETY: the event was recorded on this context's stream and is given back
                // or destroyed only below.
                unsafe { result::event::synchronize(job.event) }.map_err(cuda("cuEventSynchronize"))
            }
            Err(e) => Err(GpuError::Cuda {
                call: "cuCtxSetCurrent",
                error: e.to_string(),
            }),
        };
        if waited.is_ok() {
            spare.give_back(job.event);
        } else {
            // SAFETY: nothing waits on the event any more.
            let _ = unsafe { result::event::destroy(job.event) };
        }
        (job.done)(waited);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;
    use crate::buffer::CudaBuffer;
    use crate::cuda::DeviceAllocation;

    /// A piece of one pinned allocation.
    struct Piece(Arc<PinnedAllocation>, std::ops::Range<usize>);

    impl AsRef<[u8]> for Piece {
        fn as_ref(&self) -> &[u8] {
            &self.0.as_slice()[self.1.clone()]
        }
    }

    /// Batches of more pieces than one driver call takes (those of 6,000-byte packets in a
    /// 4 MiB batch) land whole, again and again, made in calls of at most 256 copies.
    #[test]
    fn batches_past_one_calls_copies_land_whole() {
        if crate::status::gpus_or_skip("batches_past_one_calls_copies_land_whole").is_none() {
            return;
        }
        const PIECE: usize = 6_000;
        const PIECES: usize = 700;
        let device = GpuDevice::open(0).unwrap();
        let mut source = PinnedAllocation::new(&device, PIECE * PIECES).unwrap();
        for (i, byte) in source.as_mut_slice().iter_mut().enumerate() {
            *byte = (i * 7 + i / 251) as u8;
        }
        let expected = source.as_slice().to_vec();
        let source = Arc::new(source);
        let memory = DeviceAllocation::new(&device, PIECE * PIECES).unwrap();
        let mut dest = CudaBuffer::from_owned(memory, PIECE * PIECES);
        for round in 0..300 {
            dest.fill(0xAB).unwrap();
            // Enqueued in reverse, so a piece's place comes from its offset alone.
            let pieces: Vec<(Piece, u64)> = (0..PIECES)
                .rev()
                .map(|i| {
                    let range = i * PIECE..(i + 1) * PIECE;
                    (Piece(source.clone(), range), (i * PIECE) as u64)
                })
                .collect();
            let (done, landed) = mpsc::channel();
            device.copy_pieces_to_device_async(pieces, dest.share(), move |pieces, _, result| {
                let _ = done.send((pieces.len(), result));
            });
            let (returned, result) = landed.recv().unwrap();
            result.unwrap();
            assert_eq!(returned, PIECES, "round {round}: every piece handed back");
            assert!(
                dest.copy_to_host().unwrap() == expected,
                "round {round}: bytes differ"
            );
        }
    }
}
