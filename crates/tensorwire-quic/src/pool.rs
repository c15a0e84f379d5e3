//! Several connections from one sender to one receiver: one connection moves about one
//! core's worth of QUIC, so a sender with many tensors spreads them over a few.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tensorwire_proto::split::{SplitId, plan_split};
use tensorwire_proto::{ProtocolError, TensorMeta};

use crate::config::SenderConfig;
use crate::error::TransportError;
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::sender::{SendHandle, Sender, Source};

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
    /// Opens `connections` connections (at least one) to the receiver at `addr`, all at once.
    pub async fn connect(
        addr: SocketAddr,
        config: SenderConfig,
        connections: usize,
    ) -> Result<Self, TransportError> {
        let metrics = Arc::new(Metrics::default());
        let mut opening = tokio::task::JoinSet::new();
        for _ in 0..connections.max(1) {
            let (config, metrics) = (config.clone(), metrics.clone());
            opening.spawn(Sender::connect_counting(addr, config, metrics));
        }
        let mut senders = Vec::with_capacity(connections.max(1));
        while let Some(opened) = opening.join_next().await {
            let opened =
                opened.map_err(|e| TransportError::Config(format!("connect task: {e}")))?;
            senders.push(opened?);
        }
        let assigned = senders.iter().map(|_| AtomicU64::new(0)).collect();
        Ok(Self {
            senders,
            assigned,
            metrics,
        })
    }

    /// Starts sending one tensor on the connection with the fewest bytes given to it so far.
    pub fn send(&self, meta: TensorMeta, source: impl Into<Source>) -> SendHandle {
        let least = self
            .assigned
            .iter()
            .enumerate()
            .min_by_key(|(_, bytes)| bytes.load(Ordering::Relaxed))
            .map_or(0, |(i, _)| i);
        self.assigned[least].fetch_add(meta.byte_len(), Ordering::Relaxed);
        self.senders[least].send(meta, source)
    }

    /// Starts sending one tensor as `parts` parts of consecutive rows (spec §15), each on
    /// the connection with the fewest bytes given to it so far, so that one large tensor
    /// moves over several connections at once. The receiver puts the parts back together
    /// and delivers the whole once; the handle resolves when every part is COMPLETE, or
    /// with the first part's error (the other parts are then cancelled).
    ///
    /// Fails at once for a scalar, for `parts` outside 2 to 256 or above the tensor's rows,
    /// and for a [`Source::Stream`], which can only be read in order. A receiver older than
    /// protocol version 1.3 lands the parts as tensors of their own.
    pub fn send_split(
        &self,
        meta: TensorMeta,
        source: impl Into<Source>,
        parts: usize,
    ) -> Result<SendHandle, TransportError> {
        let source = source.into();
        let total = meta.byte_len();
        let planned = plan_split(&meta, parts as u64, random_split_id()?)?;
        let mut sends = Vec::with_capacity(planned.len());
        for part in planned {
            let len = part.meta.byte_len();
            let source = source.slice(part.offset, len).ok_or(ProtocolError::Misuse(
                "only bytes in memory or a file can be split, not a stream",
            ))?;
            sends.push(self.send(part.meta, source));
        }
        Ok(SendHandle::joined(sends, total))
    }

    /// How many connections it has.
    pub fn connections(&self) -> usize {
        self.senders.len()
    }

    /// Tensor and byte counters over all its connections.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.metrics.snapshot()
    }

    /// Closes every connection cleanly, all at once: each waits out its draining period
    /// (three probe timeouts, tens of ms), which one after another would add up.
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
