//! The metric families `receiver --metrics-listen` serves beside the receiver's own: its GPU
//! pools' and remote execution's (docs/operators.md lists them).

use tensorwire::exec::ExecServer;
use tensorwire::gpu::{GpuSinkFactory, Placement, PoolStats};
use tensorwire::metrics::{Family, FamilyKind, Sample};

/// The GPU pools' and remote execution's metrics, beside the receiver's (docs/operators.md).
pub fn families(placement: &Placement, exec: Option<&ExecServer>) -> Vec<Family> {
    let mut families = Vec::new();
    if let Placement::Gpu(gpu) = placement {
        families.push(Family::new(
            "pool_requests",
            "Buffers asked of the GPU pools (staging: pinned host memory; device: the GPU's), \
             by outcome: hit (a free buffer reused) or miss (allocated).",
            FamilyKind::Counter,
            pool_samples(gpu, "outcome", |stats| {
                [("hit", stats.hits), ("miss", stats.misses)]
            }),
        ));
        families.push(Family::new(
            "pool_bytes",
            "Bytes the GPU pools hold, by state: allocated (free and in use) or in_use.",
            FamilyKind::Gauge,
            pool_samples(gpu, "state", |stats| {
                [
                    ("allocated", stats.pool_bytes as u64),
                    ("in_use", stats.in_use_bytes as u64),
                ]
            }),
        ));
        let pools = gpu.clone();
        families.push(Family::new(
            "device_allocations_outside_pool",
            "Tensors the device pool could not serve, allocated and freed on their own.",
            FamilyKind::Counter,
            move || vec![(Vec::new(), pools.allocations_outside_pool())],
        ));
        families.push(Family::new(
            "pinned_datagrams",
            "Received datagrams by where they were held: served (pinned memory, copied to the \
             GPU directly) or overflowed (the region full: through staging).",
            FamilyKind::Counter,
            || {
                let stats = tensorwire::gpu::pinned_datagram_stats();
                vec![
                    (vec![("outcome", "served".into())], stats.served),
                    (vec![("outcome", "overflowed".into())], stats.overflowed),
                ]
            },
        ));
    }
    if let Some(exec) = exec {
        let server = exec.clone();
        families.push(Family::new(
            "exec_runs",
            "Remote kernel runs (spec §14), by outcome.",
            FamilyKind::Counter,
            move || {
                let stats = server.stats();
                vec![
                    (vec![("outcome", "succeeded".into())], stats.runs_succeeded),
                    (vec![("outcome", "failed".into())], stats.runs_failed),
                ]
            },
        ));
        let server = exec.clone();
        families.push(Family::new(
            "exec_workers_replaced",
            "Kernel worker processes stopped or lost (a fault, an overrun) and replaced.",
            FamilyKind::Counter,
            move || vec![(Vec::new(), server.stats().workers.replaced)],
        ));
    }
    families
}

/// Reads `values` of the staging and device pools at each scrape, each value labelled
/// `pool` and `label`.
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
