//! A misbehaving peer for testing a receiver you run: floods of METADATA without DATA,
//! CANCEL floods, RESET_STREAM floods, one-byte DATA, and silent connections, each for a
//! while, then a report of what the receiver answered. For soak and abuse tests of your own
//! deployment; it uses development trust (a receiver on this host) or `--ca`.
//!
//! `hostile-peer --connect 127.0.0.1:7000 --mode metadata-flood --seconds 5`

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use clap::{Parser, ValueEnum};
use quinn::VarInt;
use tensorwire::proto::frame::{Cancel, Data};
use tensorwire::proto::{DType, ErrorCode, Frame, FrameDecoder, Limits, TensorMeta};
use tensorwire::quic::{ClientTls, SenderConfig, TransportSettings};
use tensorwire_examples::cli::init_logging;

/// Misbehave towards a receiver.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Receiver address.
    #[arg(long, value_parser = tensorwire_examples::cli::address)]
    connect: SocketAddr,
    /// What to do.
    #[arg(long, value_enum)]
    mode: Mode,
    /// For how long.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Bytes each METADATA claims.
    #[arg(long, default_value_t = 1 << 30)]
    claim: u64,
    /// With metadata-flood: attributes on each METADATA, each `--attribute-bytes` long, so
    /// that legal METADATA weighs on the receiver's memory.
    #[arg(long, default_value_t = 0)]
    attributes: u16,
    /// With --attributes: bytes of each attribute's value.
    #[arg(long, default_value_t = 1000)]
    attribute_bytes: usize,
    /// Local address to send from (on loopback, any of 127.0.0.0/8: a peer of its own).
    #[arg(long, default_value = "0.0.0.0")]
    from: std::net::IpAddr,
    /// With silent: connections to open.
    #[arg(long, default_value_t = 64)]
    connections: usize,
    /// PEM CA of the receiver (default: development trust on this host).
    #[arg(long)]
    ca: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Mode {
    /// Streams with a METADATA claiming `--claim` bytes, then nothing.
    MetadataFlood,
    /// METADATA then CANCEL, as fast as possible.
    CancelFlood,
    /// METADATA then RESET_STREAM, as fast as possible.
    ResetFlood,
    /// One tensor fed one byte per DATA frame.
    TinyData,
    /// Connections that open no stream.
    Silent,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_logging("warn");
    let args = Args::parse();
    let tls = match &args.ca {
        Some(ca) => ClientTls::Pem {
            ca: ca.clone(),
            identity: None,
        },
        None => ClientTls::Development,
    };
    let mut config = SenderConfig::new(ClientTls::Development);
    config.tls = tls;
    config.transport = TransportSettings::jumbo();
    let crypto = tensorwire::quic::tls::client_crypto(&config.tls, args.connect)?;
    let mut client = quinn::ClientConfig::new(crypto);
    client.transport_config(config.transport.transport_config()?);
    let endpoint = quinn::Endpoint::client(SocketAddr::new(args.from, 0))?;
    let until = Instant::now() + Duration::from_secs(args.seconds);
    let connect = || async {
        anyhow::Ok(
            endpoint
                .connect_with(client.clone(), args.connect, "localhost")?
                .await?,
        )
    };
    let meta = |i: u64, len: u64| {
        TensorMeta::new([len], DType::U8).map(|m| {
            (0..args.attributes).fold(m.with_name(format!("hostile-{i}")), |m, a| {
                m.with_attribute(format!("a{a}"), "x".repeat(args.attribute_bytes))
            })
        })
    };
    let mut streams = 0u64;
    let mut answers = std::collections::BTreeMap::<String, u64>::new();
    match args.mode {
        Mode::Silent => {
            let mut connections = Vec::new();
            while Instant::now() < until && connections.len() < args.connections {
                match connect().await {
                    Ok(connection) => connections.push(connection),
                    Err(e) => *answers.entry(format!("connect: {e}")).or_default() += 1,
                }
            }
            tokio::time::sleep_until(until.into()).await;
            for c in &connections {
                let reason = match tokio::time::timeout(Duration::ZERO, c.closed()).await {
                    Ok(e) => e.to_string(),
                    Err(_) => "still open".into(),
                };
                *answers.entry(reason).or_default() += 1;
            }
        }
        Mode::TinyData => {
            let conn = connect().await?;
            let (mut send, mut recv) = conn.open_bi().await?;
            let len = 1 << 20;
            send.write_all(&Frame::from(meta(0, len)?).to_bytes())
                .await?;
            let mut at = 0;
            let mut decoder = FrameDecoder::new(Limits::default());
            let mut granted = 0u64;
            while Instant::now() < until && at < len {
                while granted <= at {
                    match tokio::time::timeout(
                        Duration::from_secs(5),
                        recv.read_chunk(usize::MAX, true),
                    )
                    .await
                    {
                        Ok(Ok(Some(chunk))) => decoder.push(chunk.bytes),
                        other => anyhow::bail!("no credit came: {other:?}"),
                    }
                    while let Some(frame) = decoder.next_frame()? {
                        if let Frame::Credit(c) = frame {
                            granted += c.bytes;
                        } else {
                            *answers
                                .entry(format!("{frame:?}").chars().take(60).collect())
                                .or_default() += 1;
                        }
                    }
                }
                send.write_all(&Frame::from(Data::new(at, vec![7u8])).to_bytes())
                    .await?;
                at += 1;
                streams = at;
            }
            let _ = send.reset(VarInt::from_u32(ErrorCode::CANCELLED.0));
        }
        Mode::MetadataFlood | Mode::CancelFlood | Mode::ResetFlood => {
            let mut conn = connect().await?;
            let mut held = Vec::new();
            while Instant::now() < until {
                let opened = tokio::time::timeout(Duration::from_secs(1), conn.open_bi()).await;
                let (mut send, recv) = match opened {
                    Ok(Ok(pair)) => pair,
                    Ok(Err(e)) => {
                        *answers.entry(format!("connection: {e}")).or_default() += 1;
                        conn = connect().await?;
                        continue;
                    }
                    Err(_) => {
                        *answers
                            .entry("no stream slot within 1 s".into())
                            .or_default() += 1;
                        continue;
                    }
                };
                let mut wire = BytesMut::new();
                Frame::from(meta(streams, args.claim)?).encode(&mut wire);
                if let Mode::CancelFlood = args.mode {
                    Frame::from(Cancel::new(ErrorCode::CANCELLED, "flood")).encode(&mut wire);
                }
                let _ = send.write_all(&wire).await;
                match args.mode {
                    Mode::ResetFlood => drop(send.reset(VarInt::from_u32(ErrorCode::CANCELLED.0))),
                    Mode::CancelFlood => drop(send.finish()),
                    _ => held.push((send, recv)),
                }
                streams += 1;
            }
            let reason = match tokio::time::timeout(Duration::ZERO, conn.closed()).await {
                Ok(e) => e.to_string(),
                Err(_) => "connection still open".into(),
            };
            *answers.entry(reason).or_default() += 1;
        }
    }
    println!(
        "{:?}: {streams} streams (or bytes) in {} s",
        args.mode, args.seconds
    );
    for (answer, count) in answers {
        println!("  {count} x {answer}");
    }
    endpoint.close(VarInt::from_u32(0), b"done");
    Ok(())
}
