//! Several connections from one sender to one receiver: one connection moves about one
//! core's worth of QUIC, so a sender with many tensors spreads them over a few.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tensorwire_proto::split::{MAX_PARTS, SplitId, plan_split};
use tensorwire_proto::{Feature, ProtocolError, TensorMeta, Version};

use super::handle::SendHandle;
use super::sender::Sender;
use crate::binding::{Binding, BindingChoice};
use crate::config::SenderConfig;
use crate::error::TransportError;
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::source::Source;

/// Parts of a split tensor smaller than this are not worth a stream of their own.
pub const MIN_PART: u64 = 16 << 20;

/// Connections to one receiver, each on its own endpoint (UDP socket), so a receiver with
/// several endpoints spreads them over its cores. Each tensor goes whole on one connection:
/// the one with the fewest bytes given to it so far, so submitting the largest tensors first
/// balances the connections and the last to finish is small.
pub struct SenderPool {
    senders: Vec<Sender>,
    /// Bytes of the tensors given to each connection so far.
    assigned: Vec<AtomicU64>,
    metrics: Arc<Metrics>,
}

impl SenderPool {
    /// The connections worth opening for `tensors` tensors: one per core, at most 8, and no
    /// more than the tensors, or than the parts of at least [`MIN_PART`] that
    /// `splittable_bytes` (their bytes when they may be split, 0 otherwise) make.
    pub fn automatic_connections(tensors: usize, splittable_bytes: u64) -> usize {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let parts = usize::try_from(splittable_bytes / MIN_PART).unwrap_or(usize::MAX);
        cores.min(8).min(tensors.max(parts)).max(1)
    }

    /// Opens `connections` connections (at least one) to the receiver at `addr`, all at once.
    ///
    /// A receiver at its connection caps refuses connections before their handshake and
    /// serves peers in turn (spec §10): the pool then goes on with the connections it got,
    /// and while it has none it asks again, backing off, for up to
    /// [`SenderConfig::refused_retry_for`] before failing with [`TransportError::Refused`].
    pub async fn connect(
        addr: SocketAddr,
        config: SenderConfig,
        connections: usize,
    ) -> Result<Self, TransportError> {
        let metrics = Arc::new(Metrics::default());
        // One TLS configuration for all: its files are read, and development trust is
        // announced, once.
        let crypto = crate::tls::client_crypto(&config.tls, addr)?;
        let wanted = connections.max(1);
        let mut senders = Vec::with_capacity(wanted);
        let mut refused = 0;
        let mut config = config;
        if config.binding == BindingChoice::Auto {
            // The first connection finds what reaches the receiver; the others use it, so a
            // pool never mixes bindings, and only one waits out UDP's head start.
            match Sender::connect_counting(addr, config.clone(), crypto.clone(), metrics.clone())
                .await
            {
                Ok(first) => {
                    config.binding = first.binding().into();
                    senders.push(first);
                }
                Err(e) if e.is_refused_connection() => refused += 1,
                Err(e) => return Err(e),
            }
        }
        let open = |count: usize| {
            let mut opening = tokio::task::JoinSet::new();
            for _ in 0..count {
                let (config, crypto, metrics) = (config.clone(), crypto.clone(), metrics.clone());
                opening.spawn(Sender::connect_counting(addr, config, crypto, metrics));
            }
            opening
        };
        let started = Instant::now();
        let mut wait = Duration::from_millis(50);
        loop {
            let mut opening = open(wanted - senders.len());
            while let Some(opened) = opening.join_next().await {
                match opened.map_err(|e| TransportError::Config(format!("connect task: {e}")))? {
                    Ok(sender) => senders.push(sender),
                    Err(e) if e.is_refused_connection() => refused += 1,
                    Err(e) => return Err(e),
                }
            }
            if !senders.is_empty() {
                break;
            }
            if started.elapsed() + wait > config.refused_retry_for {
                return Err(TransportError::Refused {
                    addr,
                    for_how_long: started.elapsed(),
                });
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_secs(1));
        }
        if senders.len() < wanted {
            tracing::warn!(
                %addr,
                opened = senders.len(),
                wanted,
                refused,
                "the receiver refused some connections (its connection caps): sending on fewer"
            );
        }
        let assigned = senders.iter().map(|_| AtomicU64::new(0)).collect();
        Ok(Self {
            senders,
            assigned,
            metrics,
        })
    }

    /// Starts sending one tensor on the connection with the fewest bytes given to it so far,
    /// after that connection's large tensors sent before it ([`Sender::send`]).
    pub fn send(&self, meta: TensorMeta, source: impl Into<Source>) -> SendHandle {
        self.least_loaded(meta.byte_len()).send(meta, source)
    }

    /// The connection with the fewest bytes given to it so far, which `bytes` more are
    /// given to.
    fn least_loaded(&self, bytes: u64) -> &Sender {
        let least = self
            .assigned
            .iter()
            .enumerate()
            .min_by_key(|(_, given)| given.load(Ordering::Relaxed))
            .map_or(0, |(i, _)| i);
        self.assigned[least].fetch_add(bytes, Ordering::Relaxed);
        &self.senders[least]
    }

    /// Starts sending one tensor as `parts` parts of consecutive rows (spec §15), each on
    /// the connection with the fewest bytes given to it so far, so that one large tensor
    /// moves over several connections at once. The receiver puts the parts back together
    /// and delivers the whole once; the handle resolves when every part is COMPLETE, or
    /// with the first part's error (the other parts are then cancelled).
    ///
    /// Fails at once for a scalar, for `parts` outside 2 to 256 or above the tensor's rows,
    /// and for a [`Source::Stream`], which can only be read in order. A receiver whose
    /// version has no split tensors ([`peer_version`](Self::peer_version), spec §3.1) gets
    /// the tensor whole, on one connection.
    pub fn send_split(
        &self,
        meta: TensorMeta,
        source: impl Into<Source>,
        parts: usize,
    ) -> Result<SendHandle, TransportError> {
        let source = source.into();
        self.send_split_with(meta, parts, |offset, len| {
            source.slice(offset, len).ok_or_else(|| {
                ProtocolError::Misuse("only bytes in memory or a file can be split, not a stream")
                    .into()
            })
        })
    }

    /// As [`send_split`](Self::send_split), each part's bytes from `part_source(offset, len)`
    /// (its place in the whole), for sources that [`Source`] cannot slice, such as a stream
    /// per part of a GPU tensor. Nothing is sent if `part_source` fails for any part.
    pub fn send_split_with(
        &self,
        meta: TensorMeta,
        parts: usize,
        mut part_source: impl FnMut(u64, u64) -> Result<Source, TransportError>,
    ) -> Result<SendHandle, TransportError> {
        let total = meta.byte_len();
        if !self.peer_version().has(Feature::SplitTensors) {
            let source = part_source(0, total)?;
            return Ok(self.send(meta, source));
        }
        let planned = plan_split(&meta, parts as u64, random_split_id()?)?;
        let sources = planned
            .iter()
            .map(|part| part_source(part.offset, part.meta.byte_len()))
            .collect::<Result<Vec<_>, _>>()?;
        let sends = planned
            .into_iter()
            .zip(sources)
            .map(|(part, source)| {
                self.least_loaded(part.meta.byte_len())
                    .send_part(part.meta, source)
            })
            .collect();
        Ok(SendHandle::joined(sends, total))
    }

    /// How many parts to send `meta` as when it is one of tensors of `total_bytes` in all:
    /// one per fair share of the bytes (`total_bytes` over the connections, at least
    /// [`MIN_PART`]), at most one per connection and per row; 1 (whole) for a tensor within
    /// its share, a scalar or a single row, or for a receiver without split tensors. For
    /// [`send_split`](Self::send_split) when above 1.
    pub fn parts_for(&self, meta: &TensorMeta, total_bytes: u64) -> usize {
        if !self.peer_version().has(Feature::SplitTensors) {
            return 1;
        }
        let connections = self.senders.len() as u64;
        let share = (total_bytes / connections.max(1)).max(MIN_PART);
        let rows = meta.shape().first().copied().unwrap_or(1);
        let parts = meta
            .byte_len()
            .div_ceil(share)
            .min(rows)
            .min(connections)
            .min(MAX_PARTS);
        usize::try_from(parts).unwrap_or(1).max(1)
    }

    /// The protocol version the receiver has (spec §3.1): the oldest its connections
    /// negotiated.
    pub fn peer_version(&self) -> Version {
        self.senders
            .iter()
            .map(Sender::peer_version)
            .min()
            .unwrap_or(Version::V1_0)
    }

    /// How many connections it has.
    pub fn connections(&self) -> usize {
        self.senders.len()
    }

    /// What carries its connections' packets (one binding for all: under
    /// [`BindingChoice::Auto`] the first connection decides).
    pub fn binding(&self) -> Binding {
        self.senders.first().map_or(Binding::Udp, Sender::binding)
    }

    /// The largest UDP payload its connections send now: the smallest over them, since each
    /// probes its path on its own ([`TransportSettings::max_mtu`]).
    ///
    /// [`TransportSettings::max_mtu`]: crate::TransportSettings::max_mtu
    pub fn path_mtu(&self) -> u16 {
        self.senders
            .iter()
            .map(|sender| sender.connection_stats().path.current_mtu)
            .min()
            .unwrap_or(crate::MIN_MTU)
    }

    /// Tensor and byte counters over all its connections.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.metrics.snapshot()
    }

    /// Closes every connection cleanly, all at once (as [`Sender::close`]): each waits for
    /// its CONNECTION_CLOSE to go out, which one after another would add up.
    pub async fn close(self) {
        let mut closing = tokio::task::JoinSet::new();
        for sender in self.senders {
            closing.spawn(sender.close());
        }
        while closing.join_next().await.is_some() {}
    }
}

/// A split tensor's id: random, so that no other peer can guess it (spec §15).
fn random_split_id() -> Result<SplitId, TransportError> {
    let mut id = [0u8; 16];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut id)
        .map_err(|_| TransportError::Config("no random numbers for a split tensor's id".into()))?;
    Ok(SplitId(u128::from_le_bytes(id)))
}
