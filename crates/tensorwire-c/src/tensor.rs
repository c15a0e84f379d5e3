//! A tensor opened under a lease: what it is, where its bytes are, reads and writes.

use std::ffi::{CString, c_char, c_int, c_void};
use std::ptr;
use std::time::Duration;

use tensorwire_ipc::{IpcError, SharedTensor};

use crate::boundary::{fail, guarded, ipc_failure, string};
use crate::client::tw_client;
#[cfg(doc)] // Named in the docs.
use crate::client::tw_connect;
use crate::{TW_ERR_ARGUMENT, TW_ERR_INTERNAL, TW_ERR_RANGE, TW_OK};

/// A mapped tensor under a lease.
pub struct tw_tensor {
    pub(crate) tensor: SharedTensor,
    pub(crate) name: CString,
    pub(crate) dtype: CString,
    pub(crate) shape: Vec<u64>,
}

/// Opens the tensor `name` (or id) under a lease, waiting up to `wait_ms` milliseconds for a
/// name not yet shared (0: no wait), and stores it in `*out`. GPU memory is mapped on this
/// process's GPU with the producer's device UUID.
///
/// # Safety
/// `client` is from [`tw_connect`]; `name` is a NUL-terminated string; `out` points to
/// writable storage for a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_open(
    client: *mut tw_client,
    name: *const c_char,
    wait_ms: u64,
    out: *mut *mut tw_tensor,
) -> c_int {
    guarded(|| {
        // SAFETY: the caller's contract.
        let (Some(client), Some(name)) = (unsafe { client.as_ref() }, unsafe { string(name) })
        else {
            return fail(
                TW_ERR_ARGUMENT,
                "client or name is NULL, or name is not UTF-8",
            );
        };
        if out.is_null() {
            return fail(TW_ERR_ARGUMENT, "out is NULL");
        }
        let opened = if wait_ms == 0 {
            client.client.open(name)
        } else {
            client
                .client
                .open_wait(name, Duration::from_millis(wait_ms))
        };
        let tensor = match opened {
            Ok(tensor) => tensor,
            Err(e) => return ipc_failure(&e),
        };
        let fields = &tensor.descriptor().tensor;
        let (Ok(name), Ok(dtype)) = (
            CString::new(fields.name.clone()),
            CString::new(fields.dtype.clone()),
        ) else {
            return fail(TW_ERR_INTERNAL, "a name with a NUL byte");
        };
        let shape = fields.shape.clone();
        let handle = tw_tensor {
            tensor,
            name,
            dtype,
            shape,
        };
        // SAFETY: non-NULL and writable (the caller's contract).
        unsafe { *out = Box::into_raw(Box::new(handle)) };
        TW_OK
    })
}

/// Unmaps a tensor and ends its lease. NULL is ignored. Pointers from it are invalid after.
///
/// # Safety
/// `tensor` is NULL or from [`tw_open`], not released before.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_tensor_release(tensor: *mut tw_tensor) {
    if !tensor.is_null() {
        // SAFETY: made by `Box::into_raw` in `tw_open`, freed once, here.
        drop(unsafe { Box::from_raw(tensor) });
    }
}

/// # Safety
/// `tensor` is NULL or a live tensor from [`tw_open`].
unsafe fn tensor_ref<'a>(tensor: *const tw_tensor) -> Option<&'a tw_tensor> {
    // SAFETY: the caller's contract.
    unsafe { tensor.as_ref() }
}

/// The tensor's name, valid until it is released (NULL for a NULL tensor).
///
/// # Safety
/// `tensor` is NULL or a live tensor from [`tw_open`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_tensor_name(tensor: *const tw_tensor) -> *const c_char {
    // SAFETY: the caller's contract.
    unsafe { tensor_ref(tensor) }.map_or(ptr::null(), |t| t.name.as_ptr())
}

/// The dtype's name as in spec/protocol.md §5.1 ("F32", "BF16", ...), valid until released.
///
/// # Safety
/// `tensor` is NULL or a live tensor from [`tw_open`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_tensor_dtype(tensor: *const tw_tensor) -> *const c_char {
    // SAFETY: the caller's contract.
    unsafe { tensor_ref(tensor) }.map_or(ptr::null(), |t| t.dtype.as_ptr())
}

/// The number of dimensions.
///
/// # Safety
/// `tensor` is NULL or a live tensor from [`tw_open`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_tensor_ndim(tensor: *const tw_tensor) -> usize {
    // SAFETY: the caller's contract.
    unsafe { tensor_ref(tensor) }.map_or(0, |t| t.shape.len())
}

/// The shape: `tw_tensor_ndim` values, valid until released (row-major, C-contiguous).
///
/// # Safety
/// `tensor` is NULL or a live tensor from [`tw_open`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_tensor_shape(tensor: *const tw_tensor) -> *const u64 {
    // SAFETY: the caller's contract.
    unsafe { tensor_ref(tensor) }.map_or(ptr::null(), |t| t.shape.as_ptr())
}

/// Bytes of the tensor.
///
/// # Safety
/// `tensor` is NULL or a live tensor from [`tw_open`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_tensor_byte_len(tensor: *const tw_tensor) -> u64 {
    // SAFETY: the caller's contract.
    unsafe { tensor_ref(tensor) }.map_or(0, |t| t.tensor.descriptor().tensor.byte_len)
}

/// The name's generation when opened: 1 when first shared, one more per update.
///
/// # Safety
/// `tensor` is NULL or a live tensor from [`tw_open`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_tensor_generation(tensor: *const tw_tensor) -> u64 {
    // SAFETY: the caller's contract.
    unsafe { tensor_ref(tensor) }.map_or(0, |t| t.tensor.descriptor().tensor.generation)
}

/// The host address of the tensor's first byte, writable (the producer sees writes); NULL
/// for a GPU tensor.
///
/// # Safety
/// `tensor` is NULL or a live tensor from [`tw_open`]; the memory is valid until it is
/// released.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_tensor_host_ptr(tensor: *mut tw_tensor) -> *mut c_void {
    // SAFETY: the caller's contract.
    match unsafe { tensor.as_mut() } {
        Some(t) => t
            .tensor
            .host_bytes_mut()
            .map_or(ptr::null_mut(), |bytes| bytes.as_mut_ptr().cast()),
        None => ptr::null_mut(),
    }
}

/// The device address of the tensor's first byte on [`tw_tensor_device_ordinal`]'s GPU (in
/// the device's primary context); 0 for a host tensor.
///
/// # Safety
/// `tensor` is NULL or a live tensor from [`tw_open`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_tensor_device_ptr(tensor: *const tw_tensor) -> u64 {
    // SAFETY: the caller's contract.
    unsafe { tensor_ref(tensor) }
        .and_then(|t| t.tensor.device_ptr())
        .map_or(0, |(ptr, _)| ptr)
}

/// This process's ordinal of the GPU holding the tensor; -1 for a host tensor.
///
/// # Safety
/// `tensor` is NULL or a live tensor from [`tw_open`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_tensor_device_ordinal(tensor: *const tw_tensor) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { tensor_ref(tensor) }
        .and_then(|t| t.tensor.device_ptr())
        .map_or(-1, |(_, device)| {
            c_int::try_from(device.ordinal()).unwrap_or(-1)
        })
}

/// Copies `len` bytes of the tensor from byte `offset` into `dst` (from the GPU for a GPU
/// tensor).
///
/// # Safety
/// `tensor` is a live tensor from [`tw_open`]; `dst` points to `len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_tensor_read(
    tensor: *const tw_tensor,
    offset: u64,
    dst: *mut c_void,
    len: usize,
) -> c_int {
    guarded(|| {
        // SAFETY: the caller's contract.
        let Some(t) = (unsafe { tensor_ref(tensor) }) else {
            return fail(TW_ERR_ARGUMENT, "tensor is NULL");
        };
        if dst.is_null() && len > 0 {
            return fail(TW_ERR_ARGUMENT, "dst is NULL");
        }
        let bytes = match t.tensor.read_to_vec() {
            Ok(bytes) => bytes,
            Err(e) => return ipc_failure(&e),
        };
        let Some(part) = usize::try_from(offset)
            .ok()
            .and_then(|start| bytes.get(start..start.checked_add(len)?))
        else {
            return fail(
                TW_ERR_RANGE,
                format!("{len} bytes at {offset} of a {}-byte tensor", bytes.len()),
            );
        };
        // SAFETY: `dst` has room for `len` bytes (the caller's contract); `part` is `len`
        // bytes of our own vector, which does not overlap it.
        unsafe { ptr::copy_nonoverlapping(part.as_ptr(), dst.cast::<u8>(), len) };
        TW_OK
    })
}

/// Overwrites the whole tensor with `len` bytes at `src` (`len` must be its byte length):
/// the producer and other consumers see the write.
///
/// # Safety
/// `tensor` is a live tensor from [`tw_open`]; `src` points to `len` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_tensor_write(
    tensor: *mut tw_tensor,
    src: *const c_void,
    len: usize,
) -> c_int {
    guarded(|| {
        // SAFETY: the caller's contract.
        let Some(t) = (unsafe { tensor.as_mut() }) else {
            return fail(TW_ERR_ARGUMENT, "tensor is NULL");
        };
        if src.is_null() && len > 0 {
            return fail(TW_ERR_ARGUMENT, "src is NULL");
        }
        let bytes = if len == 0 {
            &[][..]
        } else {
            // SAFETY: `src` points to `len` readable bytes (the caller's contract).
            unsafe { std::slice::from_raw_parts(src.cast::<u8>(), len) }
        };
        match t.tensor.write_from(bytes) {
            Ok(()) => TW_OK,
            Err(IpcError::BadMessage(why)) => fail(TW_ERR_RANGE, why),
            Err(e) => ipc_failure(&e),
        }
    })
}
