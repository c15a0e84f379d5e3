//! Watching names under a prefix for publications, updates and deletions.

use std::ffi::{c_char, c_int};
use std::time::Duration;

use tensorwire_ipc::Watch;

use crate::boundary::{c_string, fail, guarded, ipc_failure, string};
use crate::client::tw_client;
use crate::{TW_ERR_ARGUMENT, TW_OK, TW_TIMEOUT};
#[cfg(doc)] // Named in the docs.
use crate::{boundary::tw_string_free, client::tw_connect};

/// A stream of events for names under a prefix.
pub struct tw_watch {
    pub(crate) watch: Watch,
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
