//! A [`SendHandle`]: one tensor being sent, its progress, its cancellation and its end.

use tensorwire_proto::Receipt;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::report::{SendProgress, SendReport, SendWaits};
use crate::error::TransportError;

/// One tensor being sent (on one stream, or as the parts of a split tensor).
pub struct SendHandle {
    pub(crate) task: JoinHandle<Result<SendReport, TransportError>>,
    pub(crate) progress: SendProgress,
    pub(crate) cancel: CancellationToken,
}

impl SendHandle {
    /// Payload bytes handed to QUIC so far.
    pub fn sent_bytes(&self) -> u64 {
        self.progress.sent_bytes()
    }

    /// The tensor's length.
    pub fn total_bytes(&self) -> u64 {
        self.progress.total
    }

    /// A progress reader that outlives [`finished`](Self::finished)'s borrow of the handle.
    pub fn progress(&self) -> SendProgress {
        self.progress.clone()
    }

    /// Cancels the tensor: the receiver gets CANCEL(CANCELLED).
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// A token that cancels this tensor, for use from other tasks.
    pub fn cancel_token(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// Resolves on COMPLETE, or with the error that ended the tensor.
    pub async fn finished(self) -> Result<SendReport, TransportError> {
        self.task
            .await
            .map_err(|e| TransportError::Io(std::io::Error::other(e)))?
    }

    /// One handle for the parts of a split tensor: it resolves when every part is
    /// COMPLETE, or with the first part's error, cancelling the others.
    pub(crate) fn joined(parts: Vec<SendHandle>, total: u64) -> SendHandle {
        let cancel = CancellationToken::new();
        let progress = SendProgress {
            sent: parts
                .iter()
                .flat_map(|p| p.progress.sent.iter().cloned())
                .collect(),
            total,
        };
        let tokens: Vec<_> = parts.iter().map(SendHandle::cancel_token).collect();
        let cancelled = cancel.clone();
        let task = tokio::spawn(async move {
            let cancel_all = || tokens.iter().for_each(CancellationToken::cancel);
            let started = std::time::Instant::now();
            let mut waiting: tokio::task::JoinSet<_> = parts
                .into_iter()
                .enumerate()
                .map(|(i, part)| async move { (i, part.finished().await) })
                .collect();
            let (mut bytes, mut waited, mut cancelling) = (0, SendWaits::default(), false);
            // The part that completed the whole at the receiver answers for the whole (spec
            // §15.2): its receipt says most; the others', where each part landed.
            let mut receipt = Receipt::new();
            loop {
                let joined = tokio::select! {
                    joined = waiting.join_next() => joined,
                    () = cancelled.cancelled(), if !cancelling => {
                        cancel_all();
                        cancelling = true;
                        continue;
                    }
                };
                let Some(joined) = joined else { break };
                let (i, outcome) =
                    joined.map_err(|e| TransportError::Io(std::io::Error::other(e)))?;
                match outcome {
                    Ok(report) => {
                        bytes += report.bytes;
                        waited += report.waited;
                        if report.receipt.entries().len() > receipt.entries().len() {
                            receipt = report.receipt;
                        }
                    }
                    Err(e) => {
                        cancel_all();
                        debug!(part = i, error = %e, "a part of a split tensor failed");
                        return Err(e);
                    }
                }
            }
            Ok(SendReport {
                bytes,
                elapsed: started.elapsed(),
                waited,
                receipt,
            })
        });
        SendHandle {
            task,
            progress,
            cancel,
        }
    }
}
