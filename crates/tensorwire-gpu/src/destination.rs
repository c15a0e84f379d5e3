//! Landing tensors in memory the application already owns (spec §9.4): an inference server
//! registers `name → destination` (its current weights, a KV page) and a tensor of that name
//! lands there, through the same credit and staging path as any other, instead of in memory
//! allocated for it. A tensor whose dtype or shape differ from the registration is refused
//! with DESTINATION_MISMATCH before a byte is written.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tensorwire_proto::{DType, ErrorCode, Payload, TensorMeta};
use tensorwire_sink::{CreditPermit, Divisible, Sink, SinkError, copy_payload_at};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::GpuError;
use crate::placement::Placement;

/// Host memory the application owns and shares with tensorwire: tensors land in it under the
/// lock, one DATA frame at a time.
pub type HostMemory = Arc<Mutex<Vec<u8>>>;

/// The application's registered destinations, by tensor name. Clones share them.
#[derive(Clone, Default)]
pub struct Destinations {
    by_name: Arc<Mutex<HashMap<String, Arc<Registered>>>>,
}

impl std::fmt::Debug for Destinations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self.lock().keys().cloned().collect();
        f.debug_struct("Destinations")
            .field("names", &names)
            .finish()
    }
}

/// One registration: what a tensor of its name must be, and where it lands.
struct Registered {
    dtype: DType,
    shape: Vec<u64>,
    memory: Memory,
    /// One tensor at a time lands here.
    busy: Arc<Semaphore>,
}

enum Memory {
    Host(HostMemory),
    #[cfg(feature = "cuda")]
    Device(crate::cuda::DeviceRange),
}

impl Registered {
    fn describe(&self) -> String {
        format!("{} {:?}", self.dtype, self.shape)
    }
}

impl Destinations {
    /// No destinations: every tensor lands in memory of its own.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Registered>>> {
        self.by_name.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn insert(
        &self,
        name: impl Into<String>,
        dtype: DType,
        shape: &[u64],
        len: usize,
        memory: Memory,
    ) -> Result<(), GpuError> {
        let name = name.into();
        let bytes = shape
            .iter()
            .try_fold(dtype.size(), |n, &d| n.checked_mul(d));
        if bytes != Some(len as u64) {
            return Err(GpuError::Bounds(format!(
                "{name}: {dtype} {shape:?} does not fill the {len} bytes registered for it"
            )));
        }
        let registered = Registered {
            dtype,
            shape: shape.to_vec(),
            memory,
            busy: Arc::new(Semaphore::new(1)),
        };
        self.lock().insert(name, Arc::new(registered));
        Ok(())
    }

    /// Tensors named `name` land in `memory` (host), which must be exactly `shape` × `dtype`
    /// bytes long. Replaces an earlier registration of the name.
    pub fn register_host(
        &self,
        name: impl Into<String>,
        dtype: DType,
        shape: &[u64],
        memory: HostMemory,
    ) -> Result<(), GpuError> {
        let len = memory.lock().unwrap_or_else(PoisonError::into_inner).len();
        self.insert(name, dtype, shape, len, Memory::Host(memory))
    }

    /// Tensors named `name` land in the application's cudarc slice (on a device's primary
    /// context), whose element type gives the dtype; copies into it first wait for the work
    /// queued on the slice's stream. The slice stays allocated while registered or landing.
    #[cfg(feature = "cuda")]
    pub fn register_cuda_slice<T: crate::cuda::Element>(
        &self,
        name: impl Into<String>,
        shape: &[u64],
        slice: std::sync::Arc<cudarc::driver::CudaSlice<T>>,
    ) -> Result<(), GpuError> {
        let range = crate::cuda::DeviceRange::from_cuda_slice(slice)?;
        self.register_device(name, T::DTYPE, shape, range)
    }

    /// Tensors named `name` land in `range`, device memory the application owns.
    #[cfg(feature = "cuda")]
    pub fn register_device(
        &self,
        name: impl Into<String>,
        dtype: DType,
        shape: &[u64],
        range: crate::cuda::DeviceRange,
    ) -> Result<(), GpuError> {
        let len = range.len();
        self.insert(name, dtype, shape, len, Memory::Device(range))
    }

    /// Forgets `name`'s destination (a tensor landing there finishes); whether there was one.
    pub fn unregister(&self, name: &str) -> bool {
        self.lock().remove(name).is_some()
    }

    /// Whether tensors named `name` have a destination.
    pub fn contains(&self, name: &str) -> bool {
        self.lock().contains_key(name)
    }

    /// The sink for `meta` if its name has a destination: `Ok(None)` if not (place it as
    /// usual), DESTINATION_MISMATCH if its dtype or shape differ, RESOURCE_EXHAUSTED if
    /// another tensor of the name still lands there after `wait`, UNSUPPORTED_DEVICE if the
    /// destination is on a device `placement` does not stage for.
    pub async fn claim(
        &self,
        meta: &TensorMeta,
        placement: &Placement,
        wait: Duration,
    ) -> Result<Option<DestinationSink>, SinkError> {
        let Some(registered) = self.lock().get(meta.name()).cloned() else {
            return Ok(None);
        };
        if meta.dtype() != registered.dtype || meta.shape() != registered.shape.as_slice() {
            return Err(SinkError {
                code: ErrorCode::DESTINATION_MISMATCH,
                message: format!(
                    "{}: {} {:?} does not match its destination {}",
                    meta.name(),
                    meta.dtype(),
                    meta.shape(),
                    registered.describe()
                ),
            });
        }
        let busy = tokio::time::timeout(wait, registered.busy.clone().acquire_owned())
            .await
            .map_err(|_| {
                SinkError::exhausted(format!(
                    "{}: another tensor of this name was still landing in its destination \
                     after {:.1} s",
                    meta.name(),
                    wait.as_secs_f64()
                ))
            })?
            .map_err(|_| SinkError::failed("destination closed"))?;
        let into = match &registered.memory {
            Memory::Host(memory) => LandIn::Host(memory.clone()),
            #[cfg(feature = "cuda")]
            Memory::Device(range) => {
                let elsewhere = |why: String| {
                    SinkError::unsupported_device(format!(
                        "{}: its destination is on cuda:{}, {why}",
                        meta.name(),
                        range.device().ordinal()
                    ))
                };
                let Placement::Gpu(gpu) = placement else {
                    let lands = placement.describe();
                    return Err(elsewhere(format!(
                        "but this receiver lands tensors in {lands}"
                    )));
                };
                let dest = crate::buffer::CudaBuffer::from_owned(range.allocation()?, range.len());
                // `sink_into` refuses a destination on another device than its staging.
                LandIn::Device(gpu.sink_into(dest).map_err(|e| elsewhere(e.to_string()))?)
            }
        };
        #[cfg(not(feature = "cuda"))]
        let _ = placement;
        Ok(Some(DestinationSink { into, _busy: busy }))
    }
}

/// A sink into a registered destination; see [`Destinations::claim`].
pub struct DestinationSink {
    into: LandIn,
    /// Released when the tensor finished or failed: the next tensor of the name may land.
    _busy: OwnedSemaphorePermit,
}

enum LandIn {
    Host(HostMemory),
    #[cfg(feature = "cuda")]
    Device(crate::sink::GpuSink),
}

impl std::fmt::Debug for DestinationSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DestinationSink")
            .field("device_ptr", &self.device_ptr())
            .finish()
    }
}

impl DestinationSink {
    /// The device address the tensor lands at (`None` for host memory).
    pub fn device_ptr(&self) -> Option<u64> {
        match &self.into {
            LandIn::Host(_) => None,
            #[cfg(feature = "cuda")]
            LandIn::Device(sink) => Some(sink.destination_ptr()),
        }
    }

    /// The early hand-off of a device destination (see [`crate::Handoff`]).
    #[cfg(feature = "cuda")]
    pub fn handoff(&mut self) -> Option<crate::sink::Handoff> {
        match &mut self.into {
            LandIn::Host(_) => None,
            LandIn::Device(sink) => Some(sink.handoff()),
        }
    }
}

/// The parts of a split tensor (spec §15), claimed with the whole's metadata
/// ([`SplitPart::whole`]) and joined through [`SplitTensors`], land in the destination:
/// into device memory each through staging of its own, into host memory one at a time.
///
/// [`SplitPart::whole`]: tensorwire_proto::split::SplitPart::whole
/// [`SplitTensors`]: tensorwire_sink::SplitTensors
impl Divisible for DestinationSink {
    type Part = crate::placement::TensorSink;

    fn part(&mut self) -> Option<Self::Part> {
        match &mut self.into {
            LandIn::Host(_) => None,
            #[cfg(feature = "cuda")]
            LandIn::Device(sink) => sink.part().map(crate::placement::TensorSink::Gpu),
        }
    }
}

/// Where a tensor landed in a registered destination.
#[derive(Debug)]
pub enum Landed {
    /// The application's host memory, now holding the tensor.
    Host(HostMemory),
    /// The application's device memory, landed; dropping it frees nothing.
    #[cfg(feature = "cuda")]
    Device(crate::buffer::CudaBuffer),
}

impl Landed {
    /// Where, for people: "host memory" or "cuda:0 (NVIDIA H100) at 0x…".
    pub fn location(&self) -> String {
        match self {
            Landed::Host(_) => "registered host memory".into(),
            #[cfg(feature = "cuda")]
            Landed::Device(buffer) => format!(
                "registered memory of {} at {:#x}",
                buffer.location(),
                buffer.device_ptr()
            ),
        }
    }
}

impl Sink for DestinationSink {
    type Output = Landed;

    async fn store(
        &mut self,
        offset: u64,
        payload: Payload,
        permit: CreditPermit,
        crc: Option<&mut u32>,
    ) -> Result<(), SinkError> {
        match &mut self.into {
            LandIn::Host(memory) => {
                let mut memory = memory.lock().unwrap_or_else(PoisonError::into_inner);
                copy_payload_at(&mut memory, offset, &payload, crc)?;
            }
            #[cfg(feature = "cuda")]
            LandIn::Device(sink) => return sink.store(offset, payload, permit, crc).await,
        }
        // The bytes are in the destination: their credit may go back.
        drop(permit);
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), SinkError> {
        match &mut self.into {
            LandIn::Host(_) => Ok(()),
            #[cfg(feature = "cuda")]
            LandIn::Device(sink) => sink.flush().await,
        }
    }

    fn take_checksum(&mut self) -> bool {
        match &mut self.into {
            LandIn::Host(_) => false,
            #[cfg(feature = "cuda")]
            LandIn::Device(sink) => sink.take_checksum(),
        }
    }

    async fn landed_checksum(&mut self) -> Result<u32, SinkError> {
        match &mut self.into {
            LandIn::Host(_) => Err(SinkError::failed(
                "host destinations are checksummed as they arrive",
            )),
            #[cfg(feature = "cuda")]
            LandIn::Device(sink) => sink.landed_checksum().await,
        }
    }

    async fn finish(self) -> Result<Landed, SinkError> {
        match self.into {
            LandIn::Host(memory) => Ok(Landed::Host(memory)),
            #[cfg(feature = "cuda")]
            LandIn::Device(sink) => sink.finish().await.map(Landed::Device),
        }
    }
}
