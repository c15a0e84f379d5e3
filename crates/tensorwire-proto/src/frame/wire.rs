//! A bounds-checked reader of little-endian bodies, for frames and for messages carried in
//! tensors (such as remote execution's, spec §14), and the length checks frames share.

use bytes::BufMut;

use super::header::FrameType;
use crate::error::{ErrorCode, ProtocolError};
use crate::limits::Limits;

/// What a [`Reader`] reads, for its errors: a frame's body, or a message carried in a
/// tensor, each with its own code for bytes that do not parse.
#[derive(Clone, Copy, Debug)]
enum Subject {
    Frame(FrameType),
    Message { code: ErrorCode, what: &'static str },
}

impl Subject {
    fn malformed(self) -> ErrorCode {
        match self {
            Subject::Frame(_) => ErrorCode::FRAME_MALFORMED,
            Subject::Message { code, .. } => code,
        }
    }
}

impl std::fmt::Display for Subject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Subject::Frame(ty) => write!(f, "{ty} body"),
            Subject::Message { what, .. } => f.write_str(what),
        }
    }
}

/// Reads fixed-width little-endian fields; running short is FRAME_MALFORMED, or a message's
/// own code ([`Reader::message`]).
pub struct Reader<'a> {
    buf: &'a [u8],
    subject: Subject,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8], frame: FrameType) -> Self {
        Self {
            buf,
            subject: Subject::Frame(frame),
        }
    }

    /// A reader of a message carried in a tensor: bytes that do not parse are `code`, and
    /// errors name the message as `what` (e.g. "remote-execution message").
    pub fn message(buf: &'a [u8], code: ErrorCode, what: &'static str) -> Self {
        Self {
            buf,
            subject: Subject::Message { code, what },
        }
    }

    /// The error for bytes that do not parse here.
    pub fn malformed(&self, detail: impl std::fmt::Display) -> ProtocolError {
        ProtocolError::malformed(
            self.subject.malformed(),
            format!("{}: {detail}", self.subject),
        )
    }

    /// The next `n` bytes.
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], ProtocolError> {
        if self.buf.len() < n {
            return Err(self.malformed(format_args!("ends {} bytes early", n - self.buf.len())));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    /// The next `N` bytes, as an array.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], ProtocolError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.bytes(N)?);
        Ok(out)
    }

    /// The next `u8` (little-endian).
    pub fn u8(&mut self) -> Result<u8, ProtocolError> {
        Ok(self.array::<1>()?[0])
    }

    /// The next `u16` (little-endian).
    pub fn u16(&mut self) -> Result<u16, ProtocolError> {
        self.array().map(u16::from_le_bytes)
    }

    /// The next `u32` (little-endian).
    pub fn u32(&mut self) -> Result<u32, ProtocolError> {
        self.array().map(u32::from_le_bytes)
    }

    /// The next `u64` (little-endian).
    pub fn u64(&mut self) -> Result<u64, ProtocolError> {
        self.array().map(u64::from_le_bytes)
    }

    /// Reads `n` bytes of UTF-8.
    pub fn string(&mut self, n: usize) -> Result<String, ProtocolError> {
        let raw = self.bytes(n)?;
        match std::str::from_utf8(raw) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(ProtocolError::malformed(
                ErrorCode::INVALID_UTF8,
                format!("{} string field: {e}", self.subject),
            )),
        }
    }

    /// Fails if bytes are left over: a body is exactly as long as its fields.
    pub fn finish(self) -> Result<(), ProtocolError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(self.malformed(format_args!("{} trailing bytes", self.buf.len())))
        }
    }
}

/// A frame type whose body has one fixed length.
pub(crate) fn exact_len(ty: FrameType, len: u32, expected: usize) -> Result<(), ProtocolError> {
    if len as usize == expected {
        Ok(())
    } else {
        Err(ProtocolError::malformed(
            ErrorCode::FRAME_MALFORMED,
            format!("{ty} body is {len} bytes, must be {expected}"),
        ))
    }
}

/// CANCEL and REJECT: code (4) + reason length (2) + reason.
pub(crate) fn check_reason_len(
    ty: FrameType,
    len: u32,
    limits: &Limits,
) -> Result<(), ProtocolError> {
    let Some(reason_len) = (len as usize).checked_sub(REASON_FIXED_LEN) else {
        return exact_len(ty, len, REASON_FIXED_LEN);
    };
    if reason_len > limits.max_reason_len as usize {
        return Err(ProtocolError::LimitExceeded {
            code: ErrorCode::REASON_TOO_LONG,
            what: "reason length",
            value: reason_len as u64,
            limit: limits.max_reason_len as u64,
        });
    }
    Ok(())
}

/// Fixed part of CANCEL and REJECT bodies: code (4) and reason length (2).
pub(crate) const REASON_FIXED_LEN: usize = 6;

/// Decodes the `code | reason_len | reason` body of CANCEL and REJECT.
pub(crate) fn decode_reason(
    ty: FrameType,
    body: &[u8],
) -> Result<(ErrorCode, String), ProtocolError> {
    let mut r = Reader::new(body, ty);
    let code = ErrorCode(r.u32()?);
    let reason_len = r.u16()? as usize;
    let reason = r.string(reason_len)?;
    r.finish()?;
    Ok((code, reason))
}

/// Encodes the `code | reason_len | reason` body of CANCEL and REJECT.
pub(crate) fn encode_reason(code: ErrorCode, reason: &str, dst: &mut impl BufMut) {
    dst.put_u32_le(code.0);
    dst.put_u16_le(reason.len() as u16);
    dst.put_slice(reason.as_bytes());
}

/// Cuts `reason` to at most `max` bytes on a character boundary.
pub fn truncate_reason(mut reason: String, max: usize) -> String {
    if reason.len() > max {
        let mut end = max;
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        reason.truncate(end);
    }
    reason
}
