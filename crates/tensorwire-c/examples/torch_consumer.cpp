// A C++ consumer that wraps tensors a tensorwire receiver shares as LibTorch tensors with no
// copy (torch::from_blob over the shared host or GPU memory), the way a C++ inference
// process takes weights another process received.
//
//   torch_consumer SOCKET NAME...
//
// For each NAME (waiting up to 10 s for it): prints its dtype, shape, device and the sum of
// its bytes computed by LibTorch where the tensor lives. Build against the LibTorch of the
// PyTorch that python3 imports (a virtual environment's too), after
// `cargo build --release -p tensorwire-c`:
//
//   make -C crates/tensorwire-c/examples torch_consumer      # or PYTHON=.venv/bin/python
//
// (its flags come from torch_flags.py: the C++ standard and ABI PyTorch needs, its paths).
#include <torch/torch.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tensorwire.h"

namespace {

torch::Dtype torch_dtype(const std::string& name) {
    static const std::map<std::string, torch::Dtype> types = {
        {"BOOL", torch::kBool}, {"U8", torch::kUInt8},    {"I8", torch::kInt8},
        {"I16", torch::kInt16}, {"I32", torch::kInt32},   {"I64", torch::kInt64},
        {"F16", torch::kHalf},  {"BF16", torch::kBFloat16}, {"F32", torch::kFloat},
        {"F64", torch::kDouble},
    };
    auto found = types.find(name);
    // Types LibTorch has no name for (FP8, unsigned 16/32/64) are viewed as bytes.
    return found == types.end() ? torch::kUInt8 : found->second;
}

struct Release {
    void operator()(tw_tensor* t) const { tw_tensor_release(t); }
};

}  // namespace

int main(int argc, char** argv) {
    if (argc < 3) {
        std::fprintf(stderr, "usage: %s SOCKET NAME...\n", argv[0]);
        return 2;
    }
    tw_client* client = nullptr;
    if (tw_connect(argv[1], &client) != TW_OK) {
        std::fprintf(stderr, "connect: %s\n", tw_last_error());
        return 1;
    }
    int status = 0;
    for (int i = 2; i < argc; i++) {
        tw_tensor* raw = nullptr;
        if (tw_open(client, argv[i], 10000, &raw) != TW_OK) {
            std::fprintf(stderr, "open %s: %s\n", argv[i], tw_last_error());
            status = 1;
            continue;
        }
        std::unique_ptr<tw_tensor, Release> lease(raw);
        std::vector<int64_t> shape(tw_tensor_shape(raw), tw_tensor_shape(raw) + tw_tensor_ndim(raw));
        int64_t bytes = static_cast<int64_t>(tw_tensor_byte_len(raw));
        int ordinal = tw_tensor_device_ordinal(raw);
        void* data = ordinal < 0 ? tw_tensor_host_ptr(raw)
                                 : reinterpret_cast<void*>(tw_tensor_device_ptr(raw));
        auto where = ordinal < 0 ? torch::TensorOptions().device(torch::kCPU)
                                 : torch::TensorOptions().device(torch::kCUDA, ordinal);
        std::string dtype = tw_tensor_dtype(raw);
        torch::Dtype type = torch_dtype(dtype);
        // The lease keeps the memory mapped; the tensors must not outlive it (no deleter).
        torch::Tensor typed = type == torch::kUInt8 && dtype != "U8"
                                  ? torch::from_blob(data, {bytes}, where.dtype(type))
                                  : torch::from_blob(data, shape, where.dtype(type));
        torch::Tensor as_bytes = torch::from_blob(data, {bytes}, where.dtype(torch::kUInt8));
        int64_t sum = as_bytes.sum(torch::kInt64).item<int64_t>();
        std::printf("%s %s %s on %s: byte sum %lld\n", tw_tensor_name(raw), dtype.c_str(),
                    c10::str(typed.sizes()).c_str(), c10::str(typed.device()).c_str(),
                    static_cast<long long>(sum));
    }
    tw_client_close(client);
    return status;
}
