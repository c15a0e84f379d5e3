//! Raw quinn bulk transfer, the anchor of every throughput figure: in one process, or as a
//! server and client process each (`--raw-server`, `--raw-client`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::report::print_path_stats;
use crate::setup::Setup;
use crate::source::Loaded;
use crate::threads::ThreadUsage;

/// Where the clients of runs with both sides in this process bind.
pub(crate) const LOOPBACK: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 0);

/// A server endpoint with tensorwire's TLS and transport settings; returns its address.
pub(crate) fn quinn_server(
    setup: Setup,
) -> anyhow::Result<(
    quinn::Endpoint,
    tokio::runtime::Handle,
    rustls::pki_types::CertificateDer<'static>,
)> {
    let (config, cert) = quinn_server_config(setup)?;
    let (endpoint, runtime) = setup
        .transport()
        .endpoint_with_runtime("127.0.0.1:0".parse()?, Some(config))?;
    Ok((endpoint, runtime, cert))
}

/// A server configuration with tensorwire's TLS and transport settings and a fresh
/// self-signed certificate, which it returns too.
pub(crate) fn quinn_server_config(
    setup: Setup,
) -> anyhow::Result<(
    quinn::ServerConfig,
    rustls::pki_types::CertificateDer<'static>,
)> {
    let cert = tensorwire::quic::tls::DevCertificate::generate()?;
    let dir = std::env::temp_dir().join(format!("tensorwire-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (cert_path, key_path) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert_path, &cert.pem)?;
    std::fs::write(&key_path, cert.key_pem())?;
    let tls = tensorwire::quic::ServerTls::Pem {
        cert: cert_path,
        key: key_path,
        client_ca: None,
    };
    let (crypto, _) = tensorwire::quic::tls::server_crypto(&tls)?;
    // The files were read; nothing else needs them.
    std::fs::remove_dir_all(&dir)?;
    let mut config = quinn::ServerConfig::with_crypto(crypto);
    config.transport_config(setup.transport().transport_config()?);
    Ok((config, cert.cert))
}

/// Reads one raw quinn connection's stream to its end, answers with the byte count, and
/// waits for the client to close.
pub(crate) async fn raw_quinn_serve(conn: quinn::Connection) -> anyhow::Result<u64> {
    let (mut send, mut recv) = conn.accept_bi().await?;
    let mut got = 0u64;
    while let Some(chunk) = recv.read_chunk(usize::MAX, true).await? {
        got += chunk.bytes.len() as u64;
    }
    send.write_all(&got.to_le_bytes()).await?;
    send.finish()?;
    conn.closed().await;
    Ok(got)
}

/// Sends `bytes` of `data` on one stream of `conn`, the `part.0`th of `part.1` connections,
/// in `CHUNK` writes, finishes it, and checks the server's count.
pub(crate) async fn raw_quinn_send(
    conn: &quinn::Connection,
    data: &Loaded,
    part: (usize, usize),
    bytes: u64,
) -> anyhow::Result<()> {
    let (mut send, mut recv) = conn.open_bi().await?;
    let mut pieces = data.pieces(part, bytes);
    while let Some(piece) = pieces.next().await? {
        send.write_chunk(piece).await?;
    }
    send.finish()?;
    let mut ack = [0u8; 8];
    recv.read_exact(&mut ack).await?;
    anyhow::ensure!(u64::from_le_bytes(ack) == bytes, "raw quinn lost bytes");
    Ok(())
}

/// A raw quinn client's endpoint, the runtime its work runs on, and its connection.
type RawClient = (quinn::Endpoint, tokio::runtime::Handle, quinn::Connection);

/// Sends `bytes` on every connection of `clients` at once, each on a task beside its
/// connection (its endpoint's runtime, as tensorwire's sends run).
pub(crate) async fn raw_quinn_send_on_each(
    clients: &[RawClient],
    data: &Loaded,
    bytes: u64,
) -> anyhow::Result<()> {
    let mut sends = Vec::new();
    for (k, (_, runtime, conn)) in clients.iter().enumerate() {
        let (conn, data, part) = (conn.clone(), data.clone(), (k, clients.len()));
        sends.push(runtime.spawn(async move { raw_quinn_send(&conn, &data, part, bytes).await }));
    }
    for send in sends {
        send.await??;
    }
    Ok(())
}

/// `--raw-server`: `count` connections over `count` endpoints sharing one port on `listen`.
pub(crate) async fn raw_quinn_server_process(
    cert_file: &std::path::Path,
    listen: SocketAddr,
    count: usize,
    setup: Setup,
    steering: tensorwire::quic::Steering,
) -> anyhow::Result<()> {
    let (config, cert) = quinn_server_config(setup)?;
    std::fs::write(cert_file, cert.as_ref())?;
    let endpoints =
        setup
            .transport()
            .reuse_port_endpoints(listen, count.max(1), config, steering)?;
    println!("listening on {}", endpoints[0].endpoint().local_addr()?);
    let (done, mut finished) = tokio::sync::mpsc::unbounded_channel();
    for endpoint in &endpoints {
        let (endpoint, done) = (endpoint.clone(), done.clone());
        // Its connections are served on its runtime, as a receiver serves them.
        endpoint.runtime().clone().spawn(async move {
            while let Some((incoming, slot)) = endpoint.accept().await {
                let done = done.clone();
                tokio::spawn(async move {
                    let served = async { raw_quinn_serve(incoming.await?).await }.await;
                    drop(slot);
                    let _ = done.send(served);
                });
            }
        });
    }
    for _ in 0..count {
        let got = finished
            .recv()
            .await
            .ok_or_else(|| anyhow::anyhow!("endpoints closed"))??;
        eprintln!("raw quinn server: a connection sent {got} bytes");
    }
    Ok(())
}

/// `--raw-client`: `connections` connections to a `--raw-server`, each on an endpoint of its
/// own (as `sender --connections` opens them), `bytes` on one stream of each.
pub(crate) async fn raw_quinn_client_process(
    addr: SocketAddr,
    cert_file: &std::path::Path,
    connections: usize,
    bytes: u64,
    setup: Setup,
    data: Loaded,
) -> anyhow::Result<()> {
    let cert = rustls::pki_types::CertificateDer::from(std::fs::read(cert_file)?);
    let mut clients = Vec::new();
    // Any local address: the server may be on another host (or network namespace).
    let bind = SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), 0);
    for _ in 0..connections.max(1) {
        let (client, runtime, config) = quinn_client(setup, &cert, bind)?;
        let conn = client.connect_with(config, addr, "localhost")?.await?;
        clients.push((client, runtime, conn));
    }
    raw_quinn_send_on_each(&clients, &data, bytes).await?;
    // As `sender` closes (`Sender::close`): until each CONNECTION_CLOSE has gone out (a closed
    // connection's next datagram), at most 100 ms, all together, without waiting out QUIC's
    // draining period.
    // Counted before each close, as `sender` counts: the close may go out before `close`
    // returns.
    let mut sent_before = Vec::new();
    for (_, _, conn) in &clients {
        sent_before.push(conn.stats().udp_tx.datagrams);
        conn.close(0u32.into(), b"done");
    }
    let close_sent = async {
        tokio::task::yield_now().await;
        while clients
            .iter()
            .zip(&sent_before)
            .any(|((_, _, conn), before)| conn.stats().udp_tx.datagrams == *before)
        {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    let _ = tokio::time::timeout(Duration::from_millis(100), close_sent).await;
    Ok(())
}

pub(crate) fn quinn_client(
    setup: Setup,
    cert: &rustls::pki_types::CertificateDer<'static>,
    bind: SocketAddr,
) -> anyhow::Result<(quinn::Endpoint, tokio::runtime::Handle, quinn::ClientConfig)> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.clone())?;
    let mut tls =
        rustls::ClientConfig::builder_with_provider(tensorwire::quic::tls::crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(roots)
            .with_no_client_auth();
    tls.alpn_protocols = vec![tensorwire::proto::ALPN.to_vec()];
    let mut config = quinn::ClientConfig::new(Arc::new(
        quinn::crypto::rustls::QuicClientConfig::try_from(tls)?,
    ));
    config.transport_config(setup.transport().transport_config()?);
    let (endpoint, runtime) = setup.transport().endpoint_with_runtime(bind, None)?;
    Ok((endpoint, runtime, config))
}

/// The first connection a raw quinn server endpoint accepts, once its handshake is done.
pub(crate) async fn first_connection(server: quinn::Endpoint) -> anyhow::Result<quinn::Connection> {
    Ok(server
        .accept()
        .await
        .ok_or_else(|| anyhow::anyhow!("no connection"))?
        .await?)
}

pub(crate) async fn raw_quinn(
    connections: usize,
    bytes_per_conn: u64,
    setup: Setup,
    data: &Loaded,
) -> anyhow::Result<f64> {
    let mut servers = Vec::new();
    let mut clients = Vec::new();
    let mut relays = Vec::new();
    for _ in 0..connections {
        let (server, server_runtime, cert) = quinn_server(setup)?;
        let (addr, relay) = setup.path_to(server.local_addr()?).await?;
        relays.extend(relay);
        let (client, client_runtime, config) = quinn_client(setup, &cert, LOOPBACK)?;
        let server_task = server_runtime
            .spawn(async move { raw_quinn_serve(first_connection(server).await?).await });
        let conn = client.connect_with(config, addr, "localhost")?.await?;
        servers.push(server_task);
        clients.push((client, client_runtime, conn));
    }
    let (usage, started) = (ThreadUsage::now(), Instant::now());
    raw_quinn_send_on_each(&clients, data, bytes_per_conn).await?;
    let seconds = started.elapsed().as_secs_f64();
    setup.print_busy_threads("raw quinn", &usage, seconds);
    for (client, _, conn) in clients {
        print_path_stats("raw quinn", &conn.stats());
        conn.close(0u32.into(), b"done");
        client.wait_idle().await;
    }
    for s in servers {
        s.await??;
    }
    Ok(seconds)
}
