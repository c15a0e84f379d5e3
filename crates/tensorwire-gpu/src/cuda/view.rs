//! Typed cudarc views of landed tensors, for a server's own GPU code (cuBLAS through
//! cudarc, candle's CUDA backend, its own kernels).
//!
//! A [`DeviceSlice<T>`] is a `cudarc::driver::CudaSlice<T>` over tensorwire's memory: it
//! derefs to one, so it goes wherever cudarc takes `&CudaSlice<T>` (or a `CudaView` of it),
//! and it is made on the caller's stream after that stream was told to wait for the
//! tensor's landing event, so work queued on it reads the landed bytes with no host wait.
//! When it drops, cudarc's own read/write tracking is folded into an event on its stream,
//! and the memory goes back to its pool only after that event completed.

use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DeviceRepr};
use tensorwire_proto::DType;

use super::cuda;
use crate::error::GpuError;

/// A Rust element type and the tensor dtype it views (spec §5.1).
pub trait Element: DeviceRepr + Send + Sync + 'static {
    /// The dtype a tensor must have to be viewed as `Self`.
    const DTYPE: DType;
}

macro_rules! elements {
    ($($rust:ty => $dtype:ident),* $(,)?) => {
        $(impl Element for $rust {
            const DTYPE: DType = DType::$dtype;
        })*
    };
}

elements! {
    bool => Bool, u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32,
    u64 => U64, i64 => I64, f32 => F32, f64 => F64,
}

#[cfg(feature = "half")]
elements! { half::f16 => F16, half::bf16 => BF16 }

/// Where a view's memory records the streams that used it, so it is not freed or reused
/// before their work completed.
pub(crate) trait UsedBy: Send + Sync {
    /// `event` completes when the last work queued on a view's stream has.
    fn used_until(&self, event: CudaEvent);
}

/// A typed cudarc slice over a landed tensor; see the module docs.
pub struct DeviceSlice<T> {
    /// Never dropped as a `CudaSlice` (that would free tensorwire's memory): leaked in `Drop`.
    slice: ManuallyDrop<CudaSlice<T>>,
    memory: Arc<dyn UsedBy>,
}

impl<T> std::fmt::Debug for DeviceSlice<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceSlice<{}>({} elements)",
            std::any::type_name::<T>(),
            self.slice.len()
        )
    }
}

impl<T: Element> DeviceSlice<T> {
    /// A view of `bytes` bytes at `ptr` on `stream`, after `stream` waits for `landed`.
    pub(crate) fn new(
        ptr: u64,
        bytes: usize,
        dtype: DType,
        stream: &Arc<CudaStream>,
        landed: Option<&CudaEvent>,
        memory: Arc<dyn UsedBy>,
    ) -> Result<Self, GpuError> {
        let size = std::mem::size_of::<T>();
        if dtype != T::DTYPE || size == 0 || !bytes.is_multiple_of(size) {
            return Err(GpuError::WrongType {
                dtype,
                rust_type: std::any::type_name::<T>(),
            });
        }
        if let Some(event) = landed {
            stream.wait(event).map_err(cuda("cuStreamWaitEvent"))?;
        }
        // SAFETY: `ptr..ptr + bytes` is live device memory that `memory` keeps allocated for
        // as long as this view lives (and, through the event recorded in `Drop`, until the
        // view's stream finished with it); its length is a whole number of `T`s, and `T`'s
        // dtype is the tensor's, so every bit pattern the sender wrote is a `T` the sender
        // meant. The slice is leaked in `Drop`, never freed by cudarc.
        let slice = unsafe { stream.upgrade_device_ptr::<T>(ptr, bytes / size) };
        Ok(Self {
            slice: ManuallyDrop::new(slice),
            memory,
        })
    }
}

impl<T> Deref for DeviceSlice<T> {
    type Target = CudaSlice<T>;

    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T> DerefMut for DeviceSlice<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }
}

impl<T> Drop for DeviceSlice<T> {
    fn drop(&mut self) {
        // SAFETY: `slice` is taken exactly once, here, and never used again.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        let stream = slice.stream().clone();
        // `leak` makes the stream wait for cudarc's read/write events and frees nothing.
        let _ = slice.leak();
        match stream.record_event(None) {
            Ok(event) => self.memory.used_until(event),
            Err(e) => {
                // Cannot track the stream's work: wait for it before the memory may go.
                tracing::warn!(error = %e, "cannot record a view's last use: synchronizing");
                let _ = stream.synchronize();
            }
        }
    }
}
