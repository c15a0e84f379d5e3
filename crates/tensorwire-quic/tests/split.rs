//! Split tensors over QUIC (spec §15): one tensor sent as parts over a pool's connections,
//! put back together by the receiving application with `SplitTensors`, delivered once.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{assert_budget_returned, chunk_stream, pattern, receiver, receiver_config};
use tensorwire_quic::proto::split::{SplitId, SplitPart, plan_split};
use tensorwire_quic::proto::{DType, ErrorCode, TensorMeta};
use tensorwire_quic::{
    ClientTls, IncomingTensor, Receiver, SenderConfig, SenderPool, Source, TransportError,
};
use tensorwire_sink::{Assembled, HostSink, SplitTensors};

const ROWS: u64 = 40;
const ROW: u64 = 100_000;

fn whole() -> TensorMeta {
    TensorMeta::new([ROWS, ROW], DType::U8)
        .unwrap()
        .with_name("embed")
        .with_attribute("layer", "3")
}

async fn pool(rx: &Receiver, connections: usize) -> SenderPool {
    let mut config = SenderConfig::new(ClientTls::Development);
    config.binding = common::test_binding();
    SenderPool::connect(rx.local_addr().unwrap(), config, connections)
        .await
        .unwrap()
}

/// Lands one part (or a tensor sent whole) in host memory; refuses what does not fit.
async fn land(
    splits: SplitTensors<HostSink>,
    incoming: IncomingTensor,
) -> Result<Option<Assembled<Bytes>>, TransportError> {
    let part = match SplitPart::of(incoming.meta(), u64::MAX) {
        Ok(Some(part)) => part,
        Ok(None) => panic!("{} was not split", incoming.meta().name()),
        Err(e) => {
            incoming.reject(e.code(), e.to_string());
            return Err(e.into());
        }
    };
    let host = incoming.host_memory().clone();
    let joined = splits
        .join(
            incoming.peer().ip(),
            incoming.carrier(),
            &part,
            |whole| async move { HostSink::reserved(host.reserve(whole.byte_len()).await?) },
        )
        .await;
    match joined {
        Ok(sink) => incoming
            .accept(sink)
            .finished()
            .await
            .map(|(_, whole)| whole),
        Err(e) => {
            incoming.reject(e.code, e.message.clone());
            Err(e.into())
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_tensor_goes_over_several_connections_and_lands_once() {
    let mut config = receiver_config();
    config.endpoints = 2;
    let (mut rx, _) = receiver(config).await;
    let tx = pool(&rx, 4).await;
    let bytes = pattern((ROWS * ROW) as usize, 9);
    let send = tx.send_split(whole(), bytes.clone(), 4).unwrap();
    assert_eq!(send.total_bytes(), ROWS * ROW);

    let splits = SplitTensors::new(Duration::from_secs(10));
    let mut landing = Vec::new();
    for _ in 0..4 {
        let incoming = rx.next().await.unwrap();
        assert_eq!(incoming.meta().shape(), [10, ROW], "a part of 10 rows");
        landing.push(tokio::spawn(land(splits.clone(), incoming)));
    }
    let mut wholes = Vec::new();
    for landed in landing {
        wholes.extend(landed.await.unwrap().unwrap());
    }
    let report = send.finished().await.unwrap();
    assert_eq!(report.bytes, ROWS * ROW);
    assert_eq!(wholes.len(), 1, "the whole is delivered once");
    let assembled = wholes.pop().unwrap();
    assert_eq!(assembled.meta, whole());
    assert!(assembled.output == bytes, "the whole arrived intact");
    // Each part went on a connection of its own.
    let per_connection: Vec<u64> = rx
        .connections()
        .iter()
        .map(|c| c.metrics.payload_bytes)
        .collect();
    assert_eq!(per_connection, vec![10 * ROW; 4]);
    assert_eq!(splits.assembling(), 0);
    assert_budget_returned(&rx).await;
    tx.close().await;
    rx.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parts_on_one_connection_go_alongside_not_in_turn() {
    // Large tensors on one connection take turns; the parts of a split tensor do not: a part
    // waiting behind a tensor that waits for memory its parent holds would wait for nothing.
    let (mut rx, _) = receiver(receiver_config()).await;
    let tx = pool(&rx, 1).await;
    let bytes = pattern((ROWS * ROW) as usize, 4);
    let send = tx.send_split(whole(), bytes.clone(), 2).unwrap();
    let mut arrived = Vec::new();
    for _ in 0..2 {
        let next = tokio::time::timeout(Duration::from_secs(10), rx.next()).await;
        arrived.push(
            next.expect("both parts open before either is accepted")
                .unwrap(),
        );
    }
    let splits = SplitTensors::new(Duration::from_secs(10));
    let mut wholes = Vec::new();
    let landing: Vec<_> = arrived
        .into_iter()
        .map(|incoming| tokio::spawn(land(splits.clone(), incoming)))
        .collect();
    for landed in landing {
        wholes.extend(landed.await.unwrap().unwrap());
    }
    assert_eq!(send.finished().await.unwrap().bytes, ROWS * ROW);
    assert!(
        wholes.len() == 1 && wholes[0].output == bytes,
        "the whole arrived intact"
    );
    assert_budget_returned(&rx).await;
    tx.close().await;
    rx.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_part_that_overlaps_another_is_refused_with_split_mismatch() {
    let (mut rx, _) = receiver(receiver_config()).await;
    let tx = pool(&rx, 2).await;
    // Two parts of one whole claiming the same rows, as a broken sender might send them.
    let first = plan_split(&whole(), 2, SplitId(42)).unwrap().remove(0);
    let len = first.meta.byte_len() as usize;
    let a = tx.send(first.meta.clone(), pattern(len, 1));
    let splits = SplitTensors::new(Duration::from_secs(10));
    let landed = land(splits.clone(), rx.next().await.unwrap()).await;
    assert!(landed.unwrap().is_none(), "the first part lands");
    a.finished().await.unwrap();
    let b = tx.send(first.meta, pattern(len, 2));
    let refused = land(splits, rx.next().await.unwrap()).await;
    assert!(refused.is_err());
    let e = b.finished().await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::SPLIT_MISMATCH), "{e}");
    assert_budget_returned(&rx).await;
    tx.close().await;
    rx.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_cannot_be_split_is_refused_before_anything_is_sent() {
    let (rx, _) = receiver(receiver_config()).await;
    let tx = pool(&rx, 2).await;
    let stream = Source::Stream(chunk_stream(vec![Ok(Bytes::from_static(b"x"))]));
    assert!(tx.send_split(whole(), stream, 2).is_err(), "a stream");
    let bytes = pattern((ROWS * ROW) as usize, 1);
    assert!(
        tx.send_split(whole(), bytes.clone(), 1).is_err(),
        "one part"
    );
    assert!(
        tx.send_split(whole(), bytes.clone(), 41).is_err(),
        "more parts than rows"
    );
    let scalar = TensorMeta::new([], DType::U8).unwrap();
    assert!(tx.send_split(scalar, Bytes::from_static(b"x"), 2).is_err());
    assert_eq!(tx.metrics().tensors_started, 0);
    tx.close().await;
    rx.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tensor_is_split_only_past_its_connections_fair_share() {
    let (rx, _) = receiver(receiver_config()).await;
    let tx = pool(&rx, 2).await;
    let table = TensorMeta::new([64, 1 << 20], DType::U8).unwrap();
    // Alone: 64 MiB over 2 connections, 32 MiB each.
    assert_eq!(tx.parts_for(&table, 64 << 20), 2);
    // Among 640 MiB of tensors, it is within its 320 MiB share.
    assert_eq!(tx.parts_for(&table, 640 << 20), 1);
    // Parts below 16 MiB are not worth it: 4 MB goes whole.
    assert_eq!(tx.parts_for(&whole(), ROWS * ROW), 1);
    let one_row = TensorMeta::new([1, 64 << 20], DType::U8).unwrap();
    assert_eq!(tx.parts_for(&one_row, 64 << 20), 1);
    let scalar = TensorMeta::new([], DType::F64).unwrap();
    assert_eq!(tx.parts_for(&scalar, 8), 1);
    tx.close().await;
    rx.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_part_may_come_from_a_source_of_its_own() {
    let (mut rx, _) = receiver(receiver_config()).await;
    let tx = pool(&rx, 2).await;
    let bytes = pattern((ROWS * ROW) as usize, 4);
    // A part source that fails for any part: nothing is sent.
    let failing = tx.send_split_with(whole(), 2, |offset, _| match offset {
        0 => Ok(Source::Bytes(Bytes::new())),
        _ => Err(TransportError::Config("no such range".into())),
    });
    assert!(failing.is_err());
    assert_eq!(tx.metrics().tensors_started, 0);
    // Streams, which cannot be sliced, one per part.
    let whole_bytes = bytes.clone();
    let send = tx
        .send_split_with(whole(), 2, move |offset, len| {
            let part = whole_bytes.slice(offset as usize..(offset + len) as usize);
            Ok(Source::Stream(chunk_stream(vec![Ok(part)])))
        })
        .unwrap();
    let splits = SplitTensors::new(Duration::from_secs(10));
    let first = tokio::spawn(land(splits.clone(), rx.next().await.unwrap()));
    let second = land(splits, rx.next().await.unwrap()).await.unwrap();
    let first = first.await.unwrap().unwrap();
    let assembled = first.or(second).unwrap();
    assert!(assembled.output == bytes);
    send.finished().await.unwrap();
    tx.close().await;
    rx.close().await;
}
