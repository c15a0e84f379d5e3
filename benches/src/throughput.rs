//! Throughput rounds: every transport once per round, raw quinn and tensorwire taking turns at
//! going first, the best run of each kept and every round's ratio recorded.

use crate::args::Args;
use crate::raw_quinn::raw_quinn;
use crate::report::{Rounds, Throughput};
use crate::setup::Setup;
use crate::source::{CHUNK, Loaded, RawSource, payload};
use crate::stats::{joined, keep_best, spread_text};
use crate::tcp_tls::tcp_tls;
use crate::tensorwire_run::{SinkKind, TensorwireRun, tensorwire_run};

/// Runs the throughput rounds `args` ask for, `bytes` per connection, raw quinn and TCP + TLS
/// sending from `source`.
pub(crate) async fn measure(
    setup: Setup,
    args: &Args,
    bytes: u64,
    tensor_bytes: u64,
    source: &Loaded,
) -> anyhow::Result<Rounds> {
    // The anchor of earlier figures, beside the like-for-like one.
    let hot = match args.source {
        Some(RawSource::Hot) => None,
        _ => Some(Loaded::Memory(payload(CHUNK))),
    };
    let mut measured = Rounds {
        with_hot: hot.is_some(),
        ..Rounds::default()
    };
    let connections: &[usize] = if args.no_throughput() {
        &[]
    } else {
        &args.connections
    };
    let skipped = f64::NAN;
    for &n in connections {
        let tw_run = TensorwireRun::from_args(setup, args, SinkKind::Discard, tensor_bytes);
        // Each round runs every transport once, so a machine that slows down or speeds up
        // between rounds moves both sides of that round's ratio. Raw quinn and tensorwire
        // swap places between rounds, since a fixed order can bias the ratio (the variant
        // that ran later won, results/LOG.md).
        let (mut quinn_s, mut hot_quinn_s, mut tw_s, mut tcp_s) =
            (skipped, skipped, skipped, skipped);
        let mut round_ratios = Vec::new();
        for round in 0..args.rounds().max(1) {
            let tensorwire_first = round % 2 == 1;
            let mut tw = skipped;
            if tensorwire_first && args.wants("tensorwire") {
                tw = tensorwire_run(n, bytes, tw_run.clone()).await?;
            }
            let quinn = if args.wants("raw-quinn") {
                raw_quinn(n, bytes, setup, source).await?
            } else {
                skipped
            };
            if let Some(hot) = hot.as_ref().filter(|_| args.wants("raw-quinn-hot")) {
                keep_best(&mut hot_quinn_s, raw_quinn(n, bytes, setup, hot).await?);
            }
            if !tensorwire_first && args.wants("tensorwire") {
                tw = tensorwire_run(n, bytes, tw_run.clone()).await?;
            }
            if args.wants("tcp-tls") {
                keep_best(&mut tcp_s, tcp_tls(n, bytes, source).await?);
            }
            keep_best(&mut quinn_s, quinn);
            keep_best(&mut tw_s, tw);
            round_ratios.push(quinn / tw);
        }
        // None where `--source hot` made the first anchor the hot one.
        let hot_quinn_s = hot.as_ref().map(|_| hot_quinn_s);
        measured.in_order.push((n, round_ratios));
        let total = bytes * n as u64;
        let rows = [
            Some(("raw quinn", quinn_s)),
            hot_quinn_s.map(|s| ("raw quinn, hot", s)),
            Some(("tensorwire", tw_s)),
            Some(("TCP+TLS", tcp_s)),
        ];
        // A transport `--only` left out has no row.
        for (transport, seconds) in rows.into_iter().flatten().filter(|(_, s)| !s.is_nan()) {
            measured.throughput.push(Throughput {
                transport,
                connections: n,
                bytes: total,
                seconds,
                gbit_per_s: total as f64 * 8.0 / seconds / 1e9,
            });
        }
        measured.ratios.push((n, quinn_s / tw_s));
        if let Some(hot_quinn_s) = hot_quinn_s {
            measured.hot_ratios.push((n, hot_quinn_s / tw_s));
        }
    }
    Ok(measured)
}

/// Prints the throughput table and each connection count's ratios.
pub(crate) fn print(args: &Args, measured: &Rounds, tensor_bytes: u64) {
    let runs = args.rounds();
    println!(
        "throughput, loopback, MTU {} ({} MiB per connection, best of {runs}):",
        args.mtu,
        args.mib_per_connection()
    );
    let source_name = match &args.source {
        None => format!(
            "a {} MiB buffer, as tensorwire's tensors",
            tensor_bytes >> 20
        ),
        Some(RawSource::Hot) => "one 4 MiB buffer again and again (cache-hot)".to_owned(),
        Some(RawSource::File(path)) => format!("{}, mapped", path.display()),
    };
    println!("  raw quinn and TCP+TLS send from {source_name}");
    if measured.with_hot {
        println!("  \"raw quinn, hot\" sends one 4 MiB buffer again and again (cache-hot)");
    }
    println!(
        "  {:<15} {:>5} {:>12} {:>10}",
        "transport", "conns", "Gbit/s", "seconds"
    );
    for t in &measured.throughput {
        println!(
            "  {:<15} {:>5} {:>12.2} {:>10.3}",
            t.transport, t.connections, t.gbit_per_s, t.seconds
        );
    }
    let summaries = measured.summaries();
    for (((n, ratio), (_, rounds)), (_, summary)) in measured
        .ratios
        .iter()
        .zip(&measured.in_order)
        .zip(&summaries)
    {
        if ratio.is_nan() {
            continue; // `--only` left tensorwire or raw quinn out.
        }
        let median_ratio = summary.median;
        let hot = measured
            .hot_ratios
            .iter()
            .find(|(m, r)| m == n && !r.is_nan());
        let hot = hot.map_or_else(String::new, |(_, hot_ratio)| {
            format!("; / raw quinn, hot: {hot_ratio:.3}")
        });
        let range = spread_text(runs, summary.range);
        let interval = summary.interval.map_or_else(String::new, |(low, high)| {
            format!("; 95% interval of the median {low:.3} to {high:.3}")
        });
        println!(
            "  tensorwire / raw quinn, {n} connection(s): {ratio:.3} (best of each), {median_ratio:.3} (median of the rounds' ratios{range}{interval}){hot}"
        );
        if rounds.len() > 1 {
            println!("    rounds in the order run: {}", joined(rounds, 3));
        }
    }
}
