//! The TCP binding's framing (spec §16): on a TCP connection, each QUIC packet is preceded by
//! its length as a `u16`, little-endian (§2), so the packets that UDP would carry as
//! datagrams keep their boundaries on a byte stream.

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// Bytes of the length before each packet.
pub const PACKET_LENGTH_BYTES: usize = 2;

/// The largest packet the binding carries: QUIC's largest UDP payload (RFC 9000 §18.2,
/// `max_udp_payload_size`). Longer lengths are a framing error (spec §16).
pub const MAX_TCP_PACKET: usize = 65_527;

/// Why a TCP connection's bytes are not a sequence of framed packets (spec §16). The
/// connection is closed: there is no way to find the next packet boundary.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FramingError {
    /// A length of zero: no QUIC packet is empty.
    #[error("the peer framed an empty packet")]
    EmptyPacket,
    /// A length above [`MAX_TCP_PACKET`].
    #[error(
        "the peer framed a packet of {length} bytes, more than the {MAX_TCP_PACKET} QUIC allows"
    )]
    PacketTooLong {
        /// The length it announced.
        length: usize,
    },
    /// The connection ended inside a packet or its length.
    #[error("the TCP connection ended {missing} bytes before the end of a packet")]
    Truncated {
        /// Bytes still announced (at least one).
        missing: usize,
    },
}

/// Appends `packet`, framed, to `out`.
pub fn frame_packet(out: &mut BytesMut, packet: &[u8]) -> Result<(), FramingError> {
    let header = packet_header(packet.len())?;
    out.reserve(PACKET_LENGTH_BYTES + packet.len());
    out.put_slice(&header);
    out.put_slice(packet);
    Ok(())
}

/// The length bytes that go before a packet of `length` bytes, if a packet may have it.
pub fn packet_header(length: usize) -> Result<[u8; PACKET_LENGTH_BYTES], FramingError> {
    Ok(check_length(length)?.to_le_bytes())
}

/// The length a packet's two length bytes announce, if a packet may have it.
pub fn packet_length(header: [u8; PACKET_LENGTH_BYTES]) -> Result<usize, FramingError> {
    let length = usize::from(u16::from_le_bytes(header));
    check_length(length)?;
    Ok(length)
}

/// `length` as it goes on the wire, if a packet may have it.
fn check_length(length: usize) -> Result<u16, FramingError> {
    if length == 0 {
        return Err(FramingError::EmptyPacket);
    }
    if length > MAX_TCP_PACKET {
        return Err(FramingError::PacketTooLong { length });
    }
    u16::try_from(length).map_err(|_| FramingError::PacketTooLong { length })
}

/// Splits a TCP connection's bytes back into packets. It holds at most one packet and its
/// length beyond what was pushed into it since the last packet was taken: the driver reads
/// into [`buffer`](Self::buffer) and takes packets out before reading more.
#[derive(Debug, Default)]
pub struct PacketDeframer {
    buffer: BytesMut,
}

impl PacketDeframer {
    /// An empty deframer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Where to put bytes read from the connection (for a read straight into it).
    pub fn buffer(&mut self) -> &mut BytesMut {
        &mut self.buffer
    }

    /// Appends bytes read from the connection.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buffer.extend_from_slice(bytes);
    }

    /// The next whole packet, without copying it; `Ok(None)` until one has arrived. A
    /// length that no packet may have fails as soon as it is read, before its bytes are
    /// awaited.
    pub fn next_packet(&mut self) -> Result<Option<Bytes>, FramingError> {
        let Some(length) = self.announced()? else {
            return Ok(None);
        };
        if self.buffer.len() < PACKET_LENGTH_BYTES + length {
            // Room for the rest, so the next read fills the packet without reallocating.
            self.buffer
                .reserve(PACKET_LENGTH_BYTES + length - self.buffer.len());
            return Ok(None);
        }
        self.buffer.advance(PACKET_LENGTH_BYTES);
        Ok(Some(self.buffer.split_to(length).freeze()))
    }

    /// The length of the packet at the front, once its two bytes are in.
    fn announced(&self) -> Result<Option<usize>, FramingError> {
        let [low, high, ..] = self.buffer[..] else {
            return Ok(None);
        };
        packet_length([low, high]).map(Some)
    }

    /// Checks that the connection ended at a packet boundary.
    pub fn finish(&self) -> Result<(), FramingError> {
        if self.buffer.is_empty() {
            return Ok(());
        }
        let missing = match self.announced()? {
            Some(length) => PACKET_LENGTH_BYTES + length - self.buffer.len(),
            None => PACKET_LENGTH_BYTES - self.buffer.len(),
        };
        Err(FramingError::Truncated { missing })
    }

    /// Bytes held: the part of a packet (and its length) not yet taken.
    pub fn buffered(&self) -> usize {
        self.buffer.len()
    }
}
