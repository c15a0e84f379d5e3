// y = A·x for a sparse matrix A in CSR form (F32 values, I32 column indices and row
// pointers): one thread per row. The walkthrough in the README sends this kernel's PTX with
// its inputs to `receiver --allow-exec` and checks y against a CPU reference.
//
// spmv.ptx is generated from this file with (CUDA 12 or 13; compute_75 PTX is compiled by
// the driver for any newer GPU when it is loaded):
//
//     nvcc -ptx -arch=compute_75 -o spmv.ptx spmv.cu

extern "C" __global__ void spmv_csr(const float* values, const int* col_indices,
                                    const int* row_ptr, const float* x, float* y, int rows) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row < rows) {
        float sum = 0.0f;
        for (int j = row_ptr[row]; j < row_ptr[row + 1]; ++j) {
            sum += values[j] * x[col_indices[j]];
        }
        y[row] = sum;
    }
}
