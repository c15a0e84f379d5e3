//! TCP + TLS 1.3 bulk transfer (tokio-rustls, tensorwire's crypto provider), the anchor
//! QUIC is compared with.

use std::sync::Arc;
use std::time::Instant;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::source::Loaded;

pub(crate) async fn tcp_tls(
    connections: usize,
    bytes_per_conn: u64,
    data: &Loaded,
) -> anyhow::Result<f64> {
    let cert = tensorwire::quic::tls::DevCertificate::generate()?;
    let key = rustls::pki_types::PrivateKeyDer::try_from(cert.key_der())
        .map_err(|e| anyhow::anyhow!("key: {e}"))?;
    let server_tls =
        rustls::ServerConfig::builder_with_provider(tensorwire::quic::tls::crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_no_client_auth()
            .with_single_cert(vec![cert.cert.clone()], key)?;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server_tls));
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.cert.clone())?;
    let client_tls =
        rustls::ClientConfig::builder_with_provider(tensorwire::quic::tls::crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(roots)
            .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client_tls));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        let mut tasks = Vec::new();
        for _ in 0..connections {
            let (tcp, _) = listener.accept().await?;
            let acceptor = acceptor.clone();
            tasks.push(tokio::spawn(async move {
                let mut tls = acceptor.accept(tcp).await?;
                let mut buf = vec![0u8; 1 << 20];
                let mut got = 0u64;
                loop {
                    let n = tls.read(&mut buf).await?;
                    if n == 0 {
                        break;
                    }
                    got += n as u64;
                }
                tls.write_all(&got.to_le_bytes()).await?;
                tls.shutdown().await?;
                anyhow::Ok(got)
            }));
        }
        for t in tasks {
            t.await??;
        }
        anyhow::Ok(())
    });
    let mut streams = Vec::new();
    for _ in 0..connections {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        tcp.set_nodelay(true)?;
        streams.push(connector.connect("localhost".try_into()?, tcp).await?);
    }
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (k, mut tls) in streams.into_iter().enumerate() {
        let data = data.clone();
        tasks.push(tokio::spawn(async move {
            let mut pieces = data.pieces((k, connections), bytes_per_conn);
            while let Some(piece) = pieces.next().await? {
                tls.write_all(&piece).await?;
            }
            tls.shutdown().await?; // close_notify, then the TCP write half
            let mut ack = [0u8; 8];
            tls.read_exact(&mut ack).await?;
            anyhow::Ok(u64::from_le_bytes(ack))
        }));
    }
    for t in tasks {
        anyhow::ensure!(t.await?? == bytes_per_conn, "TCP lost bytes");
    }
    let seconds = started.elapsed().as_secs_f64();
    server.await??;
    Ok(seconds)
}
