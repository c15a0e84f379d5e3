//! Each request's mailbox, keyed by peer and request id: its inputs and module may arrive
//! before it, wait there for it, and are refused once it has ended or never came (spec §14.2).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tensorwire_proto::ErrorCode;
use tensorwire_quic::IncomingTensor;
use tokio::sync::mpsc;

/// A request's mailbox: its inputs and module, which may arrive before it.
struct Entry {
    tx: mpsc::UnboundedSender<IncomingTensor>,
    rx: Option<mpsc::UnboundedReceiver<IncomingTensor>>,
    /// Set once the request is over: later tensors of it are refused with this.
    closed: Option<Failure>,
}

/// A request's key: the peer and the request's id, unique per peer (spec §14.2).
pub(super) type RequestKey = (SocketAddr, u64);

/// A failure to send back: its code and reason.
pub(super) type Failure = (ErrorCode, String);

/// Every request's mailbox; each is dropped `wait` after its request ended or, if none came,
/// after it was made.
pub(super) struct Mailboxes {
    map: Mutex<HashMap<RequestKey, Entry>>,
    /// How long a mailbox waits for its request, and is kept after the request ended.
    wait: Duration,
}

impl Mailboxes {
    /// No mailboxes yet; each waits `wait` for its request.
    pub(super) fn new(wait: Duration) -> Arc<Self> {
        Arc::new(Self {
            map: Mutex::default(),
            wait,
        })
    }

    fn requests(&self) -> MutexGuard<'_, HashMap<RequestKey, Entry>> {
        // Only inserts, removals and field writes happen under the lock.
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The mailbox of `key`, made (with a timer that refuses its tensors if no request
    /// comes) if it is new.
    fn entry<'a>(
        self: &Arc<Self>,
        map: &'a mut HashMap<RequestKey, Entry>,
        key: RequestKey,
    ) -> &'a mut Entry {
        map.entry(key).or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            self.expire_later(key);
            Entry {
                tx,
                rx: Some(rx),
                closed: None,
            }
        })
    }

    /// In `wait`, [`expire`](Self::expire)s `key`'s mailbox.
    fn expire_later(self: &Arc<Self>, key: RequestKey) {
        let mailboxes = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(mailboxes.wait).await;
            mailboxes.expire(key);
        });
    }

    /// Removes `key`'s mailbox if its request never came (or ended), refusing what waits.
    fn expire(&self, key: RequestKey) {
        let mut map = self.requests();
        let Some(entry) = map.get(&key) else { return };
        if entry.rx.is_some() {
            if let Some(mut entry) = map.remove(&key)
                && let Some(mut rx) = entry.rx.take()
            {
                drop(map);
                while let Ok(tensor) = rx.try_recv() {
                    tensor.reject(
                        ErrorCode::PROGRESS_TIMEOUT,
                        format!(
                            "no request with id {} arrived within {} s",
                            key.1,
                            self.wait.as_secs()
                        ),
                    );
                }
            }
        } else if entry.closed.is_some() {
            map.remove(&key);
        }
    }

    pub(super) fn route(self: &Arc<Self>, key: RequestKey, incoming: IncomingTensor) {
        let mut map = self.requests();
        let entry = self.entry(&mut map, key);
        if let Some((code, message)) = &entry.closed {
            let (code, message) = (*code, message.clone());
            drop(map);
            incoming.reject(code, message);
            return;
        }
        if let Err(mpsc::error::SendError(incoming)) = entry.tx.send(incoming) {
            drop(map);
            incoming.reject(ErrorCode::INTERNAL, "the request's mailbox is gone");
        }
    }

    /// Ends `key`'s request: refuses what waits and what comes later with `failure` (or,
    /// after a success, ARGUMENT_MISMATCH), until the mailbox expires.
    pub(super) fn close(
        self: &Arc<Self>,
        key: RequestKey,
        rx: Option<mpsc::UnboundedReceiver<IncomingTensor>>,
        failure: Option<Failure>,
    ) {
        let (code, message) = failure.unwrap_or_else(|| {
            (
                ErrorCode::ARGUMENT_MISMATCH,
                "it already ran; this tensor was not declared or came twice".into(),
            )
        });
        {
            let mut map = self.requests();
            let entry = self.entry(&mut map, key);
            entry.closed = Some((code, message.clone()));
            entry.rx = None;
        }
        if let Some(mut rx) = rx {
            while let Ok(tensor) = rx.try_recv() {
                tensor.reject(code, message.clone());
            }
        }
        self.expire_later(key);
    }

    /// Takes the mailbox of `key` for its request; `None` if another request has it.
    pub(super) fn claim(
        self: &Arc<Self>,
        key: RequestKey,
    ) -> Option<mpsc::UnboundedReceiver<IncomingTensor>> {
        let mut map = self.requests();
        let entry = self.entry(&mut map, key);
        if entry.closed.is_some() {
            return None;
        }
        entry.rx.take()
    }
}
