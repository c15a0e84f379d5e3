// A C++ producer that shares a LibTorch CUDA tensor with local processes with no copy: the
// memory PyTorch's own caching allocator made, as a C++ inference or training process holds
// its weights. Consumers (Python's tensorwire_ipc, the C and LibTorch consumers,
// tensorwire-share) map it and see each other's writes.
//
//   torch_producer SOCKET NAME [SECONDS]
//
// Shares NAME, F32 [256, 256] counting up from 4096 (a slice inside a larger allocation),
// prints "published NAME generation 1", then waits up to SECONDS (default 60) for a
// consumer to double it in place, printing "consumer write seen" (exit 0) or timing out
// (exit 1). Build with the Makefile beside it (`make torch_producer`), which takes its
// flags from the PyTorch that python3 imports (torch_flags.py).
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "tensorwire.h"

namespace {

// The library calls this once nothing uses the shared memory any more.
void release_tensor(void* context) { delete static_cast<torch::Tensor*>(context); }

}  // namespace

int main(int argc, char** argv) {
    if (argc < 3) {
        std::fprintf(stderr, "usage: %s SOCKET NAME [SECONDS]\n", argv[0]);
        return 2;
    }
    const int seconds = argc > 3 ? std::atoi(argv[3]) : 60;
    tw_share* share = nullptr;
    if (tw_share_start(argv[1], nullptr, &share) != TW_OK) {
        std::fprintf(stderr, "tw_share_start: %s\n", tw_last_error());
        return 1;
    }
    auto options = torch::dtype(torch::kFloat32).device(torch::kCUDA, 0);
    torch::Tensor whole = torch::arange(1 << 20, options);
    torch::Tensor weights = whole.slice(0, 4096, 4096 + 65536).view({256, 256});
    torch::cuda::synchronize();  // consumers read the memory as it is once published
    // The library holds this handle (keeping PyTorch's memory allocated) until it releases it.
    auto* lent = new torch::Tensor(weights);
    uint64_t shape[2] = {256, 256};
    const char* attributes[] = {"producer", "torch_producer", "layout", "row-major"};
    uint64_t generation = 0;
    int published = tw_share_publish_device(
        share, argv[2], "F32", shape, 2, attributes, 2,
        reinterpret_cast<uint64_t>(weights.data_ptr()),
        weights.nbytes(), weights.device().index(), release_tensor, lent, &generation);
    if (published != TW_OK) {
        std::fprintf(stderr, "tw_share_publish_device: %s\n", tw_last_error());
        tw_share_stop(share);
        return 1;
    }
    std::printf("published %s generation %llu\n", argv[2],
                static_cast<unsigned long long>(generation));
    std::fflush(stdout);
    const float doubled = 2.0f * 4096.0f;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
    int status = 1;
    while (std::chrono::steady_clock::now() < deadline) {
        if (weights[0][0].item<float>() == doubled) {
            std::printf("consumer write seen: [0][0] = %.1f, [255][255] = %.1f\n",
                        weights[0][0].item<float>(), weights[255][255].item<float>());
            status = 0;
            break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (status != 0) std::fprintf(stderr, "no consumer doubled %s within %d s\n", argv[2], seconds);
    tw_share_stop(share);
    return status;
}
