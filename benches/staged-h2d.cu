// Ingest from memory's data path in plain CUDA C, without tensorwire: THREADS host threads
// fill 4 MiB pinned staging buffers (a ring of its own each, 128 MiB in all) from 1 MiB pieces
// of a 64 MiB source and copy each to device memory, for two seconds; or an SM copy kernel
// reads the staging buffer instead of the copy engine. A cross-check of `bench --gpu`'s
// "staging and device copies without the sink" anchor, runnable on a GPU host without Rust.
//
//   nvcc -O3 -arch=sm_90 -o staged-h2d benches/staged-h2d.cu -lpthread
//   ./staged-h2d MODE THREADS CPU_COPY PER_THREAD_STREAMS [BLOCKS THREADS_PER_BLOCK]
//
// MODE: ce (copy engine, cudaMemcpyAsync) or kernel; CPU_COPY 0 leaves the staging buffers
// as they are (the GPU side alone); PER_THREAD_STREAMS 0 shares one stream under a lock.
// Prints GB/s moved to the device, and the threads' copy rate and time spent waiting.
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#include <atomic>
#include <mutex>
#include <chrono>
#define CK(x) do { cudaError_t ck_ = (x); if (ck_ != cudaSuccess) { fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(ck_)); exit(1);} } while (0)

__global__ void copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
  size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a; dst[i + stride] = b; dst[i + 2 * stride] = c; dst[i + 3 * stride] = d;
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

const size_t BUF = 4 << 20;
const size_t POOL = 128 << 20;
const size_t SRC = 64 << 20;
const size_t DST = 1ull << 30;

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "ce";      // ce | kernel
  int threads = argc > 2 ? atoi(argv[2]) : 8;        // CPU threads filling staging
  int cpu_copy = argc > 3 ? atoi(argv[3]) : 1;       // 0: GPU only
  int streams_per_thread = argc > 4 ? atoi(argv[4]) : 0; // 0: one shared stream
  int blocks = argc > 5 ? atoi(argv[5]) : 264;
  int tpb = argc > 6 ? atoi(argv[6]) : 512;
  double secs = 2.0;
  bool kernel = strcmp(mode, "kernel") == 0;
  CK(cudaSetDevice(0));
  char* pool; CK(cudaHostAlloc((void**)&pool, POOL, cudaHostAllocDefault));
  memset(pool, 1, POOL);
  char* dst; CK(cudaMalloc((void**)&dst, DST));
  std::vector<char> src(SRC); for (size_t i = 0; i < SRC; i++) src[i] = (char)(i * 7);
  cudaStream_t shared; CK(cudaStreamCreateWithFlags(&shared, cudaStreamNonBlocking));
  std::mutex launch;
  int per = (int)(POOL / BUF) / threads; if (per < 1) per = 1;
  std::atomic<bool> stop{false};
  std::vector<size_t> moved(threads, 0);
  std::vector<double> copy_s(threads, 0), wait_s(threads, 0);
  using clk = std::chrono::steady_clock;
  // warm-up
  copy_kernel<<<blocks, tpb, 0, shared>>>((const uint4*)pool, (uint4*)dst, BUF / 16);
  CK(cudaMemcpyAsync(dst, pool, BUF, cudaMemcpyHostToDevice, shared));
  CK(cudaStreamSynchronize(shared));
  auto started = std::chrono::steady_clock::now();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; t++) ts.emplace_back([&, t] {
    cudaStream_t s = shared;
    if (streams_per_thread) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::vector<cudaEvent_t> ev(per);
    std::vector<bool> used(per, false);
    for (auto& e : ev) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    size_t k = 0, from = (size_t)t * 7 * (1 << 20);
    while (!stop.load(std::memory_order_relaxed)) {
      int b = (int)(k % per);
      char* stage = pool + ((size_t)t * per + b) * BUF;
      auto w0 = clk::now();
      if (used[b]) CK(cudaEventSynchronize(ev[b]));
      auto c0 = clk::now();
      wait_s[t] += std::chrono::duration<double>(c0 - w0).count();
      if (cpu_copy) {
        for (size_t at = 0; at < BUF; at += 1 << 20) {
          memcpy(stage + at, src.data() + (from % SRC), 1 << 20);
          from += 1 << 20;
        }
      }
      copy_s[t] += std::chrono::duration<double>(clk::now() - c0).count();
      char* to = dst + ((k * threads + t) * BUF) % DST;
      {
        std::unique_lock<std::mutex> g(launch, std::defer_lock);
        if (!streams_per_thread) g.lock();
        if (kernel) copy_kernel<<<blocks, tpb, 0, s>>>((const uint4*)stage, (uint4*)to, BUF / 16);
        else CK(cudaMemcpyAsync(to, stage, BUF, cudaMemcpyHostToDevice, s));
        CK(cudaEventRecord(ev[b], s));
      }
      used[b] = true;
      moved[t] += BUF;
      k++;
    }
    for (int b = 0; b < per; b++) if (used[b]) CK(cudaEventSynchronize(ev[b]));
  });
  std::this_thread::sleep_for(std::chrono::duration<double>(secs));
  stop = true;
  for (auto& th : ts) th.join();
  double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  size_t total = 0; for (auto m : moved) total += m;
  double cs = 0, ws = 0; for (int t = 0; t < threads; t++) { cs += copy_s[t]; ws += wait_s[t]; }
  printf("  C probe: copy %.2f GB/s per busy second, copy time %.3f s, wait %.3f s\n", total / cs / 1e9, cs, ws);
  CK(cudaGetLastError());
  printf("%-6s threads=%2d cpu_copy=%d streams=%s blocks=%d tpb=%d: %.1f GB/s\n", mode, threads, cpu_copy,
         streams_per_thread ? "per-thread" : "shared", blocks, tpb, total / el / 1e9);
  return 0;
}
