//! Spec §3: either endpoint may open tensor streams. The accepting side sends tensors back to
//! the connecting side on the same connection, under the connecting side's credit budget.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use common::{
    assert_budget_returned, land_host, pattern, receive_host, receiver, receiver_config, sender,
    u8_meta,
};
use tensorwire_quic::{ClientTls, SenderConfig, TransportSettings};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_accepting_side_sends_tensors_back_on_the_same_connection() {
    let (mut rx, addr) = receiver(receiver_config()).await;
    let tx = sender(addr).await;
    // The connecting side receives under a budget smaller than what comes back, so the
    // replies need credit to be granted again and again.
    let back_config = receiver_config().with_budget(1 << 20);
    let mut back = tx.connection().incoming(back_config).unwrap();

    let request = tx.send(u8_meta("request", 4096), pattern(4096, 1));
    let incoming = rx.next().await.unwrap();
    let reply = incoming.connection(&{
        let mut config = SenderConfig::new(ClientTls::Development);
        config.transport = TransportSettings::jumbo();
        config
    });
    assert_eq!(reply.peer(), incoming.peer());
    let (meta, bytes) = land_host(incoming).await;
    assert_eq!((meta.name(), bytes), ("request", pattern(4096, 1)));
    request.finished().await.unwrap();

    // Two results back, on the connection the request came on, more than the budget holds.
    let results: Vec<_> = (0..2u64)
        .map(|i| {
            reply.send(
                u8_meta(&format!("result{i}"), 3 << 20),
                pattern(3 << 20, 10 + i),
            )
        })
        .collect();
    let mut got = Vec::new();
    for _ in 0..2 {
        let (meta, bytes) = receive_host(&mut back).await.unwrap();
        got.push((meta.name().to_owned(), bytes));
    }
    got.sort_by(|a, b| a.0.cmp(&b.0));
    for (i, (name, bytes)) in got.iter().enumerate() {
        assert_eq!(name, &format!("result{i}"));
        assert!(*bytes == pattern(3 << 20, 10 + i as u64), "{name} differs");
    }
    for result in results {
        result.finished().await.unwrap();
    }
    assert_eq!(reply.metrics().tensors_completed, 2);
    let peak = back.budget().peak_outstanding;
    assert!(peak <= 1 << 20, "the connecting side's budget held: {peak}");
    assert_budget_returned(&back).await;
    assert_budget_returned(&rx).await;
    // The first direction still works after the second was used.
    let again = tx.send(u8_meta("again", 1000), pattern(1000, 5));
    let (meta, _) = receive_host(&mut rx).await.unwrap();
    assert_eq!(meta.name(), "again");
    again.finished().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_has_one_receiver_of_its_peers_tensors() {
    let (mut rx, addr) = receiver(receiver_config()).await;
    let tx = sender(addr).await;
    let connection = tx.connection().clone();
    let _back = connection.incoming(receiver_config()).unwrap();
    // A clone shares the connection, so its peer's tensors already have a receiver.
    let again = tx.connection().incoming(receiver_config());
    assert!(
        again
            .as_ref()
            .is_err_and(|e| e.to_string().contains("already receives")),
        "a second receiver on one connection: {:?}",
        again.err()
    );

    // The accepting side's tensors go to its Receiver, not to a second one.
    let request = tx.send(u8_meta("request", 10), pattern(10, 1));
    let incoming = rx.next().await.unwrap();
    let accepted = incoming.connection(&SenderConfig::new(ClientTls::Development));
    assert!(accepted.incoming(receiver_config()).is_err());
    assert_eq!(accepted.peer_version(), tx.peer_version());
    land_host(incoming).await;
    request.finished().await.unwrap();
}
