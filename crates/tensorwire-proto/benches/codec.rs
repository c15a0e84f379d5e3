//! Codec throughput on the golden vectors and on large DATA frames.
//!
//! `cargo bench -p tensorwire-proto --bench codec`
#![allow(missing_docs)]

use bytes::{Bytes, BytesMut};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tensorwire_proto::frame::Data;
use tensorwire_proto::{Frame, FrameDecoder, Limits, TensorReceiver};

fn vectors() -> Vec<Bytes> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../spec/vectors/frames");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("spec/vectors/frames") {
        let bytes = std::fs::read(entry.expect("entry").path()).expect("read");
        let mut decoder = FrameDecoder::new(Limits::default());
        decoder.push(bytes.clone().into());
        if matches!(decoder.next_frame(), Ok(Some(_))) {
            out.push(bytes.into());
        }
    }
    out
}

fn decode_vectors(c: &mut Criterion) {
    let vectors = vectors();
    let total: usize = vectors.iter().map(Bytes::len).sum();
    let mut group = c.benchmark_group("decode");
    group.throughput(Throughput::Elements(vectors.len() as u64));
    group.bench_function(
        format!("valid_vectors_{}_frames_{total}_bytes", vectors.len()),
        |b| {
            b.iter(|| {
                let mut decoder = FrameDecoder::new(Limits::default());
                vectors.iter().for_each(|v| decoder.push(v.clone()));
                while let Ok(Some(frame)) = decoder.next_frame() {
                    std::hint::black_box(frame);
                }
            })
        },
    );
    group.finish();
}

/// 4 MiB DATA frames arriving as 1200-byte QUIC chunks: decode and receive (range + CRC).
fn data_path(c: &mut Criterion) {
    const CHUNK: usize = 4 << 20;
    let frame = Frame::from(Data::new(0, vec![7u8; CHUNK])).to_bytes();
    let pieces: Vec<Bytes> = (0..frame.len())
        .step_by(1200)
        .map(|i| frame.slice(i..(i + 1200).min(frame.len())))
        .collect();
    let mut group = c.benchmark_group("data_path");
    group.throughput(Throughput::Bytes(CHUNK as u64));
    group.bench_function("decode_4MiB_from_1200B_chunks", |b| {
        b.iter(|| {
            let mut decoder = FrameDecoder::new(Limits::default());
            pieces.iter().for_each(|p| decoder.push(p.clone()));
            std::hint::black_box(decoder.next_frame().ok())
        })
    });
    group.bench_function("decode_and_receive_4MiB", |b| {
        let meta = tensorwire_proto::TensorMeta::new([CHUNK as u64], tensorwire_proto::DType::U8)
            .expect("meta");
        b.iter(|| {
            let mut receiver = TensorReceiver::new(Limits::default());
            receiver
                .handle_frame(meta.clone().into())
                .expect("metadata");
            receiver.accept().expect("accept");
            let _ = receiver.grant(CHUNK as u64);
            let mut decoder = FrameDecoder::new(Limits::default());
            pieces.iter().for_each(|p| decoder.push(p.clone()));
            let frame = decoder.next_frame().expect("decode").expect("frame");
            std::hint::black_box(receiver.handle_frame(frame).expect("data"))
        })
    });
    group.bench_function("encode_header_4MiB", |b| {
        let data = Frame::from(Data::new(0, vec![7u8; CHUNK]));
        b.iter(|| {
            let mut header = BytesMut::with_capacity(16);
            data.encode_header(&mut header);
            std::hint::black_box(header)
        })
    });
    group.finish();
}

criterion_group!(benches, decode_vectors, data_path);
criterion_main!(benches);
