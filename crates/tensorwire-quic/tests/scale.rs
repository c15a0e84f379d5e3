//! One receiver over several UDP sockets (SO_REUSEPORT) serves many connections under one
//! budget: the connections spread over the sockets, and the credit held at once never
//! exceeds the receiver-wide budget.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use common::{
    assert_budget_returned, cancel_code, land_host, pattern, receiver, receiver_config, sender,
    u8_meta,
};
use tensorwire_quic::proto::{ErrorCode, Frame, FrameDecoder, Limits};
use tensorwire_quic::{Sender, Steering};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_connections_over_several_endpoints_share_one_budget() {
    const CONNECTIONS: u64 = 16;
    const TENSORS: u64 = 3;
    const LEN: usize = 3 << 20;
    let budget = 8 << 20;
    let mut config = receiver_config().with_budget(budget);
    config.endpoints = 4;
    config.session.grant_unit = 1 << 20;
    config.session.stream_window = 2 << 20;
    let (mut rx, addr) = receiver(config).await;
    assert_eq!(rx.endpoint_count(), 4);
    let server = tokio::spawn(async move {
        let mut handles = Vec::new();
        for _ in 0..CONNECTIONS * TENSORS {
            let incoming = rx.next().await.unwrap();
            handles.push(tokio::spawn(
                incoming.accept_host().await.unwrap().finished(),
            ));
        }
        let endpoints: std::collections::BTreeSet<usize> =
            rx.connections().iter().map(|c| c.endpoint).collect();
        let mut received = Vec::new();
        for handle in handles {
            let (meta, bytes) = handle.await.unwrap().unwrap();
            received.push((meta.name().to_owned(), bytes));
        }
        (received, endpoints, rx)
    });
    let mut senders = Vec::new();
    for c in 0..CONNECTIONS {
        senders.push(tokio::spawn(async move {
            let tx = sender(addr).await;
            let sends: Vec<_> = (0..TENSORS)
                .map(|t| {
                    let seed = c * TENSORS + t;
                    tx.send(u8_meta(&format!("c{c}t{t}"), LEN), pattern(LEN, seed))
                })
                .collect();
            for send in sends {
                send.finished().await.unwrap();
            }
            tx
        }));
    }
    let mut keep = Vec::new();
    for s in senders {
        keep.push(s.await.unwrap());
    }
    let (received, endpoints, rx) = server.await.unwrap();
    assert_eq!(received.len() as u64, CONNECTIONS * TENSORS);
    for (name, bytes) in &received {
        let (c, t) = name[1..].split_once('t').unwrap();
        let seed = c.parse::<u64>().unwrap() * TENSORS + t.parse::<u64>().unwrap();
        assert!(*bytes == pattern(LEN, seed), "{name} differs");
    }
    assert!(
        endpoints.len() > 1,
        "all connections on one socket: {endpoints:?}"
    );
    let peak = rx.budget().peak_outstanding;
    assert!(
        peak <= budget,
        "peak outstanding {peak} over the budget {budget}"
    );
    assert!(peak > 0);
    assert_budget_returned(&rx).await;
}

#[tokio::test]
async fn a_receiver_needs_an_endpoint() {
    let mut config = receiver_config();
    config.endpoints = 0;
    let err = tensorwire_quic::Receiver::bind(config).await.err().unwrap();
    assert!(err.to_string().contains("at least one endpoint"), "{err}");
}

/// Receivers of one user that each bind several SO_REUSEPORT sockets never end up on one
/// port (the kernel would split their packets between them): port 0 gives each its own,
/// and a port another receiver holds is refused as in use.
#[tokio::test]
async fn receivers_with_several_endpoints_never_share_a_port() {
    let mut ports = std::collections::BTreeSet::new();
    let mut receivers = Vec::new();
    for _ in 0..40 {
        let mut config = receiver_config();
        config.endpoints = 2;
        let (rx, addr) = receiver(config).await;
        assert!(
            ports.insert(addr.port()),
            "port {} given twice",
            addr.port()
        );
        receivers.push(rx);
    }
    let mut taken = receiver_config();
    taken.endpoints = 2;
    taken.listen = receivers[0].local_addr().unwrap();
    let refused = tensorwire_quic::Receiver::bind(taken).await;
    assert!(
        refused.is_err(),
        "a second receiver bound a port the first one holds"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_pool_spreads_tensors_over_its_connections_largest_first() {
    let mut config = receiver_config();
    config.endpoints = 2;
    let (mut rx, addr) = receiver(config).await;
    // Largest first, as the sender program submits them: 8, 6, 5, 3, 2, 1 MiB.
    let sizes: [usize; 6] = [8 << 20, 6 << 20, 5 << 20, 3 << 20, 2 << 20, 1 << 20];
    let server = tokio::spawn(async move {
        let mut handles = Vec::new();
        for _ in 0..sizes.len() {
            let incoming = rx.next().await.unwrap();
            handles.push(tokio::spawn(
                incoming.accept_host().await.unwrap().finished(),
            ));
        }
        let mut received = Vec::new();
        for handle in handles {
            let (meta, bytes) = handle.await.unwrap().unwrap();
            received.push((meta.name().to_owned(), bytes));
        }
        let mut per_connection: Vec<u64> = rx
            .connections()
            .iter()
            .map(|c| c.metrics.payload_bytes)
            .collect();
        per_connection.sort_unstable();
        (received, per_connection, rx)
    });
    let pool = tensorwire_quic::SenderPool::connect(
        addr,
        {
            let mut config =
                tensorwire_quic::SenderConfig::new(tensorwire_quic::ClientTls::Development);
            config.binding = common::test_binding();
            config
        },
        3,
    )
    .await
    .unwrap();
    assert_eq!(pool.connections(), 3);
    let sends: Vec<_> = sizes
        .iter()
        .enumerate()
        .map(|(i, &len)| pool.send(u8_meta(&format!("t{i}"), len), pattern(len, i as u64)))
        .collect();
    for send in sends {
        send.finished().await.unwrap();
    }
    let (received, per_connection, rx) = server.await.unwrap();
    for (name, bytes) in &received {
        let i: usize = name[1..].parse().unwrap();
        assert!(
            *bytes == pattern(sizes[i], i as u64),
            "{name} arrived intact"
        );
    }
    // Greedy by bytes given so far: {8}, {6, 2}, {5, 3, 1} MiB.
    assert_eq!(per_connection, vec![8 << 20, 8 << 20, 9 << 20]);
    let metrics = pool.metrics();
    assert_eq!(
        metrics.tensors_completed,
        sizes.len() as u64,
        "counted over all connections"
    );
    assert_budget_returned(&rx).await;
    pool.close().await;
    rx.close().await;
}

/// Spec §10: a receiver at its cap per peer refuses connections before their handshake; a
/// sender pool goes on with the connections it got, waits (backing off) while it has none,
/// and says plainly when the receiver stayed full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_pool_goes_on_with_the_connections_a_full_receiver_takes() {
    let mut config = receiver_config();
    config.max_connections_per_peer = 2;
    let (mut rx, addr) = receiver(config).await;
    let client = || {
        let mut config =
            tensorwire_quic::SenderConfig::new(tensorwire_quic::ClientTls::Development);
        config.transport = tensorwire_quic::TransportSettings::jumbo();
        config.refused_retry_for = Duration::from_millis(800);
        config.binding = common::test_binding();
        config
    };
    let pool = tensorwire_quic::SenderPool::connect(addr, client(), 4)
        .await
        .unwrap();
    assert_eq!(pool.connections(), 2, "two of four taken, the rest refused");
    let send = pool.send(u8_meta("t", 1 << 20), pattern(1 << 20, 3));
    let (meta, bytes) = land_host(rx.next().await.unwrap()).await;
    assert_eq!((meta.name(), bytes), ("t", pattern(1 << 20, 3)));
    send.finished().await.unwrap();

    // Full: a second pool is refused every time, and says why.
    let e = tensorwire_quic::SenderPool::connect(addr, client(), 1)
        .await
        .err()
        .unwrap();
    assert!(
        matches!(e, tensorwire_quic::TransportError::Refused { .. }),
        "{e}"
    );
    assert!(e.to_string().contains("connection cap"), "{e}");

    // It waits for room: the first pool closes while the second is still asking.
    let mut waiting_config = client();
    waiting_config.refused_retry_for = Duration::from_secs(20);
    let waiting = tokio::spawn(tensorwire_quic::SenderPool::connect(
        addr,
        waiting_config,
        1,
    ));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "refused while the first pool holds the cap"
    );
    pool.close().await;
    let second = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("connected once the first pool's connections were counted back")
        .unwrap()
        .unwrap();
    assert_eq!(second.connections(), 1);
    second.close().await;
    rx.close().await;
}

/// The remote address of each open connection, with the endpoint that serves it.
fn endpoints_by_remote(rx: &tensorwire_quic::Receiver) -> HashMap<SocketAddr, usize> {
    rx.connections()
        .iter()
        .map(|c| (c.remote, c.endpoint))
        .collect()
}

/// Open connections per endpoint.
fn per_endpoint(rx: &tensorwire_quic::Receiver, endpoints: usize) -> Vec<usize> {
    let mut counts = vec![0; endpoints];
    for c in rx.connections() {
        counts[c.endpoint] += 1;
    }
    counts
}

/// Connects a sender and lands one small tensor over it; returns the sender and the
/// endpoint that serves its connection.
async fn connect_one(
    rx: &mut tensorwire_quic::Receiver,
    addr: SocketAddr,
    seed: u64,
) -> (Sender, usize) {
    let before = endpoints_by_remote(rx);
    let tx = sender(addr).await;
    let send = tx.send(u8_meta(&format!("s{seed}"), 1024), pattern(1024, seed));
    let (meta, bytes) = land_host(rx.next().await.unwrap()).await;
    assert_eq!(
        (meta.name(), bytes),
        (format!("s{seed}").as_str(), pattern(1024, seed))
    );
    send.finished().await.unwrap();
    let (_, endpoint) = endpoints_by_remote(rx)
        .into_iter()
        .find(|(remote, _)| !before.contains_key(remote))
        .unwrap();
    (tx, endpoint)
}

/// Connections spread evenly over a receiver's endpoints, whatever their addresses hash to
/// (each goes to the least loaded endpoint, by a Retry when needed; spec §3), and an
/// endpoint's place is given back when its connection closes. With the kernel's address
/// hash alone, 8 connections land 2 per endpoint on 4 endpoints in 4% of runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_spread_evenly_over_the_endpoints_and_give_their_place_back() {
    const ENDPOINTS: usize = 4;
    let mut config = receiver_config();
    config.endpoints = ENDPOINTS;
    let (mut rx, addr) = receiver(config).await;
    let mut senders = Vec::new();
    for seed in 0..8 {
        senders.push(connect_one(&mut rx, addr, seed).await);
    }
    assert_eq!(per_endpoint(&rx, ENDPOINTS), [2, 2, 2, 2]);

    // Close the connections of endpoints 0 and 1: the next four go there.
    let (leaving, staying): (Vec<_>, Vec<_>) =
        senders.into_iter().partition(|(_, endpoint)| *endpoint < 2);
    for (tx, _) in leaving {
        tx.close().await;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while per_endpoint(&rx, ENDPOINTS) != [0, 0, 2, 2] {
        assert!(
            tokio::time::Instant::now() < deadline,
            "connections did not close"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut joined = Vec::new();
    for seed in 8..12 {
        joined.push(connect_one(&mut rx, addr, seed).await);
    }
    assert_eq!(per_endpoint(&rx, ENDPOINTS), [2, 2, 2, 2]);
    drop((staying, joined));
    assert_budget_returned(&rx).await;
}

/// With address steering the kernel's hash decides: connections still work, however
/// unevenly they land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn address_steering_serves_connections_on_whichever_endpoint_they_hash_to() {
    let mut config = receiver_config();
    config.endpoints = 4;
    config.steering = Steering::Address;
    let (mut rx, addr) = receiver(config).await;
    let mut senders = Vec::new();
    for seed in 0..6 {
        senders.push(connect_one(&mut rx, addr, seed).await);
    }
    assert_eq!(per_endpoint(&rx, 4).iter().sum::<usize>(), 6);
}

/// A client that changes address (QUIC migration, a NAT rebinding) keeps its connection on
/// a receiver with several endpoints: its packets go to the endpoint their connection ID
/// names, not to the one its new address hashes to (spec §3). With the hash alone, three
/// moves over 4 endpoints keep the connection in 1 run of 64.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_changes_address_keeps_its_connection() {
    let mut config = receiver_config();
    config.endpoints = 4;
    let (mut rx, addr) = receiver(config).await;
    // Migration exists only over UDP (spec §16).
    let (endpoint, raw) = common::raw_udp_connection(addr, b"tensorwire/1")
        .await
        .unwrap();
    for moves in 0..4 {
        if moves > 0 {
            endpoint
                .rebind(std::net::UdpSocket::bind("127.0.0.1:0").unwrap())
                .unwrap();
        }
        let client = endpoint.local_addr().unwrap();
        let name = format!("after {moves} moves");
        let metadata = Frame::from(u8_meta(&name, 16)).to_bytes();
        // METADATA alone, the stream left open (a FIN now would truncate the tensor).
        let send = async {
            let (mut send, mut recv) = raw.open_bi().await.unwrap();
            send.write_all(&metadata).await.unwrap();
            let mut decoder = FrameDecoder::new(Limits::default());
            let mut answers = Vec::new();
            while let Ok(Some(chunk)) = recv.read_chunk(usize::MAX, true).await {
                decoder.push(chunk.bytes);
                while let Ok(Some(frame)) = decoder.next_frame() {
                    answers.push(frame);
                }
            }
            answers
        };
        let receive = async {
            let incoming = tokio::time::timeout(Duration::from_secs(10), rx.next())
                .await
                .expect("no METADATA after the move")
                .unwrap();
            assert_eq!(incoming.meta().name(), name);
            assert_eq!(incoming.peer(), client);
            incoming.reject(ErrorCode::REJECTED, "seen");
        };
        let (answers, ()) = tokio::join!(send, receive);
        assert_eq!(
            cancel_code(&answers),
            Some(ErrorCode::REJECTED),
            "{answers:?}"
        );
    }
    assert_eq!(rx.connections().len(), 1);
}
