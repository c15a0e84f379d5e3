//! Handing landed tensors to a server's own code: DLPack export of any buffer, destinations
//! registered by name (spec §9.4), and on a GPU typed cudarc views, the landing event and
//! an early hand-off. Without a GPU the host paths run and the GPU tests print why they
//! skipped; with `TENSORWIRE_REQUIRE_GPU=1` a missing GPU fails.
#![allow(
    unsafe_code,
    reason = "reads DLPack's raw pointers and runs cuBLAS on landed memory"
)]
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tensorwire_gpu::dlpack::{DLManagedTensor, KDL_CPU};
use tensorwire_gpu::{
    Destinations, DeviceRequest, GpuRequirement, Landed, Placement, TensorBuffer,
};
use tensorwire_proto::testing::pattern;
use tensorwire_proto::{DType, ErrorCode, Payload, TensorMeta};
use tensorwire_quic::{Receiver, ReceiverConfig, Sender, SenderConfig, TransportError};
use tensorwire_sink::{CreditPermit, Sink};

/// What a DLPack consumer sees, read from the raw struct the way one would read it.
#[derive(Debug, PartialEq)]
struct Imported {
    data: u64,
    device: (i32, i32),
    shape: Vec<i64>,
    strides_null: bool,
    byte_offset: u64,
    dtype: (u8, u8, u16),
}

/// A minimal DLPack importer: reads the tensor's description, then calls its deleter.
fn import_and_delete(raw: *mut DLManagedTensor, read: impl FnOnce(u64, usize)) -> Imported {
    // SAFETY: `raw` came from `DlpackTensor::into_raw` and is used once, deleted below.
    let managed = unsafe { &*raw };
    let t = &managed.dl_tensor;
    let ndim = usize::try_from(t.ndim).unwrap();
    // SAFETY: DLPack: `shape` points to `ndim` i64s while the tensor lives.
    let shape = unsafe { std::slice::from_raw_parts(t.shape, ndim) }.to_vec();
    let imported = Imported {
        data: t.data as u64,
        device: (t.device.device_type, t.device.device_id),
        shape,
        strides_null: t.strides.is_null(),
        byte_offset: t.byte_offset,
        dtype: (t.dtype.code, t.dtype.bits, t.dtype.lanes),
    };
    let elements: i64 = imported.shape.iter().product();
    read(
        imported.data,
        elements as usize * (t.dtype.bits as usize / 8),
    );
    let deleter = managed.deleter.unwrap();
    // SAFETY: the consumer is done; the deleter is called exactly once.
    unsafe { deleter(raw) };
    imported
}

/// Host bytes whose owner says when it is dropped.
struct Watched(Vec<u8>, Arc<AtomicBool>);

impl AsRef<[u8]> for Watched {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        self.1.store(true, Ordering::SeqCst);
    }
}

#[test]
fn a_host_buffer_exports_as_dlpack_with_no_copy_and_its_deleter_frees_it() {
    let bytes: Vec<u8> = (0..24u8).collect();
    let dropped = Arc::new(AtomicBool::new(false));
    let host = Bytes::from_owner(Watched(bytes.clone(), dropped.clone()));
    let address = host.as_ptr() as u64;
    let tensor = TensorBuffer::Host(host)
        .into_dlpack(DType::F32, &[2, 3])
        .unwrap();
    let mut seen = Vec::new();
    let imported = import_and_delete(tensor.into_raw(), |data, len| {
        // SAFETY: a kDLCPU tensor's `data` points to its `len` bytes until the deleter runs.
        seen = unsafe { std::slice::from_raw_parts(data as *const u8, len) }.to_vec();
        assert!(!dropped.load(Ordering::SeqCst), "freed while imported");
    });
    assert_eq!(
        imported,
        Imported {
            data: address,
            device: (KDL_CPU, 0),
            shape: vec![2, 3],
            strides_null: true,
            byte_offset: 0,
            dtype: (2, 32, 1),
        }
    );
    assert_eq!(seen, bytes, "the importer reads the buffer's own bytes");
    assert!(
        dropped.load(Ordering::SeqCst),
        "the deleter dropped the buffer"
    );
}

#[test]
fn dlpack_export_refuses_a_shape_that_is_not_the_buffer() {
    let err = TensorBuffer::cpu_zeros(24)
        .into_dlpack(DType::F32, &[5])
        .unwrap_err();
    assert!(err.to_string().contains("24 bytes"), "{err}");
    let overflow = TensorBuffer::cpu_zeros(8).into_dlpack(DType::F64, &[u64::MAX, 2]);
    assert!(overflow.is_err());
}

fn f32_meta(name: &str, shape: &[u64]) -> TensorMeta {
    TensorMeta::new(shape.to_vec(), DType::F32)
        .unwrap()
        .with_name(name)
}

fn payload(bytes: &[u8]) -> Payload {
    let mut payload = Payload::default();
    payload.push(Bytes::copy_from_slice(bytes));
    payload
}

#[test]
fn registration_refuses_memory_that_is_not_the_shape() {
    let destinations = Destinations::new();
    let err = destinations
        .register_host("w", DType::F32, &[2, 3], Arc::new(Mutex::new(vec![0; 20])))
        .unwrap_err();
    assert!(err.to_string().contains("20 bytes"), "{err}");
    assert!(!destinations.contains("w"));
}

#[tokio::test]
async fn a_busy_destination_makes_the_next_tensor_of_its_name_wait_then_refuses_it() {
    let destinations = Destinations::new();
    let memory = Arc::new(Mutex::new(vec![0u8; 16]));
    destinations
        .register_host("kv", DType::F32, &[4], memory.clone())
        .unwrap();
    let host = Placement::choose(DeviceRequest::Host, GpuRequirement::Preferred).unwrap();
    let meta = f32_meta("kv", &[4]);
    let wait = Duration::from_millis(50);
    let mut first = destinations
        .claim(&meta, &host, wait)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.device_ptr(), None);
    let busy = destinations.claim(&meta, &host, wait).await.unwrap_err();
    assert_eq!(busy.code, ErrorCode::RESOURCE_EXHAUSTED, "{busy}");
    assert!(busy.message.contains("still landing"), "{busy}");
    first
        .write(0, payload(&[7; 16]), CreditPermit::unbudgeted(16))
        .await
        .unwrap();
    #[allow(irrefutable_let_patterns)] // Without the `cuda` feature only `Host` exists.
    let Landed::Host(landed) = first.finish().await.unwrap() else {
        panic!("a host destination lands in host memory");
    };
    assert!(Arc::ptr_eq(&landed, &memory), "the caller's own memory");
    assert_eq!(*memory.lock().unwrap(), vec![7; 16]);
    // Free again once the first finished; an unregistered name is placed as usual.
    assert!(
        destinations
            .claim(&meta, &host, wait)
            .await
            .unwrap()
            .is_some()
    );
    let other = f32_meta("other", &[4]);
    assert!(
        destinations
            .claim(&other, &host, wait)
            .await
            .unwrap()
            .is_none()
    );
    assert!(destinations.unregister("kv"));
    assert!(
        destinations
            .claim(&meta, &host, wait)
            .await
            .unwrap()
            .is_none()
    );
}

/// Runs a receiver that lands tensors of registered names in their destinations and the
/// rest through `placement`; returns each send's outcome, in order.
async fn send_to_destinations(
    destinations: &Destinations,
    placement: &Placement,
    tensors: Vec<(TensorMeta, Vec<u8>)>,
) -> Vec<Result<(), TransportError>> {
    let config = ReceiverConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        tensorwire_quic::ServerTls::Development,
    );
    let mut receiver = Receiver::bind(config).await.unwrap();
    let addr = receiver.local_addr().unwrap();
    let (destinations, placement) = (destinations.clone(), placement.clone());
    let count = tensors.len();
    let server = tokio::spawn(async move {
        for _ in 0..count {
            let incoming = receiver.next().await.unwrap();
            let wait = Duration::from_secs(5);
            match destinations.claim(incoming.meta(), &placement, wait).await {
                Ok(Some(sink)) => {
                    let _ = incoming.accept(sink).finished().await;
                }
                Ok(None) => {
                    let sink = placement.sink(incoming.meta()).unwrap();
                    let _ = incoming.accept(sink).finished().await;
                }
                Err(e) => incoming.reject(e.code, e.message),
            }
        }
        receiver
    });
    let sender = Sender::connect(
        addr,
        SenderConfig::new(tensorwire_quic::ClientTls::Development),
    )
    .await
    .unwrap();
    let mut outcomes = Vec::new();
    // One at a time, so each outcome is known before the next tensor is admitted.
    for (meta, bytes) in tensors {
        outcomes.push(
            sender
                .send(meta, Bytes::from(bytes))
                .finished()
                .await
                .map(|_| ()),
        );
    }
    let receiver = server.await.unwrap();
    assert_eq!(
        receiver.host_memory().reserved,
        0,
        "registered memory is the application's: nothing was reserved for it"
    );
    sender.close().await;
    receiver.close().await;
    outcomes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_destination_refuses_other_shapes_and_dtypes_and_lands_its_own_in_place() {
    let destinations = Destinations::new();
    let weights = Arc::new(Mutex::new(vec![0u8; 24]));
    destinations
        .register_host("w", DType::F32, &[2, 3], weights.clone())
        .unwrap();
    let host = Placement::choose(DeviceRequest::Host, GpuRequirement::Preferred).unwrap();
    let new_weights = pattern(24, 9);
    let f16 = TensorMeta::new([2, 3], DType::F16).unwrap().with_name("w");
    let outcomes = send_to_destinations(
        &destinations,
        &host,
        vec![
            (f32_meta("w", &[3, 2]), vec![1; 24]),
            (f16, vec![1; 12]),
            (f32_meta("w", &[2, 3]), new_weights.clone()),
            (f32_meta("unregistered", &[2]), vec![3; 8]),
        ],
    )
    .await;
    for (outcome, wrong) in outcomes[..2].iter().zip(["F32 [3, 2]", "F16 [2, 3]"]) {
        let err = outcome.as_ref().unwrap_err();
        assert_eq!(err.code(), Some(ErrorCode::DESTINATION_MISMATCH), "{err}");
        let text = err.to_string();
        assert!(
            text.contains(wrong) && text.contains("F32 [2, 3]"),
            "the sender is told both shapes: {text}"
        );
    }
    assert!(outcomes[2].is_ok(), "{:?}", outcomes[2]);
    assert!(outcomes[3].is_ok(), "{:?}", outcomes[3]);
    assert_eq!(
        *weights.lock().unwrap(),
        new_weights,
        "the matching tensor landed in the registered memory"
    );
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use tensorwire_gpu::cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
    use tensorwire_gpu::cudarc::driver::{CudaContext, CudaStream, DevicePtr};
    use tensorwire_gpu::dlpack::KDL_CUDA;
    use tensorwire_gpu::{GpuError, GpuSinkFactory, TensorSink, gpus_or_skip};

    fn gpu_placement() -> (Placement, GpuSinkFactory) {
        let placement =
            Placement::choose(DeviceRequest::Cuda(0), GpuRequirement::Required).unwrap();
        let Placement::Gpu(gpu) = &placement else {
            panic!("a GPU was required");
        };
        let gpu = gpu.clone();
        (placement, gpu)
    }

    fn server_stream() -> Arc<CudaStream> {
        CudaContext::new(0).unwrap().new_stream().unwrap()
    }

    /// Lands `bytes` through `sink` in 1 MiB DATA frames, as a receiver would.
    async fn land<S: Sink>(mut sink: S, bytes: &[u8]) -> S::Output {
        for (i, chunk) in bytes.chunks(1 << 20).enumerate() {
            let permit = CreditPermit::unbudgeted(chunk.len() as u64);
            sink.write((i << 20) as u64, payload(chunk), permit)
                .await
                .unwrap();
        }
        sink.finish().await.unwrap()
    }

    fn floats(n: usize, seed: u64) -> Vec<f32> {
        pattern(n, seed)
            .into_iter()
            .map(|b| f32::from(b) / 128.0 - 1.0)
            .collect()
    }

    fn le_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_landed_f32_matrix_is_a_cudarc_slice_for_a_cublas_gemm() {
        if gpus_or_skip("a_landed_f32_matrix_is_a_cudarc_slice_for_a_cublas_gemm").is_none() {
            return;
        }
        let (placement, gpu) = gpu_placement();
        let (m, k, n) = (384usize, 256usize, 128usize);
        let (a, b) = (floats(m * k, 1), floats(k * n, 2));
        let a_meta = f32_meta("a", &[m as u64, k as u64]);
        let b_meta = f32_meta("b", &[k as u64, n as u64]);
        let landed_a = land(placement.sink(&a_meta).unwrap(), &le_bytes(&a)).await;
        let landed_b = land(placement.sink(&b_meta).unwrap(), &le_bytes(&b)).await;
        let (TensorBuffer::Cuda(a_gpu), TensorBuffer::Cuda(b_gpu)) = (landed_a, landed_b) else {
            panic!("a GPU placement lands on the GPU");
        };
        let stream = server_stream();
        let wrong = a_gpu.as_slice::<u8>(DType::F32, &stream).unwrap_err();
        assert!(matches!(wrong, GpuError::WrongType { .. }), "{wrong}");
        // A tensor packed inside a buffer, at its offset: row 2 of A.
        let row = a_gpu
            .as_slice_of::<f32>(DType::F32, 2 * k * 4..3 * k * 4, &stream)
            .unwrap();
        assert_eq!(stream.clone_dtoh(&*row).unwrap(), a[2 * k..3 * k]);
        assert!(
            a_gpu.as_slice_of::<f32>(DType::F32, 2..6, &stream).is_err(),
            "misaligned"
        );
        drop(row);
        let a_view = a_gpu.as_slice::<f32>(DType::F32, &stream).unwrap();
        let b_view = b_gpu.as_slice::<f32>(DType::F32, &stream).unwrap();
        assert_eq!(a_view.device_ptr(&stream).0, a_gpu.device_ptr(), "no copy");
        let mut c = stream.alloc_zeros::<f32>(m * n).unwrap();
        // cuBLAS is column-major: row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ.
        let config = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_N,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: n as i32,
            n: m as i32,
            k: k as i32,
            alpha: 1.0f32,
            lda: n as i32,
            ldb: k as i32,
            beta: 0.0f32,
            ldc: n as i32,
        };
        let blas = CudaBlas::new(stream.clone()).unwrap();
        // SAFETY: the slices hold k·n, m·k and m·n f32s, as the configuration says.
        unsafe { blas.gemm(config, &*b_view, &*a_view, &mut c) }.unwrap();
        let c_host = stream.clone_dtoh(&c).unwrap();
        for row in 0..m {
            for col in 0..n {
                let expected: f64 = (0..k)
                    .map(|i| f64::from(a[row * k + i]) * f64::from(b[i * n + col]))
                    .sum();
                let got = f64::from(c_host[row * n + col]);
                assert!(
                    (got - expected).abs() <= 1e-3 * (1.0 + expected.abs()),
                    "C[{row}][{col}] = {got}, CPU reference {expected}"
                );
            }
        }
        // Views and buffers gone, their streams done: every pool buffer is back.
        drop((a_view, b_view, a_gpu, b_gpu));
        stream.synchronize().unwrap();
        assert_eq!(gpu.memory_stats().in_use_buffers, 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stream_ordered_after_the_landing_event_reads_every_byte_before_the_sink_finished() {
        let test =
            "a_stream_ordered_after_the_landing_event_reads_every_byte_before_the_sink_finished";
        if gpus_or_skip(test).is_none() {
            return;
        }
        let (placement, gpu) = gpu_placement();
        let len = 512usize << 20;
        let bytes = pattern(len, 77);
        let meta = TensorMeta::new([len as u64], DType::U8)
            .unwrap()
            .with_name("big");
        let TensorSink::Gpu(mut sink) = placement.sink(&meta).unwrap() else {
            panic!("a GPU placement lands on the GPU");
        };
        sink.poison(0xAB).unwrap();
        let handoff = sink.handoff();
        let address = sink.destination_ptr();
        let writer = tokio::spawn({
            let bytes = bytes.clone();
            async move { land(sink, &bytes).await }
        });
        // Ready before the hand-off, so the copy is queued the moment it comes, while the
        // last staging copies (up to the staging pool's 128 MiB) still run.
        let stream = server_stream();
        let mut copy = stream.alloc_zeros::<u8>(len).unwrap();
        stream.synchronize().unwrap();
        let early = handoff.landed().await.unwrap();
        // No host wait from here until the read-back: the view's stream waits on the device.
        let view = early.as_slice::<u8>(DType::U8, &stream).unwrap();
        stream.memcpy_dtod(&*view, &mut copy).unwrap();
        assert_eq!(early.device_ptr(), address);
        let finished_first = writer.is_finished();
        let landed_first = early.has_landed();
        eprintln!(
            "copy queued with the sink finished: {finished_first}, bytes landed: {landed_first}"
        );
        let read = stream.clone_dtoh(&copy).unwrap();
        assert!(
            read == bytes,
            "the stream read bytes that had not landed yet"
        );
        let finished = writer.await.unwrap();
        assert_eq!(finished.device_ptr(), address);
        drop((view, early, finished));
        stream.synchronize().unwrap();
        assert_eq!(gpu.memory_stats().in_use_buffers, 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tensor_dropped_before_its_end_is_never_handed_over() {
        if gpus_or_skip("a_tensor_dropped_before_its_end_is_never_handed_over").is_none() {
            return;
        }
        let (placement, gpu) = gpu_placement();
        let meta = TensorMeta::new([8 << 20], DType::U8)
            .unwrap()
            .with_name("cut");
        let TensorSink::Gpu(mut sink) = placement.sink(&meta).unwrap() else {
            panic!("a GPU placement lands on the GPU");
        };
        let handoff = sink.handoff();
        let half = pattern(4 << 20, 3);
        sink.write(
            0,
            payload(&half),
            CreditPermit::unbudgeted(half.len() as u64),
        )
        .await
        .unwrap();
        drop(sink); // Cancelled mid-tensor.
        let refused = handoff.landed().await.unwrap_err();
        assert!(matches!(refused, GpuError::NoHandoff(_)), "{refused}");
        // Its copy in flight let go of the destination too: the buffer is back in the pool.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while gpu.memory_stats().in_use_buffers != 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the buffer never came back"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_registered_device_destination_lands_at_its_address_with_no_other_allocation() {
        let test = "a_registered_device_destination_lands_at_its_address_with_no_other_allocation";
        if gpus_or_skip(test).is_none() {
            return;
        }
        let (placement, gpu) = gpu_placement();
        let stream = server_stream();
        let (rows, cols) = (1024usize, 1024usize);
        let weights = Arc::new(stream.alloc_zeros::<f32>(rows * cols).unwrap());
        let address = weights.device_ptr(&stream).0;
        let destinations = Destinations::new();
        destinations
            .register_cuda_slice("weights", &[rows as u64, cols as u64], weights.clone())
            .unwrap();
        let before = gpu.memory_stats();
        let values = floats(rows * cols, 5);
        let meta = f32_meta("weights", &[rows as u64, cols as u64]);
        let sink = destinations
            .claim(&meta, &placement, Duration::from_secs(1))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(sink.device_ptr(), Some(address));
        let Landed::Device(landed) = land(sink, &le_bytes(&values)).await else {
            panic!("a device destination lands on the device");
        };
        assert_eq!(
            landed.device_ptr(),
            address,
            "exactly the registered address"
        );
        landed.wait_on(&stream).unwrap();
        assert_eq!(stream.clone_dtoh(&*weights).unwrap(), values);
        let after = gpu.memory_stats();
        assert_eq!(
            (
                after.hits,
                after.misses,
                after.in_use_buffers,
                after.pool_bytes
            ),
            (
                before.hits,
                before.misses,
                before.in_use_buffers,
                before.pool_bytes
            ),
            "no device memory was allocated for it"
        );
        let mismatch = f32_meta("weights", &[cols as u64, rows as u64 + 1]);
        let refused = destinations
            .claim(&mismatch, &placement, Duration::from_secs(1))
            .await
            .err()
            .unwrap();
        assert_eq!(refused.code, ErrorCode::DESTINATION_MISMATCH);
        drop(landed);
        // Dropping the landing freed nothing: the application's slice is still its own.
        assert_eq!(stream.clone_dtoh(&*weights).unwrap(), values);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_gpu_buffer_exports_as_dlpack_and_goes_back_to_its_pool_on_delete() {
        let test = "a_gpu_buffer_exports_as_dlpack_and_goes_back_to_its_pool_on_delete";
        if gpus_or_skip(test).is_none() {
            return;
        }
        let (placement, gpu) = gpu_placement();
        let values = floats(4096, 8);
        let meta = f32_meta("x", &[64, 64]);
        let landed = land(placement.sink(&meta).unwrap(), &le_bytes(&values)).await;
        let TensorBuffer::Cuda(buffer) = &landed else {
            panic!("a GPU placement lands on the GPU");
        };
        let (address, in_use) = (buffer.device_ptr(), gpu.memory_stats().in_use_buffers);
        assert_eq!(in_use, 1);
        let tensor = landed.into_dlpack(DType::F32, &[64, 64]).unwrap();
        let stream = server_stream();
        let mut seen = Vec::new();
        let imported = import_and_delete(tensor.into_raw(), |data, len| {
            assert_eq!(gpu.memory_stats().in_use_buffers, 1, "held while imported");
            // SAFETY: a kDLCUDA tensor's `data` is `len` bytes of device memory until the
            // deleter runs; the view is leaked, never freed by cudarc.
            let view = unsafe { stream.upgrade_device_ptr::<f32>(data, len / 4) };
            seen = stream.clone_dtoh(&view).unwrap();
            let _ = view.leak();
        });
        assert_eq!(imported.data, address);
        assert_eq!(imported.device, (KDL_CUDA, 0));
        assert_eq!(imported.shape, vec![64, 64]);
        assert_eq!(seen, values);
        assert_eq!(
            gpu.memory_stats().in_use_buffers,
            0,
            "the deleter returned it"
        );
    }
}

/// A split tensor's parts (spec §15), claimed with the whole's metadata, land in the
/// registered destination of its name, and the whole is handed over once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_parts_of_a_split_tensor_land_in_its_registered_destination() {
    use tensorwire_proto::split::{SplitId, SplitPart, plan_split};
    use tensorwire_sink::SplitTensors;

    let memory = Arc::new(Mutex::new(vec![0u8; 10 * 3 * 4]));
    let destinations = Destinations::new();
    destinations
        .register_host("w", DType::F32, &[10, 3], memory.clone())
        .unwrap();
    let placement = Placement::choose(DeviceRequest::Host, GpuRequirement::Preferred).unwrap();
    let whole = f32_meta("w", &[10, 3]);
    let bytes = pattern(120, 6);
    let splits = SplitTensors::new(Duration::from_secs(10));
    let parts: Vec<SplitPart> = plan_split(&whole, 3, SplitId(3))
        .unwrap()
        .iter()
        .map(|p| SplitPart::of(&p.meta, u64::MAX).unwrap().unwrap())
        .collect();
    // A part's own shape is not the destination's: claimed by itself it is refused.
    let e = destinations
        .claim(
            &plan_split(&whole, 3, SplitId(3)).unwrap()[0].meta,
            &placement,
            Duration::ZERO,
        )
        .await
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::DESTINATION_MISMATCH);
    let mut wholes = Vec::new();
    for part in parts.iter().rev() {
        let (destinations, placement) = (&destinations, &placement);
        let mut sink = splits
            .join(
                std::net::Ipv4Addr::LOCALHOST.into(),
                &tensorwire_sink::Carrier::new(),
                part,
                |meta| async move {
                    destinations
                        .claim(&meta, placement, Duration::from_secs(1))
                        .await?
                        .ok_or_else(|| tensorwire_sink::SinkError::failed("not registered"))
                },
            )
            .await
            .unwrap();
        let (at, len) = (part.offset() as usize, part.len() as usize);
        let permit = CreditPermit::unbudgeted(len as u64);
        sink.write(0, payload(&bytes[at..at + len]), permit)
            .await
            .unwrap();
        wholes.extend(sink.finish().await.unwrap());
    }
    assert_eq!(wholes.len(), 1);
    let landed = wholes.pop().unwrap();
    assert_eq!(landed.meta, whole);
    assert!(matches!(landed.output, Landed::Host(_)));
    assert_eq!(*memory.lock().unwrap(), bytes);
}
