//! TCP + TLS 1.3 bulk transfer (tokio-rustls, tensorwire's crypto provider), the anchor
//! QUIC is compared with: both sides in this process, or one side per process
//! (`--tls-server`, `--tls-client`) as two hosts would run them.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use rustls::pki_types::CertificateDer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::client::TlsStream;

use crate::source::Loaded;

/// Both sides in this process, over loopback: the seconds `connections` connections took to
/// move `bytes_per_conn` each.
pub(crate) async fn tcp_tls(
    connections: usize,
    bytes_per_conn: u64,
    data: &Loaded,
) -> anyhow::Result<f64> {
    let (acceptor, cert) = acceptor()?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(serve(listener, acceptor, connections));
    let streams = connect(addr, &cert, connections).await?;
    let seconds = send_on_each(streams, data, bytes_per_conn).await?;
    server.await??;
    Ok(seconds)
}

/// `--tls-server`: writes a throwaway certificate (DER) to `cert_file`, listens on `listen`,
/// prints `listening on ADDR`, and exits once `connections` connections sent everything.
pub(crate) async fn tls_server_process(
    cert_file: &Path,
    listen: SocketAddr,
    connections: usize,
) -> anyhow::Result<()> {
    let (acceptor, cert) = acceptor()?;
    std::fs::write(cert_file, cert.as_ref())?;
    let listener = TcpListener::bind(listen).await?;
    println!("listening on {}", listener.local_addr()?);
    serve(listener, acceptor, connections.max(1)).await
}

/// `--tls-client`: sends `bytes_per_conn` over each of `connections` connections to a
/// `--tls-server` at `addr`, trusting the certificate in `cert_file`.
pub(crate) async fn tls_client_process(
    addr: SocketAddr,
    cert_file: &Path,
    connections: usize,
    bytes_per_conn: u64,
    data: &Loaded,
) -> anyhow::Result<()> {
    let cert = CertificateDer::from(std::fs::read(cert_file)?);
    let streams = connect(addr, &cert, connections.max(1)).await?;
    let seconds = send_on_each(streams, data, bytes_per_conn).await?;
    eprintln!("TCP + TLS client: sent in {seconds:.2} s");
    Ok(())
}

/// A TLS 1.3 acceptor with a throwaway certificate for `localhost`, and that certificate.
fn acceptor() -> anyhow::Result<(tokio_rustls::TlsAcceptor, CertificateDer<'static>)> {
    let cert = tensorwire::quic::tls::DevCertificate::generate()?;
    let key = rustls::pki_types::PrivateKeyDer::try_from(cert.key_der())
        .map_err(|e| anyhow::anyhow!("key: {e}"))?;
    let server_tls =
        rustls::ServerConfig::builder_with_provider(tensorwire::quic::tls::crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_no_client_auth()
            .with_single_cert(vec![cert.cert.clone()], key)?;
    Ok((
        tokio_rustls::TlsAcceptor::from(Arc::new(server_tls)),
        cert.cert.clone(),
    ))
}

/// Accepts `connections` connections, reads each to its end and answers with the byte count.
async fn serve(
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    connections: usize,
) -> anyhow::Result<()> {
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
    Ok(())
}

/// `connections` TLS 1.3 connections to `addr`, trusting `cert` for `localhost`.
async fn connect(
    addr: SocketAddr,
    cert: &CertificateDer<'static>,
    connections: usize,
) -> anyhow::Result<Vec<TlsStream<TcpStream>>> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.clone())?;
    let client_tls =
        rustls::ClientConfig::builder_with_provider(tensorwire::quic::tls::crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(roots)
            .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client_tls));
    let mut streams = Vec::new();
    for _ in 0..connections {
        let tcp = TcpStream::connect(addr).await?;
        tcp.set_nodelay(true)?;
        streams.push(connector.connect("localhost".try_into()?, tcp).await?);
    }
    Ok(streams)
}

/// Sends `bytes_per_conn` of `data` on each stream at once (each its own part), then reads
/// each byte count back; the seconds from the first byte to the last count.
async fn send_on_each(
    streams: Vec<TlsStream<TcpStream>>,
    data: &Loaded,
    bytes_per_conn: u64,
) -> anyhow::Result<f64> {
    let connections = streams.len();
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
    Ok(started.elapsed().as_secs_f64())
}
