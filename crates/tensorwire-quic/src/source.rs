//! A tensor's bytes read as checksummed DATA chunks, a batch ahead of sending.
//!
//! Bytes in memory and file regions are checksummed on the blocking pool a batch of several
//! chunks at a time, one batch ahead of the chunks being sent: the connection's task (which
//! shares its thread with the connection's driver) neither makes the pass over the bytes nor
//! waits for it. A file region is mapped rather than read: the checksum's pass faults the
//! pages in (a disk read where they were not cached), so each byte of the page cache is read
//! once by the CPU before quinn's packet copy, with no copy out of the page cache (which cost
//! the `sender` program 28% of its CPU time, profiled with a 1 GiB cached file).

use std::collections::VecDeque;
use std::pin::Pin;

use bytes::Bytes;
use futures_core::Stream;
use memmap2::{Advice, MmapOptions};
use tensorwire_proto::CheckedChunk;
use tokio::task::JoinHandle;

use crate::sender::Source;

/// Bytes checksummed per wake-up of the blocking pool: several DATA chunks at once.
const BATCH: usize = 4 << 20;

/// In-memory bytes shorter than this are checksummed on the sending task: for a small tensor
/// a hand-off to another thread costs more than the pass.
const CHECK_INLINE_BELOW: usize = 256 << 10;

/// A tensor's source, yielding checksummed chunks of at most a requested length.
pub(crate) struct SourceReader {
    kind: Kind,
    /// Longest chunk a batch is cut into (the sender's DATA chunk size).
    chunk: usize,
    /// Chunks checksummed and not yet sent.
    ready: VecDeque<CheckedChunk>,
    /// The next batch, being checksummed.
    ahead: Option<JoinHandle<VecDeque<CheckedChunk>>>,
}

enum Kind {
    /// What is left to checksum of bytes in memory or of a mapped file region.
    Region {
        rest: Bytes,
        /// Whether the bytes may need reading from disk, so they are never touched on the
        /// sending task.
        mapped: bool,
    },
    /// A stream of chunks of any size, checksummed as they come.
    Stream {
        inner: Pin<Box<dyn Stream<Item = std::io::Result<Bytes>> + Send>>,
        leftover: Bytes,
    },
}

impl SourceReader {
    /// A reader of `source`, a tensor of `len` bytes, cut into chunks of at most `chunk`.
    pub(crate) async fn open(source: Source, len: u64, chunk: usize) -> std::io::Result<Self> {
        let kind = match source {
            Source::Bytes(mut bytes) => {
                bytes.truncate(usize::try_from(len).unwrap_or(usize::MAX));
                Kind::Region {
                    rest: bytes,
                    mapped: false,
                }
            }
            Source::File { path, offset } => {
                let region = tokio::task::spawn_blocking(move || {
                    let named = |e: std::io::Error| {
                        std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
                    };
                    let file = std::fs::File::open(&path).map_err(named)?;
                    map_region(&file, offset, len).map_err(named)
                })
                .await
                .map_err(std::io::Error::other)??;
                Kind::Region {
                    rest: region,
                    mapped: true,
                }
            }
            Source::Stream(inner) => Kind::Stream {
                inner,
                leftover: Bytes::new(),
            },
        };
        Ok(Self {
            kind,
            chunk: chunk.max(1),
            ready: VecDeque::new(),
            ahead: None,
        })
    }

    /// Up to `max` bytes (at least one), checksummed; empty at the end of the source.
    pub(crate) async fn next(&mut self, max: usize) -> std::io::Result<CheckedChunk> {
        let max = max.max(1);
        if let Kind::Stream { inner, leftover } = &mut self.kind {
            return next_of_stream(inner, leftover, max).await;
        }
        if self.ready.is_empty() {
            self.ready = match self.ahead.take() {
                Some(batch) => batch.await.map_err(std::io::Error::other)?,
                None => {
                    let one_chunk = max.min(self.chunk);
                    if let Some(rest) = self.rest_checked_here()
                        && rest.len() <= one_chunk
                    {
                        // A small tensor's whole: one chunk, no batch to queue.
                        return Ok(CheckedChunk::new(std::mem::take(rest)));
                    }
                    self.check_next_batch_here().await?
                }
            };
            // Keep one batch checksumming while this one is sent.
            self.ahead = self.spawn_next_batch();
        }
        Ok(match self.ready.pop_front() {
            None => CheckedChunk::new(Bytes::new()),
            Some(mut chunk) if chunk.len() > max => {
                // Less credit than a chunk: only the part sent now is read again.
                let head = chunk.split_to(max);
                self.ready.push_front(chunk);
                head
            }
            Some(chunk) => chunk,
        })
    }

    /// The first batch: checksummed on this task where it is short and in memory, so a small
    /// tensor pays no hand-off; otherwise on the blocking pool.
    async fn check_next_batch_here(&mut self) -> std::io::Result<VecDeque<CheckedChunk>> {
        let chunk = self.chunk;
        if let Some(rest) = self.rest_checked_here() {
            return Ok(cut_and_check(std::mem::take(rest), chunk));
        }
        match self.spawn_next_batch() {
            Some(batch) => batch.await.map_err(std::io::Error::other),
            None => Ok(VecDeque::new()),
        }
    }

    /// What is left of a region checksummed on this task: short and in memory.
    fn rest_checked_here(&mut self) -> Option<&mut Bytes> {
        match &mut self.kind {
            Kind::Region {
                rest,
                mapped: false,
            } if rest.len() < CHECK_INLINE_BELOW => Some(rest),
            _ => None,
        }
    }

    /// Checksums the next batch on the blocking pool; `None` at the end of the region.
    fn spawn_next_batch(&mut self) -> Option<JoinHandle<VecDeque<CheckedChunk>>> {
        let Kind::Region { rest, .. } = &mut self.kind else {
            return None;
        };
        if rest.is_empty() {
            return None;
        }
        // Whole chunks per batch, so chunks are cut the same wherever batches end.
        let batch_len = BATCH.max(self.chunk) / self.chunk * self.chunk;
        let batch = rest.split_to(batch_len.min(rest.len()));
        let chunk = self.chunk;
        Some(tokio::task::spawn_blocking(move || {
            cut_and_check(batch, chunk)
        }))
    }
}

/// `bytes` cut into chunks of at most `chunk`, each checksummed.
fn cut_and_check(mut bytes: Bytes, chunk: usize) -> VecDeque<CheckedChunk> {
    let mut chunks = VecDeque::with_capacity(bytes.len().div_ceil(chunk));
    while !bytes.is_empty() {
        chunks.push_back(CheckedChunk::new(bytes.split_to(chunk.min(bytes.len()))));
    }
    chunks
}

/// The next chunk of a stream source: checksummed on this task where short, on the blocking
/// pool where long.
async fn next_of_stream(
    inner: &mut Pin<Box<dyn Stream<Item = std::io::Result<Bytes>> + Send>>,
    leftover: &mut Bytes,
    max: usize,
) -> std::io::Result<CheckedChunk> {
    if leftover.is_empty() {
        let next = std::future::poll_fn(|cx| inner.as_mut().poll_next(cx)).await;
        *leftover = next.transpose()?.unwrap_or_default();
    }
    let bytes = leftover.split_to(max.min(leftover.len()));
    if bytes.len() < CHECK_INLINE_BELOW {
        return Ok(CheckedChunk::new(bytes));
    }
    tokio::task::spawn_blocking(move || CheckedChunk::new(bytes))
        .await
        .map_err(std::io::Error::other)
}

/// Maps up to `len` bytes of `file` from `offset` (fewer where the file ends sooner; the
/// sender then reports how far the source got).
fn map_region(file: &std::fs::File, offset: u64, len: u64) -> std::io::Result<Bytes> {
    let info = file.metadata()?;
    if !info.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file (send pipes and devices as Source::Stream)",
        ));
    }
    let available = info.len().saturating_sub(offset);
    let len = usize::try_from(len.min(available)).map_err(std::io::Error::other)?;
    if len == 0 {
        // A region of no bytes cannot be mapped.
        return Ok(Bytes::new());
    }
    #[allow(unsafe_code)] // The crate's one `unsafe`.
    // SAFETY: the mapping is read-only and private to this process. What `unsafe` warns of
    // is the file changing underneath while mapped. Bytes changed after the sender
    // checksummed them reach the receiver different from the checksum in END, so the tensor
    // fails with CHECKSUM_MISMATCH rather than landing altered; a file truncated while sent
    // raises SIGBUS, as with any mapped file, and `Source::File` says the file must stay as
    // it is.
    let map = unsafe { MmapOptions::new().offset(offset).len(len).map(file)? };
    // Only a hint: read ahead in order.
    let _ = map.advise(Advice::Sequential);
    Ok(Bytes::from_owner(map))
}
