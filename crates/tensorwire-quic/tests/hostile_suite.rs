//! The hostile-peer suite (spec §10): one receiver, run as the `receiver` program runs it
//! (every tensor accepted into host memory), driven by raw QUIC peers through floods of
//! METADATA, CANCEL, RESET_STREAM, one-byte DATA and silent connections. After each flood:
//! the receiver is alive, credit and host memory are counted back, its resident memory stays
//! within what its budgets admitted plus a stated 96 MiB, and a legitimate 4 MiB transfer on
//! another connection lands within a stated 10 s.
//!
//! One test in its own binary, so the process's resident memory is this receiver's alone.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::time::Duration;

use bytes::BytesMut;
use common::{init_tracing, pattern, raw_connection, receiver, receiver_config, sender, u8_meta};
use quinn::VarInt;
use tensorwire_quic::proto::frame::{Cancel, Data, End};
use tensorwire_quic::proto::{ErrorCode, Frame, checksum};
use tensorwire_quic::{BudgetSnapshot, MemoryBudget, MemorySnapshot, MetricsSnapshot};
use tokio::sync::{mpsc, oneshot};

/// Resident memory above what the budgets admitted that any flood may add.
const RSS_SLACK: u64 = 96 << 20;
/// How long the legitimate transfer after each flood may take.
const LEGIT_WITHIN: Duration = Duration::from_secs(10);

/// This process's resident set, in bytes.
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kib * 1024
}

/// What the application reports: the credit budget, the counters and open connections.
type Check = oneshot::Sender<(BudgetSnapshot, MetricsSnapshot, usize)>;

struct Suite {
    addr: std::net::SocketAddr,
    checks: mpsc::Sender<Check>,
    host: MemoryBudget,
    baseline: u64,
    peak_rss: u64,
}

impl Suite {
    async fn snapshot(&self) -> (BudgetSnapshot, MetricsSnapshot, usize) {
        let (tx, rx) = oneshot::channel();
        self.checks.send(tx).await.unwrap();
        rx.await.unwrap()
    }

    fn host(&self) -> MemorySnapshot {
        self.host.snapshot()
    }

    /// Resident memory stays within what the host budget holds now plus the slack.
    fn assert_rss(&mut self, phase: &str) {
        let now = rss();
        self.peak_rss = self.peak_rss.max(now);
        // Buffers kept for reuse are committed too, within the budget.
        let host = self.host();
        let allowed = self.baseline + host.reserved + host.kept + RSS_SLACK;
        assert!(
            now <= allowed,
            "{phase}: resident {} MiB over the bound {} MiB (baseline {} MiB, host reserved {} MiB)",
            now >> 20,
            allowed >> 20,
            self.baseline >> 20,
            self.host().reserved >> 20
        );
    }

    /// After a flood: a legitimate transfer lands in time, and once its peers are gone every
    /// byte of credit and host memory is back.
    async fn after(&mut self, phase: &str) {
        self.assert_rss(phase);
        let good = sender(self.addr).await;
        let send = good.send(u8_meta("legit", 4 << 20), pattern(4 << 20, 77));
        tokio::time::timeout(LEGIT_WITHIN, send.finished())
            .await
            .unwrap_or_else(|_| panic!("{phase}: the legitimate transfer took over 10 s"))
            .unwrap_or_else(|e| panic!("{phase}: the legitimate transfer failed: {e}"));
        good.close().await;
        for _ in 0..500 {
            let (budget, _, _) = self.snapshot().await;
            if budget.in_flight == budget.early_offered
                && budget.held == 0
                && self.host().reserved == 0
            {
                self.assert_rss(phase);
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!(
            "{phase}: not counted back: {:?} host {:?}",
            self.snapshot().await,
            self.host()
        );
    }
}

/// Opens `n` streams on `conn`, each with METADATA for `len` bytes; returns them open.
async fn metadata_flood(
    conn: &quinn::Connection,
    n: usize,
    len: usize,
) -> Vec<(quinn::SendStream, quinn::RecvStream)> {
    let mut streams = Vec::with_capacity(n);
    for i in 0..n {
        let (mut send, recv) = conn.open_bi().await.unwrap();
        let meta = Frame::from(u8_meta(&format!("flood{i}"), len)).to_bytes();
        send.write_all(&meta).await.unwrap();
        streams.push((send, recv));
    }
    streams
}

/// The receiver counts a flood on `conn` and closes it with CANCEL_FLOOD: checked on the
/// receiver's side (its failures and its open connections), since the peer of a flood may
/// miss the CONNECTION_CLOSE among its own packets and learn of it only by a stateless reset
/// or its idle timeout.
async fn assert_closed_for_flood(suite: &Suite, conn: &quinn::Connection, failed_before: u64) {
    for _ in 0..500 {
        let (_, metrics, connections) = suite.snapshot().await;
        if connections == 0 {
            assert!(
                metrics.tensors_failed - failed_before >= 1000,
                "closed before the failure budget was spent: {metrics:?}"
            );
            if let Some(quinn::ConnectionError::ApplicationClosed(close)) = conn.close_reason() {
                assert_eq!(
                    close.error_code,
                    VarInt::from_u32(ErrorCode::CANCEL_FLOOD.0)
                );
            }
            conn.close(VarInt::from_u32(0), b"done");
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!(
        "the flooding connection is still open: {:?}",
        suite.snapshot().await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_receiver_survives_every_flood_within_its_budgets() {
    init_tracing();
    let mut config = receiver_config().with_host_memory_budget(4 << 30);
    config.session.progress_timeout = Duration::from_secs(2);
    config.session.idle_timeout = Duration::from_millis(500);
    let (mut rx, addr) = receiver(config).await;
    let host = rx.host_memory_budget();
    let (checks, mut check_rx) = mpsc::channel::<Check>(1);
    // The application: accept everything into host memory and drop it once landed.
    tokio::spawn(async move {
        loop {
            tokio::select! {
                incoming = rx.next() => {
                    let Some(incoming) = incoming else { return };
                    tokio::spawn(async move {
                        if let Ok(handle) = incoming.accept_host().await {
                            let _ = handle.finished().await;
                        }
                    });
                }
                Some(check) = check_rx.recv() => {
                    let _ = check.send((rx.budget(), rx.metrics(), rx.connections().len()));
                }
            }
        }
    });
    let mut suite = Suite {
        addr,
        checks,
        host,
        baseline: rss(),
        peak_rss: 0,
    };
    suite.after("warm-up").await;
    suite.baseline = rss();

    // 1. One METADATA claiming 2 GiB (the connection's whole share): admitted, reserved,
    //    and not committed; its reset gives the reservation back.
    let conn = raw_connection(addr, b"tensorwire/1").await.unwrap();
    let mut claim = metadata_flood(&conn, 1, 2 << 30).await;
    for _ in 0..500 {
        if suite.host().reserved == 2 << 30 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(suite.host().reserved, 2 << 30, "the claim was admitted");
    assert!(
        rss() <= suite.baseline + RSS_SLACK,
        "a 2 GiB claim committed memory"
    );
    claim[0]
        .0
        .reset(VarInt::from_u32(ErrorCode::CANCELLED.0))
        .unwrap();
    drop(claim);
    conn.close(VarInt::from_u32(0), b"done");
    suite.after("a 2 GiB METADATA").await;

    // 2. A thousand METADATA of 64 KiB that never send DATA: each holds at most its
    //    reservation until the progress timeout ends it.
    let conn = raw_connection(addr, b"tensorwire/1").await.unwrap();
    let idle = metadata_flood(&conn, 1000, 64 << 10).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    suite.assert_rss("1000 idle METADATA");
    drop(idle);
    conn.close(VarInt::from_u32(0), b"done");
    suite.after("1000 idle METADATA").await;

    // 3. METADATA + CANCEL, again and again: the failure budget closes the connection.
    let (_, before, _) = suite.snapshot().await;
    let conn = raw_connection(addr, b"tensorwire/1").await.unwrap();
    let mut wire = BytesMut::new();
    Frame::from(u8_meta("c", 1 << 20)).encode(&mut wire);
    Frame::from(Cancel::new(ErrorCode::CANCELLED, "flood")).encode(&mut wire);
    let wire = wire.freeze();
    for _ in 0..1500 {
        // Once the receiver closed the connection, a peer that missed the close waits for
        // stream credit that never comes.
        let opened = tokio::time::timeout(Duration::from_secs(2), conn.open_bi()).await;
        let Ok(Ok((mut send, _recv))) = opened else {
            break;
        };
        if send.write_all(&wire).await.is_err() || send.finish().is_err() {
            break;
        }
    }
    assert_closed_for_flood(&suite, &conn, before.tensors_failed).await;
    suite.after("a CANCEL flood").await;

    // 4. METADATA, then RESET_STREAM, again and again: resets count as CANCELs.
    let (_, before, _) = suite.snapshot().await;
    let conn = raw_connection(addr, b"tensorwire/1").await.unwrap();
    let meta = Frame::from(u8_meta("r", 1 << 20)).to_bytes();
    for _ in 0..1500 {
        // Once the receiver closed the connection, a peer that missed the close waits for
        // stream credit that never comes.
        let opened = tokio::time::timeout(Duration::from_secs(2), conn.open_bi()).await;
        let Ok(Ok((mut send, _recv))) = opened else {
            break;
        };
        if send.write_all(&meta).await.is_err() {
            break;
        }
        let _ = send.reset(VarInt::from_u32(ErrorCode::CANCELLED.0));
    }
    assert_closed_for_flood(&suite, &conn, before.tensors_failed).await;
    suite.after("a RESET_STREAM flood").await;

    // 5. A 64 KiB tensor in one-byte DATA frames: slow for the peer, bounded for us.
    let conn = raw_connection(addr, b"tensorwire/1").await.unwrap();
    let bytes = pattern(64 << 10, 3);
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(&Frame::from(u8_meta("tiny", bytes.len())).to_bytes())
        .await
        .unwrap();
    let mut decoder = tensorwire_quic::proto::FrameDecoder::new(Default::default());
    let mut granted = 0u64;
    let mut sent = 0usize;
    let mut completed = false;
    while !completed {
        let chunk = recv.read_chunk(usize::MAX, true).await.unwrap().unwrap();
        decoder.push(chunk.bytes);
        while let Some(frame) = decoder.next_frame().unwrap() {
            match frame {
                Frame::Credit(c) => granted += c.bytes,
                Frame::Complete(_) => completed = true,
                _ => {}
            }
        }
        let mut wire = BytesMut::new();
        while (sent as u64) < granted {
            Frame::from(Data::new(sent as u64, bytes.slice(sent..sent + 1))).encode(&mut wire);
            sent += 1;
        }
        if sent == bytes.len() && !wire.is_empty() {
            Frame::from(End {
                checksum: u64::from(checksum::crc32c(&bytes)),
            })
            .encode(&mut wire);
        }
        send.write_all(&wire).await.unwrap();
    }
    conn.close(VarInt::from_u32(0), b"done");
    suite.after("one-byte DATA").await;

    // 6. Fifty connections that never open a stream: each is closed at its idle timeout.
    let mut silent = Vec::new();
    for _ in 0..50 {
        silent.push(raw_connection(addr, b"tensorwire/1").await.unwrap());
    }
    for conn in &silent {
        let closed = tokio::time::timeout(Duration::from_secs(20), conn.closed()).await;
        match closed {
            Ok(quinn::ConnectionError::ApplicationClosed(close)) => assert_eq!(
                close.error_code,
                VarInt::from_u32(ErrorCode::PROGRESS_TIMEOUT.0)
            ),
            other => panic!("a silent connection ended otherwise: {other:?}"),
        }
    }
    suite.after("50 silent connections").await;

    let (_, metrics, _) = suite.snapshot().await;
    assert!(
        metrics.tensors_completed >= 8,
        "the legitimate transfers and the one-byte tensor completed: {metrics:?}"
    );
    eprintln!(
        "hostile suite: baseline {} MiB, peak resident {} MiB, {metrics:?}",
        suite.baseline >> 20,
        suite.peak_rss >> 20
    );
}
