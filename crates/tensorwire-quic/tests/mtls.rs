//! Production TLS: PEM files from a CA, and mutual TLS where a sender without a client
//! certificate from the configured CA is refused before any stream is served.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::path::{Path, PathBuf};

use common::{land_host, pattern, receive_host, u8_meta};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use tensorwire_quic::{
    ClientTls, Receiver, ReceiverConfig, Sender, SenderConfig, ServerTls, TransportSettings,
};

struct Pki {
    dir: PathBuf,
}

impl Pki {
    /// A CA, a server certificate for localhost, and a client certificate, as PEM files.
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("tensorwire-pki-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (ca_name, leaves) in [
            ("ca", &["server", "client"][..]),
            ("rogue-ca", &["rogue-client"][..]),
        ] {
            let ca_key = KeyPair::generate().unwrap();
            let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
            ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            let ca = ca_params.self_signed(&ca_key).unwrap();
            std::fs::write(dir.join(format!("{ca_name}.pem")), ca.pem()).unwrap();
            let issuer = Issuer::new(ca_params, ca_key);
            for leaf in leaves {
                let key = KeyPair::generate().unwrap();
                let cert = CertificateParams::new(vec!["localhost".to_owned()])
                    .unwrap()
                    .signed_by(&key, &issuer)
                    .unwrap();
                std::fs::write(dir.join(format!("{leaf}.pem")), cert.pem()).unwrap();
                std::fs::write(dir.join(format!("{leaf}.key")), key.serialize_pem()).unwrap();
            }
        }
        Self { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn receiver(pki: &Pki, client_ca: Option<&Path>) -> Receiver {
    let mut config = ReceiverConfig::new("127.0.0.1:0".parse().unwrap(), ServerTls::Development);
    config.tls = ServerTls::Pem {
        cert: pki.path("server.pem"),
        key: pki.path("server.key"),
        client_ca: client_ca.map(Path::to_owned),
    };
    config.transport = TransportSettings::jumbo();
    Receiver::bind(config).await.unwrap()
}

fn sender_config(pki: &Pki, identity: Option<&str>) -> SenderConfig {
    let mut config = SenderConfig::new(ClientTls::Development);
    config.binding = common::test_binding();
    config.tls = ClientTls::Pem {
        ca: pki.path("ca.pem"),
        identity: identity.map(|n| (pki.path(&format!("{n}.pem")), pki.path(&format!("{n}.key")))),
    };
    config.transport = TransportSettings::jumbo();
    config
}

/// The error a refused client sees: at connect, or, since a TLS 1.3 client may finish its
/// handshake before the server rejects its certificate, on its first tensor.
async fn refusal(addr: std::net::SocketAddr, config: SenderConfig) -> String {
    match Sender::connect(addr, config).await {
        Err(e) => e.to_string(),
        Ok(tx) => tx
            .send(u8_meta("x", 10), pattern(10, 1))
            .finished()
            .await
            .unwrap_err()
            .to_string(),
    }
}

#[tokio::test]
async fn pem_certificates_from_a_ca_work() {
    let pki = Pki::new("plain");
    let mut rx = receiver(&pki, None).await;
    let addr = rx.local_addr().unwrap();
    let tx = Sender::connect(addr, sender_config(&pki, None))
        .await
        .unwrap();
    let send = tx.send(u8_meta("t", 1000), pattern(1000, 1));
    let (_, bytes) = receive_host(&mut rx).await.unwrap();
    send.finished().await.unwrap();
    assert_eq!(bytes, pattern(1000, 1));
}

#[tokio::test]
async fn mutual_tls_admits_only_clients_of_the_configured_ca() {
    let pki = Pki::new("mtls");
    let ca = pki.path("ca.pem");
    let mut rx = receiver(&pki, Some(&ca)).await;
    let addr = rx.local_addr().unwrap();

    // No client certificate: the handshake fails; nothing reaches the application.
    let anonymous_error = refusal(addr, sender_config(&pki, None)).await;
    assert!(
        anonymous_error.to_lowercase().contains("certificate"),
        "{anonymous_error}"
    );

    // A certificate from another CA: refused too.
    let rogue_error = refusal(addr, sender_config(&pki, Some("rogue-client"))).await;
    assert!(
        rogue_error.to_lowercase().contains("certificate") || rogue_error.contains("UnknownIssuer"),
        "{rogue_error}"
    );

    // The right client certificate: served.
    let tx = Sender::connect(addr, sender_config(&pki, Some("client")))
        .await
        .unwrap();
    let send = tx.send(u8_meta("ok", 100), pattern(100, 2));
    let incoming = rx.next().await.unwrap();
    assert_eq!(
        incoming.meta().name(),
        "ok",
        "the refused clients' tensors never reached the application"
    );
    land_host(incoming).await;
    send.finished().await.unwrap();
}
