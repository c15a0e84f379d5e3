//! A UDP socket that sends each segmentation-offload batch in pieces of at most one UDP
//! datagram's size.
//!
//! quinn batches up to 10 packets per send with GSO. The kernel refuses a batch larger than
//! one UDP datagram (64 KiB) and its packets are lost: above an MTU of about 6500, quinn's
//! black-hole detection then falls back to 1200-byte packets (older versions stalled).
//! Sending such a batch in pieces lets loopback and jumbo-frame links use larger packets,
//! and so fewer of them per byte (benches/results/LOG.md, "Larger packets"). The pieces are cut
//! from the packets' actual size, which may be below the configured MTU: a peer that accepts
//! smaller datagrams lowers it after the handshake.

use std::io::{self, IoSliceMut};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};

/// Bytes one GSO send may carry: a UDP datagram's payload over IPv4 (65,507), rounded down.
const GSO_BATCH_BYTES: usize = 65_000;

/// A runtime's socket whose GSO batches go out in pieces of at most [`GSO_BATCH_BYTES`].
#[derive(Debug)]
pub(crate) struct BatchSplitter {
    /// The runtime's socket, which does the I/O.
    inner: Arc<dyn AsyncUdpSocket>,
}

impl BatchSplitter {
    /// `inner`, its oversized batches split.
    pub(crate) fn wrap(inner: Arc<dyn AsyncUdpSocket>) -> Arc<dyn AsyncUdpSocket> {
        Arc::new(Self { inner })
    }
}

impl AsyncUdpSocket for BatchSplitter {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
        let Some(segment) = transmit.segment_size else {
            return self.inner.try_send(transmit);
        };
        let piece = (GSO_BATCH_BYTES / segment.max(1)).max(1) * segment;
        if transmit.contents.len() <= piece {
            return self.inner.try_send(transmit);
        }
        // If a later piece would block, quinn retries the whole batch once the socket is
        // writable: the pieces already sent arrive twice, and the peer drops the duplicates
        // by packet number (RFC 9000 §12.3). Nothing is lost.
        for contents in transmit.contents.chunks(piece) {
            self.inner.try_send(&Transmit {
                contents,
                segment_size: (contents.len() > segment).then_some(segment),
                ..transmit.clone()
            })?;
        }
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        self.inner.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> io::Result<std::net::SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}
