// A float32 linear layer for few rows that reads its weights once per call, every output summed in one
// fixed order whatever the number of rows (built and loaded by adaptivespec/fastpath/native.py; called
// through forward.Float32Weight).
//
// pack_f32    w [N, K] float32 -> packed [ceil(N / 16), K, 16] (zero-padded): chunks of 16 outputs, each
//             [K][16], the 16 outputs' weights for one input feature contiguous (two AVX2 registers).
// linear_f32  x [M, K] float32 (unit stride in K), packed, N, bias (float32 [N] or none) -> y [M, N].
//
// Why: MKL's sgemm, which torch's float32 matmul runs, streams a weight at ~13 GB/s for one row on a
// 2-vCPU AMD EPYC (AVX2 or AVX-512), and for 2-16 rows costs 1.8-3x that (2, 3, 6, 7, 10, 11 rows are
// the worst: SmolLM2-135M's lm_head takes 5.3 ms for one row, 25 ms for 2, 37 ms for 3, 17.5 ms for 4):
// a tree of 3 rows cost 3x a plain step, so float32 speculation barely paid (docs/speed.md, *float32*).
// Here a weight block is read from memory once for all rows of a call (up to 6 rows a register group;
// more rows pass over the block again while it is in cache), so a few rows cost about what one does.
// Each output is acc = fma(x[k], w[k], acc) over k in ascending order from 0: the same sequence of
// roundings for a row whether it is alone or one of 16 (a tree's root and plain decoding agree bit for bit).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ADAPTIVESPEC_F32_LINEAR 1
#endif

namespace {

#if defined(ADAPTIVESPEC_F32_LINEAR)

// R rows (1-6) x 16 outputs over every input feature: 12 accumulators at most, named (an array of them
// may be kept in memory), then + bias into y (the chunk's last outputs masked where N ends inside it).
template <int R>
inline void micro(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, int64_t n0, int64_t N,
                  float* y, int64_t ldy) {
#define ADAPTIVESPEC_INIT(r) __m256 a##r##0 = _mm256_setzero_ps(), a##r##1 = _mm256_setzero_ps();
  ADAPTIVESPEC_INIT(0) ADAPTIVESPEC_INIT(1) ADAPTIVESPEC_INIT(2) ADAPTIVESPEC_INIT(3) ADAPTIVESPEC_INIT(4)
  ADAPTIVESPEC_INIT(5)
#undef ADAPTIVESPEC_INIT
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * 16;
    const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
#define ADAPTIVESPEC_ROW(r)                                     \
    {                                                           \
      const __m256 xv = _mm256_broadcast_ss(x + (r) * ldx + k); \
      a##r##0 = _mm256_fmadd_ps(xv, w0, a##r##0);               \
      a##r##1 = _mm256_fmadd_ps(xv, w1, a##r##1);               \
    }
    ADAPTIVESPEC_ROW(0)
    if constexpr (R > 1) ADAPTIVESPEC_ROW(1)
    if constexpr (R > 2) ADAPTIVESPEC_ROW(2)
    if constexpr (R > 3) ADAPTIVESPEC_ROW(3)
    if constexpr (R > 4) ADAPTIVESPEC_ROW(4)
    if constexpr (R > 5) ADAPTIVESPEC_ROW(5)
#undef ADAPTIVESPEC_ROW
  }
  const int64_t valid = std::min<int64_t>(16, N - n0);
  auto put = [&](int r, __m256 lo, __m256 hi) {
    alignas(32) float out[16];
    _mm256_store_ps(out, lo);
    _mm256_store_ps(out + 8, hi);
    float* yr = y + r * ldy + n0;
    for (int64_t j = 0; j < valid; ++j) yr[j] = bias ? out[j] + bias[n0 + j] : out[j];
  };
  put(0, a00, a01);
  if constexpr (R > 1) put(1, a10, a11);
  if constexpr (R > 2) put(2, a20, a21);
  if constexpr (R > 3) put(3, a30, a31);
  if constexpr (R > 4) put(4, a40, a41);
  if constexpr (R > 5) put(5, a50, a51);
}
#endif

bool available() {
#if defined(ADAPTIVESPEC_F32_LINEAR)
  return true;
#else
  return false;
#endif
}

at::Tensor pack_f32(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "pack_f32: w [N, K] float32");
  const int64_t N = w.size(0), K = w.size(1), C = (N + 15) / 16;
  auto padded = at::constant_pad_nd(w, {0, 0, 0, C * 16 - N});              // [C * 16, K]
  return padded.view({C, 16, K}).transpose(1, 2).contiguous();             // [C, K, 16]
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(available(), "linear_f32: built without AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear_f32: x [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 16 && packed.scalar_type() == at::kFloat && packed.is_contiguous(),
              "linear_f32: packed weight");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.size(1) == K && packed.size(0) == (N + 15) / 16, "linear_f32: x's features or N disagree with the weight");
  at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor b;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "linear_f32: bias [N]");
    bp = b.data_ptr<float>();
  }
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
#if defined(ADAPTIVESPEC_F32_LINEAR)
  const float* xp = xc.data_ptr<float>();
  const int64_t ldx = xc.stride(0);
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t C = packed.size(0);
  // tasks: chunks of 16 outputs; every row of the call passes over a chunk while it is in cache
  at::parallel_for(0, C, 1, [&](int64_t b0, int64_t e0) {
    for (int64_t c = b0; c < e0; ++c) {
      const float* wc = wp + c * K * 16;
      for (int64_t r = 0; r < M; r += 6) {
        const float* xr = xp + r * ldx;
        float* yr = yp + r * N;
        switch (std::min<int64_t>(6, M - r)) {
          case 6: micro<6>(xr, ldx, wc, K, bp, c * 16, N, yr, N); break;
          case 5: micro<5>(xr, ldx, wc, K, bp, c * 16, N, yr, N); break;
          case 4: micro<4>(xr, ldx, wc, K, bp, c * 16, N, yr, N); break;
          case 3: micro<3>(xr, ldx, wc, K, bp, c * 16, N, yr, N); break;
          case 2: micro<2>(xr, ldx, wc, K, bp, c * 16, N, yr, N); break;
          default: micro<1>(xr, ldx, wc, K, bp, c * 16, N, yr, N); break;
        }
      }
    }
  });
#endif
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether the kernel was built (AVX2 + FMA)");
  m.def("pack_f32", &pack_f32, "a [N, K] float32 weight in linear_f32's layout");
  m.def("linear_f32", &linear_f32, "x @ w.T (+ bias) in float32 for few rows, each output summed in one fixed order");
}
