//! The GPU path. Without a GPU each GPU test prints why it skipped and passes, and the
//! fallbacks are tested for real; with `TENSORWIRE_REQUIRE_GPU=1` a missing GPU fails.
//! On a GPU: random data (never zeros) into poisoned destinations, sizes that are not
//! multiples of the chunk or staging size, many tensors at once, a single staging buffer
//! reused under in-flight copies, two devices when there are two, pools back to all-free.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::time::Duration;

use bytes::Bytes;
use tensorwire_gpu::{DeviceRequest, GpuError, GpuRequirement, GpuStatus, Placement, TensorBuffer};
use tensorwire_proto::testing::pattern as random;
use tensorwire_proto::{DType, TensorMeta};
use tensorwire_quic::{
    Receiver, ReceiverConfig, Sender, SenderConfig, StoreOffload, TransportSettings,
};

#[test]
fn detection_never_panics_and_agrees_with_itself() {
    let status = GpuStatus::detect();
    assert_eq!(status, GpuStatus::detect());
    assert_eq!(status.is_available(), status.device_count() > 0);
    assert!(!status.to_string().is_empty());
}

#[test]
fn without_a_gpu_buffers_fall_back_to_host_memory() {
    if GpuStatus::detect().is_available() {
        let buffer = TensorBuffer::try_allocate_gpu(1000, 0);
        assert!(buffer.is_gpu() && buffer.len() == 1000);
        return;
    }
    let err = TensorBuffer::allocate_gpu(1000, 0).unwrap_err();
    assert!(
        matches!(
            err,
            GpuError::NoDriver(_) | GpuError::NoDevice { .. } | GpuError::NotCompiled
        ),
        "{err}"
    );
    let buffer = TensorBuffer::try_allocate_gpu(1000, 0);
    assert!(buffer.is_host());
    assert_eq!(buffer.len(), 1000);
    assert_eq!(buffer.location(), "host memory");
}

#[test]
fn without_a_gpu_placement_falls_back_unless_a_gpu_is_required() {
    let auto = Placement::choose(DeviceRequest::Auto, GpuRequirement::Preferred).unwrap();
    let required = Placement::choose(DeviceRequest::Auto, GpuRequirement::Required);
    if GpuStatus::detect().is_available() {
        assert!(
            auto.describe().starts_with("GPU cuda:0"),
            "{}",
            auto.describe()
        );
        assert!(required.is_ok());
    } else {
        assert!(
            auto.describe().starts_with("host memory ("),
            "{}",
            auto.describe()
        );
        assert!(required.is_err(), "--require-gpu without a GPU is an error");
    }
    let host = Placement::choose(DeviceRequest::Host, GpuRequirement::Preferred).unwrap();
    assert_eq!(host.describe(), "host memory (host memory was requested)");
    assert!(Placement::choose(DeviceRequest::Cuda(99), GpuRequirement::Required).is_err());
    assert_eq!(
        "cuda:1".parse::<DeviceRequest>(),
        Ok(DeviceRequest::Cuda(1))
    );
    assert_eq!("auto".parse::<DeviceRequest>(), Ok(DeviceRequest::Auto));
    assert!("gpu7".parse::<DeviceRequest>().is_err());
}

#[test]
fn host_buffers_copy_and_convert() {
    let mut buffer = TensorBuffer::cpu_zeros(4);
    buffer.copy_from_slice(&[1, 2, 3, 4]).unwrap();
    assert_eq!(&buffer.to_host().unwrap()[..], &[1, 2, 3, 4]);
    assert!(buffer.copy_from_slice(&[1]).is_err());
    assert!(buffer.to_cpu().unwrap().is_host());
}

/// Fills a GPU sink's destination with 0xAB first, so bytes that never landed show.
fn poisoned(
    #[allow(unused_mut)] mut sink: tensorwire_gpu::TensorSink,
) -> tensorwire_gpu::TensorSink {
    #[cfg(feature = "cuda")]
    if let tensorwire_gpu::TensorSink::Gpu(gpu) = &mut sink {
        gpu.poison(0xAB).unwrap();
    }
    sink
}

/// Streams `tensors` over loopback QUIC into `placement`; returns what landed, after checking
/// every byte and that the receiver's budget is whole again.
#[cfg(feature = "cuda")]
async fn stream_into(
    placement: &Placement,
    tensors: &[(TensorMeta, Vec<u8>)],
) -> Vec<TensorBuffer> {
    stream_stored(placement, tensors, StoreOffload::Auto).await
}

/// A sender connected to a development receiver at `addr`, with jumbo packets, over the
/// binding `TENSORWIRE_TEST_BINDING` names (`quic`, `tcp` or `auto`; UDP when unset), so
/// that landing is tested over both (spec §16).
async fn sender_to(addr: std::net::SocketAddr) -> Sender {
    let mut config = SenderConfig::new(tensorwire_quic::ClientTls::Development);
    config.transport = TransportSettings::jumbo();
    if let Ok(binding) = std::env::var("TENSORWIRE_TEST_BINDING") {
        config.binding = binding.parse().unwrap();
    }
    Sender::connect(addr, config).await.unwrap()
}

/// As [`stream_into`], the receiver storing large payloads as `offload` says.
async fn stream_stored(
    placement: &Placement,
    tensors: &[(TensorMeta, Vec<u8>)],
    offload: StoreOffload,
) -> Vec<TensorBuffer> {
    let mut config = ReceiverConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        tensorwire_quic::ServerTls::Development,
    )
    .with_budget(64 << 20);
    config.transport = TransportSettings::jumbo();
    config.session.progress_timeout = Duration::from_secs(20);
    config.store_offload = offload;
    let mut receiver = Receiver::bind(config).await.unwrap();
    let addr = receiver.local_addr().unwrap();
    let placement = placement.clone();
    let count = tensors.len();
    let server = tokio::spawn(async move {
        let mut handles = Vec::new();
        for _ in 0..count {
            let incoming = receiver.next().await.unwrap();
            let sink = poisoned(placement.sink(incoming.meta()).unwrap());
            handles.push(incoming.accept(sink));
        }
        let mut landed = Vec::new();
        for handle in handles {
            landed.push(handle.finished().await.unwrap());
        }
        (landed, receiver)
    });
    let sender = sender_to(addr).await;
    let sends: Vec<_> = tensors
        .iter()
        .map(|(m, b)| sender.send(m.clone(), Bytes::from(b.clone())))
        .collect();
    for send in sends {
        send.finished().await.unwrap();
    }
    let (landed, receiver) = server.await.unwrap();
    let mut out = Vec::new();
    for (meta, buffer) in landed {
        let (_, expected) = tensors
            .iter()
            .find(|(m, _)| m.name() == meta.name())
            .unwrap();
        assert_eq!(buffer.len(), expected.len(), "{}", meta.name());
        assert!(
            buffer.to_host().unwrap() == expected[..],
            "{}: bytes differ after landing in {}",
            meta.name(),
            buffer.location()
        );
        out.push(buffer);
    }
    let budget = receiver.budget();
    assert_eq!(
        (budget.in_flight - budget.early_offered, budget.held),
        (0, 0),
        "credit returned only after copies completed"
    );
    sender.close().await;
    receiver.close().await;
    out
}

fn odd_tensors(count: usize) -> Vec<(TensorMeta, Vec<u8>)> {
    // Sizes around the 1 MiB chunk and 4 MiB staging boundaries, and tiny ones.
    let sizes = [
        1usize,
        7,
        4095,
        (1 << 20) + 3,
        (4 << 20) - 1,
        (4 << 20) + 1,
        (9 << 20) + 333,
        65_537,
    ];
    (0..count)
        .map(|i| {
            let len = sizes[i % sizes.len()];
            let meta = TensorMeta::new([len as u64], DType::U8)
                .unwrap()
                .with_name(format!("t{i}"));
            (meta, random(len, i as u64 + 1))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tensors_land_where_the_placement_says() {
    // With no GPU this exercises the host fallback end to end; with one, the GPU sink.
    let placement = Placement::choose(DeviceRequest::Auto, GpuRequirement::Preferred).unwrap();
    let on_gpu = GpuStatus::detect().is_available();
    // Stored on each connection's thread, and (payloads of 1 MiB) on the test's workers.
    let two = StoreOffload::UpTo(std::num::NonZeroUsize::new(2).unwrap());
    for offload in [StoreOffload::Never, two] {
        let landed = stream_stored(&placement, &odd_tensors(24), offload).await;
        assert!(landed.iter().all(|b| b.is_gpu() == on_gpu), "{offload:?}");
    }
}

#[cfg(feature = "cuda")]
mod on_gpu {
    use std::io::Write;

    use std::sync::Arc;
    use tensorwire_gpu::gpus_or_skip as gpus;

    use tensorwire_gpu::{
        CHECKSUM_ON_DEVICE_FROM, ChecksumOn, CudaBuffer, GpuDevice, GpuSink, GpuSinkFactory,
        PinnedMemoryPool, PoolConfig, STAGING_BUFFER,
    };
    use tensorwire_proto::Payload;
    use tensorwire_quic::{CreditPermit, Sink};

    use super::*;

    #[test]
    fn device_buffers_round_trip_exact_bytes() {
        let Some(_) = gpus("device_buffers_round_trip_exact_bytes") else {
            return;
        };
        for (i, len) in [1usize, 4095, (4 << 20) + 3, (17 << 20) + 1]
            .into_iter()
            .enumerate()
        {
            let data = random(len, i as u64 + 7);
            let mut buffer = CudaBuffer::allocate(len, 0).unwrap();
            buffer.fill(0xAB).unwrap();
            buffer.copy_from_host(&data).unwrap();
            assert!(buffer.copy_to_host().unwrap() == data, "{len} bytes");
            let mut other = CudaBuffer::allocate(len, 0).unwrap();
            other.fill(0xCD).unwrap();
            buffer.copy_to(&mut other).unwrap();
            assert!(
                other.copy_to_host().unwrap() == data,
                "device to device, {len} bytes"
            );
            let tensor = TensorBuffer::Cuda(buffer);
            assert!(tensor.is_gpu() && tensor.location().starts_with("cuda:0"));
            assert!(tensor.to_cpu().unwrap().to_host().unwrap() == data);
            assert!(
                TensorBuffer::cpu(data.clone())
                    .to_gpu(0)
                    .unwrap()
                    .to_host()
                    .unwrap()
                    == data
            );
        }
        assert!(
            CudaBuffer::allocate(1 << 60, 0).is_err(),
            "an impossible allocation is an error"
        );
    }

    #[test]
    fn two_devices_copy_across() {
        let Some(count) = gpus("two_devices_copy_across") else {
            return;
        };
        if count < 2 {
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED two_devices_copy_across: this host has {count} GPU"
            );
            return;
        }
        let data = random((5 << 20) + 11, 99);
        let a = TensorBuffer::cpu(data.clone()).to_gpu(0).unwrap();
        let b = a.to_gpu(1).unwrap();
        let TensorBuffer::Cuda(on_one) = &b else {
            panic!("not on a GPU")
        };
        assert_eq!(on_one.ordinal(), 1);
        assert!(b.to_host().unwrap() == data);
    }

    /// Feeds `chunks` (offset, bytes) straight into a sink, as the receiver would.
    async fn feed(sink: &mut GpuSink, chunks: &[(u64, Vec<u8>)]) {
        for (offset, bytes) in chunks {
            let payload = Payload::from(bytes.clone());
            sink.write(
                *offset,
                payload,
                CreditPermit::unbudgeted(bytes.len() as u64),
            )
            .await
            .unwrap();
        }
    }

    /// `data` in chunks of 1 MiB - 1 bytes, back to front: every one starts a new staging
    /// fill.
    fn back_to_front(data: &[u8]) -> Vec<(u64, Vec<u8>)> {
        let step = (1 << 20) - 1;
        let mut chunks: Vec<(u64, Vec<u8>)> = (0..data.len())
            .step_by(step)
            .map(|at| (at as u64, data[at..(at + step).min(data.len())].to_vec()))
            .collect();
        chunks.reverse();
        chunks
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn out_of_order_chunks_land_exactly() {
        let Some(_) = gpus("out_of_order_chunks_land_exactly") else {
            return;
        };
        let gpu = GpuSinkFactory::with_defaults(0).unwrap();
        let len = (13 << 20) + 17;
        let data = random(len, 3);
        let meta = TensorMeta::new([len as u64], DType::U8).unwrap();
        let mut sink = gpu.sink(&meta).unwrap();
        sink.poison(0xAB).unwrap();
        feed(&mut sink, &back_to_front(&data)).await;
        let landed = sink.finish().await.unwrap();
        assert!(landed.copy_to_host().unwrap() == data);
        drop(landed);
        assert_eq!(
            gpu.staging_stats().in_use_buffers,
            0,
            "staging back to all-free"
        );
        assert_eq!(
            gpu.memory_stats().in_use_buffers,
            0,
            "device pool back to all-free"
        );
    }

    /// Lands `len` random bytes (from `seed`) through `gpu` in 1 MiB writes; checks them.
    async fn land(gpu: &GpuSinkFactory, len: usize, seed: u64) -> CudaBuffer {
        let data = random(len, seed);
        let meta = TensorMeta::new([len as u64], DType::U8).unwrap();
        let mut sink = gpu.sink(&meta).unwrap();
        sink.poison(0xAB).unwrap();
        let chunks: Vec<(u64, Vec<u8>)> = (0..len)
            .step_by(1 << 20)
            .map(|at| (at as u64, data[at..(at + (1 << 20)).min(len)].to_vec()))
            .collect();
        feed(&mut sink, &chunks).await;
        let landed = sink.finish().await.unwrap();
        assert!(landed.copy_to_host().unwrap() == data, "{len} bytes");
        landed
    }

    /// A tensor the device pool cannot serve (past its largest buffer, or while the pool is
    /// in use) lands all the same, in memory of its own, and is counted; once the pool's
    /// buffer is back, a tensor that fits is served from the pool again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tensors_outside_the_device_pool_land_and_are_counted() {
        let Some(_) = gpus("tensors_outside_the_device_pool_land_and_are_counted") else {
            return;
        };
        let mut staging = PoolConfig::default();
        staging.max_pool_bytes = 4 * STAGING_BUFFER;
        staging.preallocate = true;
        // One 8 MiB buffer in all.
        let mut memory = PoolConfig::default();
        memory.max_pool_bytes = 8 << 20;
        memory.max_buffer = 8 << 20;
        let gpu = GpuSinkFactory::new(0, staging, memory).unwrap();
        let (fits, too_large) = ((5 << 20) + 1, (9 << 20) + 3);
        assert_eq!(gpu.allocations_outside_pool(), 0);
        drop(land(&gpu, too_large, 1).await);
        assert_eq!(gpu.allocations_outside_pool(), 1, "past the largest buffer");
        let first = land(&gpu, fits, 2).await;
        assert_eq!(gpu.allocations_outside_pool(), 1, "the pool's buffer");
        let second = land(&gpu, fits, 3).await;
        assert_eq!(
            gpu.allocations_outside_pool(),
            2,
            "the pool's buffer is in use"
        );
        drop((first, second));
        drop(land(&gpu, fits, 4).await);
        assert_eq!(gpu.allocations_outside_pool(), 2, "the pool's buffer again");
        let stats = gpu.memory_stats();
        assert_eq!((stats.in_use_buffers, stats.misses), (0, 1));
        assert_eq!(gpu.staging_stats().in_use_buffers, 0, "staging all free");
    }

    /// The receiver's one pass over each byte: the sink checksums each piece as it copies
    /// it into staging, in whatever pieces the payload comes, and lands every byte.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sink_checksums_what_it_copies_in_the_same_pass() {
        let Some(_) = gpus("a_sink_checksums_what_it_copies_in_the_same_pass") else {
            return;
        };
        let gpu = GpuSinkFactory::with_defaults(0).unwrap();
        let len = (9 << 20) + 5;
        let data = random(len, 11);
        let meta = TensorMeta::new([len as u64], DType::U8).unwrap();
        let mut sink = gpu.sink(&meta).unwrap();
        sink.poison(0xAB).unwrap();
        // DATA of 1 MiB + 3 bytes in 6,000-byte parts (as QUIC delivers them): parts cross
        // staging buffers and the checksum's pieces.
        let step = (1 << 20) + 3;
        for at in (0..len).step_by(step) {
            let frame = &data[at..(at + step).min(len)];
            let mut payload = Payload::default();
            for part in frame.chunks(6000) {
                payload.push(bytes::Bytes::copy_from_slice(part));
            }
            let crc = sink
                .write_checksummed(
                    at as u64,
                    payload,
                    CreditPermit::unbudgeted(frame.len() as u64),
                )
                .await
                .unwrap();
            assert_eq!(
                crc,
                tensorwire_proto::checksum::crc32c(frame),
                "DATA at {at}"
            );
        }
        let landed = sink.finish().await.unwrap();
        assert!(landed.copy_to_host().unwrap() == data);
    }

    /// Spec §7.3 on the device: a tensor of a staging buffer or more is checksummed over its
    /// landed bytes by the GPU kernel, whatever its length and the order its bytes came in,
    /// equal to the host's CRC-32C; shorter tensors, and a sink told to, checksum on the host.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_device_checksums_a_landed_tensor_as_the_host_does() {
        let Some(_) = gpus("the_device_checksums_a_landed_tensor_as_the_host_does") else {
            return;
        };
        let gpu = GpuSinkFactory::with_defaults(0).unwrap();
        assert_eq!(gpu.checksum_on(), ChecksumOn::Device);
        for (i, len) in [
            CHECKSUM_ON_DEVICE_FROM,
            CHECKSUM_ON_DEVICE_FROM + 3,
            (37 << 20) + 12_345,
            (16 << 10) * 1000 + 1,
        ]
        .into_iter()
        .enumerate()
        {
            let data = random(len, 40 + i as u64);
            let meta = TensorMeta::new([len as u64], DType::U8).unwrap();
            let mut sink = gpu.sink(&meta).unwrap();
            sink.poison(0xAB).unwrap();
            assert!(sink.take_checksum(), "{len} bytes");
            feed(&mut sink, &back_to_front(&data)).await;
            let crc = sink.landed_checksum().await.unwrap();
            assert_eq!(
                crc,
                tensorwire_proto::checksum::crc32c(&data),
                "{len} bytes"
            );
            let landed = sink.finish().await.unwrap();
            assert!(landed.copy_to_host().unwrap() == data, "{len} bytes");
        }
        assert_eq!(gpu.staging_stats().in_use_buffers, 0, "staging all free");
        let short = TensorMeta::new([(CHECKSUM_ON_DEVICE_FROM - 1) as u64], DType::U8).unwrap();
        assert!(!gpu.sink(&short).unwrap().take_checksum());
        let on_host = gpu.clone().with_checksum_on(ChecksumOn::Host);
        let long = TensorMeta::new([(64 << 20) as u64], DType::U8).unwrap();
        assert!(!on_host.sink(&long).unwrap().take_checksum());
    }

    /// A GPU sink that corrupts one byte on its way in, as a bad copy would.
    struct Corrupting(GpuSink);

    impl Sink for Corrupting {
        type Output = CudaBuffer;

        async fn store(
            &mut self,
            offset: u64,
            payload: Payload,
            permit: CreditPermit,
            crc: Option<&mut u32>,
        ) -> Result<(), tensorwire_quic::SinkError> {
            let mut bytes = payload.to_bytes().to_vec();
            if offset == 0 {
                bytes[1000] ^= 1;
            }
            self.0
                .store(offset, Payload::from(bytes), permit, crc)
                .await
        }

        async fn flush(&mut self) -> Result<(), tensorwire_quic::SinkError> {
            self.0.flush().await
        }

        fn take_checksum(&mut self) -> bool {
            self.0.take_checksum()
        }

        async fn landed_checksum(&mut self) -> Result<u32, tensorwire_quic::SinkError> {
            self.0.landed_checksum().await
        }

        async fn finish(self) -> Result<CudaBuffer, tensorwire_quic::SinkError> {
            self.0.finish().await
        }
    }

    /// Over the network, the device's checksum decides: a landed byte that differs from
    /// what was sent fails the tensor with CHECKSUM_MISMATCH on both sides, and the credit
    /// and staging buffers come back; the next tensor lands.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_landed_byte_that_differs_fails_the_tensor_with_checksum_mismatch() {
        let Some(_) = gpus("a_landed_byte_that_differs_fails_the_tensor_with_checksum_mismatch")
        else {
            return;
        };
        let gpu = GpuSinkFactory::with_defaults(0).unwrap();
        let mut config = ReceiverConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            tensorwire_quic::ServerTls::Development,
        );
        config.transport = TransportSettings::jumbo();
        let mut receiver = Receiver::bind(config).await.unwrap();
        let addr = receiver.local_addr().unwrap();
        let len = (9 << 20) + 7;
        let data = random(len, 77);
        let server = tokio::spawn({
            let gpu = gpu.clone();
            async move {
                let incoming = receiver.next().await.unwrap();
                let sink = Corrupting(gpu.sink(incoming.meta()).unwrap());
                let corrupted = incoming.accept(sink).finished().await.map(drop);
                let incoming = receiver.next().await.unwrap();
                let sink = gpu.sink(incoming.meta()).unwrap();
                let landed = incoming.accept(sink).finished().await.unwrap().1;
                (corrupted, landed, receiver)
            }
        });
        let sender = sender_to(addr).await;
        let meta = TensorMeta::new([len as u64], DType::U8).unwrap();
        let sent = sender
            .send(meta.clone().with_name("bad"), Bytes::from(data.clone()))
            .finished()
            .await;
        let code = tensorwire_proto::ErrorCode::CHECKSUM_MISMATCH;
        let sent = sent.unwrap_err();
        assert_eq!(sent.code(), Some(code), "{sent}");
        sender
            .send(meta.with_name("good"), Bytes::from(data.clone()))
            .finished()
            .await
            .unwrap();
        let (corrupted, landed, receiver) = server.await.unwrap();
        let corrupted = corrupted.unwrap_err();
        assert_eq!(corrupted.code(), Some(code), "{corrupted}");
        assert!(landed.copy_to_host().unwrap() == data);
        drop(landed);
        let budget = receiver.budget();
        assert_eq!(
            (budget.in_flight - budget.early_offered, budget.held),
            (0, 0)
        );
        assert_eq!(gpu.staging_stats().in_use_buffers, 0, "staging all free");
        sender.close().await;
        receiver.close().await;
    }

    /// With one staging buffer, every new fill must wait for the previous copy: a buffer
    /// refilled while its copy is in flight would corrupt the destination.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_staging_buffer_is_never_refilled_while_its_copy_is_in_flight() {
        let Some(_) = gpus("a_staging_buffer_is_never_refilled_while_its_copy_is_in_flight") else {
            return;
        };
        let device = GpuDevice::open(0).unwrap();
        let mut one_buffer = PoolConfig::default();
        one_buffer.max_pool_bytes = STAGING_BUFFER;
        one_buffer.min_buffer = STAGING_BUFFER;
        one_buffer.max_buffer = STAGING_BUFFER;
        one_buffer.preallocate = true;
        let staging = PinnedMemoryPool::for_device(&device, one_buffer).unwrap();
        for round in 0..3u64 {
            let len = 48 << 20;
            let mut dest = CudaBuffer::allocate(len, 0).unwrap();
            dest.fill(0xAB).unwrap();
            let mut sink = GpuSink::new(device.clone(), dest, staging.clone());
            // Alternating patterns, each a full staging buffer, so each copy's source is the
            // same pinned buffer refilled with the next pattern right after the copy is enqueued.
            let chunks: Vec<(u64, Vec<u8>)> = (0..12u64)
                .map(|i| {
                    (
                        i * STAGING_BUFFER as u64,
                        random(STAGING_BUFFER, round * 100 + i),
                    )
                })
                .collect();
            feed(&mut sink, &chunks).await;
            let landed = sink.finish().await.unwrap().copy_to_host().unwrap();
            for (offset, bytes) in &chunks {
                let at = *offset as usize;
                assert!(
                    landed[at..at + bytes.len()] == bytes[..],
                    "round {round}: chunk at {at} corrupted"
                );
            }
            let stats = staging.stats();
            assert_eq!(
                (stats.in_use_buffers, stats.misses),
                (0, 0),
                "one preallocated buffer served every fill"
            );
        }
    }

    /// Partial fills parked while the staging pool runs dry never leave another tensor
    /// waiting for good. With two buffers: the first tensor fills one and parks a partial
    /// fill in the other while its full one is copied; the second and third tensors' bytes
    /// still land while the tensors before them send nothing more.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_parked_partial_fill_never_starves_another_tensor() {
        let Some(_) = gpus("a_parked_partial_fill_never_starves_another_tensor") else {
            return;
        };
        let device = GpuDevice::open(0).unwrap();
        let mut two_buffers = PoolConfig::default();
        two_buffers.max_pool_bytes = 2 * STAGING_BUFFER;
        two_buffers.min_buffer = STAGING_BUFFER;
        two_buffers.max_buffer = STAGING_BUFFER;
        two_buffers.preallocate = true;
        let staging = PinnedMemoryPool::for_device(&device, two_buffers).unwrap();
        let len = 6 << 20;
        let mut sinks = Vec::new();
        let mut written = Vec::new();
        for i in 0..3u64 {
            let mut dest = CudaBuffer::allocate(len, 0).unwrap();
            dest.fill(0xAB).unwrap();
            let mut sink = GpuSink::new(device.clone(), dest, staging.clone());
            let first = random(if i == 0 { 5 << 20 } else { 1 << 20 }, 40 + i);
            tokio::time::timeout(
                Duration::from_secs(20),
                feed(&mut sink, &[(0, first.clone())]),
            )
            .await
            .unwrap_or_else(|_| panic!("tensor {i} starved of staging"));
            sinks.push(sink);
            written.push(first);
        }
        for (i, (mut sink, first)) in sinks.into_iter().zip(written).enumerate() {
            let rest = random(len - first.len(), 50 + i as u64);
            feed(&mut sink, &[(first.len() as u64, rest.clone())]).await;
            let landed = sink.finish().await.unwrap().copy_to_host().unwrap();
            assert!(landed == [first, rest].concat(), "tensor {i}");
        }
        assert_eq!(staging.stats().in_use_buffers, 0, "staging all free");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn many_tensors_stream_into_gpu_memory_at_once() {
        let Some(_) = gpus("many_tensors_stream_into_gpu_memory_at_once") else {
            return;
        };
        let placement =
            Placement::choose(DeviceRequest::Cuda(0), GpuRequirement::Required).unwrap();
        let landed = stream_into(&placement, &odd_tensors(96)).await;
        assert!(landed.iter().all(TensorBuffer::is_gpu));
        drop(landed);
        let Placement::Gpu(gpu) = &placement else {
            panic!("not a GPU placement")
        };
        assert_eq!(gpu.staging_stats().in_use_buffers, 0);
        assert_eq!(gpu.memory_stats().in_use_buffers, 0);
        let staging = gpu.staging_stats();
        assert_eq!(
            (staging.misses, staging.drops),
            (0, 0),
            "preallocated staging serves every fill: {staging:?}"
        );
    }

    /// Far more tensors at once than staging buffers: under pool pressure a sink copies its
    /// partial fill unless a copy of its own is in flight, and every byte still lands exactly.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn more_tensors_than_staging_buffers_all_complete() {
        let Some(_) = gpus("more_tensors_than_staging_buffers_all_complete") else {
            return;
        };
        let mut two_buffers = PoolConfig::default();
        two_buffers.max_pool_bytes = 2 * STAGING_BUFFER;
        two_buffers.preallocate = true;
        let gpu = GpuSinkFactory::new(0, two_buffers, PoolConfig::default()).unwrap();
        let placement = Placement::Gpu(gpu.clone());
        let tensors: Vec<_> = (0..16)
            .map(|i| {
                let len = (6 << 20) + 1000 * i;
                let meta = TensorMeta::new([len as u64], DType::U8)
                    .unwrap()
                    .with_name(format!("p{i}"));
                (meta, random(len, 500 + i as u64))
            })
            .collect();
        let landed =
            tokio::time::timeout(Duration::from_secs(60), stream_into(&placement, &tensors)).await;
        assert!(
            landed.is_ok(),
            "stalled with 16 tensors sharing 2 staging buffers"
        );
        assert_eq!(gpu.staging_stats().in_use_buffers, 0);
    }

    #[test]
    fn device_info_names_the_device_by_uuid() {
        let Some(_) = gpus("device_info_names_the_device_by_uuid") else {
            return;
        };
        let device: Arc<GpuDevice> = GpuDevice::open(0).unwrap();
        let info = device.info();
        assert!(!info.name.is_empty());
        assert_ne!(info.uuid, [0; 16]);
        assert!(info.total_memory > 0 && info.compute_capability.0 >= 5);
        let (free, total) = device.memory().unwrap();
        assert!(free <= total && total == info.total_memory);
        assert!(matches!(
            GpuDevice::open(1000),
            Err(GpuError::NoDevice {
                requested: 1000,
                ..
            })
        ));
    }

    /// A split tensor's parts (spec §15) land in one device buffer, each through staging of
    /// its own and at once; the part that lands last yields the whole, on the GPU, and the
    /// device memory comes back when it is dropped.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn the_parts_of_a_split_tensor_land_in_one_device_buffer_at_once() {
        use tensorwire_proto::split::{SplitId, SplitPart, plan_split};
        use tensorwire_sink::SplitTensors;

        let Some(_) = gpus("the_parts_of_a_split_tensor_land_in_one_device_buffer_at_once") else {
            return;
        };
        let gpu = Arc::new(GpuSinkFactory::with_defaults(0).unwrap());
        let (rows, row) = (37u64, (1u64 << 20) + 3);
        let whole = TensorMeta::new([rows, row], DType::U8).unwrap();
        let data = Arc::new(random((rows * row) as usize, 21));
        let splits = SplitTensors::new(Duration::from_secs(30));
        let parts: Vec<SplitPart> = plan_split(&whole, 6, SplitId(6))
            .unwrap()
            .iter()
            .map(|p| SplitPart::of(&p.meta, u64::MAX).unwrap().unwrap())
            .collect();
        let mut landing = Vec::new();
        for part in parts {
            let (gpu, data, splits) = (gpu.clone(), data.clone(), splits.clone());
            landing.push(tokio::spawn(async move {
                let admit = |meta: TensorMeta| async move {
                    let reserved = gpu.memory_budget().reserve(meta.byte_len()).await?;
                    let sink = gpu.sink_reserved(&meta, reserved)?;
                    Ok(sink)
                };
                let mut sink = splits
                    .join(
                        std::net::Ipv4Addr::LOCALHOST.into(),
                        &tensorwire_sink::Carrier::new(),
                        &part,
                        admit,
                    )
                    .await
                    .unwrap();
                let mine = &data[part.offset() as usize..(part.offset() + part.len()) as usize];
                // DATA of 1 MiB + 7 bytes, as a part's stream brings them.
                for (i, frame) in mine.chunks((1 << 20) + 7).enumerate() {
                    let at = (i * ((1 << 20) + 7)) as u64;
                    let payload = Payload::from(Bytes::copy_from_slice(frame));
                    let permit = CreditPermit::unbudgeted(frame.len() as u64);
                    let crc = sink.write_checksummed(at, payload, permit).await.unwrap();
                    assert_eq!(crc, tensorwire_proto::checksum::crc32c(frame));
                }
                sink.finish().await.unwrap()
            }));
        }
        let mut wholes = Vec::new();
        for landed in landing {
            wholes.extend(landed.await.unwrap());
        }
        assert_eq!(wholes.len(), 1, "one whole");
        let assembled = wholes.pop().unwrap();
        assert_eq!(assembled.meta, whole);
        assert!(assembled.output.copy_to_host().unwrap() == *data);
        assert_eq!(gpu.memory_budget().snapshot().reserved, whole.byte_len());
        drop(assembled);
        assert_eq!(gpu.memory_budget().snapshot().reserved, 0);
        assert_eq!(splits.assembling(), 0);
    }
}

/// Encodes METADATA, `data` as DATA chunks of `chunk` bytes, then END (or CANCEL).
fn frames(meta: &TensorMeta, data: &[u8], chunk: usize, cancel_after: Option<usize>) -> Bytes {
    use tensorwire_proto::frame::{Cancel, Data, End};
    use tensorwire_proto::{ErrorCode, Frame};
    let mut wire = bytes::BytesMut::new();
    Frame::from(meta.clone()).encode(&mut wire);
    for (i, at) in (0..data.len()).step_by(chunk).enumerate() {
        if cancel_after == Some(i) {
            Frame::from(Cancel::new(ErrorCode::CANCELLED, "sender gave up")).encode(&mut wire);
            return wire.freeze();
        }
        Frame::from(Data::new(
            at as u64,
            data[at..(at + chunk).min(data.len())].to_vec(),
        ))
        .encode(&mut wire);
    }
    Frame::from(End {
        checksum: tensorwire_proto::checksum::crc32c(data).into(),
    })
    .encode(&mut wire);
    wire.freeze()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tensor_from_raw_bytes_lands_where_the_placement_says() {
    use tensorwire_gpu::{GpuReceiverEvent, GpuTensorReceiver};
    use tensorwire_proto::{Frame, Limits};
    let placement = Placement::choose(DeviceRequest::Auto, GpuRequirement::Preferred).unwrap();
    let data = random((5 << 20) + 123, 5);
    let meta = TensorMeta::new([data.len() as u64], DType::U8)
        .unwrap()
        .with_name("raw");
    let wire = frames(&meta, &data, 1 << 20, None);
    let mut rx = GpuTensorReceiver::new(placement, Limits::default());
    let (mut events, mut needed_more) = (Vec::new(), 0);
    for at in (0..wire.len()).step_by(64 << 10) {
        rx.push(wire.slice(at..(at + (64 << 10)).min(wire.len())));
        loop {
            match rx.next_event().await.unwrap() {
                GpuReceiverEvent::NeedMoreData => {
                    needed_more += 1;
                    break;
                }
                event => events.push(event),
            }
        }
    }
    assert!(needed_more > 0);
    assert_eq!(
        events.first(),
        Some(&GpuReceiverEvent::Metadata(meta.clone()))
    );
    assert_eq!(events.last(), Some(&GpuReceiverEvent::End));
    let data_bytes: u64 = events
        .iter()
        .map(|e| {
            if let GpuReceiverEvent::Data { size, .. } = e {
                *size
            } else {
                0
            }
        })
        .sum();
    assert_eq!(data_bytes, data.len() as u64);
    assert!(rx.is_complete());
    assert_eq!(
        (rx.expected_bytes(), rx.received_bytes()),
        (data.len() as u64, data.len() as u64)
    );
    let replies: Vec<Frame> = std::iter::from_fn(|| rx.poll_frame()).collect();
    assert!(
        matches!(replies.last(), Some(Frame::Complete(_))),
        "{replies:?}"
    );
    let (landed_meta, buffer) = rx.take().unwrap();
    assert_eq!(landed_meta, meta);
    assert_eq!(
        buffer.is_gpu(),
        GpuStatus::detect().is_available(),
        "{}",
        buffer.location()
    );
    assert!(buffer.to_host().unwrap() == data[..]);
    assert!(rx.take().is_none(), "taken once");
}

#[tokio::test]
async fn a_cancelled_tensor_reports_the_senders_reason() {
    use tensorwire_gpu::{GpuReceiverEvent, GpuTensorReceiver};
    use tensorwire_proto::Limits;
    let placement = Placement::choose(DeviceRequest::Auto, GpuRequirement::Preferred).unwrap();
    let data = random(3 << 20, 9);
    let meta = TensorMeta::new([data.len() as u64], DType::U8).unwrap();
    let mut rx = GpuTensorReceiver::new(placement, Limits::default());
    rx.push(frames(&meta, &data, 1 << 20, Some(2)));
    let mut last = None;
    loop {
        match rx.next_event().await.unwrap() {
            GpuReceiverEvent::NeedMoreData => break,
            event => last = Some(event),
        }
    }
    assert_eq!(
        last,
        Some(GpuReceiverEvent::Cancelled("sender gave up".into()))
    );
    assert!(!rx.is_complete());
    assert_eq!(rx.received_bytes(), 2 << 20);
    assert!(rx.take_tensor().unwrap().is_none());
}
