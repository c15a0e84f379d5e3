//! The size-class pool with a host allocator: runs everywhere, so CI tests the pool logic
//! that the pinned and device pools share.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tensorwire_gpu::{Allocation, GpuError, MemoryPool, PoolConfig};

struct HostBlock(Vec<u8>);

impl Allocation for HostBlock {
    fn len(&self) -> usize {
        self.0.len()
    }
}

fn pool(config: PoolConfig) -> (MemoryPool<HostBlock>, Arc<AtomicUsize>) {
    let allocations = Arc::new(AtomicUsize::new(0));
    let counter = allocations.clone();
    let pool = MemoryPool::new("test", config, move |size| {
        counter.fetch_add(1, Ordering::SeqCst);
        Ok(HostBlock(vec![0; size]))
    })
    .unwrap();
    (pool, allocations)
}

#[test]
fn requests_round_up_to_power_of_two_classes() {
    let config = PoolConfig::default();
    assert_eq!(config.size_class(1), Some(64 << 10), "at least min_buffer");
    assert_eq!(config.size_class((64 << 10) + 1), Some(128 << 10));
    assert_eq!(config.size_class(64 << 20), Some(64 << 20));
    assert_eq!(config.size_class((64 << 20) + 1), None, "past max_buffer");
    let (pool, _) = pool(config);
    let buffer = pool.acquire(100_000).unwrap();
    assert_eq!((buffer.len(), buffer.class()), (128 << 10, 128 << 10));
    assert!(matches!(
        pool.acquire(65 << 20),
        Err(GpuError::LargerThanPoolBuffers { .. })
    ));
}

#[test]
fn buffers_come_back_and_are_reused() {
    let (pool, allocations) = pool(PoolConfig::default());
    for _ in 0..1000 {
        let a = pool.acquire(1 << 20).unwrap();
        let b = pool.acquire(1 << 20).unwrap();
        drop((a, b));
    }
    let stats = pool.stats();
    assert_eq!(
        allocations.load(Ordering::SeqCst),
        2,
        "two buffers serve 2000 requests"
    );
    assert_eq!((stats.misses, stats.hits, stats.returns), (2, 1998, 2000));
    assert!(
        stats.hit_rate() >= 0.99,
        "hit rate {} after warm-up",
        stats.hit_rate()
    );
    assert_eq!(
        (
            stats.in_use_buffers,
            stats.in_use_bytes,
            stats.available_buffers
        ),
        (0, 0, 2)
    );
    assert_eq!(stats.pool_bytes, 2 << 20);
}

#[test]
fn the_pool_never_exceeds_its_limit() {
    let mut config = PoolConfig::default();
    config.max_pool_bytes = 4 << 20;
    config.min_buffer = 1 << 20;
    config.max_buffer = 4 << 20;
    config.preallocate = false;
    let (pool, _) = pool(config);
    let held: Vec<_> = (0..4).map(|_| pool.acquire(1 << 20).unwrap()).collect();
    let err = pool.acquire(1 << 20).unwrap_err();
    assert!(
        matches!(err, GpuError::PoolExhausted { requested, in_use, max, .. } if requested == 1 << 20 && in_use == 4 << 20 && max == 4 << 20),
        "{err}"
    );
    drop(held);
    // Free buffers of another class are released to make room.
    let big = pool.acquire(4 << 20).unwrap();
    let stats = pool.stats();
    assert_eq!(
        (stats.drops, stats.pool_bytes, stats.in_use_bytes),
        (4, 4 << 20, 4 << 20)
    );
    drop(big);
    assert_eq!(pool.stats().in_use_buffers, 0);
}

#[test]
fn a_failed_allocation_returns_its_reservation() {
    let pool = MemoryPool::new("failing", PoolConfig::default(), |size| {
        Err::<HostBlock, _>(GpuError::OutOfMemory {
            what: "test",
            bytes: size,
        })
    })
    .unwrap();
    assert!(matches!(pool.acquire(1), Err(GpuError::OutOfMemory { .. })));
    let stats = pool.stats();
    assert_eq!(
        (stats.pool_bytes, stats.in_use_bytes, stats.in_use_buffers),
        (0, 0, 0)
    );
}

#[test]
fn preallocation_fills_the_pool_up_front() {
    let mut config = PoolConfig::default();
    config.max_pool_bytes = 8 << 20;
    config.min_buffer = 1 << 20;
    config.max_buffer = 2 << 20;
    config.preallocate = true;
    let (pool, allocations) = pool(config);
    assert_eq!(
        allocations.load(Ordering::SeqCst),
        8,
        "eight buffers of the smallest class"
    );
    let stats = pool.stats();
    assert_eq!((stats.available_buffers, stats.pool_bytes), (8, 8 << 20));
    let buffers: Vec<_> = (0..8).map(|_| pool.acquire(1 << 20).unwrap()).collect();
    let stats = pool.stats();
    assert_eq!(
        (stats.hits, stats.misses, stats.drops),
        (8, 0, 0),
        "warm from the start"
    );
    drop(buffers);
    assert!(
        MemoryPool::new(
            "bad",
            {
                let mut config = PoolConfig::default();
                config.min_buffer = 0;
                config
            },
            |_| Ok(HostBlock(vec![]))
        )
        .is_err()
    );
}

#[tokio::test]
async fn an_exhausted_pool_makes_acquire_wait_until_a_buffer_returns() {
    let mut config = PoolConfig::default();
    config.max_pool_bytes = 1 << 20;
    config.min_buffer = 1 << 20;
    config.max_buffer = 1 << 20;
    config.preallocate = false;
    let (pool, _) = pool(config);
    let held = pool.acquire(1 << 20).unwrap();
    let waiter = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.acquire_wait(1 << 20).await.map(|b| b.len()) })
    };
    tokio::task::yield_now().await;
    assert!(!waiter.is_finished(), "waits while the only buffer is held");
    drop(held);
    assert_eq!(waiter.await.unwrap().unwrap(), 1 << 20);
}
