//! What one `bench` call measured, as written to `--json`.

use serde::Serialize;

use crate::args::Args;
use crate::stats::RoundsSummary;

/// What the rounds of every connection count measured.
#[derive(Default)]
pub(crate) struct Rounds {
    /// Each transport's best run per connection count.
    pub(crate) throughput: Vec<Throughput>,
    /// (connections, tensorwire's rate / raw quinn's, best of each)
    pub(crate) ratios: Vec<(usize, f64)>,
    /// (connections, every round's ratio in the order run)
    pub(crate) in_order: Vec<(usize, Vec<f64>)>,
    /// (connections, tensorwire's rate / raw quinn's from a cache-hot 4 MiB buffer)
    pub(crate) hot_ratios: Vec<(usize, f64)>,
    /// Whether raw quinn also sent the cache-hot buffer.
    pub(crate) with_hot: bool,
}

impl Rounds {
    /// What each connection count's rounds say, for the table and the JSON alike.
    pub(crate) fn summaries(&self) -> Vec<(usize, RoundsSummary)> {
        self.in_order
            .iter()
            .map(|(n, rounds)| (*n, RoundsSummary::of(rounds)))
            .collect()
    }
}

#[derive(Serialize, Debug, Clone)]
pub(crate) struct Throughput {
    pub(crate) transport: &'static str,
    pub(crate) connections: usize,
    pub(crate) bytes: u64,
    pub(crate) seconds: f64,
    pub(crate) gbit_per_s: f64,
}

#[derive(Serialize, Debug, Clone)]
pub(crate) struct Latency {
    pub(crate) transport: &'static str,
    pub(crate) message_bytes: usize,
    pub(crate) samples: u64,
    pub(crate) p50_us: u64,
    pub(crate) p99_us: u64,
    /// The whole process's CPU time per message, both ends included.
    pub(crate) cpu_us_per_message: Option<f64>,
    /// The whole process's context switches per message, both ends included.
    pub(crate) context_switches_per_message: Option<f64>,
    /// Heap allocations (and reallocations) per message, both ends included.
    pub(crate) allocations_per_message: Option<f64>,
}

/// What one ingest-from-memory run measured.
#[derive(Serialize, Debug)]
pub(crate) struct SinkIngest {
    pub(crate) gb_per_s: f64,
    /// Mean host → device copy in MiB.
    pub(crate) mean_copy_mib: f64,
    /// Tensors whose destination the device pool could not serve.
    pub(crate) allocated_outside_pool: u64,
}

/// One ingest-from-memory run and its two anchors at the same count.
#[derive(Serialize, Debug)]
pub(crate) struct IngestRun {
    /// Sinks fed at once; threads, for the anchors.
    pub(crate) sinks: usize,
    /// The best of `--runs` rounds.
    #[serde(flatten)]
    pub(crate) ingest: SinkIngest,
    /// Every round's rate, in the order run.
    pub(crate) rounds_gb_per_s: Vec<f64>,
    /// Plain memory copies as ingest's into staging, no GPU involved.
    pub(crate) host_copy_gb_per_s: f64,
    /// Ingest's copies into staging and to the device, without the sink.
    pub(crate) staged_h2d_gb_per_s: f64,
}

/// Network → host beside network → GPU at one connection count, the sinks taking turns in
/// each round.
#[derive(Serialize, Debug)]
pub(crate) struct NetworkRun {
    pub(crate) connections: usize,
    /// The best round's rate into host memory (budgeted, kept buffers).
    pub(crate) host_gbit_per_s: f64,
    /// The best round's rate into GPU memory.
    pub(crate) gpu_gbit_per_s: f64,
    /// The best GPU rate over the best host rate.
    pub(crate) gpu_over_host: f64,
    /// The median over rounds of GPU / host within the round.
    pub(crate) median_round_gpu_over_host: f64,
    /// The lowest and highest of those rounds' ratios.
    pub(crate) round_gpu_over_host_range: (f64, f64),
}

#[derive(Serialize, Debug)]
pub(crate) struct GpuReport {
    pub(crate) device: String,
    /// The pools the sinks drew from (free buffers each keeps at most).
    pub(crate) staging_pool_mib: usize,
    pub(crate) device_pool_mib: usize,
    pub(crate) pinned_h2d_gb_per_s: f64,
    pub(crate) ingest_from_memory: Vec<IngestRun>,
    pub(crate) network: Vec<NetworkRun>,
    pub(crate) staging_hit_rate: f64,
    pub(crate) device_pool_hit_rate: f64,
}

#[derive(Serialize, Debug)]
pub(crate) struct Report {
    pub(crate) host: String,
    pub(crate) cores: usize,
    pub(crate) mtu: u16,
    /// `--delay-ms`: what the relay in the QUIC throughput runs' path held each datagram
    /// each way (0: no relay)
    pub(crate) one_way_delay_ms: u64,
    /// tensorwire's credit window per tensor at its start, and the most it may grow to
    pub(crate) stream_window_mib: u64,
    pub(crate) max_stream_window_mib: u64,
    pub(crate) throughput: Vec<Throughput>,
    /// (connections, tensorwire's rate / raw quinn's from `--source`)
    pub(crate) ratio_tensorwire_over_quinn: Vec<(usize, f64)>,
    /// (connections, the median over rounds of tensorwire's rate / raw quinn's in that round)
    pub(crate) median_round_ratio_tensorwire_over_quinn: Vec<(usize, f64)>,
    /// (connections, the lowest and highest of those rounds' ratios): how far one host's
    /// rounds spread, which a median of few rounds hides
    pub(crate) round_ratio_range_tensorwire_over_quinn: Vec<(usize, (f64, f64))>,
    /// (connections, every round's ratio in the order run): whether the host drifted
    pub(crate) round_ratios_tensorwire_over_quinn: Vec<(usize, Vec<f64>)>,
    /// (connections, a 95% confidence interval of the median round ratio, where there were
    /// 6 rounds or more): whether a target lies within the rounds' spread
    pub(crate) median_interval_95_tensorwire_over_quinn: Vec<(usize, Option<(f64, f64)>)>,
    /// (connections, tensorwire's rate / raw quinn's from a cache-hot 4 MiB buffer)
    pub(crate) ratio_tensorwire_over_hot_quinn: Vec<(usize, f64)>,
    pub(crate) latency: Vec<Latency>,
    pub(crate) gpu: Option<GpuReport>,
}

impl Report {
    /// The report of one call: this host, the flags that shape the figures, and every row.
    pub(crate) fn new(
        args: &Args,
        rounds: Rounds,
        latency: Vec<Latency>,
        gpu: Option<GpuReport>,
    ) -> Self {
        let summaries = rounds.summaries();
        Report {
            host: cpu_model(),
            cores: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(0),
            mtu: args.mtu,
            one_way_delay_ms: args.delay_ms,
            stream_window_mib: args.window_mib,
            max_stream_window_mib: args.max_window_mib,
            throughput: rounds.throughput,
            ratio_tensorwire_over_quinn: rounds.ratios,
            median_round_ratio_tensorwire_over_quinn: summaries
                .iter()
                .map(|(n, s)| (*n, s.median))
                .collect(),
            round_ratio_range_tensorwire_over_quinn: summaries
                .iter()
                .map(|(n, s)| (*n, s.range))
                .collect(),
            median_interval_95_tensorwire_over_quinn: summaries
                .iter()
                .map(|(n, s)| (*n, s.interval))
                .collect(),
            round_ratios_tensorwire_over_quinn: rounds.in_order,
            ratio_tensorwire_over_hot_quinn: rounds.hot_ratios,
            latency,
            gpu,
        }
    }
}

/// The CPU's model name, from `/proc/cpuinfo`; empty where it cannot be read.
fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_default()
}

/// With `BENCH_STATS` set, prints what a throughput run's connection saw of its path.
pub(crate) fn print_path_stats(who: &str, stats: &quinn::ConnectionStats) {
    if std::env::var_os("BENCH_STATS").is_some() {
        eprintln!(
            "{who}: sent {} packets, lost {}, mtu {}, congestion window {} KiB, rtt {:?}, congestion events {}, received {} datagrams",
            stats.path.sent_packets,
            stats.path.lost_packets,
            stats.path.current_mtu,
            stats.path.cwnd >> 10,
            stats.path.rtt,
            stats.path.congestion_events,
            stats.udp_rx.datagrams
        );
    }
}
