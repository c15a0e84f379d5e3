//! One connection of a [`Receiver`](super::Receiver): the handshake checks, its sans-IO
//! [`Session`], and the loop that accepts its streams, stops unidirectional ones and ends
//! it when it stays idle (spec §3, §10).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use quinn::VarInt;
use tensorwire_proto::{ErrorCode, Party, Session};
use tensorwire_sink::{Carrier, MemoryBudget, MemoryShares};
use tokio::sync::{Notify, Semaphore, mpsc};
use tokio_util::task::task_tracker::TaskTrackerToken;
use tracing::{Instrument, debug, info, info_span, warn};

use super::incoming::IncomingTensor;
use super::offload::ConnectionLoad;
use super::tensor::serve_stream;
use super::{CLOSE_GRACE, PeerSlot, Shared};
use crate::control::{ControlEnd, read_control_stream, write_control_stream};
use crate::metrics::Metrics;
use crate::session::ConnectionSession;
use crate::steering::{ConnectionSlot, ServerEndpoint};
use crate::stream::FrameStream;

/// What the streams of one connection share.
pub(super) struct ConnectionState {
    pub(super) endpoint: usize,
    pub(super) connection: quinn::Connection,
    pub(super) metrics: Metrics,
    /// Every tensor of the connection in both directions, its credit and its abuse budgets.
    pub(super) session: ConnectionSession,
    /// Tensors of this connection waiting for the application's decision: one peer cannot
    /// fill the receiver's queue and starve the others.
    pub(super) pending: Semaphore,
    /// Woken when DATA reopens the connection's credit window after it was full.
    pub(super) window_opened: Notify,
    /// Woken when the session may have queued EARLY_CREDIT for our control stream.
    pub(super) control_queued: Notify,
    /// This connection's shares of the receiver's memory budgets.
    pub(super) memory_shares: MemoryShares,
    /// Its share of the receiver's METADATA budget, taken once: each stream reserves here.
    pub(super) metadata_share: MemoryBudget,
    /// Its large tensors being received now, which weigh on where their payloads are stored.
    pub(super) load: Arc<ConnectionLoad>,
    /// Closed when the connection ends: split tensors it carried parts of stop waiting.
    pub(super) carrier: Carrier,
    /// Streams whose tensor ended, kept until the peer has our last frame and has finished
    /// its half ([`keep_until_closed`](Self::keep_until_closed)).
    closing: Mutex<Closing>,
}

/// Ended streams a connection keeps until they close (spec §4: a completed stream is read to
/// the sender's FIN, not stopped).
///
/// No task waits on them: each is looked at when a later stream of the connection ends and at
/// the connection's idle check. A waiting task would be woken by the sender's FIN, which
/// travels with its next tensor, and run before that tensor on the connection's thread.
#[derive(Default)]
struct Closing {
    /// Oldest first, each with when it was kept and a token that makes the receiver's close
    /// wait for it.
    streams: VecDeque<(FrameStream, Instant, TaskTrackerToken)>,
    /// Set once the connection's loop has ended: streams are no longer kept here.
    ended: bool,
}

/// Kept streams looked at each time one more is kept: more than one, so the list shrinks to
/// the streams that have not closed, however many a peer leaves open; a few, so each
/// tensor's cost stays the same.
const LOOKED_AT_PER_KEPT: usize = 2;

impl Closing {
    /// Whether a kept stream can go: it closed, or was kept for [`CLOSE_GRACE`].
    fn done(stream: &mut FrameStream, since: Instant, now: Instant) -> bool {
        now.duration_since(since) >= CLOSE_GRACE || stream.delivered_and_finished_now()
    }

    /// Drops every kept stream that can go.
    fn sweep(&mut self, now: Instant) {
        self.streams
            .retain_mut(|(stream, since, _)| !Self::done(stream, *since, now));
    }

    /// Looks at the oldest few kept streams: drops those that can go, moves the others to
    /// the back.
    fn sweep_some(&mut self, now: Instant) {
        for _ in 0..LOOKED_AT_PER_KEPT.min(self.streams.len()) {
            let Some(mut kept) = self.streams.pop_front() else {
                break;
            };
            if !Self::done(&mut kept.0, kept.1, now) {
                self.streams.push_back(kept);
            }
        }
    }
}

impl ConnectionState {
    /// The connection's session (the lock is held only for a sans-IO call, never across an
    /// await).
    pub(super) fn session(&self) -> MutexGuard<'_, Session> {
        self.session.lock()
    }

    /// Closes the connection with `code`; its streams fail with it.
    pub(super) fn close(&self, code: ErrorCode, reason: &[u8]) {
        self.connection.close(VarInt::from_u32(code.0), reason);
    }

    fn closing(&self) -> MutexGuard<'_, Closing> {
        // Only sweeps and pushes happen under the lock: nothing a panic could leave half done.
        self.closing.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps `stream`, whose tensor ended, until the peer has our last frame and has finished
    /// its half, or for [`CLOSE_GRACE`] at most; `token` (of the receiver's stream tracker)
    /// goes with it. Gives the stream back once the connection's loop has ended: the caller
    /// (a tracked task) then waits on it itself.
    pub(super) fn keep_until_closed(
        &self,
        mut stream: FrameStream,
        token: TaskTrackerToken,
    ) -> Option<FrameStream> {
        let now = Instant::now();
        let mut closing = self.closing();
        if closing.ended {
            return Some(stream);
        }
        closing.sweep_some(now);
        // Also leaves a no-op waker with the stream, so that the FIN wakes no task.
        if !stream.delivered_and_finished_now() {
            closing.streams.push_back((stream, now, token));
        }
        None
    }

    /// Drops the kept streams that have closed (see [`keep_until_closed`](Self::keep_until_closed)).
    fn sweep_closing(&self) {
        self.closing().sweep(Instant::now());
    }

    /// Streams whose tensor ended, kept until the peer finishes its half.
    pub(super) fn closing_streams(&self) -> usize {
        self.closing().streams.len()
    }

    /// Once the connection's loop has ended: waits for each kept stream to close, within
    /// what is left of its [`CLOSE_GRACE`], so that a receiver closing down still delivers
    /// their last frames.
    async fn close_kept_streams(&self) {
        let kept = {
            let mut closing = self.closing();
            closing.ended = true;
            std::mem::take(&mut closing.streams)
        };
        for (mut stream, since, _token) in kept {
            let left = CLOSE_GRACE.saturating_sub(since.elapsed());
            stream.delivered_and_finished(left).await;
        }
    }
}

pub(super) async fn accept_connections(
    endpoint: ServerEndpoint,
    shared: Arc<Shared>,
    tx: mpsc::Sender<IncomingTensor>,
) {
    let index = endpoint.index();
    while let Some((incoming, slot)) = endpoint.accept().await {
        let remote = incoming.remote_address();
        // Judged before the handshake, which is the costly part (spec §10).
        let peer_slot = match shared.admit_connection(remote.ip()) {
            Ok(peer_slot) => peer_slot,
            Err(cap) => {
                warn!(peer = %remote, %cap, "refusing a connection");
                incoming.refuse();
                continue;
            }
        };
        let span = info_span!("connection", %remote, endpoint = index);
        tokio::spawn(
            serve_connection(
                index,
                shared.clone(),
                incoming,
                (slot, peer_slot),
                tx.clone(),
            )
            .instrument(span),
        );
    }
}

/// Serves one connection on endpoint `endpoint`; `_slots` count it there and against its
/// peer's caps until it ends.
async fn serve_connection(
    endpoint: usize,
    shared: Arc<Shared>,
    incoming: quinn::Incoming,
    _slots: (ConnectionSlot, PeerSlot),
    tx: mpsc::Sender<IncomingTensor>,
) {
    // The handshake (client certificate included, for mTLS) completes before any stream is
    // accepted, so no frame is acted on from an unverified peer.
    let connection = match incoming.await {
        Ok(connection) => connection,
        Err(e) => {
            warn!(error = %e, "handshake failed");
            return;
        }
    };
    if crate::tls::negotiated_version(&connection).is_none() {
        warn!(peer = %connection.remote_address(), "refusing a connection that selected no tensorwire ALPN identifier");
        connection.close(
            VarInt::from_u32(ErrorCode::UNEXPECTED_FRAME.0),
            b"ALPN tensorwire/1 or later required",
        );
        return;
    }
    serve_streams(endpoint, shared, connection, tx, None).await;
}

/// Serves the tensor streams the peer opens on `connection`, whichever side opened it; the
/// connection's `session`, if this side already sends on it, gets the receiving policy.
pub(super) async fn serve_streams(
    endpoint: usize,
    shared: Arc<Shared>,
    connection: quinn::Connection,
    tx: mpsc::Sender<IncomingTensor>,
    session: Option<ConnectionSession>,
) {
    let id = connection.stable_id();
    let config = &shared.config;
    let policy = config.session.clone();
    // A `Sender`'s connection already reads the peer's control stream (spec §4.1).
    let reads_control = session.is_none();
    let session = match session {
        Some(session) => {
            session.lock().set_config(policy);
            session
        }
        None => ConnectionSession::new(policy),
    };
    if reads_control {
        tokio::spawn(read_control_stream(connection.clone(), session.clone()));
    }
    // Spec §7.5: the connection's shares of memory, within its peer's fair shares.
    let peer = connection.remote_address().ip();
    let membership = shared
        .peer_shares
        .join(Party::from(peer), || format!("the peer {peer}"));
    let memory_shares = MemoryShares::new(
        format!("the connection from {}", connection.remote_address()),
        config.memory_share_percent,
    )
    .within(membership.shares());
    let state = Arc::new(ConnectionState {
        endpoint,
        connection: connection.clone(),
        metrics: Metrics::default(),
        session,
        pending: Semaphore::new(config.max_pending_per_connection),
        window_opened: Notify::new(),
        control_queued: Notify::new(),
        metadata_share: memory_shares.of(&shared.metadata),
        memory_shares,
        load: Arc::default(),
        carrier: Carrier::new(),
        closing: Mutex::default(),
    });
    {
        // Spec §7.1: the peer's connections together keep to a fair share of the credit.
        let mut session = state.session();
        let party = Party::from(connection.remote_address().ip());
        shared
            .budget
            .with_tracker(|credit| session.join(party, credit));
    }
    shared.connections.insert(id, state.clone());
    info!("connection established");
    if config.session.early_credit > 0 {
        let offered = {
            let mut session = state.session();
            shared
                .budget
                .with_tracker(|credit| session.offer_early_credit(credit))
        };
        debug!(offered, "early credit");
        tokio::spawn(offer_early_credit(shared.clone(), state.clone()));
    }
    let idle_check = config.session.idle_timeout.min(Duration::from_secs(1));
    // One timer for the connection's life, not one armed and cancelled per stream accepted.
    let mut idle_checks =
        tokio::time::interval_at(tokio::time::Instant::now() + idle_check, idle_check);
    idle_checks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let accepted = tokio::select! {
            _ = shared.shutdown.cancelled() => break,
            accepted = connection.accept_bi() => accepted,
            _ = idle_checks.tick() => {
                state.sweep_closing();
                // Spec §10: the session decides when an idle connection ends, and with what.
                let end = state.session().handle_timeout(Instant::now());
                if let Some(end) = end {
                    info!(%end, "closing a connection with no tensor streams");
                    state.close(end.code, end.reason.as_bytes());
                    break;
                }
                continue;
            }
        };
        match accepted {
            Ok((send, recv)) => {
                let stream_id = VarInt::from(send.id()).into_inner();
                let span = info_span!("tensor", stream = %send.id());
                if let Err(e) = state.session().open_stream(stream_id) {
                    warn!(error = %e, "stream refused");
                    continue;
                }
                let stream = FrameStream::new(send, recv, shared.config.session.limits.clone());
                // Boxed: the task then holds a pointer, not the stream's whole state machine,
                // which tokio would otherwise move at the spawn and at each change of the
                // task's stage (a few thousand bytes, three times per tensor).
                let serve = Box::pin(serve_stream(
                    shared.clone(),
                    state.clone(),
                    stream_id,
                    stream,
                    tx.clone(),
                ));
                shared.streams.spawn(serve.instrument(span));
            }
            Err(e) => {
                info!(reason = %e, "connection closed");
                break;
            }
        }
    }
    shared.connections.remove(&id);
    state.carrier.close();
    withdraw_early_credit(&shared, &state);
    {
        let mut session = state.session();
        shared.budget.with_tracker(|credit| session.leave(credit));
    }
    drop(membership);
    state.close_kept_streams().await;
}

/// Writes our EARLY_CREDIT offers on the control stream (spec §4.1, §7.6); a peer that stops
/// the stream refuses them, and they go back to the budget.
async fn offer_early_credit(shared: Arc<Shared>, state: Arc<ConnectionState>) {
    let end = write_control_stream(&state.connection, &state.session, &state.control_queued).await;
    if let ControlEnd::Refused = end {
        debug!("the peer refused early credit (a version 1.0 or 1.1 peer)");
        withdraw_early_credit(&shared, &state);
    }
}

/// Returns the early credit the peer did not use to the budget and stops offering more.
fn withdraw_early_credit(shared: &Shared, state: &ConnectionState) {
    {
        let mut session = state.session();
        shared
            .budget
            .with_tracker(|credit| session.withdraw_early_credit(credit));
    }
    shared.budget.wake();
}
