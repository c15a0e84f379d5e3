//! One connection of a [`Receiver`](super::Receiver): the handshake checks, its sans-IO
//! [`Session`](tensorwire_proto::Session), and the loop that accepts its streams, stops
//! unidirectional ones and ends it when it stays idle (spec §3, §10).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use quinn::VarInt;
use tensorwire_proto::{ErrorCode, Party, Version};
use tensorwire_sink::{Carrier, MemoryShares, PeerMembership};
use tokio::sync::{Notify, mpsc};
use tracing::{Instrument, debug, info, info_span, warn};

use super::incoming::IncomingTensor;
use super::state::ConnectionState;
use super::tensor::serve_stream;
use super::{PeerSlot, Shared};
use crate::binding::Binding;
use crate::control::{ControlEnd, read_control_stream, write_control_stream};
use crate::metrics::Metrics;
use crate::session::ConnectionSession;
use crate::steering::{ConnectionSlot, ServerEndpoint};
use crate::stream::FrameStream;

pub(super) async fn accept_connections(
    endpoint: ServerEndpoint,
    shared: Arc<Shared>,
    tx: mpsc::Sender<IncomingTensor>,
) {
    let index = endpoint.index();
    let serves = shared.config.listening.serves(Binding::Udp);
    while let Some((incoming, slot)) = endpoint.accept().await {
        let remote = incoming.remote_address();
        if !serves {
            // Listening on TCP only: UDP stays silent, as if blocked (spec §16).
            incoming.ignore();
            continue;
        }
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
                Binding::Udp,
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
pub(super) async fn serve_connection(
    endpoint: usize,
    binding: Binding,
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
            shared.admissions.handshake_failed();
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
    serve_streams(endpoint, shared, (connection, binding), tx, None).await;
}

/// Serves the tensor streams the peer opens on `connection` (carried by its binding),
/// whichever side opened it; the connection's `session`, if this side already sends on it,
/// gets the receiving policy.
pub(super) async fn serve_streams(
    endpoint: usize,
    shared: Arc<Shared>,
    connection: (quinn::Connection, Binding),
    tx: mpsc::Sender<IncomingTensor>,
    session: Option<ConnectionSession>,
) {
    let (state, membership) = join(endpoint, &shared, connection, session);
    info!("connection established");
    pump(&shared, &state, &tx).await;
    leave(&shared, &state);
    drop(membership);
    state.close_kept_streams().await;
}

/// The connection's pump: hands each stream the peer opens to a task of its own, and ends
/// the connection once the session says it stayed idle too long (spec §10). Returns when the
/// connection closes, or the receiver shuts down.
async fn pump(
    shared: &Arc<Shared>,
    state: &Arc<ConnectionState>,
    tx: &mpsc::Sender<IncomingTensor>,
) {
    let idle_check = shared
        .config
        .session
        .idle_timeout
        .min(Duration::from_secs(1));
    // One timer for the connection's life, not one armed and cancelled per stream accepted.
    let mut idle_checks =
        tokio::time::interval_at(tokio::time::Instant::now() + idle_check, idle_check);
    idle_checks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            accepted = state.connection.accept_bi() => match accepted {
                Ok((send, recv)) => serve_stream_on_its_task(shared, state, send, recv, tx),
                Err(e) => {
                    info!(reason = %e, "connection closed");
                    return;
                }
            },
            _ = idle_checks.tick() => {
                state.sweep_closing();
                let end = state.session().handle_timeout(Instant::now());
                if let Some(end) = end {
                    info!(%end, "closing a connection with no tensor streams");
                    state.close(end.code, end.reason.as_bytes());
                    return;
                }
            }
        }
    }
}

/// Opens the peer's new stream in the session (which may refuse it) and serves it on a task
/// of its own.
fn serve_stream_on_its_task(
    shared: &Arc<Shared>,
    state: &Arc<ConnectionState>,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    tx: &mpsc::Sender<IncomingTensor>,
) {
    let stream_id = VarInt::from(send.id()).into_inner();
    let span = info_span!("tensor", stream = %send.id());
    if let Err(e) = state.session().open_stream(stream_id, Instant::now()) {
        warn!(error = %e, "stream refused");
        return;
    }
    let stream = FrameStream::new(send, recv, shared.config.session.limits.clone());
    // Boxed: the task then holds a pointer, not the stream's whole state machine, which
    // tokio would otherwise move at the spawn and at each change of the task's stage (a few
    // thousand bytes, three times per tensor).
    let serve = Box::pin(serve_stream(
        shared.clone(),
        state.clone(),
        stream_id,
        stream,
        tx.clone(),
    ));
    shared.streams.spawn(serve.instrument(span));
}

/// Sets the connection up among the receiver's: its session's receiving policy, its peer's
/// fair shares of credit and memory (spec §7.1, §7.5), and our early credit offer (§7.6).
/// The membership counts the peer among those sharing the memory budgets while held.
fn join(
    endpoint: usize,
    shared: &Arc<Shared>,
    (connection, binding): (quinn::Connection, Binding),
    session: Option<ConnectionSession>,
) -> (Arc<ConnectionState>, PeerMembership) {
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
    // Spec §3.1: what the session sends keeps to the version the handshake selected.
    let version = crate::tls::negotiated_version(&connection).unwrap_or(Version::V1_0);
    session.lock().set_version(version);
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
        connection,
        binding,
        metrics: Metrics::default(),
        session,
        decision_slot_freed: Notify::new(),
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
        shared
            .budget
            .with_tracker(|credit| session.join(Party::from(peer), credit));
    }
    shared
        .connections
        .insert(state.connection.stable_id(), state.clone());
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
    (state, membership)
}

/// Takes the ended connection out of the receiver's: its split tensors stop waiting for it,
/// and its unused early credit and its share of the credit go back.
fn leave(shared: &Shared, state: &ConnectionState) {
    shared.connections.remove(&state.connection.stable_id());
    state.carrier.close();
    withdraw_early_credit(shared, state);
    let mut session = state.session();
    shared.budget.with_tracker(|credit| session.leave(credit));
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
