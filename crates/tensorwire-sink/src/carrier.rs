//! What carries a split tensor's parts to the receiver (a connection), as far as the
//! receiver tells: when every carrier of a whole has closed, no more parts can come.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::Notify;

/// A connection's liveness for [`SplitTensors`](crate::SplitTensors): the receiver makes
/// one per connection and [`close`](Self::close)s it when the connection ends. Cheap to
/// clone; clones are the same carrier.
#[derive(Clone, Debug, Default)]
pub struct Carrier {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    closed: AtomicBool,
    notify: Notify,
}

impl Carrier {
    /// An open carrier.
    pub fn new() -> Self {
        Self::default()
    }

    /// Marks it closed: nothing more comes over it.
    pub fn close(&self) {
        self.inner.closed.store(true, Ordering::SeqCst);
        self.inner.notify.notify_waiters();
    }

    /// Whether it closed.
    pub fn is_closed(&self) -> bool {
        self.inner.closed.load(Ordering::SeqCst)
    }

    /// Resolves once it has closed.
    pub async fn closed(&self) {
        loop {
            let notified = self.inner.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_closed() {
                return;
            }
            notified.await;
        }
    }

    /// Whether `other` is the same carrier.
    pub fn same_as(&self, other: &Carrier) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}
