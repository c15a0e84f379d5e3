//! Development trust cannot be subverted by another local user: a certificate others could
//! have written is not trusted, and a planted link is not written through.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::os::unix::fs::PermissionsExt;

use common::{receiver, receiver_config};
use tensorwire_quic::{Sender, SenderConfig, TransportError, dev_cert_path};

#[tokio::test]
async fn a_certificate_others_can_write_is_not_trusted() {
    let (_rx, addr) = receiver(receiver_config()).await;
    let path = dev_cert_path(addr);
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
    let err = Sender::connect(
        addr,
        SenderConfig::new(tensorwire_quic::ClientTls::Development),
    )
    .await
    .err()
    .unwrap();
    assert!(matches!(err, TransportError::Tls(_)), "{err}");
    assert!(err.to_string().contains("lets others write it"), "{err}");
}

#[tokio::test]
async fn a_link_planted_at_the_certificate_path_is_replaced_not_followed() {
    let addr = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let victim = std::env::temp_dir().join(format!("tensorwire-victim-{}", std::process::id()));
    std::fs::write(&victim, b"precious").unwrap();
    let path = dev_cert_path(addr);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let _ = std::fs::remove_file(&path);
    std::os::unix::fs::symlink(&victim, &path).unwrap();
    let mut config = receiver_config();
    config.listen = addr;
    let (_rx, _addr) = receiver(config).await;
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    let meta = std::fs::symlink_metadata(&path).unwrap();
    assert!(meta.file_type().is_file(), "the link was kept");
    assert!(
        std::fs::read_to_string(&path)
            .unwrap()
            .contains("CERTIFICATE")
    );
    std::fs::remove_file(victim).unwrap();
}

#[test]
fn the_development_directory_is_private_to_its_user() {
    let dir = dev_cert_path("127.0.0.1:1".parse().unwrap())
        .parent()
        .unwrap()
        .to_owned();
    let name = dir.file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("tensorwire-dev-"), "{name}");
}

#[tokio::test]
async fn receivers_on_two_addresses_with_one_port_are_each_trusted() {
    // Network namespaces, or two addresses of one host, let receivers share a port number.
    let first = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let port = first.local_addr().unwrap().port();
    drop(first);
    let mut config = receiver_config();
    config.listen = format!("127.0.0.1:{port}").parse().unwrap();
    let (_a, a) = receiver(config).await;
    let mut config = receiver_config();
    config.listen = format!("127.0.0.2:{port}").parse().unwrap();
    let (_b, b) = receiver(config).await;
    assert_ne!(dev_cert_path(a), dev_cert_path(b));
    for addr in [a, b] {
        let sender = Sender::connect(
            addr,
            SenderConfig::new(tensorwire_quic::ClientTls::Development),
        )
        .await
        .unwrap_or_else(|e| panic!("{addr}: {e}"));
        sender.close().await;
    }
}

#[tokio::test]
async fn a_receiver_on_every_address_is_trusted_at_each() {
    let mut config = receiver_config();
    config.listen = "0.0.0.0:0".parse().unwrap();
    let (_rx, every) = receiver(config).await;
    let loopback = std::net::SocketAddr::new([127, 0, 0, 1].into(), every.port());
    let sender = Sender::connect(
        loopback,
        SenderConfig::new(tensorwire_quic::ClientTls::Development),
    )
    .await
    .unwrap();
    sender.close().await;
}

#[tokio::test]
async fn a_development_receiver_gives_the_certificate_it_left() {
    let (rx, addr) = receiver(receiver_config()).await;
    let left = std::fs::read_to_string(dev_cert_path(addr)).unwrap();
    assert_eq!(rx.development_certificate(), Some(left.as_str()));
    assert!(left.contains("BEGIN CERTIFICATE"));
}
