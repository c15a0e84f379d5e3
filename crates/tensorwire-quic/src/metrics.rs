//! Byte and tensor counters and a latency histogram, read as snapshots.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use hdrhistogram::Histogram;
use tensorwire_proto::{CapExceeded, ErrorCode};

/// The upper bounds, in microseconds, of the latency histogram's buckets: 1 ms to 5 min.
pub const LATENCY_BUCKETS_US: [u64; 12] = [
    1_000,
    10_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    30_000_000,
    60_000_000,
    300_000_000,
];

/// Counters for a sender, a receiver or one connection.
#[derive(Debug)]
pub(crate) struct Metrics {
    started: AtomicU64,
    completed: AtomicU64,
    failed: AtomicU64,
    /// Failures by registered code, in the order of [`ErrorCode::ALL`]: a fixed set, so a
    /// peer choosing codes cannot grow it.
    failed_by_code: Box<[AtomicU64]>,
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
    /// Of `tensors_failed`, those whose code is registered (spec §9.2), by code: only codes
    /// that occurred, in registry order.
    pub failures_by_code: Vec<(ErrorCode, u64)>,
    /// DATA payload bytes moved.
    pub payload_bytes: u64,
    /// Median tensor latency, microseconds.
    pub latency_p50_us: u64,
    /// 99th percentile tensor latency, microseconds.
    pub latency_p99_us: u64,
    /// Largest tensor latency, microseconds.
    pub latency_max_us: u64,
    /// Completed tensors whose latency was at most each of [`LATENCY_BUCKETS_US`]
    /// (cumulative, as a Prometheus histogram counts them).
    pub latency_buckets: Vec<(u64, u64)>,
    /// The sum of every completed tensor's latency, microseconds (to the histogram's three
    /// significant digits).
    pub latency_sum_us: u64,
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
            failed_by_code: ErrorCode::ALL.iter().map(|_| AtomicU64::new(0)).collect(),
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

    /// A tensor completed `latency` after it began.
    pub(crate) fn completed(&self, latency: Duration) {
        self.completed.fetch_add(1, Ordering::Relaxed);
        let us = u64::try_from(latency.as_micros())
            .unwrap_or(u64::MAX)
            .max(1);
        let mut h = self
            .latency_us
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        h.saturating_record(us);
    }

    /// A tensor failed, with `code` where one is known.
    pub(crate) fn failed(&self, code: Option<ErrorCode>) {
        self.failed.fetch_add(1, Ordering::Relaxed);
        let registered = code.and_then(|code| ErrorCode::ALL.iter().position(|c| *c == code));
        if let Some(slot) = registered.and_then(|i| self.failed_by_code.get(i)) {
            slot.fetch_add(1, Ordering::Relaxed);
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
            failures_by_code: ErrorCode::ALL
                .iter()
                .zip(self.failed_by_code.iter())
                .map(|(code, count)| (*code, count.load(Ordering::Relaxed)))
                .filter(|(_, count)| *count > 0)
                .collect(),
            payload_bytes: self.payload_bytes.load(Ordering::Relaxed),
            latency_p50_us: h.value_at_quantile(0.5),
            latency_p99_us: h.value_at_quantile(0.99),
            latency_max_us: h.max(),
            latency_buckets: LATENCY_BUCKETS_US
                .iter()
                .map(|&bound| (bound, h.count_between(0, bound)))
                .collect(),
            latency_sum_us: (h.mean() * h.len() as f64) as u64,
            largest_stream_window: self.largest_stream_window.load(Ordering::Relaxed),
        }
    }
}

/// Connections a receiver turned away before or during their handshake.
#[derive(Debug, Default)]
pub(crate) struct Admissions {
    refused_peer_cap: AtomicU64,
    refused_total_cap: AtomicU64,
    handshakes_failed: AtomicU64,
}

/// A point-in-time copy of a receiver's connection admissions (spec §10).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AdmissionSnapshot {
    /// Connections refused because their peer held its cap of connections.
    pub refused_at_peer_cap: u64,
    /// Connections refused because all peers together held the cap in all.
    pub refused_at_total_cap: u64,
    /// Connections admitted whose handshake then failed (TLS, a client certificate, a
    /// timeout).
    pub handshakes_failed: u64,
}

impl Admissions {
    /// A connection was refused at `cap`.
    pub(crate) fn refused(&self, cap: CapExceeded) {
        let counter = match cap {
            CapExceeded::Peer { .. } => &self.refused_peer_cap,
            _ => &self.refused_total_cap,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// An admitted connection's handshake failed.
    pub(crate) fn handshake_failed(&self) {
        self.handshakes_failed.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> AdmissionSnapshot {
        AdmissionSnapshot {
            refused_at_peer_cap: self.refused_peer_cap.load(Ordering::Relaxed),
            refused_at_total_cap: self.refused_total_cap.load(Ordering::Relaxed),
            handshakes_failed: self.handshakes_failed.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_count_by_registered_code_and_a_peers_own_codes_add_no_entry() {
        let metrics = Metrics::default();
        metrics.failed(Some(ErrorCode::REJECTED));
        metrics.failed(Some(ErrorCode::REJECTED));
        metrics.failed(Some(ErrorCode::CHECKSUM_MISMATCH));
        // Codes a peer made up, and a failure with no code at all.
        for code in 0..1000 {
            metrics.failed(Some(ErrorCode(0x7000_0000 + code)));
        }
        metrics.failed(None);
        let snapshot = metrics.snapshot();
        assert_eq!(snapshot.tensors_failed, 1004);
        assert_eq!(
            snapshot.failures_by_code,
            [(ErrorCode::CHECKSUM_MISMATCH, 1), (ErrorCode::REJECTED, 2)]
        );
    }

    #[test]
    fn latency_buckets_are_cumulative_up_to_the_count() {
        let metrics = Metrics::default();
        for ms in [2, 20, 20, 700, 400_000] {
            metrics.completed(Duration::from_millis(ms));
        }
        let snapshot = metrics.snapshot();
        let counts: Vec<u64> = snapshot.latency_buckets.iter().map(|(_, n)| *n).collect();
        assert_eq!(counts, [0, 1, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4]);
        // The longest is past the last bucket: only the count (+Inf) has it.
        assert_eq!(snapshot.tensors_completed, 5);
        let sum_s = snapshot.latency_sum_us as f64 / 1e6;
        assert!((sum_s - 400.742).abs() < 400.742 * 0.01, "{sum_s}");
    }
}
