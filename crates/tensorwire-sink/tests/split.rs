//! The parts of a split tensor landing in one host destination (spec §15), through the
//! public API: one admission, one whole, and the destination freed when the whole fails.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tensorwire_proto::split::{SplitId, SplitPart, plan_split};
use tensorwire_proto::{DType, ErrorCode, Payload, TensorMeta};
use tensorwire_sink::{
    Carrier, CreditPermit, HostSink, MAX_ASSEMBLING, MAX_ASSEMBLING_PER_PEER, MemoryBudget,
    PartSink, Sink, SinkError, SplitTensors,
};

const PEER: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
const WITHIN: Duration = Duration::from_secs(5);

fn whole(rows: u64) -> TensorMeta {
    TensorMeta::new(vec![rows, 1000], DType::U8)
        .unwrap()
        .with_name("embed")
}

fn parts(meta: &TensorMeta, n: u64, id: u128) -> Vec<SplitPart> {
    plan_split(meta, n, SplitId(id))
        .unwrap()
        .iter()
        .map(|p| SplitPart::of(&p.meta, u64::MAX).unwrap().unwrap())
        .collect()
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8).collect()
}

/// Admits host memory from `memory`, counting admissions.
async fn join(
    splits: &SplitTensors<HostSink>,
    part: &SplitPart,
    memory: &MemoryBudget,
    admitted: &AtomicUsize,
) -> Result<PartSink<HostSink>, SinkError> {
    join_over(PEER, &Carrier::new(), splits, part, memory, admitted).await
}

/// As [`join`], the part coming from `peer` over `carrier`.
async fn join_over(
    peer: std::net::IpAddr,
    carrier: &Carrier,
    splits: &SplitTensors<HostSink>,
    part: &SplitPart,
    memory: &MemoryBudget,
    admitted: &AtomicUsize,
) -> Result<PartSink<HostSink>, SinkError> {
    splits
        .join(peer, carrier, part, |meta| async move {
            admitted.fetch_add(1, Ordering::SeqCst);
            HostSink::reserved(memory.try_reserve(meta.byte_len())?)
        })
        .await
}

/// Writes a part's bytes of `bytes` (the whole) in two DATA-sized pieces, last piece first.
async fn fill(sink: &mut PartSink<HostSink>, part: &SplitPart, bytes: &[u8]) -> u32 {
    let mine = &bytes[part.offset() as usize..(part.offset() + part.len()) as usize];
    let half = mine.len() / 2;
    let mut crc = 0;
    for (at, piece) in [(half, &mine[half..]), (0, &mine[..half])] {
        let payload = Payload::from(Bytes::copy_from_slice(piece));
        let permit = CreditPermit::unbudgeted(piece.len() as u64);
        crc ^= sink
            .write_checksummed(at as u64, payload, permit)
            .await
            .unwrap();
    }
    crc
}

#[tokio::test]
async fn parts_from_anywhere_land_in_one_whole_delivered_once() {
    let meta = whole(37);
    let bytes = pattern(meta.byte_len() as usize);
    let memory = MemoryBudget::new("host", 1 << 20);
    let admitted = AtomicUsize::new(0);
    let splits = SplitTensors::new(WITHIN);
    let parts = parts(&meta, 5, 1);
    // All join before any lands, in another order than their rows.
    let mut sinks = Vec::new();
    for i in [3, 0, 4, 1, 2] {
        sinks.push((
            i,
            join(&splits, &parts[i], &memory, &admitted).await.unwrap(),
        ));
    }
    assert_eq!(
        admitted.load(Ordering::SeqCst),
        1,
        "the whole is admitted once"
    );
    assert_eq!(memory.snapshot().reserved, meta.byte_len());
    let mut delivered = Vec::new();
    for (i, mut sink) in sinks {
        fill(&mut sink, &parts[i], &bytes).await;
        if let Some(assembled) = sink.finish().await.unwrap() {
            delivered.push(assembled);
        }
    }
    assert_eq!(
        delivered.len(),
        1,
        "one whole, from the part that landed last"
    );
    let assembled = delivered.pop().unwrap();
    assert_eq!(assembled.meta, meta);
    assert_eq!(&assembled.output[..], &bytes[..]);
    assert_eq!(splits.assembling(), 0, "a delivered whole is forgotten");
    drop(assembled);
    assert_eq!(memory.snapshot().reserved, 0);
}

#[tokio::test]
async fn a_part_that_ends_early_fails_the_whole_and_frees_it() {
    let meta = whole(10);
    let bytes = pattern(meta.byte_len() as usize);
    let memory = MemoryBudget::new("host", 1 << 20);
    let admitted = AtomicUsize::new(0);
    let splits = SplitTensors::new(WITHIN);
    let parts = parts(&meta, 3, 2);
    let mut first = join(&splits, &parts[0], &memory, &admitted).await.unwrap();
    let second = join(&splits, &parts[1], &memory, &admitted).await.unwrap();
    fill(&mut first, &parts[0], &bytes).await;
    assert!(first.finish().await.unwrap().is_none());
    // The second part's stream is cancelled before it landed: its sink is dropped.
    drop(second);
    assert_eq!(
        memory.snapshot().reserved,
        0,
        "the destination went with the whole"
    );
    // The third part learns at once; the whole is not admitted again.
    let e = join(&splits, &parts[2], &memory, &admitted)
        .await
        .err()
        .unwrap();
    assert_eq!(e.code, ErrorCode::CANCELLED);
    assert_eq!(admitted.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn parts_that_do_not_all_arrive_in_time_free_the_whole() {
    let meta = whole(8);
    let bytes = pattern(meta.byte_len() as usize);
    let memory = MemoryBudget::new("host", 1 << 20);
    let admitted = AtomicUsize::new(0);
    let splits = SplitTensors::new(WITHIN);
    let parts = parts(&meta, 2, 3);
    let mut first = join(&splits, &parts[0], &memory, &admitted).await.unwrap();
    fill(&mut first, &parts[0], &bytes).await;
    assert!(first.finish().await.unwrap().is_none());
    assert_eq!(memory.snapshot().reserved, meta.byte_len());
    tokio::time::sleep(WITHIN + Duration::from_millis(1)).await;
    assert_eq!(memory.snapshot().reserved, 0, "freed when time was up");
    assert_eq!(splits.assembling(), 0);
    // A part arriving later starts over, alone, and is refused in its turn.
    let late = join(&splits, &parts[1], &memory, &admitted).await.unwrap();
    assert_eq!(admitted.load(Ordering::SeqCst), 2);
    tokio::time::sleep(WITHIN + Duration::from_millis(1)).await;
    let mut late = late;
    let payload = Payload::from(Bytes::from_static(b"x"));
    let e = late
        .write(0, payload, CreditPermit::unbudgeted(1))
        .await
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::RESOURCE_EXHAUSTED);
    assert!(e.message.contains("did not all arrive"), "{}", e.message);
}

#[tokio::test]
async fn a_refused_admission_refuses_every_part_with_its_reason() {
    let meta = whole(10);
    let memory = MemoryBudget::new("host", 100);
    let admitted = AtomicUsize::new(0);
    let splits = SplitTensors::new(WITHIN);
    let parts = parts(&meta, 2, 4);
    for part in &parts {
        let e = join(&splits, part, &memory, &admitted).await.err().unwrap();
        assert_eq!(e.code, ErrorCode::RESOURCE_EXHAUSTED);
    }
    assert_eq!(admitted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_part_that_does_not_fit_spoils_the_whole() {
    let meta = whole(10);
    let memory = MemoryBudget::new("host", 1 << 20);
    let admitted = AtomicUsize::new(0);
    let splits = SplitTensors::new(WITHIN);
    let parts = parts(&meta, 2, 5);
    let mut first = join(&splits, &parts[0], &memory, &admitted).await.unwrap();
    // The same rows again, as a hostile or broken peer might send them.
    let e = join(&splits, &parts[0], &memory, &admitted)
        .await
        .err()
        .unwrap();
    assert_eq!(e.code, ErrorCode::SPLIT_MISMATCH);
    let payload = Payload::from(Bytes::from_static(b"x"));
    let e = first
        .write(0, payload, CreditPermit::unbudgeted(1))
        .await
        .unwrap_err();
    assert_eq!(
        e.code,
        ErrorCode::SPLIT_MISMATCH,
        "the other parts are told"
    );
    assert_eq!(memory.snapshot().reserved, 0);
}

/// A whole whose parts came over connections that have all closed can get no more parts:
/// it fails at once and frees its destination, not at the parts' deadline; while one of
/// its connections is open, it waits.
#[tokio::test]
async fn a_whole_fails_once_every_connection_that_carried_its_parts_closed() {
    let meta = whole(4);
    let memory = MemoryBudget::new("host", u64::MAX);
    let admitted = AtomicUsize::new(0);
    let splits = SplitTensors::new(Duration::from_secs(3600));
    let planned = parts(&meta, 4, 7);
    let bytes = vec![5u8; meta.byte_len() as usize];
    let (first, second) = (Carrier::new(), Carrier::new());
    for (part, carrier) in planned[..2].iter().zip([&first, &second]) {
        let mut sink = join_over(PEER, carrier, &splits, part, &memory, &admitted)
            .await
            .unwrap();
        fill(&mut sink, part, &bytes).await;
        assert!(sink.finish().await.unwrap().is_none(), "two of four parts");
    }
    assert_eq!(memory.snapshot().reserved, meta.byte_len());
    first.close();
    tokio::task::yield_now().await;
    assert_eq!(
        memory.snapshot().reserved,
        meta.byte_len(),
        "one connection still open"
    );
    second.close();
    for _ in 0..100 {
        if memory.snapshot().reserved == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(memory.snapshot().reserved, 0, "freed once both closed");
    let late = join_over(
        PEER,
        &Carrier::new(),
        &splits,
        &planned[2],
        &memory,
        &admitted,
    )
    .await
    .err()
    .expect("a late part is refused");
    assert!(late.message.contains("closed"), "{}", late.message);
}

/// Spec §15.2: wholes being assembled are capped per peer, so one peer at its cap leaves
/// room for others, and in all.
#[tokio::test]
async fn wholes_being_assembled_are_capped_per_peer_and_in_all() {
    let meta = whole(2);
    let memory = MemoryBudget::new("host", u64::MAX);
    let admitted = AtomicUsize::new(0);
    let splits = SplitTensors::new(WITHIN);
    let mut held = Vec::new();
    let peer = |n: usize| std::net::IpAddr::from([10, 0, (n >> 8) as u8, n as u8]);
    for id in 0..MAX_ASSEMBLING_PER_PEER as u128 {
        let part = &parts(&meta, 2, id)[0];
        held.push(
            join_over(peer(0), &Carrier::new(), &splits, part, &memory, &admitted)
                .await
                .unwrap(),
        );
    }
    let greedy = &parts(&meta, 2, u128::MAX)[0];
    let e = join_over(
        peer(0),
        &Carrier::new(),
        &splits,
        greedy,
        &memory,
        &admitted,
    )
    .await
    .err()
    .unwrap();
    assert_eq!(e.code, ErrorCode::RESOURCE_EXHAUSTED);
    assert!(e.message.contains("per peer"), "{}", e.message);
    // Other peers fill the rest, up to the cap in all.
    let mut id = MAX_ASSEMBLING_PER_PEER as u128;
    for n in 1.. {
        if held.len() == MAX_ASSEMBLING {
            break;
        }
        for _ in 0..MAX_ASSEMBLING_PER_PEER.min(MAX_ASSEMBLING - held.len()) {
            let part = &parts(&meta, 2, id)[0];
            held.push(
                join_over(peer(n), &Carrier::new(), &splits, part, &memory, &admitted)
                    .await
                    .unwrap(),
            );
            id += 1;
        }
    }
    let one_more = &parts(&meta, 2, u128::MAX - 1)[0];
    let e = join_over(
        peer(999),
        &Carrier::new(),
        &splits,
        one_more,
        &memory,
        &admitted,
    )
    .await
    .err()
    .unwrap();
    assert_eq!(e.code, ErrorCode::RESOURCE_EXHAUSTED);
    assert!(e.message.contains("assembled already"), "{}", e.message);
    drop(held);
}

#[tokio::test]
async fn admit_serves_tensors_sent_whole_and_parts_alike() {
    use tensorwire_sink::Landing;
    let memory = MemoryBudget::new("host", 1 << 20);
    let splits = SplitTensors::<HostSink>::new(WITHIN);
    let host = |meta: TensorMeta| {
        let memory = memory.clone();
        async move { HostSink::reserved(memory.try_reserve(meta.byte_len())?) }
    };
    // Sent whole: a sink of its own, handed over as the whole.
    let alone = TensorMeta::new(vec![4], DType::U8)
        .unwrap()
        .with_name("alone");
    let mut sink = splits
        .admit(PEER, &Carrier::new(), &alone, u64::MAX, host)
        .await
        .unwrap();
    let payload = Payload::from(Bytes::from_static(b"abcd"));
    sink.write(0, payload, CreditPermit::unbudgeted(4))
        .await
        .unwrap();
    let Landing::Whole(landed) = sink.finish().await.unwrap() else {
        panic!("a tensor sent whole lands whole");
    };
    assert_eq!((landed.meta, &landed.output[..]), (alone, &b"abcd"[..]));
    // Parts: word of the first, the whole with the second.
    let meta = whole(2);
    let bytes = pattern(meta.byte_len() as usize);
    let planned = plan_split(&meta, 2, SplitId(9)).unwrap();
    let mut landings = Vec::new();
    for part in &planned {
        let mut sink = splits
            .admit(PEER, &Carrier::new(), &part.meta, u64::MAX, host)
            .await
            .unwrap();
        let at = part.offset as usize;
        let mine = &bytes[at..at + part.meta.byte_len() as usize];
        let payload = Payload::from(Bytes::copy_from_slice(mine));
        let permit = CreditPermit::unbudgeted(mine.len() as u64);
        sink.write(0, payload, permit).await.unwrap();
        landings.push(sink.finish().await.unwrap());
    }
    assert!(matches!(landings[0], Landing::Part));
    let Landing::Whole(assembled) = landings.pop().unwrap() else {
        panic!("the last part yields the whole");
    };
    assert_eq!(assembled.meta, meta);
    assert_eq!(&assembled.output[..], &bytes[..]);
    // Malformed split attributes and a whole past the limit are refused with their codes.
    let broken = TensorMeta::new(vec![1, 1000], DType::U8)
        .unwrap()
        .with_attribute(tensorwire_proto::split::SPLIT_ID, "nope");
    let e = splits
        .admit(PEER, &Carrier::new(), &broken, u64::MAX, host)
        .await
        .err()
        .unwrap();
    assert_eq!(e.code, ErrorCode::SPLIT_MISMATCH);
    let e = splits
        .admit(PEER, &Carrier::new(), &planned[0].meta, 1000, host)
        .await
        .err()
        .unwrap();
    assert_eq!(e.code, ErrorCode::TENSOR_TOO_LARGE);
}
