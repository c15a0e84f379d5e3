//! Version negotiation over QUIC (spec §3.1): a current sender and receiver agree on 1.5; a
//! receiver that predates 1.4 (it offers only `tensorwire/1`) gets large tensors whole,
//! never as parts, and no remote-execution request; a sender that predates 1.4 is served.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::sync::{Arc, Mutex};

use common::{pattern, raw_connection, receiver, receiver_config, u8_meta};
use tensorwire_quic::proto::{
    DType, ErrorCode, Frame, FrameDecoder, Limits, TensorMeta, Version, frame::Reject,
};
use tensorwire_quic::tls::DevCertificate;
use tensorwire_quic::{ClientTls, SenderConfig, SenderPool};

/// A receiver of version 1.3 or older: it offers only `tensorwire/1`, answers every tensor
/// with REJECT, and hands back the METADATA it saw. Trusted through a CA file.
async fn old_receiver() -> (
    std::net::SocketAddr,
    std::path::PathBuf,
    Arc<Mutex<Vec<TensorMeta>>>,
) {
    let dev = DevCertificate::generate().unwrap();
    let ca = std::env::temp_dir().join(format!("tensorwire-old-rx-{}.pem", std::process::id()));
    std::fs::write(&ca, &dev.pem).unwrap();
    let key = rustls::pki_types::PrivateKeyDer::try_from(dev.key_der()).unwrap();
    let mut tls =
        rustls::ServerConfig::builder_with_provider(tensorwire_quic::tls::crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![dev.cert.clone()], key)
            .unwrap();
    tls.alpn_protocols = vec![b"tensorwire/1".to_vec()];
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls).unwrap();
    let server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    let endpoint = quinn::Endpoint::server(server, "127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = endpoint.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let recorded = seen.clone();
    tokio::spawn(async move {
        while let Some(incoming) = endpoint.accept().await {
            let recorded = recorded.clone();
            tokio::spawn(async move {
                let connection = incoming.await.unwrap();
                while let Ok((mut send, mut recv)) = connection.accept_bi().await {
                    let mut decoder = FrameDecoder::new(Limits::default());
                    let meta = loop {
                        let chunk = recv.read_chunk(usize::MAX, true).await.unwrap().unwrap();
                        decoder.push(chunk.bytes);
                        if let Some(Frame::Metadata(m)) = decoder.next_frame().unwrap() {
                            break m.meta;
                        }
                    };
                    // Recorded before the answer, so the sender's failure means it is here.
                    recorded.lock().unwrap().push(meta);
                    let reject = Frame::Reject(Reject::new(ErrorCode::RESOURCE_EXHAUSTED, "test"));
                    send.write_all(&reject.to_bytes()).await.unwrap();
                    let _ = send.finish();
                }
            });
        }
    });
    (addr, ca, seen)
}

#[tokio::test]
async fn current_peers_negotiate_the_current_version() {
    let (rx, addr) = receiver(receiver_config()).await;
    let pool = SenderPool::connect(addr, SenderConfig::new(ClientTls::Development), 2)
        .await
        .unwrap();
    assert_eq!(pool.peer_version(), Version::CURRENT);
    let meta = TensorMeta::new([64, 1 << 20], DType::U8).unwrap();
    assert_eq!(
        pool.parts_for(&meta, meta.byte_len()),
        2,
        "split for a 1.4 receiver"
    );
    pool.close().await;
    drop(rx);
}

#[tokio::test]
async fn a_receiver_older_than_1_4_gets_large_tensors_whole() {
    let (addr, ca, seen) = old_receiver().await;
    let config = SenderConfig::new(ClientTls::Pem {
        ca: ca.clone(),
        identity: None,
    });
    let pool = SenderPool::connect(addr, config, 2).await.unwrap();
    assert_eq!(pool.peer_version(), Version::V1_0);
    let meta = TensorMeta::new([64, 1 << 20], DType::U8)
        .unwrap()
        .with_name("embed");
    assert_eq!(
        pool.parts_for(&meta, meta.byte_len()),
        1,
        "no parts for a 1.0 receiver"
    );
    let bytes = pattern(64 << 20, 3);
    // Asked for four parts, the sender sends the tensor whole.
    let sent = pool.send_split(meta.clone(), bytes, 4).unwrap();
    assert!(
        sent.finished().await.is_err(),
        "the old receiver refuses everything"
    );
    pool.close().await;
    let metas = seen.lock().unwrap().clone();
    assert_eq!(metas.len(), 1, "one METADATA, not one per part");
    assert_eq!(metas[0].shape(), meta.shape(), "the whole's shape");
    assert!(
        metas[0]
            .attributes()
            .iter()
            .all(|(k, _)| !k.starts_with("tensorwire.split.")),
        "no split attribute: {:?}",
        metas[0].attributes()
    );
    let _ = std::fs::remove_file(ca);
}

/// A sender that predates 1.4 offers only `tensorwire/1`; the receiver still serves it.
#[tokio::test]
async fn a_sender_older_than_1_4_is_served() {
    let (mut rx, addr) = receiver(receiver_config()).await;
    let connection = raw_connection(addr, b"tensorwire/1").await.unwrap();
    let meta = u8_meta("old", 4);
    let mut wire = bytes::BytesMut::new();
    Frame::Metadata(tensorwire_quic::proto::frame::Metadata { meta }).encode(&mut wire);
    let (mut send, _recv) = connection.open_bi().await.unwrap();
    send.write_all(&wire).await.unwrap();
    let incoming = rx.next().await.expect("the old sender's tensor");
    assert_eq!(incoming.meta().name(), "old");
    drop(incoming);
}

/// Spec §6.8: a current sender learns where its tensor landed from COMPLETE's receipt.
#[tokio::test]
async fn a_current_sender_gets_the_receipt() {
    let (mut rx, addr) = receiver(receiver_config()).await;
    let pool = SenderPool::connect(addr, SenderConfig::new(ClientTls::Development), 1)
        .await
        .unwrap();
    let sent = pool.send(u8_meta("weights", 4096), pattern(4096, 5));
    let (meta, bytes) = common::receive_host(&mut rx).await.unwrap();
    assert_eq!((meta.name(), bytes.len()), ("weights", 4096));
    let report = sent.finished().await.unwrap();
    assert_eq!(
        report.receipt.device(),
        Some("host"),
        "{:?}",
        report.receipt
    );
    pool.close().await;
}

/// Spec §6.8, §3.1: a sender of 1.4 (whose decoder takes only an empty COMPLETE) gets an
/// empty one; a sender of 1.5 gets the receipt.
#[tokio::test]
async fn a_1_4_sender_gets_an_empty_complete() {
    for (alpn, expect_receipt) in [(&b"tensorwire/1.4"[..], false), (b"tensorwire/1.5", true)] {
        let (mut rx, addr) = receiver(receiver_config()).await;
        let connection = raw_connection(addr, alpn).await.unwrap();
        let bytes = pattern(64, 6);
        let end = tensorwire_quic::proto::frame::End {
            checksum: tensorwire_quic::proto::checksum::crc32c(&bytes).into(),
        };
        let frames = [
            Frame::Metadata(tensorwire_quic::proto::frame::Metadata {
                meta: u8_meta("t", 64),
            }),
            Frame::Data(tensorwire_quic::proto::frame::Data::new(0, bytes.to_vec())),
            Frame::End(end),
        ];
        let exchange = tokio::spawn(async move {
            let answers = common::raw_exchange(&connection, &frames, true).await;
            (answers, connection)
        });
        common::receive_host(&mut rx).await.unwrap();
        let (answers, _connection) = exchange.await.unwrap();
        let complete = answers
            .iter()
            .find_map(|f| match f {
                Frame::Complete(c) => Some(c.clone()),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no COMPLETE in {answers:?}"));
        let encoded = Frame::Complete(complete.clone()).to_bytes();
        match expect_receipt {
            false => assert_eq!(encoded.len(), 5, "an empty body for 1.4: {complete:?}"),
            true => assert_eq!(complete.receipt.device(), Some("host"), "{complete:?}"),
        }
    }
}
