//! DLPack export: the `DLManagedTensor` ABI of `dlpack.h` (v0.8, the one `from_dlpack`
//! capsules carry), so PyTorch, JAX or CuPy can take a tensor without a copy.
//!
//! A [`DlpackTensor`] owns the value that keeps the memory alive (for a shared tensor: its
//! mapping and lease) until the importer calls the deleter, or until it is dropped here.

use std::any::Any;
use std::ffi::c_void;
use std::ptr::NonNull;

use tensorwire_proto::DType;

use crate::error::GpuError;

/// `kDLCPU`: host memory.
pub const KDL_CPU: i32 = 1;
/// `kDLCUDA`: CUDA device memory.
pub const KDL_CUDA: i32 = 2;

/// `DLDevice`: where the data is.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDevice {
    /// [`KDL_CPU`] or [`KDL_CUDA`].
    pub device_type: i32,
    /// The device ordinal in this process.
    pub device_id: i32,
}

/// `DLDataType`: type code, bits, lanes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDataType {
    /// 0 int, 1 uint, 2 float, 4 bfloat, 6 bool.
    pub code: u8,
    /// Bits per element.
    pub bits: u8,
    /// Always 1.
    pub lanes: u16,
}

impl DLDataType {
    /// The DLPack type of `dtype`; FP8 types travel as `uint8` (their bytes), since importers
    /// disagree on FP8 codes. `None` for dtypes newer than this code.
    pub fn of(dtype: DType) -> Option<Self> {
        let (code, bits) = match dtype {
            DType::Bool => (6, 8),
            DType::U8 | DType::F8E4M3 | DType::F8E5M2 => (1, 8),
            DType::I8 => (0, 8),
            DType::U16 => (1, 16),
            DType::I16 => (0, 16),
            DType::U32 => (1, 32),
            DType::I32 => (0, 32),
            DType::U64 => (1, 64),
            DType::I64 => (0, 64),
            DType::F16 => (2, 16),
            DType::BF16 => (4, 16),
            DType::F32 => (2, 32),
            DType::F64 => (2, 64),
            _ => return None,
        };
        Some(Self {
            code,
            bits,
            lanes: 1,
        })
    }
}

/// `DLTensor`: a C-contiguous view (no strides).
#[repr(C)]
#[derive(Debug)]
pub struct DLTensor {
    /// First byte.
    pub data: *mut c_void,
    /// Where it is.
    pub device: DLDevice,
    /// Dimensions.
    pub ndim: i32,
    /// Element type.
    pub dtype: DLDataType,
    /// `ndim` sizes.
    pub shape: *mut i64,
    /// Null: C-contiguous.
    pub strides: *mut i64,
    /// Bytes from `data` to the first element.
    pub byte_offset: u64,
}

/// `DLManagedTensor`: a tensor plus the deleter its importer calls once when done.
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensor {
    /// The tensor.
    pub dl_tensor: DLTensor,
    /// The exporter's state (here: the shape and the owner).
    pub manager_ctx: *mut c_void,
    /// Frees everything; called exactly once.
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// What the managed tensor owns: its shape array and whatever keeps the memory alive.
struct Context {
    shape: Vec<i64>,
    _owner: Box<dyn Any + Send>,
}

unsafe extern "C" fn delete(managed: *mut DLManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: `managed` and its context were made by `Box::into_raw` in `DlpackTensor::new`,
    // and DLPack's contract is that the deleter runs exactly once.
    unsafe {
        let managed = Box::from_raw(managed);
        drop(Box::from_raw(managed.manager_ctx.cast::<Context>()));
    }
}

/// An exported DLPack tensor; dropping it runs the deleter, unless it was handed to an
/// importer with [`into_raw`](Self::into_raw).
pub struct DlpackTensor {
    raw: NonNull<DLManagedTensor>,
}

// SAFETY: the managed tensor is owned by this value alone, and its owner is `Send`.
unsafe impl Send for DlpackTensor {}

impl std::fmt::Debug for DlpackTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DlpackTensor")
            .field("device", &self.tensor().device)
            .field("dtype", &self.tensor().dtype)
            .field("shape", &self.shape())
            .finish()
    }
}

impl DlpackTensor {
    /// A tensor of `dtype` and `shape` at address `data` on `device`; `owner` is dropped when
    /// the importer is done with it.
    ///
    /// # Safety
    ///
    /// `data` must be the address of at least `shape × dtype` bytes on `device` (host memory
    /// for a CPU device), readable and writable by whoever imports the tensor, and `owner`
    /// must keep them so until it is dropped: an importer reads and writes them freely.
    pub unsafe fn new(
        data: u64,
        device: DLDevice,
        dtype: DType,
        shape: &[u64],
        owner: Box<dyn Any + Send>,
    ) -> Result<Self, GpuError> {
        let dl_dtype = DLDataType::of(dtype)
            .ok_or_else(|| GpuError::Bounds(format!("no DLPack type for {dtype}")))?;
        let mut shape: Vec<i64> = shape
            .iter()
            .map(|&d| i64::try_from(d))
            .collect::<Result<_, _>>()
            .map_err(|_| GpuError::Bounds("a dimension exceeds i64".into()))?;
        let ndim = i32::try_from(shape.len())
            .map_err(|_| GpuError::Bounds("too many dimensions".into()))?;
        let shape_ptr = shape.as_mut_ptr();
        let context = Box::into_raw(Box::new(Context {
            shape,
            _owner: owner,
        }));
        let managed = Box::new(DLManagedTensor {
            dl_tensor: DLTensor {
                data: data as usize as *mut c_void,
                device,
                ndim,
                dtype: dl_dtype,
                // Moving the Vec into the context above did not move its heap buffer.
                shape: shape_ptr,
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: context.cast(),
            deleter: Some(delete),
        });
        Ok(Self {
            raw: NonNull::from(Box::leak(managed)),
        })
    }

    /// The tensor's description.
    pub fn tensor(&self) -> &DLTensor {
        // SAFETY: `raw` points to a live managed tensor owned by this value.
        unsafe { &self.raw.as_ref().dl_tensor }
    }

    /// The shape.
    pub fn shape(&self) -> &[i64] {
        // SAFETY: `manager_ctx` is this value's live context, whose shape is never changed.
        unsafe { &(*self.raw.as_ref().manager_ctx.cast::<Context>()).shape }
    }

    /// Hands the managed tensor to an importer (a capsule, a C API), which must call its
    /// deleter exactly once.
    pub fn into_raw(self) -> *mut DLManagedTensor {
        let raw = self.raw.as_ptr();
        std::mem::forget(self);
        raw
    }
}

impl Drop for DlpackTensor {
    fn drop(&mut self) {
        // SAFETY: not handed out (`into_raw` forgets `self`), so the deleter has not run.
        unsafe { delete(self.raw.as_ptr()) }
    }
}

impl crate::buffer::TensorBuffer {
    /// This buffer as a DLPack tensor of `dtype` and row-major `shape` (compact strides,
    /// byte offset 0), with no copy: host bytes as `kDLCPU`, device memory as `kDLCUDA` on
    /// its ordinal. The DLPack tensor owns the buffer; its deleter drops it, so a pooled
    /// buffer goes back to its pool then. `shape` × `dtype` must be the buffer's length.
    ///
    /// Host bytes are exported read-only in spirit: DLPack has no read-only flag, and a
    /// consumer that writes them writes this buffer's memory, which nothing else reads.
    pub fn into_dlpack(self, dtype: DType, shape: &[u64]) -> Result<DlpackTensor, GpuError> {
        let bytes = shape
            .iter()
            .try_fold(dtype.size(), |n, &d| n.checked_mul(d));
        if bytes != Some(self.len() as u64) {
            return Err(GpuError::Bounds(format!(
                "{dtype} {shape:?} is not the buffer's {} bytes",
                self.len()
            )));
        }
        let (data, device) = match &self {
            crate::buffer::TensorBuffer::Host(host) => (
                host.as_ptr() as u64,
                DLDevice {
                    device_type: KDL_CPU,
                    device_id: 0,
                },
            ),
            crate::buffer::TensorBuffer::Cuda(gpu) => (
                gpu.device_ptr(),
                DLDevice {
                    device_type: KDL_CUDA,
                    device_id: i32::try_from(gpu.ordinal())
                        .map_err(|_| GpuError::Bounds("device ordinal exceeds i32".into()))?,
                },
            ),
        };
        // SAFETY: `data` is the first of the buffer's `len` bytes (checked to be `shape` ×
        // `dtype`), on `device`; the buffer is the owner, so they stay valid (host bytes do
        // not move: `Bytes` never reallocates, device memory is held) until the deleter runs.
        unsafe { DlpackTensor::new(data, device, dtype, shape, Box::new(self)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    struct Flag(Arc<AtomicBool>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn the_owner_lives_until_the_deleter_runs() {
        let dropped = Arc::new(AtomicBool::new(false));
        let cpu = DLDevice {
            device_type: KDL_CPU,
            device_id: 0,
        };
        // SAFETY: a made-up address, never read: the test only checks ownership and layout.
        let tensor = unsafe {
            DlpackTensor::new(
                0x1000,
                cpu,
                DType::BF16,
                &[2, 3],
                Box::new(Flag(dropped.clone())),
            )
        }
        .unwrap();
        assert_eq!(tensor.shape(), [2, 3]);
        assert_eq!(tensor.tensor().ndim, 2);
        assert_eq!(
            tensor.tensor().dtype,
            DLDataType {
                code: 4,
                bits: 16,
                lanes: 1
            }
        );
        let raw = tensor.into_raw();
        assert!(!dropped.load(Ordering::SeqCst), "handed out, still owned");
        // SAFETY: the importer's side of the contract: call the deleter once.
        unsafe { ((*raw).deleter.unwrap())(raw) };
        assert!(dropped.load(Ordering::SeqCst));
    }

    #[test]
    fn dropping_an_unexported_tensor_releases_its_owner() {
        let dropped = Arc::new(AtomicBool::new(false));
        let cuda = DLDevice {
            device_type: KDL_CUDA,
            device_id: 0,
        };
        // SAFETY: never exported to an importer, so the address is never read.
        let unexported = unsafe {
            DlpackTensor::new(
                0,
                cuda,
                DType::F8E4M3,
                &[4],
                Box::new(Flag(dropped.clone())),
            )
        };
        drop(unexported.unwrap());
        assert!(dropped.load(Ordering::SeqCst));
        // SAFETY: refused before anything is built.
        let too_big = unsafe { DlpackTensor::new(0, cuda, DType::U8, &[u64::MAX], Box::new(())) };
        assert!(too_big.is_err());
    }
}
