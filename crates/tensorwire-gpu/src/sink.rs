//! The GPU sink: DATA chunks are copied into pinned staging buffers, coalesced to about
//! 4 MiB, and copied to the destination on the device's copy stream; a staging buffer and
//! the credit of its bytes come back only once its copy's event has completed. Payload pieces
//! that quinn decrypted into pinned memory ([`PinnedDatagrams`](crate::PinnedDatagrams)) skip
//! staging: about 4 MiB of them are copied to the device in one batch, straight from there.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use tensorwire_proto::checksum::{crc32c_append, crc32c_of_pieces};
use tensorwire_proto::{Payload, TensorMeta};
use tensorwire_sink::{
    CreditPermit, Divisible, MemoryBudget, MemoryReservation, Sink, SinkError,
    checksum_then_copy_with,
};
use tokio::sync::{Notify, oneshot};

use crate::buffer::CudaBuffer;
use crate::cuda::{
    DeviceAllocation, DeviceMemoryKind, GpuDevice, PinnedAllocation, in_pinned_datagram,
    pin_datagram_region, stream_into,
};
use crate::error::GpuError;
use crate::pool::{Allocation, MemoryPool, PoolConfig, PoolStats, Pooled};

/// Staging buffer size: a host-to-device copy pays a fixed cost, which copies this large
/// spread thin enough to run near the link's rate (benches/results/LOG.md).
pub const STAGING_BUFFER: usize = 4 << 20;

/// The default staging pool: 128 MiB of pinned memory, allocated up front.
pub const DEFAULT_STAGING_POOL: usize = 128 << 20;

/// The shortest payload piece copied to the device straight from its pinned datagram: a
/// shorter one (packets under 16 KiB, as GRO batches them) goes through staging, where the
/// copy engine would spend more on a copy's fixed cost than on its bytes.
const DIRECT_FROM: usize = 16 << 10;

/// Tensors at least this long (one staging buffer) are checksummed on the device once landed
/// ([`ChecksumOn::Device`]); shorter ones as they arrive, where a kernel's round trip would
/// cost more time than the CPU saves.
pub const CHECKSUM_ON_DEVICE_FROM: usize = STAGING_BUFFER;

/// Bytes each GPU thread checksums: 256 MiB take 0.4 ms on an H200 (0.19 ms with 4 KiB
/// pieces, which leave the host 4 times as many CRCs to combine).
const CHECKSUM_PIECE: usize = 16 << 10;

/// The piece each GPU thread checksums in a tensor of `len` bytes: one staging buffer holds
/// the pieces' CRCs (4 bytes each), so pieces grow past 16 GiB tensors.
fn checksum_piece(len: usize) -> usize {
    let most_pieces = STAGING_BUFFER / 4;
    CHECKSUM_PIECE
        .max(len.div_ceil(most_pieces))
        .next_multiple_of(16)
}

/// Where a GPU receiver computes the CRC-32C that END's checksum is checked against
/// (spec §7.3).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ChecksumOn {
    /// Over the landed tensor, on the device, for tensors of [`CHECKSUM_ON_DEVICE_FROM`]
    /// bytes or more: no CPU core reads their bytes but the copy into staging. Shorter
    /// tensors, and every tensor where the kernel does not load (a warning says why), are
    /// checksummed on the host.
    #[default]
    Device,
    /// On the host, each payload in the same pass as its copy into staging.
    Host,
}

impl std::str::FromStr for ChecksumOn {
    type Err = String;

    /// `device` or `host`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "device" => Ok(Self::Device),
            "host" => Ok(Self::Host),
            _ => Err(format!("checksum on {s:?}: expected device or host")),
        }
    }
}

/// Pinned host memory buffers by size class.
pub type PinnedMemoryPool = MemoryPool<PinnedAllocation>;

/// Device memory buffers by size class, from `cuMemAlloc` (exportable for sharing later).
pub type GpuMemoryPool = MemoryPool<DeviceAllocation>;

impl MemoryPool<PinnedAllocation> {
    /// A pool of pinned memory registered with `device`'s context.
    pub fn for_device(device: &Arc<GpuDevice>, config: PoolConfig) -> Result<Self, GpuError> {
        let device = device.clone();
        MemoryPool::new("pinned", config, move |size| {
            PinnedAllocation::new(&device, size)
        })
    }
}

impl MemoryPool<DeviceAllocation> {
    /// A pool of `cuMemAlloc` memory on `device`.
    pub fn for_device(device: &Arc<GpuDevice>, config: PoolConfig) -> Result<Self, GpuError> {
        Self::for_device_with_kind(device, config, DeviceMemoryKind::Legacy)
    }

    /// A pool of memory of `kind` on `device`. VMM buffers are rounded up to the allocation
    /// granularity (2 MiB on Hopper), so give such a pool a `min_buffer` of at least that.
    pub fn for_device_with_kind(
        device: &Arc<GpuDevice>,
        config: PoolConfig,
        kind: DeviceMemoryKind,
    ) -> Result<Self, GpuError> {
        let device = device.clone();
        MemoryPool::new("device", config, move |size| {
            DeviceAllocation::with_kind(&device, size, kind)
        })
    }
}

/// A receiver's GPU side: one device, a pinned staging pool and a device memory pool, from
/// which each incoming tensor gets a [`GpuSink`].
#[derive(Clone)]
pub struct PooledGpuReceiver {
    device: Arc<GpuDevice>,
    staging: PinnedMemoryPool,
    memory: GpuMemoryPool,
    kind: DeviceMemoryKind,
    /// Destination buffers of landed tensors, admitted before ACCEPT (spec §7.5).
    budget: MemoryBudget,
    fallback: HostFallback,
    /// Destinations allocated on their own because the device pool could not serve them.
    outside_pool: Arc<AtomicU64>,
    checksum_on: ChecksumOn,
}

/// Whether a tensor that finds no device memory may land in host memory instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HostFallback {
    /// Yes, with a warning naming the tensor (the default for `auto` placement).
    Allowed,
    /// No: the tensor waits for device memory, then is refused (`--require-gpu`).
    Forbidden,
}

/// The default device-memory budget: this share of the memory free when the device opens.
const DEFAULT_BUDGET_OF_FREE: (usize, usize) = (3, 4);

impl PooledGpuReceiver {
    /// Opens CUDA device `ordinal` with the given pool sizes; staging buffers are all
    /// [`STAGING_BUFFER`] bytes, the only size the sink asks for.
    pub fn new(ordinal: usize, staging: PoolConfig, memory: PoolConfig) -> Result<Self, GpuError> {
        Self::with_memory_kind(ordinal, staging, memory, DeviceMemoryKind::Legacy)
    }

    /// As [`new`](Self::new), with tensors landing in memory of `kind`: VMM memory can be
    /// shared with other processes as an fd with no copy (`tensorwire-ipc`).
    pub fn with_memory_kind(
        ordinal: usize,
        staging: PoolConfig,
        memory: PoolConfig,
        kind: DeviceMemoryKind,
    ) -> Result<Self, GpuError> {
        let device = GpuDevice::open(ordinal)?;
        let staging = PoolConfig {
            min_buffer: STAGING_BUFFER,
            max_buffer: STAGING_BUFFER,
            ..staging
        };
        let staging = PinnedMemoryPool::for_device(&device, staging)?;
        let memory = GpuMemoryPool::for_device_with_kind(&device, memory, kind)?;
        // The checksum kernel loads now rather than at the first large tensor: the driver
        // compiles its PTX for this GPU (once per machine where its compute cache is kept),
        // which would stall that tensor's connection. A kernel that does not load is
        // reported when a tensor would have used it (`Sink::take_checksum`).
        let _ = device.checksum_kernel();
        // Where the program's allocator is `PinnedDatagrams`, received payloads reach the
        // device straight from quinn's buffers; without the region they go through staging.
        if let Err(e) = pin_datagram_region(&device) {
            tracing::warn!(error = %e, "received datagrams are not pinned: payloads go through staging");
        }
        // Measured after the staging pool's preallocation: what is left for tensors.
        let (free, _total) = device.memory()?;
        let (num, den) = DEFAULT_BUDGET_OF_FREE;
        let budget = MemoryBudget::new(format!("cuda:{ordinal}"), (free / den * num) as u64);
        Ok(Self {
            staging,
            memory,
            kind,
            device,
            budget,
            fallback: HostFallback::Allowed,
            outside_pool: Arc::default(),
            checksum_on: ChecksumOn::default(),
        })
    }

    /// Sets where tensors' checksums are computed (the default: on the device).
    pub fn with_checksum_on(mut self, checksum_on: ChecksumOn) -> Self {
        self.checksum_on = checksum_on;
        self
    }

    /// Where tensors' checksums are computed.
    pub fn checksum_on(&self) -> ChecksumOn {
        self.checksum_on
    }

    /// Sets the device-memory budget: landed tensors on this device never hold more.
    pub fn with_memory_budget(mut self, bytes: u64) -> Self {
        self.budget = MemoryBudget::new(format!("cuda:{}", self.device.ordinal()), bytes);
        self
    }

    /// Sets whether tensors that find no device memory may land in host memory.
    pub fn with_host_fallback(mut self, fallback: HostFallback) -> Self {
        self.fallback = fallback;
        self
    }

    /// The device-memory budget (clones share it).
    pub fn memory_budget(&self) -> &MemoryBudget {
        &self.budget
    }

    /// Whether host memory may stand in for device memory.
    pub fn host_fallback(&self) -> HostFallback {
        self.fallback
    }

    /// The kind of device memory tensors land in (VMM memory can be exported).
    pub fn memory_kind(&self) -> DeviceMemoryKind {
        self.kind
    }

    /// Defaults: 128 MiB of pinned staging allocated up front, the default device pool.
    pub fn with_defaults(ordinal: usize) -> Result<Self, GpuError> {
        Self::with_defaults_of_kind(ordinal, DeviceMemoryKind::Legacy)
    }

    /// The defaults, with tensors landing in memory of `kind` (VMM buffers start at 2 MiB).
    pub fn with_defaults_of_kind(ordinal: usize, kind: DeviceMemoryKind) -> Result<Self, GpuError> {
        let staging = PoolConfig {
            max_pool_bytes: DEFAULT_STAGING_POOL,
            preallocate: true,
            ..PoolConfig::default()
        };
        let mut memory = PoolConfig::default();
        if kind == DeviceMemoryKind::Vmm {
            memory.min_buffer = memory.min_buffer.max(2 << 20);
        }
        Self::with_memory_kind(ordinal, staging, memory, kind)
    }

    /// The device tensors land on.
    pub fn device(&self) -> &Arc<GpuDevice> {
        &self.device
    }

    /// The staging pool's counters.
    pub fn staging_stats(&self) -> PoolStats {
        self.staging.stats()
    }

    /// The device pool's counters.
    pub fn memory_stats(&self) -> PoolStats {
        self.memory.stats()
    }

    /// Tensors whose destination was allocated on its own because the device pool was full
    /// or its buffers too small. Each costs a `cuMemAlloc` and, once dropped, a `cuMemFree`,
    /// which may wait for the device's copies in flight (traced: 0.5 ms each, with the copy
    /// stream left idle meanwhile). Size the pool to the tensors in flight to avoid them.
    pub fn allocations_outside_pool(&self) -> u64 {
        self.outside_pool.load(Ordering::Relaxed)
    }

    /// A sink for `meta`. Its destination comes from the device pool when it fits a pool
    /// buffer and the pool has room; otherwise from an allocation of its own (the pool bounds
    /// what is cached, not what the device may hold). Fails only when the device is out of
    /// memory.
    pub fn sink(&self, meta: &TensorMeta) -> Result<GpuSink, GpuError> {
        let reservation =
            self.budget
                .try_reserve(meta.byte_len())
                .map_err(|e| GpuError::BudgetExhausted {
                    device: self.device.ordinal(),
                    message: e.message,
                })?;
        self.sink_reserved(meta, reservation)
    }

    /// A sink into `dest` (the application's registered memory, say) through this
    /// receiver's staging pool; `dest` must be on this receiver's device.
    pub fn sink_into(&self, dest: CudaBuffer) -> Result<GpuSink, GpuError> {
        if dest.device_id() != self.device.ordinal() {
            return Err(GpuError::InvalidConfig(format!(
                "a cuda:{} destination for a cuda:{} receiver",
                dest.device_id(),
                self.device.ordinal()
            )));
        }
        Ok(
            GpuSink::new(self.device.clone(), dest, self.staging.clone())
                .with_checksum_on(self.checksum_on),
        )
    }

    /// A sink for `meta` into memory already admitted against [`Self::memory_budget`].
    pub fn sink_reserved(
        &self,
        meta: &TensorMeta,
        reservation: MemoryReservation,
    ) -> Result<GpuSink, GpuError> {
        let len = usize::try_from(meta.byte_len())
            .map_err(|_| GpuError::Bounds("tensor larger than the address space".into()))?;
        let pooled = match self.memory.acquire(len) {
            Ok(buffer) => Some(buffer),
            Err(GpuError::PoolExhausted { .. } | GpuError::LargerThanPoolBuffers { .. }) => None,
            Err(e) => return Err(e),
        };
        let dest = match pooled {
            Some(buffer) => CudaBuffer::from_pool(buffer, len),
            None => {
                tracing::debug!(
                    bytes = len,
                    "device pool full or buffer too large: allocating directly"
                );
                let own = DeviceAllocation::with_kind(&self.device, len, self.kind)?;
                self.outside_pool.fetch_add(1, Ordering::Relaxed);
                CudaBuffer::from_owned(own, len)
            }
        };
        Ok(GpuSink::new(
            self.device.clone(),
            dest.with_reservation(reservation)?,
            self.staging.clone(),
        )
        .with_checksum_on(self.checksum_on))
    }
}

/// Copies in flight for one sink, and the first error any of them hit.
#[derive(Default)]
struct InFlight {
    copies: AtomicUsize,
    idle: Notify,
    error: Mutex<Option<GpuError>>,
}

impl InFlight {
    fn finished(&self, result: Result<(), GpuError>) {
        if let Err(e) = result {
            self.error
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get_or_insert(e);
        }
        if self.copies.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.idle.notify_waiters();
        }
    }

    fn error(&self) -> Option<GpuError> {
        self.error
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    async fn wait_idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.copies.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// A staging buffer being filled with contiguous tensor bytes.
struct Fill {
    buffer: Pooled<PinnedAllocation>,
    start: u64,
    filled: usize,
    /// Credit of the bytes copied in so far, but those of the current `write`: theirs moves
    /// in once per buffer and write (`settle`), not per received piece, because every split
    /// clones the receiver-wide budget's `Arc` (an atomic on one cache line that all workers
    /// share: 4.8% of a GPU receiver's CPU when done per piece, profiled).
    permit: Option<CreditPermit>,
}

impl AsRef<[u8]> for Fill {
    /// The filled part of the staging buffer: what the copy reads.
    fn as_ref(&self) -> &[u8] {
        &self.buffer.as_slice()[..self.filled]
    }
}

/// Payload pieces that quinn decrypted into pinned memory (`PinnedDatagrams`), gathered for
/// one batch of copies straight to the device, as a staging buffer gathers the others.
#[derive(Default)]
struct Direct {
    /// Each piece, kept until its copy completed, and its tensor offset.
    pieces: Vec<(Bytes, u64)>,
    /// The pieces' credit (as many bytes as they hold), returned when their copies
    /// completed.
    permit: Option<CreditPermit>,
}

impl Direct {
    /// The bytes gathered.
    fn bytes(&self) -> u64 {
        self.permit.as_ref().map_or(0, CreditPermit::bytes)
    }
}

/// Receives one tensor into device memory (see the module docs).
pub struct GpuSink {
    device: Arc<GpuDevice>,
    /// Every copy in flight holds a share of it, which keeps the memory allocated.
    dest: CudaBuffer,
    staging: PinnedMemoryPool,
    fill: Option<Fill>,
    /// Boxed, so that enums holding a sink stay small.
    direct: Box<Direct>,
    in_flight: Arc<InFlight>,
    handoff: Option<oneshot::Sender<CudaBuffer>>,
    checksum_on: ChecksumOn,
    /// Whether a receiver left the tensor's checksum to the device (`Sink::take_checksum`).
    checksum_taken: bool,
}

/// The destination of a tensor, handed over as soon as its last copy is enqueued: before
/// the copies completed and before COMPLETE, so a server can queue its GPU work at once.
/// From [`GpuSink::handoff`].
#[derive(Debug)]
pub struct Handoff(oneshot::Receiver<CudaBuffer>);

impl Handoff {
    /// Resolves, once every byte arrived and its copy was enqueued, to the destination with
    /// its landing event: work on a stream that [`CudaBuffer::wait_on`] (or
    /// [`CudaBuffer::as_slice`]) ordered after the event reads the landed bytes. The bytes'
    /// checksum was verified by then, unless the device computes it over the landed tensor
    /// ([`ChecksumOn::Device`]), which then runs beside the application's first work.
    ///
    /// Fails if the tensor failed first. The tensor can still fail after the hand-off (a
    /// copy error, a checksum that differs, or the sender's CANCEL while the last copies
    /// run): only the receiver's own result says the bytes are good, so publish nothing
    /// computed from them before it.
    pub async fn landed(self) -> Result<CudaBuffer, GpuError> {
        self.0
            .await
            .map_err(|_| GpuError::NoHandoff("the tensor ended before its last copy".into()))
    }
}

impl GpuSink {
    /// A sink writing into `dest` through buffers of `staging`.
    pub fn new(device: Arc<GpuDevice>, dest: CudaBuffer, staging: PinnedMemoryPool) -> Self {
        Self {
            device,
            dest,
            staging,
            fill: None,
            direct: Box::default(),
            in_flight: Arc::default(),
            handoff: None,
            checksum_on: ChecksumOn::default(),
            checksum_taken: false,
        }
    }

    /// Sets where this tensor's checksum is computed (the default: on the device).
    pub fn with_checksum_on(mut self, checksum_on: ChecksumOn) -> Self {
        self.checksum_on = checksum_on;
        self
    }

    /// Hands the destination over (if [`handoff`](Self::handoff) was asked for) once its last
    /// copy is enqueued. Only a hand-off needs the landing event (copies run in order on one
    /// stream, so an event after the last is the tensor's landing): the buffer `finish`
    /// returns has landed already, so other tensors pay nothing for it.
    fn hand_off(&mut self) -> Result<(), GpuError> {
        if let Some(handoff) = self.handoff.take() {
            let mut early = self.dest.share();
            early.set_landing(self.device.record_copies()?);
            let _ = handoff.send(early);
        }
        Ok(())
    }

    /// The CRC-32C of the landed bytes, computed on the device after every copy enqueued.
    async fn checksum_on_device(&mut self) -> Result<u32, GpuError> {
        self.copy_held()?;
        // The application's work may queue behind the copies while the checksum runs.
        self.hand_off()?;
        let len = self.dest.len();
        let piece = checksum_piece(len);
        let out = self.staging.acquire_wait(STAGING_BUFFER).await?;
        let (tx, rx) = oneshot::channel();
        self.device.checksum_pieces_async(
            self.dest.share(),
            piece,
            out,
            move |out, dest, result| {
                drop(dest);
                let _ = tx.send((out, result));
            },
        );
        let (out, result) = rx.await.map_err(|_| GpuError::Cuda {
            call: "checksum kernel",
            error: "its completion was dropped".into(),
        })?;
        result?;
        if let Some(e) = self.in_flight.error() {
            return Err(e);
        }
        // Combined here, not on the completion thread, which other tensors' copies wait on.
        let crcs: Vec<u32> = out.as_slice()[..len.div_ceil(piece) * 4]
            .chunks_exact(4)
            .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        drop(out);
        crc32c_of_pieces(&crcs, piece as u64, len as u64)
            .ok_or_else(|| GpuError::Bounds("checksum pieces do not cover the tensor".into()))
    }

    /// The destination's early hand-off (see [`Handoff`]); asking again replaces it.
    pub fn handoff(&mut self) -> Handoff {
        let (tx, rx) = oneshot::channel();
        self.handoff = Some(tx);
        Handoff(rx)
    }

    /// The device address the tensor lands at.
    pub fn destination_ptr(&self) -> u64 {
        self.dest.device_ptr()
    }

    /// Sets every destination byte to `value` first (tests poison destinations with it).
    pub fn poison(&mut self, value: u8) -> Result<(), GpuError> {
        self.dest.fill(value)
    }

    /// Enqueues the copy of the current staging buffer; its buffer and credit come back
    /// when the copy's event completes.
    fn copy_fill(&mut self) -> Result<(), GpuError> {
        let Some(fill) = self.fill.take() else {
            return Ok(());
        };
        if fill.filled == 0 {
            return Ok(());
        }
        let dest = self.dest.share();
        let offset = usize::try_from(fill.start)
            .map_err(|_| GpuError::Bounds("offset past the address space".into()))?;
        let in_flight = self.in_flight.clone();
        in_flight.copies.fetch_add(1, Ordering::AcqRel);
        self.device
            .copy_to_device_async(fill, dest, offset, move |fill, dest, result| {
                // Only now that the copy completed: the staging buffer goes back to its pool,
                // then the bytes' credit to the receiver's budget (Fill's field order), and
                // this copy's hold on the destination ends.
                drop(fill);
                drop(dest);
                in_flight.finished(result);
            });
        Ok(())
    }

    /// Enqueues the copies of the payload pieces gathered from pinned datagrams; the pieces
    /// (so quinn's buffers) and their credit come back when the copies have completed.
    fn copy_direct(&mut self) {
        let Direct { pieces, permit } = std::mem::take(&mut *self.direct);
        if pieces.is_empty() {
            return;
        }
        let in_flight = self.in_flight.clone();
        in_flight.copies.fetch_add(1, Ordering::AcqRel);
        self.device.copy_pieces_to_device_async(
            pieces,
            self.dest.share(),
            move |pieces, dest, result| {
                drop(pieces);
                drop(permit);
                drop(dest);
                in_flight.finished(result);
            },
        );
    }

    /// Enqueues every copy this sink holds back: the staging buffer being filled and the
    /// pieces gathered from pinned datagrams.
    fn copy_held(&mut self) -> Result<(), GpuError> {
        self.copy_fill()?;
        self.copy_direct();
        Ok(())
    }

    /// Starts a new staging buffer at tensor offset `at`, flushing the current one.
    async fn start_fill(&mut self, at: u64) -> Result<(), GpuError> {
        self.copy_fill()?;
        let buffer = self.staging.acquire_wait(STAGING_BUFFER).await?;
        self.fill = Some(Fill {
            buffer,
            start: at,
            filled: 0,
            permit: None,
        });
        Ok(())
    }

    /// Moves the credit of the bytes the current buffer holds from `permit` into the buffer,
    /// which returns it once its copy is done.
    fn settle(&mut self, permit: &mut CreditPermit) {
        let Some(fill) = self.fill.as_mut() else {
            return;
        };
        let covered = fill.permit.as_ref().map_or(0, CreditPermit::bytes);
        let owed = fill.filled as u64 - covered;
        if owed == 0 {
            return;
        }
        let piece = permit.split_off(owed);
        match &mut fill.permit {
            Some(held) => held.merge(piece),
            None => fill.permit = Some(piece),
        }
    }

    /// Stores `payload` at `offset` through staging, its CRC-32C into `crc` if asked.
    async fn stage(
        &mut self,
        offset: u64,
        payload: Payload,
        mut permit: CreditPermit,
        mut crc: Option<&mut u32>,
    ) -> Result<(), SinkError> {
        if let Some(e) = self.in_flight.error() {
            return Err(e.into());
        }
        let end = offset.checked_add(payload.len() as u64);
        let len = self.dest.len() as u64;
        if end.is_none_or(|end| end > len) {
            return Err(
                GpuError::Bounds(format!("write at {offset} past a {len}-byte tensor")).into(),
            );
        }
        let mut at = offset;
        let mut direct_bytes = 0;
        for part in payload.parts() {
            if part.len() >= DIRECT_FROM && in_pinned_datagram(part) {
                // Pinned where quinn decrypted it: the copy engine reads it from there.
                if let Some(crc) = crc.as_deref_mut() {
                    *crc = crc32c_append(*crc, part);
                }
                self.direct.pieces.push((part.clone(), at));
                direct_bytes += part.len() as u64;
            } else {
                self.write_part(at, part, &mut permit, crc.as_deref_mut())
                    .await?;
            }
            at += part.len() as u64;
        }
        self.settle(&mut permit);
        if direct_bytes > 0 {
            // Credit moves once per payload, for the reason `Fill::permit` gives.
            let credit = permit.split_off(direct_bytes);
            match &mut self.direct.permit {
                Some(held) => held.merge(credit),
                None => self.direct.permit = Some(credit),
            }
            if self.direct.bytes() >= STAGING_BUFFER as u64 {
                self.copy_direct();
            }
        }
        // Liveness: with every staging buffer taken, other tensors wait for a copy to
        // return one. A partial fill parked until this tensor's next bytes arrive is copied
        // now unless a copy of this sink is in flight, which returns a buffer (and credit)
        // without waiting for anyone's bytes. So whenever the pool runs dry, some copy is in
        // flight. Copying every partial fill instead made copies of 1-3 MiB when the GPU set
        // the pace, each costing the copy engine its fixed overhead. The atomic is read
        // first: while this sink's copies run, no write takes the pool's lock for the rule.
        // The fill's credit is the receiver's to free: it flushes the sink once the tensor
        // has no credit in flight and gets none (`Sink::flush`, spec §7.1).
        if self.in_flight.copies.load(Ordering::Acquire) == 0
            && self.staging.stats().available_buffers == 0
        {
            self.copy_fill()?;
        }
        Ok(())
    }

    /// Copies `part` into staging at tensor offset `at`; with `crc`, checksums each piece
    /// right before copying it (one read of the bytes from memory).
    async fn write_part(
        &mut self,
        mut at: u64,
        mut part: &[u8],
        permit: &mut CreditPermit,
        mut crc: Option<&mut u32>,
    ) -> Result<(), GpuError> {
        while !part.is_empty() {
            let contiguous = self
                .fill
                .as_ref()
                .is_some_and(|f| f.start + f.filled as u64 == at && f.filled < f.buffer.len());
            if !contiguous {
                self.settle(permit);
                self.start_fill(at).await?;
            }
            let Some(fill) = self.fill.as_mut() else {
                return Err(GpuError::Bounds("no staging buffer".into()));
            };
            let n = part.len().min(fill.buffer.len() - fill.filled);
            let to = &mut fill.buffer.as_mut_slice()[fill.filled..fill.filled + n];
            // A connection's DATA (checksummed here, or by the device once landed) streams
            // into staging; a copy from memory keeps ordinary stores, which one thread moves
            // faster (`cuda::streaming`).
            match crc.as_deref_mut() {
                Some(crc) => *crc = checksum_then_copy_with(*crc, &part[..n], to, stream_into),
                None if self.checksum_taken => stream_into(to, &part[..n]),
                None => to.copy_from_slice(&part[..n]),
            }
            fill.filled += n;
            if fill.filled == fill.buffer.len() {
                self.settle(permit);
                self.copy_fill()?;
            }
            at += n as u64;
            part = &part[n..];
        }
        Ok(())
    }
}

impl Sink for GpuSink {
    type Output = CudaBuffer;

    async fn store(
        &mut self,
        offset: u64,
        payload: Payload,
        permit: CreditPermit,
        crc: Option<&mut u32>,
    ) -> Result<(), SinkError> {
        self.stage(offset, payload, permit, crc).await
    }

    /// Copies a partial staging buffer, and the pieces gathered from pinned datagrams, now:
    /// its tensor gets no more bytes until credit comes back, and they hold some of it.
    async fn flush(&mut self) -> Result<(), SinkError> {
        Ok(self.copy_held()?)
    }

    fn take_checksum(&mut self) -> bool {
        if self.checksum_on != ChecksumOn::Device || self.dest.len() < CHECKSUM_ON_DEVICE_FROM {
            return false;
        }
        match self.device.checksum_kernel() {
            Ok(()) => {
                self.checksum_taken = true;
                true
            }
            Err(e) => {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    tracing::warn!(
                        error = %e,
                        "the CRC-32C kernel does not load: tensors are checksummed on the host"
                    );
                });
                false
            }
        }
    }

    async fn landed_checksum(&mut self) -> Result<u32, SinkError> {
        Ok(self.checksum_on_device().await?)
    }

    async fn finish(mut self) -> Result<CudaBuffer, SinkError> {
        self.copy_held()?;
        self.hand_off()?;
        self.in_flight.wait_idle().await;
        if let Some(e) = self.in_flight.error() {
            return Err(e.into());
        }
        Ok(self.dest)
    }
}

/// The parts of a split tensor (spec §15) fill the destination at once, each through staging
/// buffers of its own: the copies into staging run on as many cores as parts.
impl Divisible for GpuSink {
    type Part = GpuSink;

    fn part(&mut self) -> Option<GpuSink> {
        Some(GpuSink::new(
            self.device.clone(),
            self.dest.share(),
            self.staging.clone(),
        ))
    }
}

// A sink dropped mid-tensor (cancelled) needs no Drop: each copy in flight owns its staging
// buffer and a share of the destination, which are freed when that copy's event completes.

#[cfg(test)]
mod tests {
    use super::*;

    /// Every tensor's pieces' CRCs fit in one staging buffer.
    #[test]
    fn the_pieces_crcs_of_any_tensor_fit_one_staging_buffer() {
        for len in [
            1,
            16 << 10,
            16 << 30,
            (16 << 30) + 1,
            1 << 40,
            usize::MAX / 2,
        ] {
            let piece = checksum_piece(len);
            assert!(
                piece >= CHECKSUM_PIECE && piece.is_multiple_of(16),
                "{len}: {piece}"
            );
            assert!(len.div_ceil(piece) * 4 <= STAGING_BUFFER, "{len}: {piece}");
        }
        assert_eq!(checksum_piece(16 << 30), CHECKSUM_PIECE);
    }
}
