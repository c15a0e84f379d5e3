//! One TCP connection as the socket of a quinn endpoint: the TCP binding (spec §16). QUIC
//! packets go as they would in UDP datagrams, each framed by its length
//! ([`tensorwire_proto::frame_packet`]); one TCP connection carries one QUIC connection, so
//! TLS, streams, credit and every rule above them are the same on both bindings.
//!
//! Memory is bounded per link: one packet being read, [`INBOUND_PACKETS`] read and not yet
//! taken by quinn, and [`OUTBOUND_BYTES`] (plus one transmit) queued for the TCP socket.
//! A full queue makes quinn wait, as a full UDP send buffer does, so TCP's own flow control
//! reaches the QUIC connection.

use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};
use tensorwire_proto::{FramingError, MAX_TCP_PACKET, PacketDeframer, frame_packet};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;

/// Packets read from the TCP connection and not yet taken by quinn. Reading stops while
/// they wait, so a peer that sends faster than quinn processes is slowed by TCP.
const INBOUND_PACKETS: usize = 8;

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
    shared: Arc<LinkShared>,
    inbound: Mutex<mpsc::Receiver<Bytes>>,
    local: SocketAddr,
    peer: SocketAddr,
}

/// What the link's reading and writing tasks share with it.
#[derive(Debug, Default)]
struct LinkShared {
    outbound: Mutex<Outbound>,
    /// Bytes were queued, or the link ends: the writer has work.
    queued: Notify,
    /// Cancelled when the link is dropped or the TCP connection fails.
    ended: CancellationToken,
    /// Why the TCP connection ended, if it failed.
    failure: Mutex<Option<String>>,
}

#[derive(Debug, Default)]
struct Outbound {
    bytes: BytesMut,
    /// quinn's connection drivers waiting for room in `bytes`.
    waiting: Vec<Waker>,
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
    /// Starts reading and writing `stream` on the current tokio runtime (the endpoint's:
    /// the stream is registered with it).
    pub(crate) fn start(stream: TcpStream) -> io::Result<(Arc<Self>, LinkEnd)> {
        // Packets are batched here already; Nagle would only delay the last of a burst.
        stream.set_nodelay(true)?;
        let local = stream.local_addr()?;
        let peer = stream.peer_addr()?;
        let (read, write) = stream.into_split();
        let shared = Arc::new(LinkShared::default());
        let (packets, inbound) = mpsc::channel(INBOUND_PACKETS);
        tokio::spawn(read_packets(read, packets, shared.clone()));
        tokio::spawn(write_packets(write, shared.clone()));
        let link = Arc::new(Self {
            shared: shared.clone(),
            inbound: Mutex::new(inbound),
            local,
            peer,
        });
        Ok((link, LinkEnd(shared)))
    }
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        self.shared.ended.cancel();
        self.shared.queued.notify_one();
    }
}

/// Reads packets into `packets` until the connection ends, the link is dropped, or the
/// peer's framing is broken (the connection is then closed: no packet boundary can be found
/// again, spec §16).
async fn read_packets(
    mut read: OwnedReadHalf,
    packets: mpsc::Sender<Bytes>,
    shared: Arc<LinkShared>,
) {
    let mut deframer = PacketDeframer::new();
    let failure = loop {
        let read = tokio::select! {
            () = shared.ended.cancelled() => return,
            read = read_some(&mut read, &mut deframer) => read,
        };
        match read {
            Ok(0) => match deframer.finish() {
                Ok(()) => break None,
                Err(e) => break Some(e.to_string()),
            },
            Ok(_) => {}
            Err(e) => break Some(format!("reading the TCP connection: {e}")),
        }
        loop {
            match deframer.next_packet() {
                Ok(Some(packet)) => {
                    let sent = tokio::select! {
                        () = shared.ended.cancelled() => return,
                        sent = packets.send(packet) => sent,
                    };
                    if sent.is_err() {
                        return;
                    }
                }
                Ok(None) => break,
                Err(e) => return fail(&shared, framing(&e)),
            }
        }
    };
    match failure {
        Some(failure) => fail(&shared, failure),
        None => shared.ended.cancel(),
    }
}

/// Reads what has arrived into the deframer, with room for a whole packet.
async fn read_some(read: &mut OwnedReadHalf, deframer: &mut PacketDeframer) -> io::Result<usize> {
    let buffer = deframer.buffer();
    buffer.reserve(MAX_TCP_PACKET + 2);
    read.read_buf(buffer).await
}

fn framing(error: &FramingError) -> String {
    format!("the peer broke the TCP binding's framing (spec §16): {error}")
}

/// Writes queued packets until the link ends; then writes what is left, for up to
/// [`FLUSH_GRACE`], and closes.
async fn write_packets(mut write: OwnedWriteHalf, shared: Arc<LinkShared>) {
    loop {
        let (bytes, waiting) = {
            let mut outbound = lock(&shared.outbound);
            let bytes = outbound.bytes.split();
            (bytes, std::mem::take(&mut outbound.waiting))
        };
        // The queue is empty now: whoever waited for room may queue again.
        waiting.into_iter().for_each(Waker::wake);
        if bytes.is_empty() {
            if shared.ended.is_cancelled() {
                let _ = write.shutdown().await;
                return;
            }
            shared.queued.notified().await;
            continue;
        }
        let abandoned = async {
            shared.ended.cancelled().await;
            tokio::time::sleep(FLUSH_GRACE).await;
        };
        tokio::select! {
            written = write.write_all(&bytes) => if let Err(e) = written {
                return fail(&shared, format!("writing the TCP connection: {e}"));
            },
            () = abandoned => return,
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
    // Byte queues and wakers: nothing a panic could leave half done.
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
        for packet in transmit.contents.chunks(segment.max(1)) {
            frame_packet(&mut outbound.bytes, packet)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        }
        drop(outbound);
        self.shared.queued.notify_one();
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        let mut inbound = lock(&self.inbound);
        let mut filled = 0;
        for (buf, meta) in bufs.iter_mut().zip(meta.iter_mut()) {
            let packet = if filled == 0 {
                match inbound.poll_recv(cx) {
                    Poll::Ready(Some(packet)) => packet,
                    // The link ended: no more packets, ever. quinn's idle timeout, or the
                    // owner watching the link's end, closes the connection.
                    Poll::Ready(None) | Poll::Pending => return Poll::Pending,
                }
            } else {
                match inbound.try_recv() {
                    Ok(packet) => packet,
                    Err(_) => break,
                }
            };
            // quinn's buffers hold its largest payload, which is at least the framing's
            // largest packet; a longer one would be a bug, and is dropped rather than cut.
            let Some(target) = buf.get_mut(..packet.len()) else {
                continue;
            };
            target.copy_from_slice(&packet);
            *meta = RecvMeta {
                addr: self.peer,
                len: packet.len(),
                stride: packet.len(),
                ecn: None,
                dst_ip: None,
            };
            filled += 1;
        }
        if filled == 0 {
            // Every packet taken was dropped: look again.
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        Poll::Ready(Ok(filled))
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
