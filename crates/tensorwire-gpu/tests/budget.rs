//! Device memory inside the budget (spec §7.5) and METADATA device hints (spec §5.2), over
//! QUIC: tensors wait for device memory instead of falling back to host memory, a strict
//! placement refuses what cannot fit, and hints land where they ask or are refused.
//! Without CUDA, the hint tests run on host placement; the GPU ones print SKIPPED.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::time::Duration;

use tensorwire_gpu::{DeviceRequest, GpuRequirement, Placement, TensorBuffer};
use tensorwire_proto::testing::pattern;
use tensorwire_proto::{DType, Device, ErrorCode, ProtocolError, TensorMeta};
use tensorwire_quic::{
    Receiver, ReceiverConfig, Sender, SenderConfig, TransportError, TransportSettings,
};

async fn pair() -> (Receiver, Sender) {
    pair_with(|_| {}).await
}

/// As [`pair`], the receiver's configuration changed by `adjust` first.
async fn pair_with(adjust: impl FnOnce(&mut ReceiverConfig)) -> (Receiver, Sender) {
    let mut config = ReceiverConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        tensorwire_quic::ServerTls::Development,
    )
    .with_budget(64 << 20);
    config.transport = TransportSettings::jumbo();
    config.session.progress_timeout = Duration::from_secs(60);
    config.session.admission_timeout = Duration::from_secs(60);
    adjust(&mut config);
    let rx = Receiver::bind(config).await.unwrap();
    let addr = rx.local_addr().unwrap();
    let tx = Sender::connect(addr, {
        let mut config = SenderConfig::new(tensorwire_quic::ClientTls::Development);
        config.transport = TransportSettings::jumbo();
        config
    })
    .await
    .unwrap();
    (rx, tx)
}

fn meta(name: &str, len: usize) -> TensorMeta {
    TensorMeta::new([len as u64], DType::U8)
        .unwrap()
        .with_name(name)
}

fn remote_code(err: &TransportError) -> Option<ErrorCode> {
    match err {
        TransportError::Protocol(ProtocolError::Remote { code, .. }) => Some(*code),
        _ => None,
    }
}

/// Admits, lands and returns one tensor per `placement`, or the refusal's code.
async fn land(
    rx: &mut Receiver,
    placement: &Placement,
    wait: Duration,
) -> Result<TensorBuffer, ErrorCode> {
    let incoming = rx.next().await.unwrap();
    let meta = incoming.meta().clone();
    match placement
        .admit(
            &meta,
            incoming.memory_shares(),
            incoming.host_memory(),
            wait,
        )
        .await
    {
        Ok(sink) => Ok(incoming.accept(sink).finished().await.unwrap().1),
        Err(e) => {
            incoming.reject(e.code, e.message);
            Err(e.code)
        }
    }
}

/// Hints: `host` lands in host memory whatever the placement; `cuda:N` for a GPU this
/// receiver does not land on is refused with UNSUPPORTED_DEVICE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_hints_are_honoured_or_refused() {
    let placement = Placement::choose(DeviceRequest::Auto, GpuRequirement::Preferred).unwrap();
    let (mut rx, tx) = pair().await;
    let host = tx.send(
        meta("on-host", 3 << 20).with_device(Device::Host),
        pattern(3 << 20, 2),
    );
    let buffer = land(&mut rx, &placement, Duration::from_secs(5))
        .await
        .unwrap();
    assert!(buffer.is_host(), "landed in {}", buffer.location());
    assert_eq!(buffer.to_host().unwrap(), pattern(3 << 20, 2));
    host.finished().await.unwrap();

    // One past the GPUs this host has (cuda:0 where there is none).
    let absent = tensorwire_gpu::GpuStatus::detect().device_count() as u16;
    let wrong = tx.send(
        meta("elsewhere", 1000).with_device(Device::Cuda(absent)),
        pattern(1000, 3),
    );
    let refused = land(&mut rx, &placement, Duration::from_secs(5)).await;
    assert_eq!(refused.err(), Some(ErrorCode::UNSUPPORTED_DEVICE));
    let err = wrong.finished().await.unwrap_err();
    assert_eq!(
        remote_code(&err),
        Some(ErrorCode::UNSUPPORTED_DEVICE),
        "{err}"
    );
    assert!(err.to_string().contains(&format!("cuda:{absent}")), "{err}");
}

#[cfg(feature = "cuda")]
mod on_gpu {
    use bytes::Bytes;
    use tensorwire_gpu::gpus_or_skip;

    use super::*;

    /// 4 GiB through a 1 GiB device budget: every tensor waits for device memory and lands on
    /// the GPU (never in host memory) as the application releases earlier ones.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn four_gib_through_a_one_gib_device_budget_all_land_on_the_gpu() {
        if gpus_or_skip("four_gib_through_a_one_gib_device_budget_all_land_on_the_gpu").is_none() {
            return;
        }
        const LEN: usize = 256 << 20;
        const COUNT: usize = 16;
        let Placement::Gpu(gpu) =
            Placement::choose(DeviceRequest::Cuda(0), GpuRequirement::Required).unwrap()
        else {
            panic!("not a GPU placement");
        };
        let gpu = gpu.with_memory_budget(1 << 30);
        let placement = Placement::Gpu(gpu.clone());
        let (mut rx, tx) = pair().await;
        let data = Bytes::from(pattern(LEN, 77));
        let sends: Vec<_> = (0..COUNT)
            .map(|i| tx.send(meta(&format!("w{i}"), LEN), data.clone()))
            .collect();
        let mut landing = Vec::new();
        for _ in 0..COUNT {
            let incoming = rx.next().await.unwrap();
            let (placement, data) = (placement.clone(), data.clone());
            landing.push(tokio::spawn(async move {
                let meta = incoming.meta().clone();
                let sink = placement
                    .admit(
                        &meta,
                        incoming.memory_shares(),
                        incoming.host_memory(),
                        Duration::from_secs(60),
                    )
                    .await
                    .unwrap();
                let (_, buffer) = incoming.accept(sink).finished().await.unwrap();
                assert!(
                    buffer.is_gpu(),
                    "{} landed in {}",
                    meta.name(),
                    buffer.location()
                );
                assert!(buffer.to_host().unwrap() == data, "{} differs", meta.name());
                // The consumer is done with it: its device memory goes back to the budget.
            }));
        }
        for task in landing {
            task.await.unwrap();
        }
        for send in sends {
            send.finished().await.unwrap();
        }
        let budget = gpu.memory_budget().snapshot();
        assert_eq!(
            budget.reserved, 0,
            "every landed tensor released its memory"
        );
        assert!(
            budget.peak <= 1 << 30,
            "peak {} over the 1 GiB budget",
            budget.peak
        );
        assert!(budget.peak >= LEN as u64);
    }

    /// Spec §7.1: a credit budget smaller than one staging buffer, granted in 1 MiB units,
    /// never fills a staging buffer; each tensor's partial one is copied once its tensor runs
    /// out of credit, so every tensor lands instead of timing out with its credit held.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn credit_smaller_than_a_staging_buffer_lands_every_tensor() {
        if gpus_or_skip("credit_smaller_than_a_staging_buffer_lands_every_tensor").is_none() {
            return;
        }
        const LEN: usize = 24 << 20;
        const BUDGET: u64 = 3 << 20;
        assert!(BUDGET < tensorwire_gpu::STAGING_BUFFER as u64);
        let placement =
            Placement::choose(DeviceRequest::Cuda(0), GpuRequirement::Required).unwrap();
        let (mut rx, tx) = pair_with(|config| {
            *config = config.clone().with_budget(BUDGET);
            config.session.grant_unit = 1 << 20;
            config.session.stream_window = 2 << 20;
            config.session.progress_timeout = Duration::from_secs(5);
        })
        .await;
        let data = Bytes::from(pattern(LEN, 5));
        let sends: Vec<_> = (0..3)
            .map(|i| tx.send(meta(&format!("t{i}"), LEN), data.clone()))
            .collect();
        let mut landing = Vec::new();
        for _ in 0..sends.len() {
            let incoming = rx.next().await.unwrap();
            let meta = incoming.meta().clone();
            let sink = placement
                .admit(
                    &meta,
                    incoming.memory_shares(),
                    incoming.host_memory(),
                    Duration::from_secs(5),
                )
                .await
                .unwrap();
            landing.push((meta, incoming.accept(sink)));
        }
        for (meta, handle) in landing {
            let (_, buffer) = handle.finished().await.unwrap();
            assert!(
                buffer.is_gpu(),
                "{} landed in {}",
                meta.name(),
                buffer.location()
            );
            assert!(buffer.to_host().unwrap() == data, "{} differs", meta.name());
        }
        for send in sends {
            send.finished().await.unwrap();
        }
        let budget = rx.budget();
        assert!(budget.peak_outstanding <= BUDGET);
        assert_eq!(budget.held, 0, "every credit byte came back");
    }

    /// With a GPU required, a tensor larger than the device budget is refused with
    /// RESOURCE_EXHAUSTED, which the sender sees; it does not land in host memory.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_required_gpu_refuses_what_its_budget_cannot_hold() {
        if gpus_or_skip("a_required_gpu_refuses_what_its_budget_cannot_hold").is_none() {
            return;
        }
        let Placement::Gpu(gpu) =
            Placement::choose(DeviceRequest::Cuda(0), GpuRequirement::Required).unwrap()
        else {
            panic!("not a GPU placement");
        };
        let placement = Placement::Gpu(gpu.with_memory_budget(64 << 20));
        let (mut rx, tx) = pair().await;
        let send = tx.send(meta("too-big", 128 << 20), pattern(128 << 20, 1));
        let refused = land(&mut rx, &placement, Duration::from_millis(200)).await;
        assert_eq!(refused.err(), Some(ErrorCode::RESOURCE_EXHAUSTED));
        let err = send.finished().await.unwrap_err();
        assert_eq!(
            remote_code(&err),
            Some(ErrorCode::RESOURCE_EXHAUSTED),
            "{err}"
        );
        assert!(err.to_string().contains("cuda:0"), "{err}");
    }

    /// `cuda:0` on a GPU placement lands on the GPU.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cuda_hint_lands_on_that_gpu() {
        if gpus_or_skip("a_cuda_hint_lands_on_that_gpu").is_none() {
            return;
        }
        let placement =
            Placement::choose(DeviceRequest::Cuda(0), GpuRequirement::Preferred).unwrap();
        let (mut rx, tx) = pair().await;
        let send = tx.send(
            meta("on-gpu", 5 << 20).with_device(Device::Cuda(0)),
            pattern(5 << 20, 4),
        );
        let buffer = land(&mut rx, &placement, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(buffer.is_gpu(), "landed in {}", buffer.location());
        assert_eq!(buffer.to_host().unwrap(), pattern(5 << 20, 4));
        send.finished().await.unwrap();
    }
}
