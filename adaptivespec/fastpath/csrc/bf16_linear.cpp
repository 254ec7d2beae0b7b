// A bfloat16 linear layer whose every output is summed in one fixed order, whatever the number of rows
// (built and loaded by adaptivespec/fastpath/native.py; called through prepack.BF16Weight).
//
// pack_linear  w [N, K] bf16 -> packed [4 ceil(N / 64), ceil(K / 2), 16] int32 (zero-padded), chunks of 64 outputs, each
//              [K / 2][64]: 64 outputs' weights for two input features, one pair per 32-bit lane (the layout VDPBF16PS reads).
// linear_bf16  x [M, K] bf16 (unit stride in K), packed, N, bias (float32 [N] or none) -> y [M, N] bf16.
//
// Why: oneDNN's bf16 matmul picks its blocking (and with it the order of a row's sums) by the number of
// rows: on a 2-vCPU AMD EPYC, SmolLM2's down projection (K = 1536) gives a row different last bits
// when it is row 12 of a call than when it runs alone, so a token's logits depend on what is decoded
// beside it. Here each output is acc = sum over k in order, one VDPBF16PS per input pair (the odd
// feature's product added first, then the even one's: two float32 roundings, exact bf16 products),
// from the row's own features only; how many rows a call has decides how they are tiled, never how
// an output is summed. Rows come 6 at a time against 4 blocks of 16 outputs (24 accumulators), the
// inputs in blocks of 96 (the weights' block stays in L1 for every row group of a task).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define ADAPTIVESPEC_BF16_LINEAR 1
#endif

namespace {

#if defined(ADAPTIVESPEC_BF16_LINEAR)

// R rows (1-6) x 64 outputs (4 blocks of 16) over input pairs [k0, k1); x rows `ldx` 32-bit words apart.
// The 24 accumulators are named registers (an array of them was kept in memory by the compiler). They
// start from acc [R][64] (float32: the sums of the pairs before k0, stored exactly) unless `first`, and
// end there, or, with `last`, + bias rounded to bf16 into y: one output's sum is the same sequence of
// roundings however the pairs are cut into blocks.
template <int R>
inline void micro(const uint32_t* x, int64_t ldx, const uint32_t* w, int64_t k0, int64_t k1, float* acc, bool first,
                  bool last, const float* bias, int64_t n0, int64_t N, uint16_t* y, int64_t ldy) {
#define ADAPTIVESPEC_INIT(r, b) __m512 a##r##b = first || (r) >= R ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + (r) * 64 + (b) * 16);
  ADAPTIVESPEC_INIT(0, 0) ADAPTIVESPEC_INIT(0, 1) ADAPTIVESPEC_INIT(0, 2) ADAPTIVESPEC_INIT(0, 3)
  ADAPTIVESPEC_INIT(1, 0) ADAPTIVESPEC_INIT(1, 1) ADAPTIVESPEC_INIT(1, 2) ADAPTIVESPEC_INIT(1, 3)
  ADAPTIVESPEC_INIT(2, 0) ADAPTIVESPEC_INIT(2, 1) ADAPTIVESPEC_INIT(2, 2) ADAPTIVESPEC_INIT(2, 3)
  ADAPTIVESPEC_INIT(3, 0) ADAPTIVESPEC_INIT(3, 1) ADAPTIVESPEC_INIT(3, 2) ADAPTIVESPEC_INIT(3, 3)
  ADAPTIVESPEC_INIT(4, 0) ADAPTIVESPEC_INIT(4, 1) ADAPTIVESPEC_INIT(4, 2) ADAPTIVESPEC_INIT(4, 3)
  ADAPTIVESPEC_INIT(5, 0) ADAPTIVESPEC_INIT(5, 1) ADAPTIVESPEC_INIT(5, 2) ADAPTIVESPEC_INIT(5, 3)
#undef ADAPTIVESPEC_INIT
  for (int64_t k2 = k0; k2 < k1; ++k2) {
    const uint32_t* wk = w + k2 * 64;  // the chunk's 64 outputs for this input pair, contiguous
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 16),
                   w2 = (__m512bh)_mm512_loadu_si512(wk + 32), w3 = (__m512bh)_mm512_loadu_si512(wk + 48);
#define ADAPTIVESPEC_ROW(r)                                                                   \
    {                                                                                         \
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[(r) * ldx + k2])); \
      a##r##0 = _mm512_dpbf16_ps(a##r##0, xv, w0);                                           \
      a##r##1 = _mm512_dpbf16_ps(a##r##1, xv, w1);                                           \
      a##r##2 = _mm512_dpbf16_ps(a##r##2, xv, w2);                                           \
      a##r##3 = _mm512_dpbf16_ps(a##r##3, xv, w3);                                           \
    }
    ADAPTIVESPEC_ROW(0)
    if constexpr (R > 1) ADAPTIVESPEC_ROW(1)
    if constexpr (R > 2) ADAPTIVESPEC_ROW(2)
    if constexpr (R > 3) ADAPTIVESPEC_ROW(3)
    if constexpr (R > 4) ADAPTIVESPEC_ROW(4)
    if constexpr (R > 5) ADAPTIVESPEC_ROW(5)
#undef ADAPTIVESPEC_ROW
  }
  auto put = [&](int r, int b, __m512 v) {
    if (!last) {
      _mm512_storeu_ps(acc + r * 64 + b * 16, v);
      return;
    }
    const int64_t o = n0 + b * 16, valid = std::min<int64_t>(16, N - o);
    if (valid <= 0) return;
    const __mmask16 mk = static_cast<__mmask16>((1u << valid) - 1);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, bias + o));
    _mm256_mask_storeu_epi16(y + r * ldy + o, mk, (__m256i)_mm512_cvtneps_pbh(v));
  };
  put(0, 0, a00), put(0, 1, a01), put(0, 2, a02), put(0, 3, a03);
  if constexpr (R > 1) put(1, 0, a10), put(1, 1, a11), put(1, 2, a12), put(1, 3, a13);
  if constexpr (R > 2) put(2, 0, a20), put(2, 1, a21), put(2, 2, a22), put(2, 3, a23);
  if constexpr (R > 3) put(3, 0, a30), put(3, 1, a31), put(3, 2, a32), put(3, 3, a33);
  if constexpr (R > 4) put(4, 0, a40), put(4, 1, a41), put(4, 2, a42), put(4, 3, a43);
  if constexpr (R > 5) put(5, 0, a50), put(5, 1, a51), put(5, 2, a52), put(5, 3, a53);
}

// rows [0, rows) x one chunk of 64 outputs: input pairs in blocks of KB (the chunk's weights for a block,
// KB x 256 bytes, stay in L1 while every 6-row group passes), partial sums in acc [rows][64]
constexpr int64_t KB = 48;
inline void rows_block(int64_t rows, const uint32_t* x, int64_t ldx, const uint32_t* w, int64_t K2, float* acc,
                       const float* bias, int64_t n0, int64_t N, uint16_t* y, int64_t ldy) {
  for (int64_t k0 = 0; k0 < K2; k0 += KB) {
    const int64_t k1 = std::min(K2, k0 + KB);
    const bool first = k0 == 0, last = k1 == K2;
    for (int64_t r = 0; r < rows; r += 6) {
      const uint32_t* xr = x + r * ldx;
      float* ar = acc + r * 64;
      uint16_t* yr = y + r * ldy;
      switch (std::min<int64_t>(6, rows - r)) {
        case 6: micro<6>(xr, ldx, w, k0, k1, ar, first, last, bias, n0, N, yr, ldy); break;
        case 5: micro<5>(xr, ldx, w, k0, k1, ar, first, last, bias, n0, N, yr, ldy); break;
        case 4: micro<4>(xr, ldx, w, k0, k1, ar, first, last, bias, n0, N, yr, ldy); break;
        case 3: micro<3>(xr, ldx, w, k0, k1, ar, first, last, bias, n0, N, yr, ldy); break;
        case 2: micro<2>(xr, ldx, w, k0, k1, ar, first, last, bias, n0, N, yr, ldy); break;
        default: micro<1>(xr, ldx, w, k0, k1, ar, first, last, bias, n0, N, yr, ldy); break;
      }
    }
  }
}
#endif

bool available() {
#if defined(ADAPTIVESPEC_BF16_LINEAR)
  return true;
#else
  return false;
#endif
}

at::Tensor pack_linear(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack_linear: w [N, K] bfloat16");
  auto wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), NBK = (N + 63) / 64 * 4, K2 = (K + 1) / 2;  // 64 outputs a chunk
  auto out = at::zeros({NBK, K2, 16}, at::TensorOptions().dtype(at::kInt));
  auto src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  auto dst = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      uint32_t& cell = dst[((n / 64) * K2 + k / 2) * 64 + n % 64];
      cell |= static_cast<uint32_t>(src[n * K + k]) << (16 * (k % 2));
    }
  return out;
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(available(), "linear_bf16: built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear_bf16: x [M, K] bfloat16");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 16 && packed.scalar_type() == at::kInt, "linear_bf16: packed weight");
  const int64_t M = x.size(0), K = x.size(1), K2 = packed.size(1);
  TORCH_CHECK(K2 == (K + 1) / 2 && packed.size(0) == (N + 63) / 64 * 4, "linear_bf16: x's features or N disagree with the weight");
  at::Tensor xc = K % 2 ? at::constant_pad_nd(x, {0, 1}) : x;  // rows as 32-bit pairs: unit stride, even row stride
  if (xc.stride(1) != 1 || xc.stride(0) % 2 != 0) xc = xc.contiguous();
  at::Tensor b;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "linear_bf16: bias [N]");
    bp = b.data_ptr<float>();
  }
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
#if defined(ADAPTIVESPEC_BF16_LINEAR)
  auto xp = reinterpret_cast<const uint32_t*>(xc.data_ptr<at::BFloat16>());
  const int64_t ldx = xc.stride(0) / 2;
  auto wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  auto yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  // tasks: chunks of 64 outputs x chunks of up to 48 rows (their partial sums, 12 KB, beside the
  // weights' block in L1); how a call is cut never changes how an output is summed
  constexpr int64_t NCH = 64, RCH = 48;
  const int64_t nch = (N + NCH - 1) / NCH, rch = (M + RCH - 1) / RCH;
  const int64_t rows_each = std::min(RCH, ((M + rch - 1) / rch + 5) / 6 * 6);  // even chunks, whole 6-row groups
  at::parallel_for(0, nch * rch, 1, [&](int64_t b, int64_t e) {
    alignas(64) float acc[RCH * 64];
    for (int64_t t = b; t < e; ++t) {
      const int64_t c = t % nch, rc = t / nch;
      const int64_t n0 = c * NCH, r0 = rc * rows_each, rows = std::min(rows_each, M - r0);
      if (rows <= 0) continue;
      rows_block(rows, xp + r0 * ldx, ldx, wp + (n0 / 64) * K2 * 64, K2, acc, bp, n0, N, yp + r0 * N, N);
    }
  });
#endif
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether the kernel was built (AVX512-BF16)");
  m.def("pack_linear", &pack_linear, "a [N, K] bf16 weight in linear_bf16's layout");
  m.def("linear_bf16", &linear_bf16, "x @ w.T (+ bias) in bf16, each output summed in one fixed order");
}
