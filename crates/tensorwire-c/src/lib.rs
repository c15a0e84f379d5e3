//! The C ABI of tensorwire's local sharing (spec/ipc.md). As a consumer, a C or C++ process
//! connects to a receiver's sharing socket, lists, waits for and opens tensors (host memory
//! as a pointer, GPU memory as a device pointer on this process's ordinal), writes them in
//! place, and watches names for updates. As a producer, it shares its own host or GPU
//! tensors (a LibTorch process's, in PyTorch's own memory) on a socket of its own. The header
//! is `include/tensorwire.h` (cbindgen).
//!
//! Conventions: functions return 0 on success and a negative `TW_ERR_*` code on failure, with
//! the reason for the calling thread in [`tw_last_error`]. Objects are opaque pointers freed
//! by their own function; strings the library returns are freed with [`tw_string_free`].
//! No function panics across the boundary.

#![allow(
    unsafe_code,
    reason = "a C ABI: raw pointers cross it; each block says why it is sound"
)]
#![allow(non_camel_case_types)] // The C names of the types: tw_client, tw_share, tw_release_fn, …

use std::ffi::c_int;

mod boundary;
mod client;
mod producer;
mod tensor;
mod watch;

pub use boundary::{tw_last_error, tw_string_free};
pub use client::{tw_client, tw_client_close, tw_connect, tw_list_json};
pub use producer::{
    tw_release_fn, tw_share, tw_share_delete, tw_share_publish_device, tw_share_publish_host,
    tw_share_start, tw_share_stop,
};
pub use tensor::{
    tw_open, tw_tensor, tw_tensor_byte_len, tw_tensor_device_ordinal, tw_tensor_device_ptr,
    tw_tensor_dtype, tw_tensor_generation, tw_tensor_host_ptr, tw_tensor_name, tw_tensor_ndim,
    tw_tensor_read, tw_tensor_release, tw_tensor_shape, tw_tensor_write,
};
pub use watch::{tw_watch, tw_watch_close, tw_watch_next, tw_watch_start};

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
