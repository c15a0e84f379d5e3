//! A receiver's counters as Prometheus metrics, read at each scrape.

use std::fmt;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use tensorwire_quic::ReceiverObserver;
use tensorwire_sink::{MemoryBudget, MemorySnapshot};

/// A receiver's metrics, encoded on demand in the OpenMetrics text format; cheap to clone.
#[derive(Clone)]
pub struct ReceiverMetrics {
    collector: Arc<ReceiverCollector>,
}

/// Whether a [`Family`] only grows or goes up and down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FamilyKind {
    /// Only grows (Prometheus appends `_total` to its name).
    Counter,
    /// Goes up and down.
    Gauge,
}

/// One sample of a [`Family`]: its labels (name, value) and its value.
pub type Sample = (Vec<(&'static str, String)>, u64);

/// A metric family of the application's own (a GPU pool's hits, kernel runs), read at each
/// scrape beside the receiver's.
#[derive(Clone)]
pub struct Family {
    name: &'static str,
    help: &'static str,
    kind: FamilyKind,
    read: Arc<dyn Fn() -> Vec<Sample> + Send + Sync>,
}

impl Family {
    /// `tensorwire_NAME`, described by `help`, whose samples `read` returns at each scrape.
    pub fn new(
        name: &'static str,
        help: &'static str,
        kind: FamilyKind,
        read: impl Fn() -> Vec<Sample> + Send + Sync + 'static,
    ) -> Self {
        Self {
            name,
            help,
            kind,
            read: Arc::new(read),
        }
    }
}

impl fmt::Debug for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Family")
            .field("name", &self.name)
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

impl ReceiverMetrics {
    /// The metrics of the receiver `observer` reads (its host and METADATA memory included).
    pub fn new(observer: ReceiverObserver) -> Self {
        Self::with_memory(observer, Vec::new())
    }

    /// The same, with the state of further memory budgets (each GPU's) beside the host's.
    pub fn with_memory(observer: ReceiverObserver, budgets: Vec<MemoryBudget>) -> Self {
        Self {
            collector: Arc::new(ReceiverCollector {
                observer,
                budgets,
                families: Vec::new(),
            }),
        }
    }

    /// Adds a family of the application's own; its name must not be one of the receiver's.
    pub fn with_family(mut self, family: Family) -> Self {
        Arc::make_mut(&mut self.collector).families.push(family);
        self
    }

    /// Every metric now, as an OpenMetrics text exposition (ends with `# EOF`).
    pub fn encode(&self) -> String {
        let mut registry = Registry::with_prefix("tensorwire");
        registry.register_collector(Box::new(self.collector.clone()));
        let mut out = String::new();
        // Writing into a String cannot fail, and every collector below returns only the
        // writer's errors.
        let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
        out
    }
}

impl fmt::Debug for ReceiverMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReceiverMetrics").finish_non_exhaustive()
    }
}

/// Reads the receiver, the budgets and the application's families at each scrape.
#[derive(Clone, Debug)]
struct ReceiverCollector {
    observer: ReceiverObserver,
    budgets: Vec<MemoryBudget>,
    families: Vec<Family>,
}

impl Collector for ReceiverCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        use FamilyKind::{Counter, Gauge};
        let out = &mut encoder;
        let metrics = self.observer.metrics();
        family(
            out,
            "received_tensors",
            "Tensors received, by outcome: completed (landed and confirmed with COMPLETE) or \
             failed (refused, cancelled by either side, or lost with their connection).",
            Counter,
            &[
                sample(&[("outcome", "completed")], metrics.tensors_completed),
                sample(&[("outcome", "failed")], metrics.tensors_failed),
            ],
        )?;
        let registered: u64 = metrics.failures_by_code.iter().map(|(_, n)| n).sum();
        let by_code: Vec<Sample> = metrics
            .failures_by_code
            .iter()
            .map(|(code, n)| sample(&[("code", code.name().unwrap_or("other"))], *n))
            .chain([sample(
                &[("code", "other")],
                metrics.tensors_failed.saturating_sub(registered),
            )])
            .collect();
        family(
            out,
            "received_tensor_failures",
            "Failed received tensors by wire code (spec §9.2); other: an unregistered code, \
             or none (a connection lost).",
            Counter,
            &by_code,
        )?;
        family(
            out,
            "received_payload_bytes",
            "DATA payload bytes received.",
            Counter,
            &[sample(&[], metrics.payload_bytes)],
        )?;
        {
            let mut metric = out.encode_descriptor(
                "receive_latency_seconds",
                "Completed tensors by latency, METADATA received to COMPLETE sent.",
                None,
                MetricType::Histogram,
            )?;
            // The encoder sums the buckets itself and writes f64::MAX as +Inf: each bucket
            // goes with its own count, not the cumulative one the snapshot holds.
            let mut below = 0;
            let buckets: Vec<(f64, u64)> = metrics
                .latency_buckets
                .iter()
                .map(|&(us, cumulative)| (us as f64 / 1e6, cumulative))
                .chain([(f64::MAX, metrics.tensors_completed)])
                .map(|(seconds, cumulative)| {
                    let own = cumulative.saturating_sub(below);
                    below = below.max(cumulative);
                    (seconds, own)
                })
                .collect();
            metric.encode_histogram::<NoLabelSet>(
                metrics.latency_sum_us as f64 / 1e6,
                metrics.tensors_completed,
                &buckets,
                None,
            )?;
        }

        let admissions = self.observer.admissions();
        family(
            out,
            "refused_connections",
            "Connections refused before their handshake (spec §10), by the cap they met: \
             peer (one peer's connections) or total (all peers').",
            Counter,
            &[
                sample(&[("cap", "peer")], admissions.refused_at_peer_cap),
                sample(&[("cap", "total")], admissions.refused_at_total_cap),
            ],
        )?;
        family(
            out,
            "failed_handshakes",
            "Admitted connections whose TLS handshake failed (a certificate refused, a timeout).",
            Counter,
            &[sample(&[], admissions.handshakes_failed)],
        )?;

        let open = self.observer.open_connections();
        family(
            out,
            "connections",
            "Connections open now, by what carries their packets (spec §16).",
            Gauge,
            &[
                sample(&[("binding", "udp")], open.udp as u64),
                sample(&[("binding", "tcp")], open.tcp as u64),
            ],
        )?;
        family(
            out,
            "closing_streams",
            "Streams whose tensor ended, kept until the peer finishes its half (spec §4).",
            Gauge,
            &[sample(&[], open.closing_streams as u64)],
        )?;

        let credit = self.observer.budget();
        family(
            out,
            "credit_budget_bytes",
            "The receiver's byte-credit budget (spec §7.1).",
            Gauge,
            &[sample(&[], credit.budget)],
        )?;
        family(
            out,
            "credit_bytes",
            "Credit outstanding now: in_flight (granted, not yet arrived; early credit \
             included), early_offered (of in_flight, early credit offered and unused, spec \
             §7.6), held (arrived, not yet durable in a sink).",
            Gauge,
            &[
                sample(&[("state", "in_flight")], credit.in_flight),
                sample(&[("state", "early_offered")], credit.early_offered),
                sample(&[("state", "held")], credit.held),
            ],
        )?;
        family(
            out,
            "credit_peak_bytes",
            "The most credit ever outstanding at once (in flight plus held).",
            Gauge,
            &[sample(&[], credit.peak_outstanding)],
        )?;

        let mut memories: Vec<(String, MemorySnapshot)> = vec![
            ("host".to_owned(), self.observer.host_memory()),
            ("metadata".to_owned(), self.observer.metadata_memory()),
        ];
        memories.extend(
            self.budgets
                .iter()
                .map(|b| (b.what().to_owned(), b.snapshot())),
        );
        let each = |value: fn(&MemorySnapshot) -> u64| -> Vec<Sample> {
            memories
                .iter()
                .map(|(what, m)| sample(&[("memory", what)], value(m)))
                .collect()
        };
        family(
            out,
            "memory_limit_bytes",
            "Each memory budget's limit: host (landed tensors in host memory), metadata \
             (METADATA of open streams, spec §10), cuda:N (a GPU's).",
            Gauge,
            &each(|m| m.limit),
        )?;
        let by_state: Vec<Sample> = memories
            .iter()
            .flat_map(|(what, m)| {
                [
                    sample(&[("memory", what), ("state", "reserved")], m.reserved),
                    sample(&[("memory", what), ("state", "kept")], m.kept),
                ]
            })
            .collect();
        family(
            out,
            "memory_bytes",
            "Each memory budget's use now: reserved (for tensors landed or landing), kept \
             (buffers of dropped tensors kept for reuse).",
            Gauge,
            &by_state,
        )?;
        family(
            out,
            "memory_peak_bytes",
            "The most each memory budget ever held at once, kept buffers included.",
            Gauge,
            &each(|m| m.peak),
        )?;

        for extra in &self.families {
            family(out, extra.name, extra.help, extra.kind, &(extra.read)())?;
        }
        Ok(())
    }
}

/// A sample with `labels` (name, value) and `value`.
fn sample(labels: &[(&'static str, &str)], value: u64) -> Sample {
    let labels = labels.iter().map(|(k, v)| (*k, (*v).to_owned())).collect();
    (labels, value)
}

/// One metric family: its descriptor, then each sample with its labels.
fn family(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: FamilyKind,
    samples: &[Sample],
) -> fmt::Result {
    let metric_type = match kind {
        FamilyKind::Counter => MetricType::Counter,
        FamilyKind::Gauge => MetricType::Gauge,
    };
    let mut metric = encoder.encode_descriptor(name, help, None, metric_type)?;
    for (labels, value) in samples {
        let encode = |m: &mut MetricEncoder| match kind {
            FamilyKind::Counter => m.encode_counter::<NoLabelSet, _, u64>(value, None),
            FamilyKind::Gauge => m.encode_gauge(value),
        };
        match labels.is_empty() {
            true => encode(&mut metric)?,
            false => encode(&mut metric.encode_family(labels)?)?,
        }
    }
    Ok(())
}
