//! A UDP socket that keeps each segmentation-offload batch within one UDP datagram's limit.
//!
//! quinn batches up to 10 packets per send with GSO. The kernel refuses a batch larger than
//! one UDP datagram (64 KiB) and its packets are lost: above an MTU of about 6500, quinn's
//! black-hole detection then falls back to 1200-byte packets (older versions stalled).
//! Cutting the batch to what fits lets loopback and jumbo-frame links use larger packets,
//! and so fewer of them per byte (benches/README.md, "Larger packets").

use std::fmt;
use std::io::{self, IoSliceMut};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};

/// Bytes one GSO batch may carry: a UDP datagram's payload over IPv4 (65,507), rounded down.
pub(crate) const GSO_BATCH_BYTES: usize = 65_000;

/// `inner`, with at most as many segments per send as `mtu`-byte packets fit in
/// [`GSO_BATCH_BYTES`].
pub(crate) struct SegmentCap {
    /// The runtime's socket, which does the I/O.
    inner: Arc<dyn AsyncUdpSocket>,
    /// The most packets one send may carry at this MTU.
    max_segments: usize,
}

impl SegmentCap {
    /// `inner`, its batches cut to fit for packets of `mtu` bytes.
    pub(crate) fn wrap(inner: Arc<dyn AsyncUdpSocket>, mtu: u16) -> Arc<dyn AsyncUdpSocket> {
        let max_segments = (GSO_BATCH_BYTES / usize::from(mtu.max(1200))).max(1);
        Arc::new(Self {
            inner,
            max_segments,
        })
    }
}

impl fmt::Debug for SegmentCap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SegmentCap")
            .field("inner", &self.inner)
            .field("max_segments", &self.max_segments)
            .finish()
    }
}

impl AsyncUdpSocket for SegmentCap {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
        self.inner.try_send(transmit)
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
        self.inner.max_transmit_segments().min(self.max_segments)
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}
