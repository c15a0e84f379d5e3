//! Small-tensor latency: tensorwire's METADATA → COMPLETE beside raw quinn's request and
//! response, one message at a time, in a row and alternated.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use tensorwire::proto::{DType, TensorMeta};
use tensorwire::quic::{Receiver, ReceiverConfig, Sender, SenderConfig};

use crate::alloc::{ALLOCATOR, Counting};
use crate::args::Args;
use crate::raw_quinn::{first_connection, quinn_client, quinn_server};
use crate::report::Latency;
use crate::setup::Setup;
use crate::source::payload;
use crate::tensorwire_run::DiscardSink;
use crate::threads::{ProcessUsage, ThreadUsage};

pub(crate) fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("constant bounds")
}

/// Runs a latency client on a runtime worker, as a server's tasks run, not on `main`'s own
/// thread (which every wake-up would have to cross to).
pub(crate) async fn on_worker(
    run: impl Future<Output = anyhow::Result<Histogram<u64>>> + Send + 'static,
) -> anyhow::Result<Histogram<u64>> {
    tokio::spawn(run).await?
}

/// How the latency run's two ends hand tensors to the application.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admission {
    /// `Receiver::next` and `accept` on the application's task; `send` on a task of its own.
    Queued,
    /// `Receiver::admit_with` on each tensor's own task; `send_inline` on the caller's task.
    Inline,
}

/// One tensorwire connection for the latency runs: one tensor at a time, METADATA →
/// COMPLETE, in one round trip once the receiver's early credit (spec §7.6) has arrived,
/// which [`start`](Self::start) awaits.
pub(crate) struct TensorwireLatency {
    pub(crate) sender: Arc<Sender>,
    pub(crate) server: tokio::task::JoinHandle<anyhow::Result<Receiver>>,
    pub(crate) admission: Admission,
    pub(crate) meta: TensorMeta,
    pub(crate) data: Bytes,
    pub(crate) samples: u64,
}

impl TensorwireLatency {
    /// A receiver and a connected sender, for `samples` tensors of `size` bytes.
    pub(crate) async fn start(
        samples: u64,
        size: usize,
        setup: Setup,
        admission: Admission,
    ) -> anyhow::Result<Self> {
        let mut config = ReceiverConfig::new(
            "127.0.0.1:0".parse()?,
            tensorwire::quic::ServerTls::Development,
        );
        config.transport = setup.transport();
        config.endpoints = 1;
        let mut receiver = Receiver::bind(config).await?;
        let addr = receiver.local_addr()?;
        // Accepting starts the receive on the tensor's own task, which goes on with the
        // handle dropped: the receiver's counts say at the end whether every tensor landed,
        // so nothing is spawned or kept per tensor on the measured path.
        if admission == Admission::Inline {
            receiver.admit_with(|incoming| drop(incoming.accept(DiscardSink)))?;
        }
        let server = tokio::spawn(async move {
            if admission == Admission::Queued {
                for _ in 0..samples {
                    let incoming = receiver
                        .next()
                        .await
                        .ok_or_else(|| anyhow::anyhow!("closed"))?;
                    drop(incoming.accept(DiscardSink));
                }
            }
            anyhow::Ok(receiver)
        });
        let sender = Sender::connect(addr, {
            let mut config = SenderConfig::new(tensorwire::quic::ClientTls::Development);
            config.transport = setup.transport();
            config
        })
        .await?;
        for _ in 0..1000 {
            if sender.early_allowance().is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        match sender.early_allowance() {
            Some(bytes) if bytes >= size as u64 => {
                println!("tensorwire latency: {size}-byte tensors go early, in one round trip");
            }
            other => println!("tensorwire latency: no early credit for {size} bytes ({other:?})"),
        }
        Ok(Self {
            sender: Arc::new(sender),
            server,
            admission,
            meta: TensorMeta::new([size as u64], DType::U8)?.with_name("small"),
            data: payload(size),
            samples,
        })
    }
}

impl LatencyConnection for TensorwireLatency {
    /// Sends the tensors on the connection's own runtime, where a latency-sensitive
    /// application runs its sends.
    async fn run(&self, count: u64) -> anyhow::Result<Histogram<u64>> {
        let (sender, meta, data, admission) = (
            self.sender.clone(),
            self.meta.clone(),
            self.data.clone(),
            self.admission,
        );
        self.sender
            .runtime()
            .spawn(async move {
                let mut h = histogram();
                for _ in 0..count {
                    let started = Instant::now();
                    match admission {
                        Admission::Queued => {
                            sender.send(meta.clone(), data.clone()).finished().await?
                        }
                        Admission::Inline => sender.send_inline(meta.clone(), data.clone()).await?,
                    };
                    h.saturating_record(started.elapsed().as_micros() as u64);
                }
                anyhow::Ok(h)
            })
            .await?
    }

    /// Also checks that every tensor was admitted and landed.
    async fn finish(self) -> anyhow::Result<()> {
        print_datagrams("tensorwire", &self.sender.connection_stats(), self.samples);
        Arc::into_inner(self.sender)
            .ok_or_else(|| anyhow::anyhow!("sender still shared"))?
            .close()
            .await;
        let receiver = self.server.await??;
        // A tensor's stream task counts it right after sending COMPLETE.
        let mut landed = receiver.metrics();
        for _ in 0..100 {
            if landed.tensors_completed + landed.tensors_failed >= self.samples {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            landed = receiver.metrics();
        }
        anyhow::ensure!(
            landed.tensors_completed == self.samples && landed.tensors_failed == 0,
            "{} of {} tensors landed, {} failed",
            landed.tensors_completed,
            self.samples,
            landed.tensors_failed
        );
        receiver.close().await;
        Ok(())
    }
}

/// A connection of a latency run, up: it exchanges messages one at a time, then closes.
pub(crate) trait LatencyConnection: Send + Sync + Sized + 'static {
    /// Exchanges `count` messages one after another and records each one's time.
    fn run(&self, count: u64) -> impl Future<Output = anyhow::Result<Histogram<u64>>> + Send;
    /// Closes both ends (and checks what the run left behind).
    fn finish(self) -> impl Future<Output = anyhow::Result<()>> + Send;
}

/// `samples` messages in a row over a connection `start` brings up, which is then closed;
/// prints, under `label`, the context switches and CPU time per message of each thread that
/// switched while the messages went (set-up and close left out).
pub(crate) async fn in_a_row<C: LatencyConnection>(
    label: &str,
    samples: u64,
    start: impl Future<Output = anyhow::Result<C>>,
) -> anyhow::Result<Histogram<u64>> {
    let connection = start.await?;
    let before = ThreadUsage::now();
    let h = connection.run(samples).await?;
    let by_thread = ThreadUsage::now().since(&before, samples);
    connection.finish().await?;
    if !by_thread.is_empty() {
        println!(
            "{label}: per message, by thread (oldest first): context switches (CPU) {by_thread}"
        );
    }
    Ok(h)
}

/// What the raw quinn latency anchor exchanges on each fresh stream.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Exchange {
    /// `size` bytes and FIN, a 1-byte answer: a plain request/response.
    OneRoundTrip,
    /// tensorwire's two round trips on bare quinn: a 64-byte header and a 1-byte answer, then
    /// `size` bytes and FIN and a 1-byte answer (METADATA → ACCEPT, DATA + END → COMPLETE,
    /// without framing, credit or a sink).
    TwoRoundTrips,
}

/// One raw quinn connection for the latency runs: each message on a fresh stream, as
/// `exchange` says.
pub(crate) struct QuinnLatency {
    conn: quinn::Connection,
    client: quinn::Endpoint,
    client_runtime: tokio::runtime::Handle,
    server_task: tokio::task::JoinHandle<anyhow::Result<()>>,
    exchange: Exchange,
    data: Bytes,
    samples: u64,
}

impl QuinnLatency {
    pub(crate) async fn start(
        samples: u64,
        size: usize,
        setup: Setup,
        exchange: Exchange,
    ) -> anyhow::Result<Self> {
        let (server, server_runtime, cert) = quinn_server(setup)?;
        let addr: SocketAddr = server.local_addr()?;
        let server_task = server_runtime.spawn(async move {
            let conn = first_connection(server).await?;
            while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                tokio::spawn(async move {
                    if exchange == Exchange::TwoRoundTrips {
                        let mut header = [0u8; 64];
                        recv.read_exact(&mut header).await?;
                        send.write_all(&[1]).await?;
                    }
                    let _ = recv.read_to_end(usize::MAX).await?;
                    send.write_all(&[2]).await?;
                    send.finish()?;
                    anyhow::Ok(())
                });
            }
            anyhow::Ok(())
        });
        let (client, client_runtime, config) =
            quinn_client(setup, &cert, crate::raw_quinn::LOOPBACK)?;
        let conn = client.connect_with(config, addr, "localhost")?.await?;
        Ok(Self {
            conn,
            client,
            client_runtime,
            server_task,
            exchange,
            data: payload(size),
            samples,
        })
    }
}

impl LatencyConnection for QuinnLatency {
    /// Exchanges the messages on the client endpoint's runtime, as tensorwire's client runs.
    async fn run(&self, count: u64) -> anyhow::Result<Histogram<u64>> {
        let (conn, data, exchange) = (self.conn.clone(), self.data.clone(), self.exchange);
        self.client_runtime
            .spawn(async move {
                let mut h = histogram();
                let mut answer = [0u8; 1];
                for _ in 0..count {
                    let started = Instant::now();
                    let (mut send, mut recv) = conn.open_bi().await?;
                    if exchange == Exchange::TwoRoundTrips {
                        send.write_all(&[0u8; 64]).await?;
                        recv.read_exact(&mut answer).await?;
                    }
                    send.write_chunk(data.clone()).await?;
                    send.finish()?;
                    let _ = recv.read_to_end(16).await?;
                    h.saturating_record(started.elapsed().as_micros() as u64);
                }
                anyhow::Ok(h)
            })
            .await?
    }

    async fn finish(self) -> anyhow::Result<()> {
        print_datagrams("raw quinn", &self.conn.stats(), self.samples);
        self.conn.close(0u32.into(), b"done");
        self.client.wait_idle().await;
        self.server_task.abort();
        Ok(())
    }
}

/// The latency row of tensorwire in [`alternated_latency`].
pub(crate) const ALTERNATED_TENSORWIRE: &str = "tensorwire, inline, alt.";
/// The latency row of raw quinn in [`alternated_latency`].
pub(crate) const ALTERNATED_QUINN: &str = "raw quinn, alternated";

/// tensorwire (inline) and raw quinn's request/response with both connections up, taking
/// turns ten messages at a time (which goes first swapped every turn), so that both meet
/// the same state of the host: on a loaded or virtualised host one end-to-end wake-up costs
/// anywhere from a few to tens of µs, from one minute to the next.
pub(crate) async fn alternated_latency(
    samples: u64,
    size: usize,
    setup: Setup,
) -> anyhow::Result<(Histogram<u64>, Histogram<u64>)> {
    const TURN: u64 = 10;
    let tensorwire = TensorwireLatency::start(samples, size, setup, Admission::Inline).await?;
    let quinn = QuinnLatency::start(samples, size, setup, Exchange::OneRoundTrip).await?;
    let (mut tw, mut raw) = (histogram(), histogram());
    let mut done = 0;
    while done < samples {
        let n = TURN.min(samples - done);
        if (done / TURN).is_multiple_of(2) {
            tw.add(tensorwire.run(n).await?)?;
            raw.add(quinn.run(n).await?)?;
        } else {
            raw.add(quinn.run(n).await?)?;
            tw.add(tensorwire.run(n).await?)?;
        }
        done += n;
    }
    tensorwire.finish().await?;
    quinn.finish().await?;
    Ok((tw, raw))
}

/// UDP datagrams the client sent and received per message, handshake included: one each way
/// is the floor for a request/response.
pub(crate) fn print_datagrams(who: &str, stats: &quinn::ConnectionStats, samples: u64) {
    let per = |n: u64| n as f64 / samples.max(1) as f64;
    println!(
        "{who} latency client: {:.2} datagrams sent, {:.2} received per message",
        per(stats.udp_tx.datagrams),
        per(stats.udp_rx.datagrams)
    );
    println!(
        "{who} latency client, QUIC frames per message: sent {}; received {}",
        frames_per_message(&stats.frame_tx, samples),
        frames_per_message(&stats.frame_rx, samples)
    );
}

/// The kinds of QUIC frame a latency exchange can carry, per message, where one in a hundred
/// messages or more carries one: what an extra datagram held.
pub(crate) fn frames_per_message(frames: &quinn::FrameStats, samples: u64) -> String {
    let kinds = [
        ("STREAM", frames.stream),
        ("ACK", frames.acks),
        ("MAX_DATA", frames.max_data),
        ("MAX_STREAM_DATA", frames.max_stream_data),
        ("MAX_STREAMS (bidi)", frames.max_streams_bidi),
        ("MAX_STREAMS (uni)", frames.max_streams_uni),
        ("PING", frames.ping),
        ("RESET_STREAM", frames.reset_stream),
        ("STOP_SENDING", frames.stop_sending),
        ("DATA_BLOCKED", frames.data_blocked),
        ("STREAM_DATA_BLOCKED", frames.stream_data_blocked),
        ("STREAMS_BLOCKED (bidi)", frames.streams_blocked_bidi),
    ];
    kinds
        .iter()
        .map(|(kind, n)| (kind, *n as f64 / samples.max(1) as f64))
        .filter(|(_, per)| *per >= 0.01)
        .map(|(kind, per)| format!("{kind} {per:.2}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A latency row; `used` is what the whole process spent over the run, if it was measured
/// alone.
pub(crate) fn latency_row(
    transport: &'static str,
    size: usize,
    h: &Histogram<u64>,
    used: Option<ProcessUsage>,
) -> Latency {
    let per_message = |n: f64| n / h.len().max(1) as f64;
    Latency {
        transport,
        message_bytes: size,
        samples: h.len(),
        p50_us: h.value_at_quantile(0.5),
        p99_us: h.value_at_quantile(0.99),
        cpu_us_per_message: used.map(|u| per_message(u.cpu_seconds * 1e6)),
        context_switches_per_message: used.map(|u| per_message(u.context_switches as f64)),
        allocations_per_message: used.map(|u| per_message(u.allocations as f64)),
    }
}

/// The latency rows measured alone, one connection each: `samples` messages of `size` bytes.
pub(crate) struct LatencyRows {
    pub(crate) samples: u64,
    pub(crate) size: usize,
    pub(crate) setup: Setup,
}

impl LatencyRows {
    /// tensorwire's row for `admission`.
    pub(crate) async fn tensorwire(&self, admission: Admission) -> anyhow::Result<Latency> {
        let name = match admission {
            Admission::Queued => "tensorwire, queued",
            Admission::Inline => "tensorwire, inline",
        };
        let start = TensorwireLatency::start(self.samples, self.size, self.setup, admission);
        self.measure(name, start).await
    }

    /// Raw quinn's row for `exchange`.
    pub(crate) async fn quinn(&self, exchange: Exchange) -> anyhow::Result<Latency> {
        let name = match exchange {
            Exchange::OneRoundTrip => "raw quinn",
            Exchange::TwoRoundTrips => "raw quinn, 2 round trips",
        };
        let start = QuinnLatency::start(self.samples, self.size, self.setup, exchange);
        self.measure(name, start).await
    }

    /// The row `name` of the messages in a row over the connection `start` brings up.
    pub(crate) async fn measure<C: LatencyConnection>(
        &self,
        name: &'static str,
        start: impl Future<Output = anyhow::Result<C>> + Send + 'static,
    ) -> anyhow::Result<Latency> {
        measured_row(name, self.size, in_a_row(name, self.samples, start)).await
    }
}

/// Runs one latency measurement on a runtime worker and makes its row, with the process's
/// CPU time and context switches per message over the run (both ends live in this process;
/// set-up included).
pub(crate) async fn measured_row(
    transport: &'static str,
    size: usize,
    run: impl Future<Output = anyhow::Result<Histogram<u64>>> + Send + 'static,
) -> anyhow::Result<Latency> {
    ALLOCATOR.count(Counting::On);
    let before = ProcessUsage::now();
    let h = on_worker(run).await;
    let after = ProcessUsage::now();
    ALLOCATOR.count(Counting::Off);
    let used = before.zip(after).map(|(b, a)| a.since(&b));
    Ok(latency_row(transport, size, &h?, used))
}

/// Size of the message every latency row sends.
pub(crate) const MESSAGE_BYTES: usize = 4096;

/// The latency rows `args` ask for: all of them, alternated ones included, or one alone
/// (`--only latency-inline`, `--only latency-raw`); none without samples.
pub(crate) async fn measure(setup: Setup, args: &Args) -> anyhow::Result<Vec<Latency>> {
    let samples = args.latency_samples();
    let size = MESSAGE_BYTES;
    let rows = LatencyRows {
        samples,
        size,
        setup,
    };
    Ok(match args.only.as_deref() {
        _ if samples == 0 => Vec::new(),
        Some("latency-inline") => vec![rows.tensorwire(Admission::Inline).await?],
        Some("latency-raw") => vec![rows.quinn(Exchange::OneRoundTrip).await?],
        _ => {
            let (alternated_tw, alternated_raw) =
                tokio::spawn(alternated_latency(samples, size, setup)).await??;
            vec![
                rows.tensorwire(Admission::Queued).await?,
                rows.tensorwire(Admission::Inline).await?,
                rows.quinn(Exchange::OneRoundTrip).await?,
                rows.quinn(Exchange::TwoRoundTrips).await?,
                latency_row(ALTERNATED_TENSORWIRE, size, &alternated_tw, None),
                latency_row(ALTERNATED_QUINN, size, &alternated_raw, None),
            ]
        }
    })
}

/// Prints the latency rows and tensorwire's p50 and p99 over raw quinn's.
pub(crate) fn print(latency: &[Latency], samples: u64) {
    if latency.is_empty() {
        return;
    }
    println!("latency, one {MESSAGE_BYTES}-byte message at a time ({samples} samples):");
    for l in latency {
        let usage = l
            .cpu_us_per_message
            .zip(l.context_switches_per_message)
            .zip(l.allocations_per_message)
            .map_or_else(String::new, |((us, switches), allocations)| {
                format!(
                    "   per message: CPU {us:.0} µs, {switches:.1} context switches, {allocations:.1} allocations"
                )
            });
        println!(
            "  {:<25} p50 {:>6} µs   p99 {:>6} µs{usage}",
            l.transport, l.p50_us, l.p99_us
        );
    }
    let row = |name: &str| latency.iter().find(|l| l.transport == name);
    for (how, tw, raw) in [
        ("one after the other", "tensorwire, inline", "raw quinn"),
        ("alternated", ALTERNATED_TENSORWIRE, ALTERNATED_QUINN),
    ] {
        if let (Some(tw), Some(raw)) = (row(tw), row(raw)) {
            let times = |a: u64, b: u64| a as f64 / b.max(1) as f64;
            println!(
                "  tensorwire inline / raw quinn, {how}: p50 {:.2}×, p99 {:.2}×",
                times(tw.p50_us, raw.p50_us),
                times(tw.p99_us, raw.p99_us)
            );
        }
    }
}
