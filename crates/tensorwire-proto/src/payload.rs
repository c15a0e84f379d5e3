//! DATA payloads as chains of received `Bytes`, never copied (spec §6.2).

use bytes::{Buf, Bytes};
use smallvec::SmallVec;

/// A DATA payload: the received `Bytes` pieces it spans, in order, shared with the input.
///
/// A frame may span several network reads; the decoder hands their slices on as they are,
/// so the only copy of the bytes is the one the sink makes into its destination.
#[derive(Clone, Default)]
pub struct Payload {
    /// One piece inline: a payload that arrived in one read (a small tensor's, or any in a
    /// test) takes no allocation of its own.
    parts: SmallVec<[Bytes; 1]>,
    len: usize,
}

impl Payload {
    /// Total length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the payload has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The pieces, in order; none is empty.
    pub fn parts(&self) -> &[Bytes] {
        &self.parts
    }

    /// Appends a piece (ignored when empty).
    pub fn push(&mut self, part: Bytes) {
        if !part.is_empty() {
            self.len += part.len();
            self.parts.push(part);
        }
    }

    /// The payload as one `Bytes`: free for one piece, one copy for several.
    pub fn to_bytes(&self) -> Bytes {
        match self.parts.as_slice() {
            [] => Bytes::new(),
            [one] => one.clone(),
            many => {
                let mut out = Vec::with_capacity(self.len);
                many.iter().for_each(|p| out.extend_from_slice(p));
                out.into()
            }
        }
    }

    /// CRC-32C of the payload's bytes.
    pub fn crc32c(&self) -> u32 {
        self.crc32c_append(0)
    }

    /// CRC-32C of the bytes whose CRC is `crc` followed by the payload.
    pub fn crc32c_append(&self, crc: u32) -> u32 {
        self.parts
            .iter()
            .fold(crc, |crc, p| crate::checksum::crc32c_append(crc, p))
    }

    /// Continues `crc`, when given, over the payload: what a sink that stores without copying
    /// does with the checksum its `store` is asked for.
    pub fn continue_crc(&self, crc: Option<&mut u32>) {
        if let Some(crc) = crc {
            *crc = self.crc32c_append(*crc);
        }
    }

    /// Copies the payload into `dst`, which must be exactly `len()` bytes long.
    pub fn copy_to_slice(&self, dst: &mut [u8]) {
        let mut at = 0;
        for part in &self.parts {
            dst[at..at + part.len()].copy_from_slice(part);
            at += part.len();
        }
    }

    /// Iterates over the bytes (for tests and small payloads).
    pub fn bytes(&self) -> impl Iterator<Item = u8> + '_ {
        self.parts.iter().flat_map(|p| p.iter().copied())
    }
}

impl From<Bytes> for Payload {
    fn from(bytes: Bytes) -> Self {
        let mut payload = Payload::default();
        payload.push(bytes);
        payload
    }
}

impl From<Vec<u8>> for Payload {
    fn from(bytes: Vec<u8>) -> Self {
        Bytes::from(bytes).into()
    }
}

impl PartialEq for Payload {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.bytes().eq(other.bytes())
    }
}

impl Eq for Payload {}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Payload({} bytes in {} parts)",
            self.len,
            self.parts.len()
        )
    }
}

/// A queue of received `Bytes` that frames are cut from without copying.
#[derive(Default, Debug)]
pub(crate) struct ByteQueue {
    chunks: std::collections::VecDeque<Bytes>,
    len: usize,
}

impl ByteQueue {
    pub(crate) fn push(&mut self, bytes: Bytes) {
        if !bytes.is_empty() {
            self.len += bytes.len();
            self.chunks.push_back(bytes);
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Copies the first `dst.len()` bytes into `dst` without consuming; `false` if too few.
    pub(crate) fn peek(&self, dst: &mut [u8]) -> bool {
        if self.len < dst.len() {
            return false;
        }
        let mut at = 0;
        for chunk in &self.chunks {
            let n = chunk.len().min(dst.len() - at);
            dst[at..at + n].copy_from_slice(&chunk[..n]);
            at += n;
            if at == dst.len() {
                break;
            }
        }
        true
    }

    /// Drops the first `n` bytes; the caller has checked that they are buffered.
    pub(crate) fn skip(&mut self, mut n: usize) {
        self.len -= n;
        while n > 0 {
            let Some(front) = self.chunks.front_mut() else {
                return;
            };
            if front.len() > n {
                front.advance(n);
                return;
            }
            n -= front.len();
            self.chunks.pop_front();
        }
    }

    /// Takes the first `n` bytes as shared slices of the input.
    pub(crate) fn take(&mut self, mut n: usize) -> Payload {
        let mut payload = Payload::default();
        self.len -= n;
        while n > 0 {
            let Some(front) = self.chunks.front_mut() else {
                break;
            };
            if front.len() > n {
                payload.push(front.split_to(n));
                break;
            }
            n -= front.len();
            if let Some(chunk) = self.chunks.pop_front() {
                payload.push(chunk);
            }
        }
        payload
    }
}

/// The body of one fully buffered frame, cut from the front of a [`ByteQueue`].
pub(crate) struct ByteQueueBody<'a> {
    queue: &'a mut ByteQueue,
    remaining: usize,
}

impl<'a> ByteQueueBody<'a> {
    /// The caller has checked that `len` bytes are buffered.
    pub(crate) fn new(queue: &'a mut ByteQueue, len: usize) -> Self {
        Self {
            queue,
            remaining: len,
        }
    }

    /// Copies the body's first `dst.len()` bytes without consuming them.
    pub(crate) fn peek(&self, dst: &mut [u8]) -> bool {
        dst.len() <= self.remaining && self.queue.peek(dst)
    }

    /// Takes the rest of the body as one `Bytes`, copying only if it spans input chunks.
    pub(crate) fn contiguous(&mut self) -> Bytes {
        let payload = self.take_rest();
        payload.to_bytes()
    }

    /// Takes a little-endian u64; the caller has checked the body is long enough.
    pub(crate) fn take_u64_le(&mut self) -> u64 {
        let mut raw = [0u8; 8];
        self.queue.peek(&mut raw);
        self.queue.skip(8);
        self.remaining -= 8;
        u64::from_le_bytes(raw)
    }

    /// Copies the rest of the body into `dst` and returns it, if it fits: a short fixed
    /// body is read without collecting its pieces.
    pub(crate) fn copy_rest<'d>(&mut self, dst: &'d mut [u8]) -> Option<&'d [u8]> {
        let dst = dst.get_mut(..self.remaining)?;
        if !self.peek(dst) {
            return None;
        }
        self.queue.skip(self.remaining);
        self.remaining = 0;
        Some(dst)
    }

    /// Takes the rest of the body as shared slices.
    pub(crate) fn take_rest(&mut self) -> Payload {
        let payload = self.queue.take(self.remaining);
        self.remaining = 0;
        payload
    }
}

impl Drop for ByteQueueBody<'_> {
    /// Whatever a decoder left of the body is dropped, so the next frame starts aligned.
    fn drop(&mut self) {
        self.queue.skip(self.remaining);
    }
}
