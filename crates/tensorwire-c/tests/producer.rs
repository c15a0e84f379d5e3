//! The producer half of the C ABI, called as a C program would: a host tensor published
//! through it is read by a consumer, names are replaced and deleted, and the memory a
//! device publication lends is released exactly once, here where no GPU can take it.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.
#![allow(unsafe_code, reason = "calling the C ABI as C does")]

use std::ffi::{CStr, CString, c_void};
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};

use tensorwire_c::{
    TW_ERR_ARGUMENT, TW_ERR_MEMORY, TW_ERR_REFUSED, TW_OK, tw_last_error, tw_share,
    tw_share_delete, tw_share_publish_device, tw_share_publish_host, tw_share_start, tw_share_stop,
};
use tensorwire_ipc::ShareClient;

fn last_error() -> String {
    // SAFETY: never NULL, valid until this thread's next call.
    unsafe { CStr::from_ptr(tw_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn c(text: &str) -> CString {
    CString::new(text).unwrap()
}

fn start(dir: &std::path::Path) -> *mut tw_share {
    let socket = c(dir.join("share").join("share.sock").to_str().unwrap());
    let mut share = ptr::null_mut();
    // SAFETY: valid strings and out-pointer.
    let started = unsafe { tw_share_start(socket.as_ptr(), ptr::null(), &mut share) };
    assert_eq!(started, TW_OK, "{}", last_error());
    share
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("tensorwire-c-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `tw_share_publish_host` of an F32 [2, 3] named `name` from `values`, claiming `len`
/// bytes: its return code and the generation it reported (0 if none).
fn publish_f32_2x3(share: *mut tw_share, name: &CStr, values: &[u8], len: u64) -> (i32, u64) {
    assert!(len as usize <= values.len());
    let (f32, shape, mut generation) = (c("F32"), [2u64, 3], 0);
    let (key, value) = (c("revision"), c("7"));
    let attributes = [key.as_ptr(), value.as_ptr()];
    // SAFETY: a live service (the caller's), valid strings, 2 dims, one attribute pair,
    // `len` readable bytes, a writable u64.
    let code = unsafe {
        tw_share_publish_host(
            share,
            name.as_ptr(),
            f32.as_ptr(),
            shape.as_ptr(),
            2,
            attributes.as_ptr(),
            1,
            values.as_ptr().cast(),
            len,
            &mut generation,
        )
    };
    (code, generation)
}

#[test]
fn a_host_tensor_published_from_c_is_read_by_a_consumer_and_replaced_by_name() {
    let dir = temp_dir("producer");
    let share = start(&dir);
    let name = c("weights");
    let values: Vec<u8> = (0..24).collect();
    let published = publish_f32_2x3(share, &name, &values, 24);
    assert_eq!(published, (TW_OK, 1), "{}", last_error());
    let client = ShareClient::connect(dir.join("share").join("share.sock")).unwrap();
    let tensor = client.open("weights").unwrap();
    assert_eq!(tensor.read_to_vec().unwrap(), values);
    assert_eq!(tensor.descriptor().tensor.shape, [2, 3]);
    assert_eq!(
        tensor
            .descriptor()
            .tensor
            .attributes
            .get("revision")
            .map(String::as_str),
        Some("7"),
        "the producer's attributes reach consumers"
    );
    drop(tensor);
    // Again under the same name: the next generation.
    let again = publish_f32_2x3(share, &name, &values, 24);
    assert_eq!(again, (TW_OK, 2), "{}", last_error());
    // Bytes that disagree with the shape are refused, naming both.
    let (short, _) = publish_f32_2x3(share, &name, &values, 20);
    assert_eq!(short, TW_ERR_ARGUMENT);
    assert!(
        last_error().contains("20 bytes for a 24-byte tensor"),
        "{}",
        last_error()
    );
    // SAFETY: a live service and a valid string.
    assert_eq!(unsafe { tw_share_delete(share, name.as_ptr()) }, TW_OK);
    assert!(client.open("weights").is_err(), "deleted");
    // SAFETY: as above.
    let again = unsafe { tw_share_delete(share, name.as_ptr()) };
    assert_eq!(again, TW_ERR_REFUSED, "a name no longer shared");
    // SAFETY: from tw_share_start, stopped once.
    unsafe { tw_share_stop(share) };
    drop(client);
    std::fs::remove_dir_all(dir).unwrap();
}

static RELEASED: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C" fn count_release(context: *mut c_void) {
    assert_eq!(context as usize, 0x5eed, "the context given back");
    RELEASED.fetch_add(1, Ordering::SeqCst);
}

/// Without a GPU (or with a pointer that is no device memory) a device publication fails
/// with TW_ERR_MEMORY, and the memory it lent is released at once, exactly once.
#[test]
fn a_device_publication_that_fails_releases_what_it_lent_once() {
    if tensorwire_gpu::GpuStatus::detect().is_available() {
        // A GPU here would make the bogus pointer a driver error instead: same outcome.
        eprintln!("note: a GPU is present; the pointer below is still not device memory");
    }
    let dir = temp_dir("producer-device");
    let share = start(&dir);
    let (name, f32) = (c("gpu"), c("F32"));
    let shape = [4u64];
    // SAFETY: a live service, valid strings, 1 dim; the device pointer is bogus on purpose
    // and is never dereferenced on the host.
    let published = unsafe {
        tw_share_publish_device(
            share,
            name.as_ptr(),
            f32.as_ptr(),
            shape.as_ptr(),
            1,
            ptr::null(),
            0,
            0x1000,
            16,
            0,
            Some(count_release),
            0x5eed as *mut c_void,
            ptr::null_mut(),
        )
    };
    assert_eq!(published, TW_ERR_MEMORY, "{}", last_error());
    assert!(!last_error().is_empty());
    assert_eq!(RELEASED.load(Ordering::SeqCst), 1, "released once, at once");
    // SAFETY: from tw_share_start, stopped once.
    unsafe { tw_share_stop(share) };
    assert_eq!(RELEASED.load(Ordering::SeqCst), 1, "and never again");
    std::fs::remove_dir_all(dir).unwrap();
}
