//! [`GpuSink`], the copy engine: DATA into pinned staging (or straight from pinned datagrams),
//! host-to-device copies on the device's copy stream, credit back once each copy completed.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use tensorwire_proto::Payload;
use tensorwire_proto::checksum::{crc32c_append, crc32c_of_pieces};
use tensorwire_sink::{CreditPermit, Divisible, Sink, SinkError, checksum_then_copy_with};
use tokio::sync::{Notify, oneshot};

use super::{CHECKSUM_ON_DEVICE_FROM, ChecksumOn, DIRECT_FROM, STAGING_BUFFER, checksum_piece};
use crate::buffer::CudaBuffer;
use crate::cuda::{GpuDevice, PinnedAllocation, in_pinned_datagram, stream_into};
use crate::error::GpuError;
use crate::memory_pools::PinnedMemoryPool;
use crate::pool::{Allocation, Pooled};

/// Copies in flight for one sink, and the first error any of them hit.
#[derive(Default)]
pub(crate) struct InFlight {
    pub(crate) copies: AtomicUsize,
    pub(crate) idle: Notify,
    pub(crate) error: Mutex<Option<GpuError>>,
}

impl InFlight {
    pub(crate) fn finished(&self, result: Result<(), GpuError>) {
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

    pub(crate) fn error(&self) -> Option<GpuError> {
        self.error
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub(crate) async fn wait_idle(&self) {
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
pub(crate) struct Fill {
    pub(crate) buffer: Pooled<PinnedAllocation>,
    pub(crate) start: u64,
    pub(crate) filled: usize,
    /// Credit of the bytes copied in so far, but those of the current `write`: theirs moves
    /// in once per buffer and write (`settle`), not per received piece, because every split
    /// clones the receiver-wide budget's `Arc` (an atomic on one cache line that all workers
    /// share, which showed in profiles when done per piece).
    pub(crate) permit: Option<CreditPermit>,
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
pub(crate) struct Direct {
    /// Each piece, kept until its copy completed, and its tensor offset.
    pub(crate) pieces: Vec<(Bytes, u64)>,
    /// The pieces' credit (as many bytes as they hold), returned when their copies
    /// completed.
    pub(crate) permit: Option<CreditPermit>,
}

impl Direct {
    /// The bytes gathered.
    pub(crate) fn bytes(&self) -> u64 {
        self.permit.as_ref().map_or(0, CreditPermit::bytes)
    }
}

/// Receives one tensor into device memory (see the module docs).
pub struct GpuSink {
    pub(crate) device: Arc<GpuDevice>,
    /// Every copy in flight holds a share of it, which keeps the memory allocated.
    pub(crate) dest: CudaBuffer,
    pub(crate) staging: PinnedMemoryPool,
    pub(crate) fill: Option<Fill>,
    /// Boxed, so that enums holding a sink stay small.
    pub(crate) direct: Box<Direct>,
    pub(crate) in_flight: Arc<InFlight>,
    pub(crate) handoff: Option<oneshot::Sender<CudaBuffer>>,
    pub(crate) checksum_on: ChecksumOn,
    /// Whether a receiver left the tensor's checksum to the device (`Sink::take_checksum`).
    pub(crate) checksum_taken: bool,
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
    pub(crate) fn hand_off(&mut self) -> Result<(), GpuError> {
        if let Some(handoff) = self.handoff.take() {
            let mut early = self.dest.share();
            early.set_landing(self.device.record_copies()?);
            let _ = handoff.send(early);
        }
        Ok(())
    }

    /// The CRC-32C of the landed bytes, computed on the device after every copy enqueued.
    pub(crate) async fn checksum_on_device(&mut self) -> Result<u32, GpuError> {
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
    pub(crate) fn copy_fill(&mut self) -> Result<(), GpuError> {
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
    pub(crate) fn copy_direct(&mut self) {
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
    pub(crate) fn copy_held(&mut self) -> Result<(), GpuError> {
        self.copy_fill()?;
        self.copy_direct();
        Ok(())
    }

    /// Starts a new staging buffer at tensor offset `at`, flushing the current one.
    pub(crate) async fn start_fill(&mut self, at: u64) -> Result<(), GpuError> {
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
    pub(crate) fn settle(&mut self, permit: &mut CreditPermit) {
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
    pub(crate) async fn stage(
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
    pub(crate) async fn write_part(
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
