//! Where an endpoint's work runs (`TransportSettings::endpoint_threads`): a tensor's sink
//! runs on its endpoint's own thread, or on the caller's runtime, and from its first large
//! payload on the receiver's runtime where `ReceiverConfig::store_offload` says; the threads
//! end once the receiver and senders are gone.
#![allow(clippy::unwrap_used)]

mod common;

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use tensorwire_quic::proto::{ErrorCode, Payload};
use tensorwire_quic::{
    ACCEPTING_THREAD, CONNECTING_THREAD, CreditPermit, EndpointThreads, Receiver, Sender,
    SenderConfig, Sink, SinkError, StoreOffload, TransportError, TransportSettings,
};

/// The name of the thread of a receiver's first endpoint.
const RECEIVING_THREAD_0: &str = "tensorwire-rx-0";

/// The tests of this binary count endpoint threads: they run one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Records the thread and length of each payload it stores; fails the store at
/// `fail_at`, if any; holds its first store until `gate` gives a permit, if set.
struct PayloadThreadSink {
    stores: Arc<Mutex<Vec<(String, usize)>>>,
    fail_at: Option<usize>,
    gate: Option<Arc<tokio::sync::Semaphore>>,
}

impl Sink for PayloadThreadSink {
    type Output = ();

    async fn store(
        &mut self,
        _: u64,
        payload: Payload,
        permit: CreditPermit,
        crc: Option<&mut u32>,
    ) -> Result<(), SinkError> {
        if let Some(gate) = self.gate.take() {
            let _open = gate.acquire().await;
        }
        let name = std::thread::current().name().unwrap_or("").to_owned();
        let mut stores = self.stores.lock().unwrap();
        stores.push((name, payload.len()));
        if Some(stores.len()) == self.fail_at {
            return Err(SinkError::failed("the test's sink fails here"));
        }
        payload.continue_crc(crc);
        drop(permit);
        Ok(())
    }

    async fn finish(self) -> Result<(), SinkError> {
        Ok(())
    }
}

fn transport(threads: EndpointThreads) -> TransportSettings {
    let mut settings = TransportSettings::jumbo();
    settings.endpoint_threads = threads;
    settings
}

/// A receiver of `endpoints` endpoints and a sender connected to it, all on `threads`.
async fn receiver_and_sender(threads: EndpointThreads, endpoints: usize) -> (Receiver, Sender) {
    let mut config = receiver_config();
    config.transport = transport(threads);
    config.endpoints = endpoints;
    let (rx, addr) = receiver(config).await;
    let tx = Sender::connect(addr, {
        let mut config = SenderConfig::new(tensorwire_quic::ClientTls::Development);
        config.transport = transport(threads);
        config.binding = common::test_binding();
        config
    })
    .await
    .unwrap();
    (rx, tx)
}

/// Sends one 3 MiB tensor from a sender on `threads` to a one-endpoint receiver on
/// `threads`; returns the threads its bytes were stored on.
async fn stored_on(threads: EndpointThreads) -> Vec<String> {
    let _serial = SERIAL.lock().await;
    let (mut rx, tx) = receiver_and_sender(threads, 1).await;
    let len = 3 << 20;
    let send = tx.send(u8_meta("t", len), pattern(len, 7));
    let stores = Arc::new(Mutex::new(Vec::new()));
    let handle = rx.next().await.unwrap().accept(PayloadThreadSink {
        stores: stores.clone(),
        fail_at: None,
        gate: None,
    });
    send.finished().await.unwrap();
    handle.finished().await.unwrap();
    tx.close().await;
    rx.close().await;
    let seen: Vec<String> = stores
        .lock()
        .unwrap()
        .iter()
        .map(|(t, _)| t.clone())
        .collect();
    assert!(!seen.is_empty());
    seen
}

/// Threads of this process whose name starts with `prefix` (Linux names them in /proc).
fn threads_named(prefix: &str) -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|task| std::fs::read_to_string(task.path().join("comm")).ok())
        .filter(|comm| comm.trim_end().starts_with(prefix))
        .count()
}

#[tokio::test]
async fn a_tensor_lands_on_its_endpoints_own_thread() {
    let one = EndpointThreads::Own(NonZeroUsize::MIN);
    for name in stored_on(one).await {
        assert_eq!(name, RECEIVING_THREAD_0);
    }
}

#[tokio::test]
async fn on_the_callers_runtime_a_tensor_lands_on_its_threads() {
    let test_thread = std::thread::current().name().unwrap_or("").to_owned();
    for name in stored_on(EndpointThreads::Caller).await {
        // A current-thread test runtime: everything runs on the test's own thread.
        assert_eq!(name, test_thread);
    }
}

#[tokio::test]
async fn endpoint_threads_end_with_their_endpoints() {
    if !std::path::Path::new("/proc/self/task").exists() {
        eprintln!("SKIPPED: no /proc/self/task to count threads in");
        return;
    }
    let _serial = SERIAL.lock().await;
    let two = EndpointThreads::Own(NonZeroUsize::new(2).unwrap());
    let (mut rx, tx) = receiver_and_sender(two, 3).await;
    // Each endpoint's runtime thread and its two workers carry its side's name (Linux keeps
    // 15 characters of it): the receiver's three endpoints accept, the sender's connects.
    assert!(threads_named(ACCEPTING_THREAD) >= 3 * 2);
    assert!(threads_named(CONNECTING_THREAD) >= 2);
    let send = tx.send(u8_meta("t", 1000), pattern(1000, 1));
    land_host(rx.next().await.unwrap()).await;
    send.finished().await.unwrap();
    tx.close().await;
    rx.close().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let endpoint_threads = || threads_named(ACCEPTING_THREAD) + threads_named(CONNECTING_THREAD);
    while endpoint_threads() > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} endpoint threads still running",
            endpoint_threads()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn endpoint_threads_parse_from_the_command_line() {
    assert_eq!(
        "caller".parse::<EndpointThreads>().unwrap(),
        EndpointThreads::Caller
    );
    assert_eq!(
        "3".parse::<EndpointThreads>().unwrap(),
        EndpointThreads::Own(NonZeroUsize::new(3).unwrap())
    );
    assert!("0".parse::<EndpointThreads>().is_err());
    assert!("many".parse::<EndpointThreads>().is_err());
}

/// Outside any tokio runtime, an endpoint of its own starts (it brings its runtime); one on
/// the caller's runtime is refused with an error that says so, not a panic.
#[test]
fn endpoints_outside_a_runtime() {
    let _serial = SERIAL.blocking_lock();
    let addr = "127.0.0.1:0".parse().unwrap();
    let own = transport(EndpointThreads::default()).endpoint(addr, None);
    assert!(own.is_ok(), "{:?}", own.err());
    drop(own);
    let err = transport(EndpointThreads::Caller)
        .endpoint(addr, None)
        .unwrap_err();
    assert!(err.to_string().contains("inside a tokio runtime"), "{err}");
}

/// Sends one 6 MiB tensor (1 MiB DATA frames, then a 4 KiB one) to a one-endpoint receiver
/// storing large payloads as `offload` says, from this multi-thread runtime; returns where
/// each payload was stored and how the tensor ended on both sides.
async fn stores_with(
    offload: StoreOffload,
    fail_at: Option<usize>,
) -> (Vec<(String, usize)>, Result<(), TransportError>) {
    let _serial = SERIAL.lock().await;
    let mut config = receiver_config();
    config.endpoints = 1;
    config.store_offload = offload;
    let (mut rx, addr) = receiver(config).await;
    let tx = sender(addr).await;
    let len = (6 << 20) + 4096;
    let send = tx.send(u8_meta("t", len), pattern(len, 9));
    let stores = Arc::new(Mutex::new(Vec::new()));
    let handle = rx.next().await.unwrap().accept(PayloadThreadSink {
        stores: stores.clone(),
        fail_at,
        gate: None,
    });
    let received = handle.finished().await.map(drop);
    let sent = send.finished().await.map(drop);
    assert_eq!(received.is_ok(), sent.is_ok(), "{received:?} / {sent:?}");
    // Every byte's credit came back, however the tensor ended (the connection's early credit
    // stays offered while it lives).
    let budget = rx.budget();
    assert_eq!(
        (budget.in_flight - budget.early_offered, budget.held),
        (0, 0),
        "{budget:?}"
    );
    tx.close().await;
    rx.close().await;
    let stores = stores.lock().unwrap().clone();
    (stores, sent)
}

/// From its first large payload on, a tensor's payloads are stored off the endpoint's
/// thread, the small last one too, in the order they came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_payloads_are_stored_off_the_endpoints_thread_when_asked() {
    let (stores, sent) = stores_with(StoreOffload::UpTo(NonZeroUsize::MIN), None).await;
    sent.unwrap();
    let lengths: Vec<usize> = stores.iter().map(|(_, n)| *n).collect();
    let mut expected = vec![1 << 20; 6];
    expected.push(4096);
    assert_eq!(lengths, expected, "stored in order");
    for (thread, len) in &stores {
        assert_ne!(thread, RECEIVING_THREAD_0, "{len} bytes");
    }
}

/// While a payload is stored off the endpoint's thread, the stream goes on being read: the
/// DATA behind it is counted as arrived and frees credit, so the sender gets past the
/// tensor's window (granted-but-unarrived bytes) before that store ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_is_read_on_while_a_store_off_its_thread_runs() {
    let _serial = SERIAL.lock().await;
    let mut config = receiver_config();
    config.endpoints = 1;
    config.store_offload = StoreOffload::UpTo(NonZeroUsize::MIN);
    let window = config.session.stream_window;
    let (mut rx, addr) = receiver(config).await;
    let tx = sender(addr).await;
    let len = 32 << 20;
    let send = tx.send(u8_meta("t", len), pattern(len, 4));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let handle = rx.next().await.unwrap().accept(PayloadThreadSink {
        stores: Arc::default(),
        fail_at: None,
        gate: Some(gate.clone()),
    });
    let waited = tokio::time::timeout(Duration::from_secs(10), async {
        while send.sent_bytes() <= window {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    let sent_while_held = send.sent_bytes();
    gate.add_permits(1);
    assert!(
        waited.is_ok(),
        "the sender stopped at {sent_while_held} bytes, the window being {window}"
    );
    handle.finished().await.unwrap();
    send.finished().await.unwrap();
    assert_budget_returned(&rx).await;
    tx.close().await;
    rx.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_stores_on_the_endpoints_thread() {
    let (stores, sent) = stores_with(StoreOffload::Never, None).await;
    sent.unwrap();
    for (thread, len) in stores {
        assert_eq!(thread, RECEIVING_THREAD_0, "{len} bytes");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_failing_off_the_endpoints_thread_reaches_the_sender() {
    let (stores, sent) = stores_with(StoreOffload::UpTo(NonZeroUsize::MIN), Some(2)).await;
    assert_ne!(stores[1].0, RECEIVING_THREAD_0);
    let err = sent.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::SINK_FAILED), "{err}");
    assert!(
        err.to_string().contains("the test's sink fails here"),
        "{err}"
    );
}
