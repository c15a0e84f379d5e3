//! What a send reports: [`SendReport`] at the end, [`SendProgress`] while it runs, and
//! [`SendWaits`], what its time went to.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tensorwire_proto::Receipt;

/// What a completed send did.
#[derive(Clone, Debug)]
pub struct SendReport {
    /// Payload bytes sent.
    pub bytes: u64,
    /// From the send's start, its turn on the connection waited for included, to COMPLETE.
    pub elapsed: Duration,
    /// What the send waited for, and how long: which side held it up.
    pub waited: SendWaits,
    /// What the receiver made of the tensor (spec §6.8): where it landed, the id local
    /// processes open it by, where it was saved. Empty from a receiver older than 1.5.
    pub receipt: Receipt,
}

/// How long a send waited for each thing it needs; the rest of its time is its own work
/// (opening its source, laying out frames, handing bytes to QUIC). A split tensor's are
/// summed over its parts, which wait at once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendWaits {
    /// For the large tensors before it on its connection to be done with the turn (spec §7.4).
    pub turn: Duration,
    /// For the receiver: a stream it allows (QUIC's stream limit), its ACCEPT, CREDIT once
    /// the bytes granted were sent, and COMPLETE once every byte was. A slow or full
    /// receiver shows here.
    pub receiver: Duration,
    /// For the source's next checksummed chunk: a file's pages from disk, a stream's items.
    pub source: Duration,
    /// For QUIC to take the bytes: its send buffer full, so congestion control or a slow path
    /// holds them.
    pub transport: Duration,
}

impl std::fmt::Display for SendWaits {
    /// "receiver 1.20 s, source 0.00 s, QUIC 0.03 s, turn 0.50 s".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "receiver {:.2} s, source {:.2} s, QUIC {:.2} s, turn {:.2} s",
            self.receiver.as_secs_f64(),
            self.source.as_secs_f64(),
            self.transport.as_secs_f64(),
            self.turn.as_secs_f64()
        )
    }
}

impl std::ops::AddAssign for SendWaits {
    fn add_assign(&mut self, other: Self) {
        self.turn += other.turn;
        self.receiver += other.receiver;
        self.source += other.source;
        self.transport += other.transport;
    }
}

/// Awaits `future`, adding the time it took to `waited`.
pub(crate) async fn timed<T>(waited: &mut Duration, future: impl Future<Output = T>) -> T {
    let started = Instant::now();
    let out = future.await;
    *waited += started.elapsed();
    out
}

/// Reads how far one tensor's send has got.
#[derive(Clone, Debug)]
pub struct SendProgress {
    /// One counter per stream the tensor goes on.
    pub(crate) sent: Arc<[Arc<AtomicU64>]>,
    pub(crate) total: u64,
}

impl SendProgress {
    /// Payload bytes handed to QUIC so far.
    pub fn sent_bytes(&self) -> u64 {
        self.sent.iter().map(|s| s.load(Ordering::Relaxed)).sum()
    }

    /// The tensor's length.
    pub fn total_bytes(&self) -> u64 {
        self.total
    }
}
