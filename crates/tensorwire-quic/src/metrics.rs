//! Byte and tensor counters and a latency histogram, read as snapshots.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use hdrhistogram::Histogram;

/// Counters for a sender, a receiver or one connection.
#[derive(Debug)]
pub(crate) struct Metrics {
    started: AtomicU64,
    completed: AtomicU64,
    failed: AtomicU64,
    payload_bytes: AtomicU64,
    largest_stream_window: AtomicU64,
    latency_us: Mutex<Histogram<u64>>,
}

/// A point-in-time copy of a sender's or receiver's counters. Latency is METADATA sent (or
/// received) → COMPLETE.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// Tensors begun.
    pub tensors_started: u64,
    /// Tensors that completed.
    pub tensors_completed: u64,
    /// Tensors that ended in an error or cancel.
    pub tensors_failed: u64,
    /// DATA payload bytes moved.
    pub payload_bytes: u64,
    /// Median tensor latency, microseconds.
    pub latency_p50_us: u64,
    /// 99th percentile tensor latency, microseconds.
    pub latency_p99_us: u64,
    /// Largest tensor latency, microseconds.
    pub latency_max_us: u64,
    /// Largest credit window a received tensor had, in bytes (spec §7.1): more than the
    /// configured `stream_window` where a long path made windows grow. 0 on a sender.
    pub largest_stream_window: u64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            started: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            payload_bytes: AtomicU64::new(0),
            largest_stream_window: AtomicU64::new(0),
            latency_us: Mutex::new(
                Histogram::new_with_bounds(1, 3_600_000_000, 3)
                    .expect("constant bounds: 1 µs to 1 h at 3 significant digits"),
            ),
        }
    }
}

impl Metrics {
    pub(crate) fn started(&self) {
        self.started.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn add_bytes(&self, n: u64) {
        self.payload_bytes.fetch_add(n, Ordering::Relaxed);
    }

    /// A received tensor's credit window reached `bytes`.
    pub(crate) fn window_reached(&self, bytes: u64) {
        self.largest_stream_window
            .fetch_max(bytes, Ordering::Relaxed);
    }

    pub(crate) fn finished(&self, ok: bool, latency: Duration) {
        if ok {
            self.completed.fetch_add(1, Ordering::Relaxed);
            let us = u64::try_from(latency.as_micros())
                .unwrap_or(u64::MAX)
                .max(1);
            let mut h = self
                .latency_us
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            h.saturating_record(us);
        } else {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn snapshot(&self) -> MetricsSnapshot {
        let h = self
            .latency_us
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        MetricsSnapshot {
            tensors_started: self.started.load(Ordering::Relaxed),
            tensors_completed: self.completed.load(Ordering::Relaxed),
            tensors_failed: self.failed.load(Ordering::Relaxed),
            payload_bytes: self.payload_bytes.load(Ordering::Relaxed),
            latency_p50_us: h.value_at_quantile(0.5),
            latency_p99_us: h.value_at_quantile(0.99),
            latency_max_us: h.max(),
            largest_stream_window: self.largest_stream_window.load(Ordering::Relaxed),
        }
    }
}
