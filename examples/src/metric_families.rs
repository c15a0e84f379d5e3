//! The metric families `receiver --metrics-listen` serves beside the receiver's own: its GPU
//! pools' and remote execution's (docs/operators.md lists them).

use tensorwire::exec::ExecServer;
use tensorwire::gpu::Placement;
use tensorwire::metrics::{Family, FamilyKind};

/// The GPU pools' and remote execution's metrics, beside the receiver's (docs/operators.md).
pub fn families(placement: &Placement, exec: Option<&ExecServer>) -> Vec<Family> {
    let mut families = Vec::new();
    if let Placement::Gpu(gpu) = placement {
        let pools = gpu.clone();
        families.push(Family::new(
            "pool_requests",
            "Buffers asked of the GPU pools (staging: pinned host memory; device: the GPU's), \
             by outcome: hit (a free buffer reused) or miss (allocated).",
            FamilyKind::Counter,
            move || {
                let pools = [
                    ("staging", pools.staging_stats()),
                    ("device", pools.memory_stats()),
                ];
                pools
                    .iter()
                    .flat_map(|(pool, stats)| {
                        [("hit", stats.hits), ("miss", stats.misses)].map(|(outcome, n)| {
                            (
                                vec![("pool", (*pool).to_owned()), ("outcome", outcome.into())],
                                n,
                            )
                        })
                    })
                    .collect()
            },
        ));
        let pools = gpu.clone();
        families.push(Family::new(
            "pool_bytes",
            "Bytes the GPU pools hold, by state: allocated (free and in use) or in_use.",
            FamilyKind::Gauge,
            move || {
                let pools = [
                    ("staging", pools.staging_stats()),
                    ("device", pools.memory_stats()),
                ];
                pools
                    .iter()
                    .flat_map(|(pool, stats)| {
                        [
                            ("allocated", stats.pool_bytes),
                            ("in_use", stats.in_use_bytes),
                        ]
                        .map(|(state, n)| {
                            let labels =
                                vec![("pool", (*pool).to_owned()), ("state", state.into())];
                            (labels, n as u64)
                        })
                    })
                    .collect()
            },
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
