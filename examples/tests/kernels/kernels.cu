// Kernels the remote-execution tests run. Generated files, from this directory:
//
//     nvcc -ptx -arch=compute_75 -o kernels.ptx kernels.cu
//     nvcc -cubin -arch=sm_80 -o kernels_sm80.cubin kernels.cu
//     nvcc -cubin -arch=sm_90 -o kernels_sm90.cubin kernels.cu

// out[i] = in[i] + delta.
extern "C" __global__ void add(const float* in, float* out, float delta, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = in[i] + delta;
}

// Writes a terabyte past its output: an illegal address.
extern "C" __global__ void write_far(float* out) {
    out[(1ull << 40) / sizeof(float)] = 1.0f;
}

// Spins until *flag is non-zero; the server zeroes outputs, so it never ends.
extern "C" __global__ void spin(volatile int* flag) {
    while (*flag == 0) {
    }
}
