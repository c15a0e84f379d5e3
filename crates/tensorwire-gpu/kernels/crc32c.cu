// CRC-32C (Castagnoli, reflected, init and final XOR 0xFFFFFFFF: spec §5.3) of device memory,
// for a GPU receiver that checks a tensor's checksum over its landed bytes (spec §7.3).
//
// Each thread checksums one chunk of `chunk` bytes (the last may be shorter) with
// slicing-by-8 tables in shared memory and writes the chunk's CRC-32C to `out[i]`; the host
// combines the chunks' CRCs (crc(A ‖ B) = crc(A) · x^(8·len(B)) mod P ⊕ crc(B)).
//
// The PTX beside this file is what the crate loads; scripts/build-kernels.sh regenerates it.

extern "C" __global__ void tensorwire_crc32c_chunks(
    const unsigned char* __restrict__ data,
    unsigned long long len,
    unsigned long long chunk,
    unsigned int* __restrict__ out,
    unsigned long long chunks)
{
    __shared__ unsigned int table[8][256];
    for (unsigned int i = threadIdx.x; i < 256; i += blockDim.x) {
        unsigned int c = i;
        for (int k = 0; k < 8; k++) {
            c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        }
        table[0][i] = c;
    }
    __syncthreads();
    for (unsigned int i = threadIdx.x; i < 256; i += blockDim.x) {
        unsigned int c = table[0][i];
        for (int s = 1; s < 8; s++) {
            c = (c >> 8) ^ table[0][c & 0xffu];
            table[s][i] = c;
        }
    }
    __syncthreads();

    unsigned long long index = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (index >= chunks) {
        return;
    }
    unsigned long long start = index * chunk;
    unsigned long long end = start + chunk < len ? start + chunk : len;
    const unsigned char* p = data + start;
    unsigned long long n = end - start;
    unsigned int crc = 0xFFFFFFFFu;
    // Bytes up to the first 16-byte boundary, one at a time.
    while (n != 0 && (((unsigned long long)p) & 15u) != 0) {
        crc = (crc >> 8) ^ table[0][(crc ^ *p) & 0xffu];
        p++;
        n--;
    }
    const uint4* q = (const uint4*)p;
    for (; n >= 16; n -= 16) {
        uint4 v = __ldg(q);
        q++;
        unsigned int a = crc ^ v.x;
        unsigned int b = v.y;
        crc = table[7][a & 0xffu] ^ table[6][(a >> 8) & 0xffu] ^ table[5][(a >> 16) & 0xffu]
            ^ table[4][a >> 24] ^ table[3][b & 0xffu] ^ table[2][(b >> 8) & 0xffu]
            ^ table[1][(b >> 16) & 0xffu] ^ table[0][b >> 24];
        a = crc ^ v.z;
        b = v.w;
        crc = table[7][a & 0xffu] ^ table[6][(a >> 8) & 0xffu] ^ table[5][(a >> 16) & 0xffu]
            ^ table[4][a >> 24] ^ table[3][b & 0xffu] ^ table[2][(b >> 8) & 0xffu]
            ^ table[1][(b >> 16) & 0xffu] ^ table[0][b >> 24];
    }
    p = (const unsigned char*)q;
    for (; n != 0; n--) {
        crc = (crc >> 8) ^ table[0][(crc ^ *p) & 0xffu];
        p++;
    }
    out[index] = crc ^ 0xFFFFFFFFu;
}
