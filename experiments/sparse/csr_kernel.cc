// CSR times dense (cols, batch) for XLA:CPU, as an XLA FFI custom call.
//
// out[i, :] = sum_k data[k] * x[indices[k], :] over k in [indptr[i], indptr[i+1]).
// The sums run in float64 in the order SciPy's csr_matvec/csr_matvecs use
// (row by row, nonzeros in storage order, no FMA: build with
// -ffp-contract=off), so the results equal SciPy's bit for bit. Rows are split
// into blocks of about equal nonzero count over XLA's intra-op thread pool
// when the work (nonzeros x batch) is at least `min_work`.
//
// Built by experiments/sparse/host_csr.py (g++ -O3 -shared); nothing else uses it.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Columns [c, c + W) of row i: the W accumulators stay in registers.
template <int W, typename T>
inline void Chunk(const int32_t* indptr, const int32_t* indices, const double* data,
                  const T* x, T* out, int64_t batch, int64_t c, int64_t i) {
  double acc[W] = {};
  for (int32_t k = indptr[i]; k < indptr[i + 1]; ++k) {
    const double a = data[k];
    const T* xr = x + static_cast<int64_t>(indices[k]) * batch + c;
    for (int b = 0; b < W; ++b) acc[b] += a * static_cast<double>(xr[b]);
  }
  T* o = out + i * batch + c;
  for (int b = 0; b < W; ++b) o[b] = static_cast<T>(acc[b]);
}

template <typename T>
void Rows(const int32_t* indptr, const int32_t* indices, const double* data,
          const T* x, T* out, int64_t batch, int64_t r0, int64_t r1) {
  for (int64_t i = r0; i < r1; ++i) {
    int64_t c = 0;
    for (; c + 16 <= batch; c += 16) Chunk<16>(indptr, indices, data, x, out, batch, c, i);
    if (c + 8 <= batch) Chunk<8>(indptr, indices, data, x, out, batch, c, i), c += 8;
    if (c + 4 <= batch) Chunk<4>(indptr, indices, data, x, out, batch, c, i), c += 4;
    if (c + 2 <= batch) Chunk<2>(indptr, indices, data, x, out, batch, c, i), c += 2;
    if (c < batch) Chunk<1>(indptr, indices, data, x, out, batch, c, i);
  }
}

// Blocks are claimed from a shared counter by the caller and by the tasks it
// schedules; the caller waits only for blocks already claimed, so it never
// waits for a pool thread that is busy elsewhere. Late tasks find no block
// left and return without touching the buffers.
template <typename T>
struct Job {
  const int32_t* indptr;
  const int32_t* indices;
  const double* data;
  const T* x;
  T* out;
  int64_t batch;
  std::vector<int64_t> cuts;  // row boundaries of the blocks
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  int64_t blocks() const { return static_cast<int64_t>(cuts.size()) - 1; }
  void Work() {
    for (int64_t b; (b = next.fetch_add(1)) < blocks();) {
      Rows(indptr, indices, data, x, out, batch, cuts[b], cuts[b + 1]);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <ffi::DataType DT>
ffi::Error Spmm(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> indptr,
                ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::F64> data,
                ffi::Buffer<DT> x, ffi::ResultBuffer<DT> out, int64_t min_work) {
  using T = ffi::NativeType<DT>;
  const int64_t rows = static_cast<int64_t>(indptr.element_count()) - 1;
  const int64_t out_size = static_cast<int64_t>(out->element_count());
  if (rows < 0 || (rows > 0 && out_size % rows != 0)) {
    return ffi::Error::InvalidArgument("csr_spmm: output does not match indptr");
  }
  const int64_t batch = rows > 0 ? out_size / rows : 1;
  const int32_t* ip = indptr.typed_data();
  const int64_t nnz = rows > 0 ? ip[rows] : 0;

  int64_t blocks = 1;
  if (min_work > 0 && nnz * batch >= min_work) {
    blocks = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), nnz * batch / min_work));
  }
  if (blocks == 1) {
    Rows(ip, indices.typed_data(), data.typed_data(), x.typed_data(), out->typed_data(),
         batch, 0, rows);
    return ffi::Error::Success();
  }
  auto job = std::make_shared<Job<T>>();
  job->indptr = ip;
  job->indices = indices.typed_data();
  job->data = data.typed_data();
  job->x = x.typed_data();
  job->out = out->typed_data();
  job->batch = batch;
  job->cuts.push_back(0);
  for (int64_t b = 1; b < blocks; ++b) {  // equal nonzero counts
    const int64_t target = nnz * b / blocks;
    job->cuts.push_back(std::upper_bound(ip, ip + rows + 1, target) - ip - 1);
  }
  job->cuts.push_back(rows);
  for (int64_t b = 1; b < blocks; ++b) pool.Schedule([job] { job->Work(); });
  job->Work();
  while (job->done.load(std::memory_order_acquire) < job->blocks()) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

#define HDM_CSR_HANDLER(name, DT)                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, Spmm<DT>,          \
                                ffi::Ffi::Bind()         \
                                    .Ctx<ffi::ThreadPool>() \
                                    .Arg<ffi::Buffer<ffi::S32>>() \
                                    .Arg<ffi::Buffer<ffi::S32>>() \
                                    .Arg<ffi::Buffer<ffi::F64>>() \
                                    .Arg<ffi::Buffer<DT>>()       \
                                    .Ret<ffi::Buffer<DT>>()       \
                                    .Attr<int64_t>("min_work"));

HDM_CSR_HANDLER(HdmCsrSpmmF64, ffi::F64)
HDM_CSR_HANDLER(HdmCsrSpmmF32, ffi::F32)
