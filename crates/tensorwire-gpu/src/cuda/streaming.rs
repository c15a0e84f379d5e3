//! Copies into staging with streaming (non-temporal) stores.
//!
//! Staging is read by the GPU's copy engine, never by this CPU: an ordinary store first reads
//! each line into the cache (a read for ownership) and then takes a cache line from the
//! connection's own working set. Streaming stores do neither, so a receiving process spends
//! less CPU per byte (benches/results/LOG.md). They also cap one thread's copy rate, so copies
//! from memory (ingest, without a checksum) keep ordinary stores.

/// Copies `src` into `dst` (the same length) with streaming stores where `dst` is 16-byte
/// aligned, and makes them visible to the device before it returns.
pub(crate) fn stream_into(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "stream_into: lengths differ");
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        const LANE: usize = std::mem::size_of::<__m128i>();
        let head = dst.as_ptr().align_offset(LANE).min(dst.len());
        let body = (dst.len() - head) / LANE * LANE;
        let (dst_head, rest) = dst.split_at_mut(head);
        let (dst_body, dst_tail) = rest.split_at_mut(body);
        let (src_head, rest) = src.split_at(head);
        let (src_body, src_tail) = rest.split_at(body);
        dst_head.copy_from_slice(src_head);
        for (to, from) in dst_body
            .chunks_exact_mut(LANE)
            .zip(src_body.chunks_exact(LANE))
        {
            // SAFETY: SSE2 is part of x86-64. `from` is 16 readable bytes (an unaligned load
            // is allowed); `to` is 16 writable bytes at a 16-byte-aligned address (`head`
            // aligned the body's start and every lane is 16 bytes), as the store requires.
            unsafe {
                let lane = _mm_loadu_si128(from.as_ptr().cast::<__m128i>());
                _mm_stream_si128(to.as_mut_ptr().cast::<__m128i>(), lane);
            }
        }
        dst_tail.copy_from_slice(src_tail);
        // SAFETY: SSE2 is part of x86-64; the fence orders the streaming stores above before
        // the copy that the caller starts next reads them.
        unsafe { _mm_sfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

#[cfg(test)]
mod tests {
    use super::stream_into;

    #[test]
    fn every_alignment_and_length_copies_exactly() {
        let src: Vec<u8> = (0..300u32).map(|i| (i * 7 + 1) as u8).collect();
        let mut dst = vec![0u8; 320];
        for start in 0..17 {
            for len in [0, 1, 15, 16, 17, 31, 32, 63, 64, 65, 100, 255, 300 - 17] {
                dst.fill(0);
                stream_into(&mut dst[start..start + len], &src[..len]);
                assert_eq!(
                    &dst[start..start + len],
                    &src[..len],
                    "at {start}, {len} bytes"
                );
                assert!(dst[..start].iter().all(|&b| b == 0), "before {start}");
                assert!(
                    dst[start + len..].iter().all(|&b| b == 0),
                    "after {start}+{len}"
                );
            }
        }
    }
}
