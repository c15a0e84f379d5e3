//! Received datagrams in pinned memory (`PinnedDatagrams` as this binary's allocator): a
//! GPU receiver copies payloads to the device straight from quinn's buffers. Without a GPU
//! the region is never pinned and every allocation is the wrapped allocator's.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::alloc::System;

use bytes::Bytes;
use tensorwire_gpu::{GpuSinkFactory, PinnedDatagrams, gpus_or_skip, pinned_datagram_stats};
use tensorwire_proto::testing::pattern as random;
use tensorwire_proto::{DType, TensorMeta};
use tensorwire_quic::{Receiver, ReceiverConfig, Sender, SenderConfig, TransportSettings};

#[global_allocator]
static ALLOCATOR: PinnedDatagrams<System> = PinnedDatagrams::new(System).with_capacity_mib(64);

#[test]
fn without_a_gpu_receiver_nothing_is_lent() {
    // Allocations of a datagram's size, before any receiver pinned the region here (this
    // test binary's other test may have, on a GPU host).
    let before = pinned_datagram_stats();
    let blocks: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8; 65_507]).collect();
    assert!(blocks.iter().enumerate().all(|(i, b)| b[1000] == i as u8));
    drop(blocks);
    if before.capacity == 0 {
        assert_eq!(pinned_datagram_stats(), before, "no region, no slots");
    }
}

/// Tensors over loopback QUIC land byte-exact with their payloads copied from the
/// pinned datagrams (through staging, any that found the region full); the slots, staging
/// buffers and credit all come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn payloads_are_copied_to_the_device_from_the_datagrams_they_arrived_in() {
    let Some(_) =
        gpus_or_skip("payloads_are_copied_to_the_device_from_the_datagrams_they_arrived_in")
    else {
        return;
    };
    land_over(TransportSettings::jumbo(), 1000).await;
    // 6000-byte packets, which GRO may gather into pinned datagrams: pieces too short to
    // copy alone go through staging, and land as well.
    land_over(TransportSettings::default().fixed_mtu(6000), 0).await;
    zeroed_slots_are_zero();
    a_forked_child_allocates_outside_the_region();
}

/// Slots that held datagrams are lent again zeroed where zeroed memory is asked for.
fn zeroed_slots_are_zero() {
    let before = pinned_datagram_stats().served;
    let blocks: Vec<Vec<u8>> = (0..64).map(|_| vec![0u8; 40_000]).collect();
    assert!(
        pinned_datagram_stats().served >= before + 64,
        "lent from the region"
    );
    assert!(
        blocks.iter().all(|b| b.iter().all(|&x| x == 0)),
        "not zeroed"
    );
}

/// The region is the parent's: in a forked child (a Python process's workers, say) an
/// allocation of a datagram's size comes from the wrapped allocator. Without the fork
/// handler, the child was lent a slot (H200, driver 580.159.04), and this test failed.
#[allow(
    unsafe_code,
    reason = "fork, _exit and waitpid: the test is about a forked child"
)]
fn a_forked_child_allocates_outside_the_region() {
    let opened = pinned_datagram_stats();
    assert!(opened.capacity > 0, "the region is open in the parent");
    // SAFETY: the child only allocates (glibc's allocator is usable after fork), reads
    // atomics and calls `_exit`; the parent waits for it.
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork failed");
    if child == 0 {
        let before = pinned_datagram_stats().served;
        let block = vec![7u8; 32 << 10];
        let lent = pinned_datagram_stats().served != before;
        let code = if !lent && block[(32 << 10) - 1] == 7 {
            0
        } else {
            3
        };
        // SAFETY: ends the child without running the parent's destructors or runtime.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: `child` is this process's child; `status` is a valid place for its status.
    let waited = unsafe { libc::waitpid(child, &mut status, 0) };
    assert_eq!(waited, child);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the forked child was lent a slot of the parent's region (wait status {status:#x})"
    );
}

/// One receiver and sender over `transport`, at least `min_pinned` datagrams received into
/// pinned memory: see the test above.
async fn land_over(transport: TransportSettings, min_pinned: u64) {
    let gpu = GpuSinkFactory::with_defaults(0).unwrap();
    let pinned = pinned_datagram_stats();
    assert_eq!(pinned.capacity, 64 << 20, "the receiver pinned the region");
    let mut config = ReceiverConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        tensorwire_quic::ServerTls::Development,
    )
    .with_budget(256 << 20);
    config.transport = transport.clone();
    let mut receiver = Receiver::bind(config).await.unwrap();
    let addr = receiver.local_addr().unwrap();
    // Not multiples of a datagram or of staging; the last larger than the whole region.
    let lens = [(9 << 20) + 333, 3 << 20, (97 << 20) + 5];
    let tensors: Vec<Vec<u8>> = lens
        .iter()
        .enumerate()
        .map(|(i, &len)| random(len, 40 + i as u64))
        .collect();
    let server = tokio::spawn({
        let gpu = gpu.clone();
        async move {
            let mut landed = Vec::new();
            for _ in 0..lens.len() {
                let incoming = receiver.next().await.unwrap();
                let mut sink = gpu.sink(incoming.meta()).unwrap();
                sink.poison(0xAB).unwrap();
                landed.push(incoming.accept(sink).finished().await.unwrap().1);
            }
            (landed, receiver)
        }
    });
    let mut config = SenderConfig::new(tensorwire_quic::ClientTls::Development);
    config.transport = transport;
    let sender = Sender::connect(addr, config).await.unwrap();
    for (i, data) in tensors.iter().enumerate() {
        let meta = TensorMeta::new([data.len() as u64], DType::U8)
            .unwrap()
            .with_name(format!("t{i}"));
        sender
            .send(meta, Bytes::from(data.clone()))
            .finished()
            .await
            .unwrap();
    }
    let (landed, receiver) = server.await.unwrap();
    for (i, (buffer, data)) in landed.into_iter().zip(&tensors).enumerate() {
        assert!(
            buffer.copy_to_host().unwrap() == *data,
            "t{i}: bytes differ"
        );
    }
    let after = pinned_datagram_stats();
    assert!(
        after.served >= pinned.served + min_pinned,
        "payloads arrived in pinned datagrams: {after:?}"
    );
    assert!(
        after.reached <= after.capacity && (after.served == 0) == (after.reached == 0),
        "how far the region was used: {after:?}"
    );
    let budget = receiver.budget();
    assert_eq!(
        (budget.in_flight - budget.early_offered, budget.held),
        (0, 0),
        "credit back after the copies"
    );
    assert_eq!(gpu.staging_stats().in_use_buffers, 0, "staging all free");
    sender.close().await;
    receiver.close().await;
    // The endpoints' threads let go of their last datagrams as they wind down.
    let mut closed = pinned_datagram_stats();
    for _ in 0..200 {
        if closed.lent <= pinned.lent {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        closed = pinned_datagram_stats();
    }
    assert!(
        closed.lent <= pinned.lent,
        "slots lent before {}, after closing {}",
        pinned.lent,
        closed.lent
    );
}
