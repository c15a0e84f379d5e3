//! The metric families `receiver --metrics-listen` serves beside the receiver's and its
//! placement's own: remote execution's (docs/operators.md lists them).

use tensorwire::exec::ExecServer;
use tensorwire::metrics::{Family, FamilyKind};

/// Remote execution's metrics, beside the receiver's (docs/operators.md).
pub fn families(exec: &ExecServer) -> Vec<Family> {
    let (runs, workers) = (exec.clone(), exec.clone());
    vec![
        Family::new(
            "exec_runs",
            "Remote kernel runs (spec §14), by outcome.",
            FamilyKind::Counter,
            move || {
                let stats = runs.stats();
                vec![
                    (vec![("outcome", "succeeded".into())], stats.runs_succeeded),
                    (vec![("outcome", "failed".into())], stats.runs_failed),
                ]
            },
        ),
        Family::new(
            "exec_workers_replaced",
            "Kernel worker processes stopped or lost (a fault, an overrun) and replaced.",
            FamilyKind::Counter,
            move || vec![(Vec::new(), workers.stats().workers.replaced)],
        ),
    ]
}
