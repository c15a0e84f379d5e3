//! One TCP connection as the socket of a quinn endpoint: the TCP binding (spec §16). QUIC
//! packets go as they would in UDP datagrams, each framed by its length
//! ([`tensorwire_proto::frame_packet`]); one TCP connection carries one QUIC connection, so
//! TLS, streams, credit and every rule above them are the same on both bindings.
//!
//! Packets are read from the socket straight into quinn's receive buffers and written to it
//! straight from quinn's transmits, as a UDP socket would: only what the socket cannot take
//! at once is queued (at most [`OUTBOUND_BYTES`] and one transmit), and only a packet that
//! arrives in pieces is gathered in a buffer of its own first. A full queue makes quinn wait,
//! as a full UDP send buffer does, so TCP's own flow control reaches the QUIC connection;
//! while quinn does not read, the kernel's receive buffer fills and TCP slows the peer.

use std::io::{self, IoSlice, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::{Buf, BytesMut};
use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};
use smallvec::SmallVec;
use tensorwire_proto::{FramingError, PACKET_LENGTH_BYTES, packet_header, packet_length};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Framed bytes queued for the TCP socket past which quinn is told to wait.
const OUTBOUND_BYTES: usize = 1 << 20;

/// Transmits of several packets quinn may hand over at once (its GSO batches).
const SEGMENTS_PER_TRANSMIT: usize = 10;

/// How long a link that has ended may take to write what it still has queued (a last
/// CONNECTION_CLOSE) before its TCP connection is dropped: a peer that stopped reading
/// cannot keep it.
const FLUSH_GRACE: Duration = Duration::from_secs(1);

/// A TCP connection carrying one QUIC connection's packets (spec §16). Dropping it (quinn
/// does, once the endpoint and its connections are gone) sends what is queued and closes
/// the TCP connection.
#[derive(Debug)]
pub(crate) struct TcpLink {
    stream: Arc<TcpStream>,
    shared: Arc<LinkShared>,
    reading: Mutex<Reading>,
    local: SocketAddr,
    peer: SocketAddr,
}

/// What the link shares with its writing task.
#[derive(Debug, Default)]
struct LinkShared {
    outbound: Mutex<Outbound>,
    /// Bytes were queued, or the link ends: the writer has work.
    queued: Notify,
    /// Cancelled when the link is dropped or the TCP connection ends.
    ended: CancellationToken,
    /// Why the TCP connection ended, if it failed.
    failure: Mutex<Option<String>>,
}

#[derive(Debug, Default)]
struct Outbound {
    /// Framed bytes the socket has not taken yet, in order.
    bytes: BytesMut,
    /// The writer holds bytes taken from `bytes` and not yet written: later packets queue
    /// behind them, even while `bytes` is empty.
    writing: bool,
    /// quinn's connection drivers waiting for room in `bytes`.
    waiting: Vec<Waker>,
}

/// Where reading stands between two packets or inside one.
#[derive(Debug, Default)]
struct Reading {
    /// The next packet's length bytes, `header_read` of them read.
    header: [u8; PACKET_LENGTH_BYTES],
    header_read: usize,
    /// The length of a packet that arrived in part (0: none), and what arrived of it. The
    /// buffer is kept for the next such packet.
    gathering: usize,
    gathered: Vec<u8>,
}

/// How reading ended.
enum ReadEnd {
    /// The peer closed the connection at a packet boundary.
    Closed,
    /// The connection failed, or the peer broke the framing.
    Failed(String),
}

/// The end of a link, to learn when and why its TCP connection ended without holding the
/// link open.
#[derive(Clone, Debug)]
pub(crate) struct LinkEnd(Arc<LinkShared>);

impl LinkEnd {
    /// Resolves once the TCP connection has ended: failed, closed by the peer, or dropped.
    pub(crate) async fn ended(&self) {
        self.0.ended.cancelled().await;
    }

    /// Why the TCP connection failed, if it did.
    pub(crate) fn failure(&self) -> Option<String> {
        lock(&self.0.failure).clone()
    }
}

impl TcpLink {
    /// Starts writing `stream` on the current tokio runtime (the endpoint's: the stream is
    /// registered with it); quinn reads it.
    pub(crate) fn start(stream: TcpStream) -> io::Result<(Arc<Self>, LinkEnd)> {
        // Packets are batched here already; Nagle would only delay the last of a burst.
        stream.set_nodelay(true)?;
        let local = stream.local_addr()?;
        let peer = stream.peer_addr()?;
        let stream = Arc::new(stream);
        let shared = Arc::new(LinkShared::default());
        tokio::spawn(write_queued(stream.clone(), shared.clone()));
        let link = Arc::new(Self {
            stream,
            shared: shared.clone(),
            reading: Mutex::default(),
            local,
            peer,
        });
        Ok((link, LinkEnd(shared)))
    }

    /// Reads whole packets into `bufs` (counting them in `filled`) until the socket has
    /// nothing more or `bufs` are full.
    fn read_packets(
        &self,
        reading: &mut Reading,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
        filled: &mut usize,
    ) -> Result<(), ReadEnd> {
        while let (Some(buf), Some(meta)) = (bufs.get_mut(*filled), meta.get_mut(*filled)) {
            let length = if reading.gathering > 0 {
                // A packet that arrived in pieces: go on gathering it.
                let (length, had) = (reading.gathering, reading.gathered.len());
                reading.gathered.resize(length, 0);
                let read = self.read_body(
                    &mut reading.header,
                    &mut reading.header_read,
                    &mut reading.gathered[had..],
                )?;
                reading.gathered.truncate(had + read);
                if had + read < length {
                    if read == 0 {
                        return Ok(());
                    }
                    continue;
                }
                room(buf, length)?.copy_from_slice(&reading.gathered);
                reading.gathered.clear();
                reading.gathering = 0;
                length
            } else {
                if !self.read_header(reading)? {
                    return Ok(());
                }
                let length = packet_length(reading.header).map_err(framing)?;
                reading.header_read = 0;
                let target = room(buf, length)?;
                let read = self.read_body(&mut reading.header, &mut reading.header_read, target)?;
                if read < length {
                    // Gathered apart: quinn may reuse its buffer before the rest arrives.
                    reading.gathered.extend_from_slice(&target[..read]);
                    reading.gathering = length;
                    continue;
                }
                length
            };
            *meta = RecvMeta {
                addr: self.peer,
                len: length,
                stride: length,
                ecn: None,
                dst_ip: None,
            };
            *filled += 1;
        }
        Ok(())
    }

    /// Reads what has arrived of the next packet's length; whether it is all in.
    fn read_header(&self, reading: &mut Reading) -> Result<bool, ReadEnd> {
        if reading.header_read < PACKET_LENGTH_BYTES {
            match self
                .stream
                .try_read(&mut reading.header[reading.header_read..])
            {
                Ok(0) if reading.header_read == 0 => return Err(ReadEnd::Closed),
                Ok(0) => return Err(truncated(PACKET_LENGTH_BYTES - reading.header_read)),
                Ok(read) => reading.header_read += read,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(failed_read(&e)),
            }
        }
        Ok(reading.header_read == PACKET_LENGTH_BYTES)
    }

    /// Reads into `body` (the rest of a packet) and, in the same call, the next packet's
    /// length into `next` (counted in `next_read`) if it has arrived too; how many bytes of
    /// `body` were read (0: none had arrived).
    fn read_body(
        &self,
        next: &mut [u8; PACKET_LENGTH_BYTES],
        next_read: &mut usize,
        body: &mut [u8],
    ) -> Result<usize, ReadEnd> {
        let wanted = body.len();
        let mut slices = [IoSliceMut::new(body), IoSliceMut::new(next)];
        match self.stream.try_read_vectored(&mut slices) {
            Ok(0) => Err(truncated(wanted)),
            Ok(read) => {
                *next_read = read.saturating_sub(wanted);
                Ok(read.min(wanted))
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
            Err(e) => Err(failed_read(&e)),
        }
    }

    /// Writes `packets` (framed) to the socket in one call, or queues what it does not take
    /// at once.
    fn send_packets(&self, outbound: &mut Outbound, packets: &[&[u8]]) {
        // quinn builds no packet that the framing refuses; one would be dropped here.
        let framed: SmallVec<[([u8; PACKET_LENGTH_BYTES], &[u8]); SEGMENTS_PER_TRANSMIT]> = packets
            .iter()
            .filter_map(|&packet| Some((packet_header(packet.len()).ok()?, packet)))
            .collect();
        let mut written = 0;
        if outbound.bytes.is_empty() && !outbound.writing {
            let slices: SmallVec<[IoSlice<'_>; 2 * SEGMENTS_PER_TRANSMIT]> = framed
                .iter()
                .flat_map(|(header, packet)| [IoSlice::new(header), IoSlice::new(packet)])
                .collect();
            match self.stream.try_write_vectored(&slices) {
                Ok(taken) => written = taken,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return fail(&self.shared, format!("writing the TCP connection: {e}")),
            }
        }
        // What the socket did not take waits in the queue, in order.
        let mut skip = written;
        for (header, packet) in &framed {
            for part in [&header[..], packet] {
                if skip >= part.len() {
                    skip -= part.len();
                } else {
                    outbound.bytes.extend_from_slice(&part[skip..]);
                    skip = 0;
                }
            }
        }
        if !outbound.bytes.is_empty() {
            self.shared.queued.notify_one();
        }
    }
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        self.shared.ended.cancel();
        self.shared.queued.notify_one();
    }
}

/// The first `length` bytes of quinn's buffer, which holds its largest packet.
fn room(buf: &mut [u8], length: usize) -> Result<&mut [u8], ReadEnd> {
    buf.get_mut(..length).ok_or_else(|| {
        ReadEnd::Failed(format!(
            "a packet of {length} bytes, more than the endpoint receives"
        ))
    })
}

fn failed_read(error: &io::Error) -> ReadEnd {
    ReadEnd::Failed(format!("reading the TCP connection: {error}"))
}

fn framing(error: FramingError) -> ReadEnd {
    ReadEnd::Failed(format!(
        "the peer broke the TCP binding's framing (spec §16): {error}"
    ))
}

fn truncated(missing: usize) -> ReadEnd {
    framing(FramingError::Truncated { missing })
}

/// Writes what the link queued until the link ends; then writes what is left, for up to
/// [`FLUSH_GRACE`], and closes the sending direction.
async fn write_queued(stream: Arc<TcpStream>, shared: Arc<LinkShared>) {
    loop {
        let (mut bytes, waiting) = {
            let mut outbound = lock(&shared.outbound);
            let bytes = outbound.bytes.split();
            outbound.writing = !bytes.is_empty();
            (bytes, std::mem::take(&mut outbound.waiting))
        };
        // The queue is empty now: whoever waited for room may queue again.
        waiting.into_iter().for_each(Waker::wake);
        if bytes.is_empty() {
            if shared.ended.is_cancelled() {
                let _ = socket2::SockRef::from(&*stream).shutdown(std::net::Shutdown::Write);
                return;
            }
            shared.queued.notified().await;
            continue;
        }
        let abandoned = async {
            shared.ended.cancelled().await;
            tokio::time::sleep(FLUSH_GRACE).await;
        };
        tokio::pin!(abandoned);
        while !bytes.is_empty() {
            tokio::select! {
                ready = stream.writable() => {
                    let written = ready.and_then(|()| stream.try_write(&bytes));
                    match written {
                        Ok(written) => bytes.advance(written),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(e) => return fail(&shared, format!("writing the TCP connection: {e}")),
                    }
                }
                () = &mut abandoned => return,
            }
        }
    }
}

/// Ends the link for `why`, waking whoever waits for room so that it sees the end.
fn fail(shared: &LinkShared, why: String) {
    tracing::debug!(%why, "TCP link failed");
    lock(&shared.failure).get_or_insert(why);
    shared.ended.cancel();
    shared.queued.notify_one();
    let waiting = std::mem::take(&mut lock(&shared.outbound).waiting);
    waiting.into_iter().for_each(Waker::wake);
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Byte queues, read positions and wakers: nothing a panic could leave half done.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl AsyncUdpSocket for TcpLink {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        Box::pin(RoomPoller(self.shared.clone()))
    }

    fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
        if transmit.destination != self.peer || self.shared.ended.is_cancelled() {
            // Nowhere to go (a link has one peer), or nothing to carry it: lost, as a
            // datagram would be. QUIC's loss recovery and idle timeout take it from here.
            return Ok(());
        }
        let mut outbound = lock(&self.shared.outbound);
        if outbound.bytes.len() >= OUTBOUND_BYTES {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let segment = transmit.segment_size.unwrap_or(transmit.contents.len());
        let packets: SmallVec<[&[u8]; SEGMENTS_PER_TRANSMIT]> =
            transmit.contents.chunks(segment.max(1)).collect();
        self.send_packets(&mut outbound, &packets);
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        let mut reading = lock(&self.reading);
        loop {
            if self.shared.ended.is_cancelled() {
                // No more packets, ever: quinn's idle timeout, or the owner watching the
                // link's end, closes the connection.
                return Poll::Pending;
            }
            let mut filled = 0;
            let read = self.read_packets(&mut reading, bufs, meta, &mut filled);
            if let Err(end) = read {
                match end {
                    ReadEnd::Closed => self.shared.ended.cancel(),
                    ReadEnd::Failed(why) => fail(&self.shared, why),
                }
            }
            if filled > 0 {
                return Poll::Ready(Ok(filled));
            }
            // Nothing had arrived: wait for the socket (a read that would block cleared its
            // readiness, so this registers the waker), then read again.
            match self.stream.poll_read_ready(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => {
                    fail(&self.shared, format!("reading the TCP connection: {e}"));
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }

    fn max_transmit_segments(&self) -> usize {
        SEGMENTS_PER_TRANSMIT
    }

    fn may_fragment(&self) -> bool {
        false
    }
}

/// Ready while the link's queue has room (or the link has ended: sends are then dropped).
#[derive(Debug)]
struct RoomPoller(Arc<LinkShared>);

impl UdpPoller for RoomPoller {
    fn poll_writable(self: Pin<&mut Self>, cx: &mut Context) -> Poll<io::Result<()>> {
        let mut outbound = lock(&self.0.outbound);
        if outbound.bytes.len() < OUTBOUND_BYTES || self.0.ended.is_cancelled() {
            return Poll::Ready(Ok(()));
        }
        if !outbound.waiting.iter().any(|w| w.will_wake(cx.waker())) {
            outbound.waiting.push(cx.waker().clone());
        }
        Poll::Pending
    }
}
