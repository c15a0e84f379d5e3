//! A connection to a producer's sharing socket: connect, list and open tensors.

use std::ffi::{c_char, c_int};

use tensorwire_ipc::ShareClient;

#[cfg(doc)] // Named in the docs.
use crate::boundary::tw_string_free;
use crate::boundary::{c_string, fail, guarded, ipc_failure, string};
use crate::{TW_ERR_ARGUMENT, TW_OK};

/// A connection to a producer's sharing socket.
pub struct tw_client {
    pub(crate) client: ShareClient,
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
