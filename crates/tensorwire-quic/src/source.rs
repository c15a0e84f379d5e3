//! A tensor's bytes read as checksummed DATA chunks, batches ahead of sending.
//!
//! Bytes in memory and file regions are checksummed on the blocking pool a batch of several
//! chunks at a time, [`BATCHES_AHEAD`] batches ahead of the chunks being sent and from the
//! moment the reader opens: the connection's task (which shares its thread with the
//! connection's driver) neither makes the pass over the bytes nor waits for it. A file
//! region is mapped rather than read: the checksum's pass faults the pages in (a disk read
//! where they were not cached), so each byte of the page cache is read once by the CPU
//! before quinn's packet copy, with no copy out of the page cache (a copy that was a large
//! share of the `sender` program's CPU in profiles, benches/results/LOG.md).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::pin::Pin;

use bytes::Bytes;
use futures_core::Stream;
use memmap2::{Advice, MmapOptions};
use tensorwire_proto::CheckedChunk;
use tokio::task::JoinHandle;

/// Where a tensor's bytes come from.
pub enum Source {
    /// Bytes in memory, sent without copying.
    Bytes(Bytes),
    /// A region of a regular file starting at `offset`, as long as the tensor. It is mapped and sent
    /// from the page cache without a copy; the file must not be truncated while it is sent
    /// (the process would get SIGBUS, as with any mapped file), and bytes changed meanwhile
    /// fail the receiver's checksum.
    File {
        /// The file.
        path: PathBuf,
        /// Where the tensor's first byte is.
        offset: u64,
    },
    /// An async stream of chunks of any size, in order, adding up to the tensor's length.
    Stream(Pin<Box<dyn Stream<Item = std::io::Result<Bytes>> + Send>>),
}

impl Source {
    /// Its bytes `[offset, offset + len)`, for one part of a split tensor; `None` for a
    /// stream, which can only be read in order, and for bytes past the end of memory.
    pub fn slice(&self, offset: u64, len: u64) -> Option<Source> {
        match self {
            Source::Bytes(bytes) => {
                let start = usize::try_from(offset).ok()?;
                let end = start.checked_add(usize::try_from(len).ok()?)?;
                (end <= bytes.len()).then(|| Source::Bytes(bytes.slice(start..end)))
            }
            Source::File { path, offset: at } => Some(Source::File {
                path: path.clone(),
                offset: at.checked_add(offset)?,
            }),
            Source::Stream(_) => None,
        }
    }
}

impl From<Bytes> for Source {
    fn from(bytes: Bytes) -> Self {
        Source::Bytes(bytes)
    }
}

impl From<Vec<u8>> for Source {
    fn from(bytes: Vec<u8>) -> Self {
        Source::Bytes(bytes.into())
    }
}

/// Bytes checksummed per wake-up of the blocking pool: several DATA chunks at once.
const BATCH: usize = 4 << 20;

/// Batches checksummed ahead of the one being sent: a receiver's default stream window
/// (8 MiB), so that a CREDIT which lets a whole window go at once, as after a wait, finds
/// it checksummed; with one batch ahead, the sending task waited for checksums after each
/// such CREDIT.
const BATCHES_AHEAD: usize = 2;

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
    /// The next batches, in order, being checksummed.
    ahead: VecDeque<JoinHandle<VecDeque<CheckedChunk>>>,
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
    /// A reader of `source`, a tensor of `len` bytes, cut into chunks of at most `chunk`; a
    /// region too long to checksum on the sending task starts checksumming now.
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
        let mut reader = Self {
            kind,
            chunk: chunk.max(1),
            ready: VecDeque::new(),
            ahead: VecDeque::new(),
        };
        if reader.rest_checked_here().is_none() {
            reader.check_ahead();
        }
        Ok(reader)
    }

    /// Up to `max` bytes (at least one), checksummed; empty at the end of the source.
    pub(crate) async fn next(&mut self, max: usize) -> std::io::Result<CheckedChunk> {
        let max = max.max(1);
        if let Kind::Stream { inner, leftover } = &mut self.kind {
            return next_of_stream(inner, leftover, max).await;
        }
        if self.ready.is_empty() {
            self.ready = match self.ahead.pop_front() {
                Some(batch) => batch.await.map_err(std::io::Error::other)?,
                None => {
                    let chunk = self.chunk;
                    match self.rest_checked_here() {
                        // A small tensor's whole: one chunk, no batch to queue.
                        Some(rest) if rest.len() <= max.min(chunk) => {
                            return Ok(CheckedChunk::new(std::mem::take(rest)));
                        }
                        // Short and in memory: checksummed here, so a small tensor pays no
                        // hand-off.
                        Some(rest) => cut_and_check(std::mem::take(rest), chunk),
                        // A longer region's batches started when it opened: none ahead is
                        // none left.
                        None => VecDeque::new(),
                    }
                }
            };
            self.check_ahead();
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

    /// Keeps [`BATCHES_AHEAD`] batches checksumming while the ready one is sent.
    fn check_ahead(&mut self) {
        while self.ahead.len() < BATCHES_AHEAD {
            let Some(batch) = self.spawn_next_batch() else {
                break;
            };
            self.ahead.push_back(batch);
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
    #[allow(
        unsafe_code,
        reason = "the crate's one unsafe: mapping a file read-only"
    )]
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

#[cfg(test)]
mod tests {
    use super::*;
    use tensorwire_proto::checksum::crc32c;

    const CHUNK: usize = 1 << 20;

    fn region(len: usize) -> Bytes {
        (0..len)
            .map(|i| (i % 251) as u8 ^ (i >> 16) as u8)
            .collect::<Vec<u8>>()
            .into()
    }

    async fn open(bytes: &Bytes) -> SourceReader {
        SourceReader::open(Source::Bytes(bytes.clone()), bytes.len() as u64, CHUNK)
            .await
            .expect("bytes in memory open")
    }

    /// Reads to the end, `max` bytes at most at a time, checking each chunk's checksum and
    /// that no more than [`BATCHES_AHEAD`] batches are ever being checksummed.
    async fn read_all(reader: &mut SourceReader, max: usize) -> Vec<u8> {
        let mut read = Vec::new();
        loop {
            let chunk = reader.next(max).await.expect("in-memory reads cannot fail");
            if chunk.is_empty() {
                return read;
            }
            assert!(chunk.len() <= max.min(CHUNK));
            assert_eq!(chunk.crc(), crc32c(chunk.payload()));
            assert!(reader.ahead.len() <= BATCHES_AHEAD);
            read.extend_from_slice(chunk.payload());
        }
    }

    #[tokio::test]
    async fn a_long_region_is_checksummed_from_open_and_read_back_in_order() {
        // Five batches, the last one short: batches checksummed at once come back in order.
        let bytes = region((19 << 20) + 12_345);
        let mut reader = open(&bytes).await;
        assert_eq!(
            reader.ahead.len(),
            BATCHES_AHEAD,
            "checksumming starts at open"
        );
        assert_eq!(read_all(&mut reader, usize::MAX).await, bytes);
        assert!(reader.ahead.is_empty());
    }

    #[tokio::test]
    async fn less_credit_than_a_chunk_reads_the_rest_of_it_next() {
        let bytes = region((5 << 20) + 7);
        let mut reader = open(&bytes).await;
        assert_eq!(read_all(&mut reader, 300_001).await, bytes);
    }

    #[tokio::test]
    async fn a_short_region_in_memory_is_checksummed_on_the_sending_task() {
        let bytes = region(CHECK_INLINE_BELOW - 1);
        let mut reader = open(&bytes).await;
        assert!(reader.ahead.is_empty(), "no hand-off for a small tensor");
        assert_eq!(read_all(&mut reader, usize::MAX).await, bytes);
        assert!(reader.ahead.is_empty());
        // In pieces, as credit allows: still no hand-off.
        let mut reader = open(&bytes).await;
        assert_eq!(read_all(&mut reader, 100_000).await, bytes);
        assert!(reader.ahead.is_empty());
    }
}
