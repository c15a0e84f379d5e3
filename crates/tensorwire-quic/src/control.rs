//! The control streams of a connection (spec §4.1): reading the peer's EARLY_CREDIT into the
//! connection's session, and writing ours.

use bytes::BytesMut;
use quinn::{VarInt, WriteError};
use tensorwire_proto::{ErrorCode, FrameDecoder, Limits};
use tokio::sync::Notify;
use tracing::{debug, warn};

use crate::session::ConnectionSession;

/// Reads the peer's control stream, the first unidirectional stream it opens, into `session`
/// for the life of the connection; stops every later one (spec §3). A frame other than
/// EARLY_CREDIT, or one that does not decode, closes the connection with its code.
pub(crate) async fn read_control_stream(connection: quinn::Connection, session: ConnectionSession) {
    let Ok(mut control) = connection.accept_uni().await else {
        return;
    };
    tokio::spawn(stop_other_streams(connection.clone()));
    let mut decoder = FrameDecoder::new(Limits::default());
    loop {
        let chunk = match control.read_chunk(usize::MAX, true).await {
            Ok(Some(chunk)) => chunk.bytes,
            // Spec §4.1: an ended control stream only ends the offers.
            Ok(None) | Err(_) => return,
        };
        decoder.push(chunk);
        loop {
            let handled = match decoder.next_frame() {
                Ok(Some(frame)) => session.lock().handle_control_frame(frame),
                Ok(None) => break,
                Err(e) => Err(e),
            };
            if let Err(e) = handled {
                warn!(error = %e, "closing the connection: its control stream broke a rule");
                connection.close(VarInt::from_u32(e.code().0), b"control stream");
                return;
            }
        }
    }
}

/// Spec §3: unidirectional streams other than the control stream are stopped.
async fn stop_other_streams(connection: quinn::Connection) {
    while let Ok(mut recv) = connection.accept_uni().await {
        debug!("stopping a second unidirectional stream");
        let _ = recv.stop(VarInt::from_u32(ErrorCode::UNEXPECTED_FRAME.0));
    }
}

/// How our control stream ended.
pub(crate) enum ControlEnd {
    /// The connection closed.
    Closed,
    /// The peer stopped the stream (a version 1.0 or 1.1 peer): our offers are refused and
    /// must be taken back (spec §4.1).
    Refused,
}

/// Opens our control stream and writes what the session queues for it (EARLY_CREDIT) each
/// time `queued` is notified, until the connection closes or the peer stops the stream.
pub(crate) async fn write_control_stream(
    connection: &quinn::Connection,
    session: &ConnectionSession,
    queued: &Notify,
) -> ControlEnd {
    let Ok(mut control) = connection.open_uni().await else {
        return ControlEnd::Closed;
    };
    let mut out = BytesMut::new();
    loop {
        // Armed before draining, so a frame queued in between is not missed.
        let more = queued.notified();
        {
            let mut session = session.lock();
            while let Some(frame) = session.poll_control_frame() {
                frame.encode(&mut out);
            }
        }
        if !out.is_empty() {
            match control.write_all(&out.split()).await {
                Ok(()) => {}
                Err(WriteError::Stopped(_)) => return ControlEnd::Refused,
                Err(_) => return ControlEnd::Closed,
            }
        }
        tokio::select! {
            () = more => {}
            stopped = control.stopped() => {
                return match stopped {
                    Ok(Some(_)) => ControlEnd::Refused,
                    _ => ControlEnd::Closed,
                };
            }
        }
    }
}
