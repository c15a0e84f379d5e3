//! What crosses the C boundary besides the objects: the calling thread's last error, panics
//! stopped at the boundary, and strings both ways.

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char, c_int};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;

use tensorwire_ipc::IpcError;

use crate::{TW_ERR_CONNECT, TW_ERR_INTERNAL, TW_ERR_MEMORY, TW_ERR_REFUSED};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

pub(crate) fn set_error(message: impl Into<String>) {
    let text = message.into().replace('\0', " ");
    let text = CString::new(text).unwrap_or_default();
    LAST_ERROR.with(|last| *last.borrow_mut() = text);
}

pub(crate) fn fail(code: c_int, message: impl Into<String>) -> c_int {
    set_error(message);
    code
}

pub(crate) fn ipc_failure(e: &IpcError) -> c_int {
    let code = match e {
        IpcError::Refused { .. } => TW_ERR_REFUSED,
        IpcError::Connect(_) | IpcError::Closed | IpcError::Io(_) => TW_ERR_CONNECT,
        IpcError::Gpu(_) | IpcError::NoCuda(_) => TW_ERR_MEMORY,
        _ => TW_ERR_INTERNAL,
    };
    fail(code, e.to_string())
}

/// Runs `body`, turning a panic into [`TW_ERR_INTERNAL`] (unwinding into C is undefined).
pub(crate) fn guarded(body: impl FnOnce() -> c_int) -> c_int {
    catch_unwind(AssertUnwindSafe(body))
        .unwrap_or_else(|_| fail(TW_ERR_INTERNAL, "tensorwire: internal fault (a panic)"))
}

/// The string at `text`, if it is non-NULL UTF-8.
///
/// # Safety
/// `text` is NULL or a NUL-terminated string that stays valid during the call.
pub(crate) unsafe fn string<'a>(text: *const c_char) -> Option<&'a str> {
    if text.is_null() {
        return None;
    }
    // SAFETY: non-NULL, and the caller promises a NUL-terminated string.
    unsafe { CStr::from_ptr(text) }.to_str().ok()
}

/// Hands `text` to C; free it with [`tw_string_free`].
pub(crate) fn c_string(text: String) -> *mut c_char {
    CString::new(text.replace('\0', " "))
        .map(CString::into_raw)
        .unwrap_or(ptr::null_mut())
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
