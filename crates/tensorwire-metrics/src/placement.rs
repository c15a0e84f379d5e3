//! The metrics of where tensors land: each GPU's memory budget, the GPU pools' and the pinned
//! datagram region's families (docs/operators.md lists them).

use tensorwire_gpu::Placement;
#[cfg(feature = "cuda")]
use tensorwire_gpu::{GpuSinkFactory, PoolStats};
use tensorwire_quic::ReceiverObserver;

use crate::ReceiverMetrics;
#[cfg(feature = "cuda")]
use crate::{Family, FamilyKind, Sample};

impl ReceiverMetrics {
    /// The receiver's metrics with those of `placement`: on a GPU, its memory budget beside
    /// the host's, and its pools' families; on the host, the receiver's alone.
    pub fn for_placement(observer: ReceiverObserver, placement: &Placement) -> Self {
        match placement {
            #[cfg(feature = "cuda")]
            Placement::Gpu(gpu) => gpu_families(gpu).into_iter().fold(
                Self::with_memory(observer, vec![gpu.memory_budget().clone()]),
                Self::with_family,
            ),
            // Host memory; or, built without `cuda`, a GPU whose pools this build cannot read.
            _ => Self::new(observer),
        }
    }
}

/// The GPU pools' and the pinned datagram region's families.
#[cfg(feature = "cuda")]
fn gpu_families(gpu: &GpuSinkFactory) -> Vec<Family> {
    let pools = gpu.clone();
    vec![
        Family::new(
            "pool_requests",
            "Buffers asked of the GPU pools (staging: pinned host memory; device: the GPU's), \
             by outcome: hit (a free buffer reused) or miss (allocated).",
            FamilyKind::Counter,
            pool_samples(gpu, "outcome", |stats| {
                [("hit", stats.hits), ("miss", stats.misses)]
            }),
        ),
        Family::new(
            "pool_bytes",
            "Bytes the GPU pools hold, by state: allocated (free and in use) or in_use.",
            FamilyKind::Gauge,
            pool_samples(gpu, "state", |stats| {
                [
                    ("allocated", stats.pool_bytes as u64),
                    ("in_use", stats.in_use_bytes as u64),
                ]
            }),
        ),
        Family::new(
            "device_allocations_outside_pool",
            "Tensors the device pool could not serve, allocated and freed on their own.",
            FamilyKind::Counter,
            move || vec![(Vec::new(), pools.allocations_outside_pool())],
        ),
        Family::new(
            "pinned_datagrams",
            "Received datagrams by where they were held: served (pinned memory, copied to the \
             GPU directly) or overflowed (the region full: through staging).",
            FamilyKind::Counter,
            || {
                let stats = tensorwire_gpu::pinned_datagram_stats();
                vec![
                    (vec![("outcome", "served".into())], stats.served),
                    (vec![("outcome", "overflowed".into())], stats.overflowed),
                ]
            },
        ),
    ]
}

/// Reads `values` of the staging and device pools at each scrape, each value labelled
/// `pool` and `label`.
#[cfg(feature = "cuda")]
fn pool_samples(
    gpu: &GpuSinkFactory,
    label: &'static str,
    values: impl Fn(&PoolStats) -> [(&'static str, u64); 2] + Send + Sync + 'static,
) -> impl Fn() -> Vec<Sample> + Send + Sync + 'static {
    let pools = gpu.clone();
    move || {
        [
            ("staging", pools.staging_stats()),
            ("device", pools.memory_stats()),
        ]
        .iter()
        .flat_map(|(pool, stats)| {
            values(stats).map(|(value_label, n)| {
                let labels = vec![
                    ("pool", (*pool).to_owned()),
                    (label, value_label.to_owned()),
                ];
                (labels, n)
            })
        })
        .collect()
    }
}
