//! The C ABI of tensorwire's sharing consumer (spec/ipc.md): a C or C++ process connects to
//! a receiver's sharing socket, lists, waits for and opens tensors (host memory as a pointer,
//! GPU memory as a device pointer on this process's ordinal), writes them in place, and
//! watches names for updates. The header is `include/tensorwire.h` (cbindgen).
//!
//! Conventions: functions return 0 on success and a negative `TW_ERR_*` code on failure, with
//! the reason for the calling thread in [`tw_last_error`]. Objects are opaque pointers freed
//! by their own function; strings the library returns are freed with [`tw_string_free`].
//! No function panics across the boundary.

#![allow(
    unsafe_code,
    reason = "a C ABI: raw pointers cross it; each block says why it is sound"
)]
#![allow(non_camel_case_types)] // The C names of the opaque types: tw_client, tw_tensor, tw_watch.

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;
use std::time::Duration;

use tensorwire_ipc::{IpcError, ShareClient, SharedTensor, Watch};

/// Success.
pub const TW_OK: c_int = 0;
/// No event arrived before the timeout ([`tw_watch_next`]).
pub const TW_TIMEOUT: c_int = 1;
/// A pointer argument was NULL or a string was not UTF-8.
pub const TW_ERR_ARGUMENT: c_int = -1;
/// The socket could not be reached or the connection broke.
pub const TW_ERR_CONNECT: c_int = -2;
/// The producer refused the request (the message starts with its code, e.g. `not_found`).
pub const TW_ERR_REFUSED: c_int = -3;
/// A CUDA call or a mapping failed.
pub const TW_ERR_MEMORY: c_int = -4;
/// Offsets or lengths outside the tensor.
pub const TW_ERR_RANGE: c_int = -5;
/// A fault inside the library (a bug): the call was stopped.
pub const TW_ERR_INTERNAL: c_int = -6;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_error(message: impl Into<String>) {
    let text = message.into().replace('\0', " ");
    let text = CString::new(text).unwrap_or_default();
    LAST_ERROR.with(|last| *last.borrow_mut() = text);
}

fn fail(code: c_int, message: impl Into<String>) -> c_int {
    set_error(message);
    code
}

fn ipc_failure(e: &IpcError) -> c_int {
    let code = match e {
        IpcError::Refused { .. } => TW_ERR_REFUSED,
        IpcError::Connect(_) | IpcError::Closed | IpcError::Io(_) => TW_ERR_CONNECT,
        IpcError::Gpu(_) | IpcError::NoCuda(_) => TW_ERR_MEMORY,
        _ => TW_ERR_INTERNAL,
    };
    fail(code, e.to_string())
}

/// Runs `body`, turning a panic into [`TW_ERR_INTERNAL`] (unwinding into C is undefined).
fn guarded(body: impl FnOnce() -> c_int) -> c_int {
    catch_unwind(AssertUnwindSafe(body))
        .unwrap_or_else(|_| fail(TW_ERR_INTERNAL, "tensorwire: internal fault (a panic)"))
}

/// The string at `text`, if it is non-NULL UTF-8.
///
/// # Safety
/// `text` is NULL or a NUL-terminated string that stays valid during the call.
unsafe fn string<'a>(text: *const c_char) -> Option<&'a str> {
    if text.is_null() {
        return None;
    }
    // SAFETY: non-NULL, and the caller promises a NUL-terminated string.
    unsafe { CStr::from_ptr(text) }.to_str().ok()
}

/// Hands `text` to C; free it with [`tw_string_free`].
fn c_string(text: String) -> *mut c_char {
    CString::new(text.replace('\0', " "))
        .map(CString::into_raw)
        .unwrap_or(ptr::null_mut())
}

/// A connection to a producer's sharing socket.
pub struct tw_client {
    client: ShareClient,
}

/// A mapped tensor under a lease.
pub struct tw_tensor {
    tensor: SharedTensor,
    name: CString,
    dtype: CString,
    shape: Vec<u64>,
}

/// A stream of events for names under a prefix.
pub struct tw_watch {
    watch: Watch,
}

/// The reason the calling thread's last call failed (empty if none); valid until its next
/// call. Never NULL.
#[unsafe(no_mangle)]
pub extern "C" fn tw_last_error() -> *const c_char {
    LAST_ERROR.with(|last| last.borrow().as_ptr())
}

/// Frees a string the library returned. NULL is ignored.
///
/// # Safety
/// `text` is NULL or a string from this library, not freed before.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_string_free(text: *mut c_char) {
    if !text.is_null() {
        // SAFETY: the caller passes a string made by `CString::into_raw` here, once.
        drop(unsafe { CString::from_raw(text) });
    }
}

/// Connects to the sharing socket at `socket_path` and stores the client in `*out`.
///
/// # Safety
/// `socket_path` is a NUL-terminated string; `out` points to writable storage for a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_connect(socket_path: *const c_char, out: *mut *mut tw_client) -> c_int {
    guarded(|| {
        // SAFETY: the caller's contract.
        let Some(path) = (unsafe { string(socket_path) }) else {
            return fail(TW_ERR_ARGUMENT, "socket_path is NULL or not UTF-8");
        };
        if out.is_null() {
            return fail(TW_ERR_ARGUMENT, "out is NULL");
        }
        match ShareClient::connect(path) {
            Ok(client) => {
                // SAFETY: `out` is non-NULL and writable (the caller's contract).
                unsafe { *out = Box::into_raw(Box::new(tw_client { client })) };
                TW_OK
            }
            Err(e) => ipc_failure(&e),
        }
    })
}

/// Closes a client. Tensors opened through it must be released first. NULL is ignored.
///
/// # Safety
/// `client` is NULL or from [`tw_connect`], not closed before.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_client_close(client: *mut tw_client) {
    if !client.is_null() {
        // SAFETY: made by `Box::into_raw` in `tw_connect`, freed once, here.
        drop(unsafe { Box::from_raw(client) });
    }
}

/// Every shared tensor as a JSON array (spec/ipc.md `Info`: name, dtype, shape, attributes,
/// device, generation, ...) in `*json_out`; free it with [`tw_string_free`].
///
/// # Safety
/// `client` is from [`tw_connect`]; `json_out` points to writable storage for a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_list_json(client: *mut tw_client, json_out: *mut *mut c_char) -> c_int {
    guarded(|| {
        // SAFETY: the caller's contract: a live client or NULL.
        let Some(client) = (unsafe { client.as_ref() }) else {
            return fail(TW_ERR_ARGUMENT, "client is NULL");
        };
        if json_out.is_null() {
            return fail(TW_ERR_ARGUMENT, "json_out is NULL");
        }
        match client.client.list() {
            Ok(list) => {
                let json = serde_json::to_string(&list).unwrap_or_default();
                // SAFETY: non-NULL and writable (the caller's contract).
                unsafe { *json_out = c_string(json) };
                TW_OK
            }
            Err(e) => ipc_failure(&e),
        }
    })
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

/// Starts watching names that start with `prefix` ("" for all) on a connection of its own.
///
/// # Safety
/// `client` is from [`tw_connect`]; `prefix` is a NUL-terminated string; `out` points to
/// writable storage for a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_watch_start(
    client: *mut tw_client,
    prefix: *const c_char,
    out: *mut *mut tw_watch,
) -> c_int {
    guarded(|| {
        // SAFETY: the caller's contract.
        let (Some(client), Some(prefix)) = (unsafe { client.as_ref() }, unsafe { string(prefix) })
        else {
            return fail(
                TW_ERR_ARGUMENT,
                "client or prefix is NULL, or prefix is not UTF-8",
            );
        };
        if out.is_null() {
            return fail(TW_ERR_ARGUMENT, "out is NULL");
        }
        match client.client.watch(prefix) {
            Ok(watch) => {
                // SAFETY: non-NULL and writable (the caller's contract).
                unsafe { *out = Box::into_raw(Box::new(tw_watch { watch })) };
                TW_OK
            }
            Err(e) => ipc_failure(&e),
        }
    })
}

/// Waits up to `timeout_ms` (negative: forever) for the next event and stores it as JSON
/// (`{"event":"published"|"updated"|"deleted","tensor":{...}}`) in `*event_json`; free it
/// with [`tw_string_free`]. Returns [`TW_TIMEOUT`] if none came.
///
/// # Safety
/// `watch` is from [`tw_watch_start`]; `event_json` points to writable storage for a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_watch_next(
    watch: *mut tw_watch,
    timeout_ms: i64,
    event_json: *mut *mut c_char,
) -> c_int {
    guarded(|| {
        // SAFETY: the caller's contract.
        let Some(watch) = (unsafe { watch.as_mut() }) else {
            return fail(TW_ERR_ARGUMENT, "watch is NULL");
        };
        if event_json.is_null() {
            return fail(TW_ERR_ARGUMENT, "event_json is NULL");
        }
        let timeout = u64::try_from(timeout_ms)
            .ok()
            .map(|ms| Duration::from_millis(ms.max(1)));
        match watch.watch.next_timeout(timeout) {
            Ok(Some(event)) => {
                let json = serde_json::to_string(&event).unwrap_or_default();
                // SAFETY: non-NULL and writable (the caller's contract).
                unsafe { *event_json = c_string(json) };
                TW_OK
            }
            Ok(None) => TW_TIMEOUT,
            Err(e) => ipc_failure(&e),
        }
    })
}

/// Ends a watch. NULL is ignored.
///
/// # Safety
/// `watch` is NULL or from [`tw_watch_start`], not closed before.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_watch_close(watch: *mut tw_watch) {
    if !watch.is_null() {
        // SAFETY: made by `Box::into_raw` in `tw_watch_start`, freed once, here.
        drop(unsafe { Box::from_raw(watch) });
    }
}
