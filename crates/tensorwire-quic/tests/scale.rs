//! One receiver over several UDP sockets (SO_REUSEPORT) serves many connections under one
//! budget: the connections spread over the sockets, and the credit held at once never
//! exceeds the receiver-wide budget.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use common::{assert_budget_returned, pattern, receiver, receiver_config, sender, u8_meta};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_connections_over_several_endpoints_share_one_budget() {
    const CONNECTIONS: u64 = 16;
    const TENSORS: u64 = 3;
    const LEN: usize = 3 << 20;
    let budget = 8 << 20;
    let mut config = receiver_config().with_budget(budget);
    config.endpoints = 4;
    config.grant_unit = 1 << 20;
    config.stream_window = 2 << 20;
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
        tensorwire_quic::SenderConfig::new(tensorwire_quic::ClientTls::Development),
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
