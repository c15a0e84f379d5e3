//! Publishing tensors from C or C++ (spec/ipc.md): a process (a LibTorch program, a C
//! inference engine) shares its own host or GPU tensors on a socket, as `receiver --share`
//! shares received ones, and other local processes map them with no copy.

use std::ffi::{c_char, c_int, c_void};

use tensorwire_gpu::DeviceRange;
use tensorwire_ipc::{OnExisting, PublishedTensor, ShareConfig, ShareService};
use tensorwire_proto::{DType, TensorMeta};

use crate::boundary::{fail, guarded, ipc_failure, string};
use crate::{TW_ERR_ARGUMENT, TW_ERR_MEMORY, TW_OK};

/// A sharing socket this process publishes tensors on.
pub struct tw_share {
    service: ShareService,
}

/// Called once the memory a publication lent is no longer used (the name was replaced or
/// deleted and the last consumer's lease ended, or publishing failed): free it then.
pub type tw_release_fn = Option<unsafe extern "C" fn(context: *mut c_void)>;

/// The caller's memory, kept until the publication and every lease let go; then `release`.
struct Lent {
    release: tw_release_fn,
    context: *mut c_void,
}

// SAFETY: the caller of `tw_share_publish_device` promises that `release` may be called
// with `context` from any thread, once; nothing else touches `context`.
unsafe impl Send for Lent {}
// SAFETY: `Lent` is never read through a shared reference; only its `Drop` uses it.
unsafe impl Sync for Lent {}

impl Drop for Lent {
    fn drop(&mut self) {
        if let Some(release) = self.release {
            // SAFETY: the caller's contract: `release(context)` may run once, on any thread.
            unsafe { release(self.context) };
        }
    }
}

/// Starts sharing on the Unix socket `socket_path` (its directory is made mode 0700; a
/// stale socket of a process that is gone is replaced) and stores the service in `*out`.
/// `on_existing` says what a name published again does: `"replace"` (NULL: the default;
/// consumers of the old tensor keep it until they release it), `"in-place"` (its bytes are
/// copied into the memory shared already) or `"reject"`.
///
/// # Safety
/// `socket_path` is a NUL-terminated string, `on_existing` NULL or one; `out` points to
/// writable storage for a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_share_start(
    socket_path: *const c_char,
    on_existing: *const c_char,
    out: *mut *mut tw_share,
) -> c_int {
    guarded(|| {
        // SAFETY: the caller's contract.
        let Some(path) = (unsafe { string(socket_path) }) else {
            return fail(TW_ERR_ARGUMENT, "socket_path is NULL or not UTF-8");
        };
        if out.is_null() {
            return fail(TW_ERR_ARGUMENT, "out is NULL");
        }
        let mut config = ShareConfig::default();
        if !on_existing.is_null() {
            // SAFETY: the caller's contract.
            let Some(policy) = (unsafe { string(on_existing) }) else {
                return fail(TW_ERR_ARGUMENT, "on_existing is not UTF-8");
            };
            match policy.parse::<OnExisting>() {
                Ok(policy) => config.on_existing = policy,
                Err(e) => return fail(TW_ERR_ARGUMENT, format!("on_existing {policy:?}: {e}")),
            }
        }
        match ShareService::start(path, config) {
            Ok(service) => {
                // SAFETY: `out` is non-NULL and writable (the caller's contract).
                unsafe { *out = Box::into_raw(Box::new(tw_share { service })) };
                TW_OK
            }
            Err(e) => ipc_failure(&e),
        }
    })
}

/// Stops sharing: the socket is removed and no new consumer connects. Tensors consumers
/// hold stay mapped until they release them (their memory is released then). NULL is
/// ignored.
///
/// # Safety
/// `share` is NULL or from [`tw_share_start`], not stopped before.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_share_stop(share: *mut tw_share) {
    if !share.is_null() {
        // SAFETY: made by `Box::into_raw` in `tw_share_start`, freed once, here.
        drop(unsafe { Box::from_raw(share) });
    }
}

/// The tensor `name` of `dtype` (spec §5.1's names: `"F32"`, `"BF16"`, …) and `shape`
/// (`ndim` dimensions), with `attribute_count` attributes, checked against `len` bytes.
///
/// # Safety
/// `name` and `dtype` are NUL-terminated strings; `shape` points to `ndim` values (or is
/// NULL with `ndim` 0); `attributes` to `2 × attribute_count` strings (or is NULL with a
/// count of 0).
unsafe fn describe(
    name: *const c_char,
    dtype: *const c_char,
    shape: *const u64,
    ndim: usize,
    (attributes, attribute_count): (*const *const c_char, usize),
    len: u64,
) -> Result<TensorMeta, c_int> {
    // SAFETY: the caller's contract.
    let (Some(name), Some(dtype)) = (unsafe { string(name) }, unsafe { string(dtype) }) else {
        return Err(fail(TW_ERR_ARGUMENT, "name or dtype is NULL or not UTF-8"));
    };
    let Some(dtype) = DType::from_name_any_case(dtype) else {
        return Err(fail(
            TW_ERR_ARGUMENT,
            format!("dtype {dtype:?} is not one of spec §5.1"),
        ));
    };
    if shape.is_null() && ndim != 0 {
        return Err(fail(TW_ERR_ARGUMENT, "shape is NULL"));
    }
    let dims = if ndim == 0 {
        Vec::new()
    } else {
        // SAFETY: non-NULL and `ndim` values long (the caller's contract).
        unsafe { std::slice::from_raw_parts(shape, ndim) }.to_vec()
    };
    let mut meta = TensorMeta::new(dims, dtype)
        .map_err(|e| fail(TW_ERR_ARGUMENT, format!("{name}: {e}")))?
        .with_name(name);
    if attributes.is_null() && attribute_count != 0 {
        return Err(fail(TW_ERR_ARGUMENT, "attributes is NULL"));
    }
    for i in 0..attribute_count {
        // SAFETY: `2 × attribute_count` string pointers (the caller's contract).
        let (key, value) = unsafe { (*attributes.add(2 * i), *attributes.add(2 * i + 1)) };
        // SAFETY: each a NUL-terminated string (the caller's contract).
        let (Some(key), Some(value)) = (unsafe { string(key) }, unsafe { string(value) }) else {
            return Err(fail(
                TW_ERR_ARGUMENT,
                format!("{name}: attribute {i} is NULL or not UTF-8"),
            ));
        };
        meta = meta.with_attribute(key, value);
    }
    if meta.byte_len() != len {
        return Err(fail(
            TW_ERR_ARGUMENT,
            format!("{name}: {len} bytes for a {}-byte tensor", meta.byte_len()),
        ));
    }
    Ok(meta)
}

/// What both publications share: the service, the tensor's description, `publish` with
/// them, and the generation written back.
///
/// # Safety
/// As [`describe`]; `share` is NULL or from [`tw_share_start`]; `generation` is NULL or
/// writable.
#[allow(clippy::too_many_arguments)] // The C call's own arguments, passed through once.
unsafe fn publish_with(
    share: *mut tw_share,
    name: *const c_char,
    dtype: *const c_char,
    shape: *const u64,
    ndim: usize,
    attributes: (*const *const c_char, usize),
    len: u64,
    generation: *mut u64,
    publish: impl FnOnce(&ShareService, &TensorMeta) -> Result<PublishedTensor, c_int>,
) -> c_int {
    // SAFETY: the caller's contract: a live service or NULL.
    let Some(share) = (unsafe { share.as_ref() }) else {
        return fail(TW_ERR_ARGUMENT, "share is NULL");
    };
    // SAFETY: the caller's contract.
    let meta = match unsafe { describe(name, dtype, shape, ndim, attributes, len) } {
        Ok(meta) => meta,
        Err(code) => return code,
    };
    match publish(&share.service, &meta) {
        Ok(published) => {
            if !generation.is_null() {
                // SAFETY: non-NULL and writable (the caller's contract).
                unsafe { *generation = published.generation() };
            }
            TW_OK
        }
        Err(code) => code,
    }
}

/// Publishes `len` bytes of host memory at `data` as the tensor `name` of `dtype` and
/// `shape`, with `attribute_count` attributes (`attributes` holds key, value, key, value, …:
/// a WAV's `sample_rate`, a model revision), copied once into shared memory (the caller
/// keeps its buffer). A name published again is updated by the service's policy
/// ([`tw_share_start`]'s `on_existing`). Stores the name's generation (1 when first
/// published) in `*generation` if it is not NULL.
///
/// # Safety
/// `share` is from [`tw_share_start`]; `name` and `dtype` are NUL-terminated strings;
/// `shape` points to `ndim` values; `attributes` to `2 × attribute_count` NUL-terminated
/// strings (or is NULL with a count of 0); `data` to `len` readable bytes; `generation` is
/// NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_share_publish_host(
    share: *mut tw_share,
    name: *const c_char,
    dtype: *const c_char,
    shape: *const u64,
    ndim: usize,
    attributes: *const *const c_char,
    attribute_count: usize,
    data: *const c_void,
    len: u64,
    generation: *mut u64,
) -> c_int {
    let attributes = (attributes, attribute_count);
    let publish = |service: &ShareService, meta: &TensorMeta| {
        let Ok(len) = usize::try_from(len) else {
            return Err(fail(TW_ERR_ARGUMENT, "len is past the address space"));
        };
        if data.is_null() && len != 0 {
            return Err(fail(TW_ERR_ARGUMENT, "data is NULL"));
        }
        let bytes = if len == 0 {
            &[][..]
        } else {
            // SAFETY: non-NULL and `len` readable bytes for the call (the caller's contract).
            unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }
        };
        service
            .publish_host(meta, bytes)
            .map_err(|e| ipc_failure(&e))
    };
    // SAFETY: the caller's contract.
    guarded(|| unsafe {
        publish_with(
            share, name, dtype, shape, ndim, attributes, len, generation, publish,
        )
    })
}

/// Publishes `len` bytes of GPU memory at `device_ptr` on CUDA device `device` (this
/// process's ordinal) as the tensor `name` of `dtype` and `shape`, with attributes as
/// [`tw_share_publish_host`] takes them, with no copy: consumers
/// map the `cudaMalloc` allocation it lies in (so a tensor a framework's caching allocator
/// carved out of a larger block works, and the block's other bytes are mapped too) and see
/// each other's writes. The memory must stay allocated until `release(context)` is called
/// (once: when the name was replaced or deleted and the last consumer let go, or when
/// publishing fails); `release` may be NULL. VMM memory (`cuMemCreate`, such as PyTorch's
/// expandable segments) is refused with `TW_ERR_MEMORY`. Queue no more writes to the memory
/// before publishing: consumers read it as it is.
///
/// # Safety
/// As [`tw_share_publish_host`]; `device_ptr..device_ptr + len` is device memory of
/// `device`'s primary context (the CUDA runtime's) that stays allocated until `release`;
/// `release` may be called with `context` from any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_share_publish_device(
    share: *mut tw_share,
    name: *const c_char,
    dtype: *const c_char,
    shape: *const u64,
    ndim: usize,
    attributes: *const *const c_char,
    attribute_count: usize,
    device_ptr: u64,
    len: u64,
    device: c_int,
    release: tw_release_fn,
    context: *mut c_void,
    generation: *mut u64,
) -> c_int {
    // Released on every path that does not publish.
    let lent = Lent { release, context };
    let attributes = (attributes, attribute_count);
    let publish = move |service: &ShareService, meta: &TensorMeta| {
        let (Ok(ordinal), Ok(len)) = (usize::try_from(device), usize::try_from(len)) else {
            return Err(fail(
                TW_ERR_ARGUMENT,
                "device is negative or len past the address space",
            ));
        };
        if device_ptr == 0 {
            return Err(fail(TW_ERR_ARGUMENT, "device_ptr is 0"));
        }
        // SAFETY: the caller's contract: live device memory of that device's primary
        // context, kept allocated until `lent` (the range's owner) releases it.
        let range = unsafe { DeviceRange::new(ordinal, device_ptr, len, lent) }
            .map_err(|e| fail(TW_ERR_MEMORY, format!("{}: {e}", meta.name())))?;
        service
            .publish_range(meta, &range)
            .map_err(|e| ipc_failure(&e))
    };
    // SAFETY: the caller's contract.
    guarded(move || unsafe {
        publish_with(
            share, name, dtype, shape, ndim, attributes, len, generation, publish,
        )
    })
}

/// Unshares `name`: new opens fail; consumers holding it keep it until they release it.
/// Returns [`TW_OK`], or `TW_ERR_REFUSED` for a name not shared.
///
/// # Safety
/// `share` is from [`tw_share_start`]; `name` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_share_delete(share: *mut tw_share, name: *const c_char) -> c_int {
    guarded(|| {
        // SAFETY: the caller's contract.
        let (Some(share), Some(name)) = (unsafe { share.as_ref() }, unsafe { string(name) }) else {
            return fail(
                TW_ERR_ARGUMENT,
                "share or name is NULL, or name is not UTF-8",
            );
        };
        match share.service.delete(name) {
            Ok(_) => TW_OK,
            Err(e) => ipc_failure(&e),
        }
    })
}
