//! [`HostSink`]: a tensor landed in host memory that is committed only as bytes arrive and
//! goes back to the operating system when the last reference is dropped.

use bytes::Bytes;
use memmap2::MmapMut;
use tensorwire_proto::{Device, Payload, Receipt};

use crate::{CreditPermit, Divisible, MemoryReservation, Sink, SinkError, copy_payload_at};

/// Below this, a heap buffer; at and above, an anonymous mapping, whose untouched pages cost
/// nothing and which is unmapped on drop. The allocator would keep freed blocks above its
/// (dynamic, up to 32 MiB) mmap threshold in the process: a burst of tensors of a few hundred
/// KiB would stay resident after they are dropped.
const MAP_FROM: usize = 32 << 10;

/// Mappings this large ask for transparent huge pages.
const HUGE_FROM: usize = 4 << 20;

/// A sink into one host-memory buffer of the tensor's length.
#[derive(Debug)]
pub struct HostSink {
    buf: HostBuffer,
    reservation: Option<MemoryReservation>,
    /// Bytes written so far, when the buffer is a reused one: it must be written whole
    /// before it is handed over, since it holds an earlier tensor's bytes.
    reused: Option<u64>,
}

#[derive(Debug)]
enum HostBuffer {
    Heap(Vec<u8>),
    Mapped(MmapMut),
}

impl HostBuffer {
    fn as_mut(&mut self) -> &mut [u8] {
        match self {
            HostBuffer::Heap(v) => v,
            HostBuffer::Mapped(m) => m,
        }
    }
}

/// Keeps a mapping (and its memory reservation) alive for as long as [`Bytes`] refer to it;
/// then hands the mapping to its budget's spares ([`MemoryBudget::keeping_spares`]).
///
/// [`MemoryBudget::keeping_spares`]: crate::MemoryBudget::keeping_spares
struct MappedOwner {
    map: Option<MmapMut>,
    reservation: Option<MemoryReservation>,
}

impl AsRef<[u8]> for MappedOwner {
    fn as_ref(&self) -> &[u8] {
        self.map.as_deref().unwrap_or_default()
    }
}

impl Drop for MappedOwner {
    fn drop(&mut self) {
        let (Some(map), Some(reservation)) = (self.map.take(), self.reservation.take()) else {
            return;
        };
        let budget = reservation.budget().clone();
        drop(reservation);
        budget.keep_spare(map);
    }
}

/// Keeps a heap buffer (and its memory reservation) alive for as long as [`Bytes`] refer to it.
struct HeapOwner {
    buf: Vec<u8>,
    _reservation: Option<MemoryReservation>,
}

impl AsRef<[u8]> for HeapOwner {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl HostSink {
    /// A zeroed buffer of `len` bytes outside any budget; fails cleanly if the address space
    /// cannot be had. Pages are committed only as bytes are written.
    pub fn new(len: u64) -> Result<Self, SinkError> {
        Self::build(len, None)
    }

    /// A buffer of the reservation's length, counted against its budget until the buffer
    /// (or the [`Bytes`] made from it) is dropped.
    pub fn reserved(reservation: MemoryReservation) -> Result<Self, SinkError> {
        Self::build(reservation.bytes(), Some(reservation))
    }

    fn build(len: u64, reservation: Option<MemoryReservation>) -> Result<Self, SinkError> {
        let len = usize::try_from(len)
            .map_err(|_| SinkError::exhausted("tensor larger than the address space"))?;
        let spare = match &reservation {
            Some(reservation) if len >= MAP_FROM => reservation.budget().take_spare(len),
            _ => None,
        };
        if let Some(map) = spare {
            return Ok(Self {
                buf: HostBuffer::Mapped(map),
                reservation,
                reused: Some(0),
            });
        }
        let buf = if len >= MAP_FROM {
            let map = MmapMut::map_anon(len)
                .map_err(|e| SinkError::exhausted(format!("{len} bytes of host memory: {e}")))?;
            if len >= HUGE_FROM {
                // Transparent huge pages where the kernel allows them: a landing tensor then
                // faults once per 2 MiB instead of once per 4 KiB. Only a hint.
                let _ = map.advise(memmap2::Advice::HugePage);
            }
            HostBuffer::Mapped(map)
        } else {
            let mut buf = Vec::new();
            buf.try_reserve_exact(len)
                .map_err(|e| SinkError::exhausted(format!("{len} bytes of host memory: {e}")))?;
            buf.resize(len, 0);
            HostBuffer::Heap(buf)
        };
        Ok(Self {
            buf,
            reservation,
            reused: None,
        })
    }
}

impl Sink for HostSink {
    type Output = Bytes;

    async fn store(
        &mut self,
        offset: u64,
        payload: Payload,
        permit: CreditPermit,
        crc: Option<&mut u32>,
    ) -> Result<(), SinkError> {
        copy_payload_at(self.buf.as_mut(), offset, &payload, crc)?;
        // Writes never overlap (the receiver checks DATA first), so a sum says "whole".
        if let Some(written) = &mut self.reused {
            *written += payload.len() as u64;
        }
        drop(permit); // The bytes are in their final place: durable.
        Ok(())
    }

    /// Host memory, always.
    fn receipt(_: &Bytes) -> Receipt {
        Receipt::new().with(Receipt::DEVICE, Device::Host.to_string())
    }

    async fn finish(self) -> Result<Bytes, SinkError> {
        Ok(match self.buf {
            HostBuffer::Heap(buf) if self.reservation.is_none() => buf.into(),
            HostBuffer::Heap(buf) => Bytes::from_owner(HeapOwner {
                buf,
                _reservation: self.reservation,
            }),
            HostBuffer::Mapped(map) => {
                let len = map.len() as u64;
                if let Some(written) = self.reused.filter(|&written| written < len) {
                    return Err(SinkError::failed(format!(
                        "finished with {written} of {len} bytes written into a reused buffer"
                    )));
                }
                Bytes::from_owner(MappedOwner {
                    map: Some(map),
                    reservation: self.reservation,
                })
            }
        })
    }
}

/// Parts of a split tensor write into host memory one at a time: one mapping has one writer.
impl Divisible for HostSink {
    type Part = HostSink;

    fn part(&mut self) -> Option<HostSink> {
        None
    }
}
