//! tensorwire's throughput run: tensors of `--tensor-mib` over N connections into a sink
//! that discards (or a GPU sink, for the GPU section).

use std::sync::Arc;
use std::time::Instant;

use tensorwire::proto::{DType, Payload, TensorMeta};
use tensorwire::quic::{
    CreditPermit, IncomingTensor, Receiver, ReceiverConfig, Sender, SenderConfig, Sink, SinkError,
};

use crate::args::Args;
use crate::report::print_path_stats;
use crate::setup::Setup;
use crate::source::payload;
use crate::threads::ThreadUsage;

/// Where tensorwire's throughput runs put the bytes.
#[derive(Clone)]
pub(crate) enum SinkKind {
    /// Drop them: the transport alone.
    Discard,
    /// A placement (the GPU runs use one).
    Placed(tensorwire::gpu::Placement),
    /// Host memory as a receiving application gets it: `accept_host`, under the receiver's
    /// host-memory budget, landing in the kept buffers of tensors already dropped.
    Host,
}

impl SinkKind {
    /// Accepts `incoming` into this kind of sink; the future resolves when it has landed.
    pub(crate) async fn accept(&self, incoming: IncomingTensor) -> anyhow::Result<Landing> {
        Ok(match self {
            SinkKind::Discard => landing(incoming.accept(DiscardSink)),
            SinkKind::Placed(placement) => {
                let sink = placement.sink(incoming.meta())?;
                landing(incoming.accept(sink))
            }
            SinkKind::Host => landing(incoming.accept_host().await?),
        })
    }
}

/// Resolves once the tensor of `handle` has landed, its output dropped.
pub(crate) fn landing<T: Send + 'static>(handle: tensorwire::quic::TensorHandle<T>) -> Landing {
    Box::pin(async move { handle.finished().await.map(drop) })
}

/// Counts bytes and drops them: measures the transport, not a memcpy into a buffer.
pub(crate) struct DiscardSink;

impl Sink for DiscardSink {
    type Output = ();

    async fn store(
        &mut self,
        _: u64,
        payload: Payload,
        permit: CreditPermit,
        crc: Option<&mut u32>,
    ) -> Result<(), SinkError> {
        std::hint::black_box(payload.len());
        payload.continue_crc(crc);
        drop(permit);
        Ok(())
    }

    async fn finish(self) -> Result<(), SinkError> {
        Ok(())
    }
}

/// A tensor accepted by a throughput run's receiver: resolves once it has landed (the
/// receive runs on the tensor's own task, whether or not this is polled).
type Landing =
    std::pin::Pin<Box<dyn Future<Output = Result<(), tensorwire::quic::TransportError>> + Send>>;

/// tensorwire's knobs for one throughput run.
#[derive(Clone)]
pub(crate) struct TensorwireRun {
    sink: SinkKind,
    tensor_bytes: u64,
    setup: Setup,
    chunk: u64,
    window: u64,
    max_window: u64,
    grant: u64,
    inflight: usize,
}

impl TensorwireRun {
    /// The knobs the command line set (and the call's `setup`), for tensors of `tensor_bytes` landing in `sink`.
    pub(crate) fn from_args(setup: Setup, args: &Args, sink: SinkKind, tensor_bytes: u64) -> Self {
        Self {
            sink,
            tensor_bytes,
            setup,
            chunk: args.chunk_kib << 10,
            window: args.window_mib << 20,
            max_window: args.max_window_mib << 20,
            grant: args.grant_mib << 20,
            inflight: args.inflight,
        }
    }
}

pub(crate) async fn tensorwire_run(
    connections: usize,
    bytes_per_conn: u64,
    run: TensorwireRun,
) -> anyhow::Result<f64> {
    let TensorwireRun {
        sink,
        tensor_bytes,
        setup,
        chunk,
        window,
        max_window,
        grant,
        inflight: in_flight,
    } = run;
    let tensors_per_conn = bytes_per_conn.div_ceil(tensor_bytes);
    let data = payload(tensor_bytes as usize);
    let mut receivers = Vec::new();
    let mut senders = Vec::new();
    let mut relays = Vec::new();
    for _ in 0..connections {
        // One receiving endpoint (socket) per connection: quinn's receive path is one task
        // per endpoint.
        let mut config = ReceiverConfig::new(
            "127.0.0.1:0".parse()?,
            tensorwire::quic::ServerTls::Development,
        )
        .with_budget((window * 8).max(256 << 20));
        config.transport = setup.transport();
        config.endpoints = 1;
        config.store_offload = setup.store_offload;
        config.session.stream_window = window;
        config.session.max_stream_window = max_window;
        config.session.grant_unit = grant;
        let mut receiver = Receiver::bind(config).await?;
        let addr = receiver.local_addr()?;
        let sink = sink.clone();
        receivers.push(tokio::spawn(async move {
            // As a consuming application does: each tensor is dropped once it has landed
            // (at most the sender's tensors in flight are held), so its memory goes back to
            // the pools or the kept host buffers for the next.
            let mut landing = std::collections::VecDeque::new();
            for _ in 0..tensors_per_conn {
                let incoming = receiver
                    .next()
                    .await
                    .ok_or_else(|| anyhow::anyhow!("closed"))?;
                landing.push_back(sink.accept(incoming).await?);
                if landing.len() > in_flight.max(1) {
                    landing.pop_front().expect("held").await?;
                }
            }
            for landed in landing {
                landed.await?;
            }
            anyhow::Ok(receiver)
        }));
        let (path, relay) = setup.path_to(addr).await?;
        relays.extend(relay);
        // Development trust finds a receiver's certificate by the port connected to, which a
        // relay changes: the certificate it left is trusted by its path instead.
        let tls = tensorwire::quic::ClientTls::Pem {
            ca: tensorwire::quic::dev_cert_path(addr),
            identity: None,
        };
        let mut config = SenderConfig::new(tls);
        config.transport = setup.transport();
        config.chunk_size = chunk;
        senders.push(Sender::connect(path, config).await?);
    }
    let meta = TensorMeta::new([tensor_bytes], DType::U8)?.with_name("bench");
    let senders: Vec<Arc<Sender>> = senders.into_iter().map(Arc::new).collect();
    let (usage, started) = (ThreadUsage::now(), Instant::now());
    let mut tasks = Vec::new();
    for sender in &senders {
        let (sender, meta, data) = (sender.clone(), meta.clone(), data.clone());
        // `in_flight` tensors per connection: the next starts as soon as the oldest completes.
        tasks.push(tokio::spawn(async move {
            let mut inflight = std::collections::VecDeque::new();
            let mut waited = tensorwire::quic::SendWaits::default();
            for _ in 0..tensors_per_conn {
                if inflight.len() == in_flight.max(1) {
                    let oldest: tensorwire::quic::SendHandle =
                        inflight.pop_front().expect("in flight");
                    waited += oldest.finished().await?.waited;
                }
                inflight.push_back(sender.send(meta.clone(), data.clone()));
            }
            for send in inflight {
                waited += send.finished().await?.waited;
            }
            anyhow::Ok(waited)
        }));
    }
    let mut waited = tensorwire::quic::SendWaits::default();
    for task in tasks {
        waited += task.await??;
    }
    let seconds = started.elapsed().as_secs_f64();
    setup.print_busy_threads("tensorwire", &usage, seconds);
    setup.print_send_waits(&waited, seconds);
    for s in senders {
        let s = Arc::into_inner(s).ok_or_else(|| anyhow::anyhow!("sender still shared"))?;
        print_path_stats("tensorwire", &s.connection_stats());
        s.close().await;
    }
    let mut largest_window = 0;
    for r in receivers {
        let receiver = r.await??;
        largest_window = largest_window.max(receiver.metrics().largest_stream_window);
        receiver.close().await;
    }
    if largest_window > window {
        // Spec §7.1: the arrival rate over the path's RTT outgrew the initial window.
        println!(
            "    tensorwire: credit windows grew to {} MiB (from {} MiB)",
            largest_window >> 20,
            window >> 20
        );
    }
    Ok(seconds)
}
