// Kernels of the int8 target (adaptivespec/fastpath/int8.py) whose results do not depend on the
// layout of the forward they run in: every output is computed by the same code, in the same order,
// from its own row's inputs only. Built at first use by adaptivespec/fastpath/native.py.
//
// quantize_rows  x [M, K] (bf16 or f32), optional smoothing [K]
//                -> q uint8 [M, K] (= round-half-up(x * s * 127 / amax) + 128), amax f32 [M, 1]
// scale_rows     y f32 [M, N] (float(acc) * sw / 127), amax [M, 1], optional bias [N] -> [M, N] in dtype
// attend         q [H, n, D], keys / values [Hkv, S, D] (strided over S and heads), visibility:
//                row i sees keys [0, prefix) and, beyond, key j where (mask ? mask[i][j] : j <= limit_i)
//                -> out [n, H * D]. One pass over the visible keys in ascending order with an online
//                softmax: the sums are the same whatever the other rows, the masked keys or the
//                number of keys after the last visible one.
#include <torch/extension.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <cstring>
#include <vector>
#include <algorithm>
#include <type_traits>
#include <memory>

namespace {

template <typename T> inline float to_f(T v) { return static_cast<float>(v); }

template <typename T>
void quantize_impl(const T* x, const float* smooth, uint8_t* q, float* amax, int64_t M, int64_t K, int64_t ldx) {
  at::parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
    std::vector<float> row(K);
    for (int64_t m = b; m < e; ++m) {
      const T* xr = x + m * ldx;
      float mx = 0.f;
      for (int64_t k = 0; k < K; ++k) {
        float v = to_f(xr[k]);
        if (smooth) v = v * smooth[k];
        row[k] = v;
        float a = std::fabs(v);
        mx = a > mx ? a : mx;
      }
      if (mx < 1e-30f) mx = 1e-30f;
      amax[m] = mx;
      const float inv = 127.0f / mx;
      uint8_t* qr = q + m * K;
      for (int64_t k = 0; k < K; ++k) {
        float t = row[k] * inv;
        t = t + 128.5f;
        qr[k] = static_cast<uint8_t>(static_cast<int>(t));  // t in [1.5, 255.5]: truncation is floor
      }
    }
  });
}

std::vector<at::Tensor> quantize_rows(const at::Tensor& x, const c10::optional<at::Tensor>& smooth) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "quantize_rows: x must be [M, K] with unit stride in K");
  const int64_t M = x.size(0), K = x.size(1);
  auto q = at::empty({M, K}, x.options().dtype(at::kByte));
  auto amax = at::empty({M, 1}, x.options().dtype(at::kFloat));
  at::Tensor s;
  if (smooth.has_value()) s = smooth->to(at::kFloat).contiguous();
  const float* sp = smooth.has_value() ? s.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kBFloat16) {
    quantize_impl(x.data_ptr<at::BFloat16>(), sp, q.data_ptr<uint8_t>(), amax.data_ptr<float>(), M, K, x.stride(0));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "quantize_rows: bf16 or f32");
    quantize_impl(x.data_ptr<float>(), sp, q.data_ptr<uint8_t>(), amax.data_ptr<float>(), M, K, x.stride(0));
  }
  return {q, amax};
}

template <typename T>
void scale_impl(const float* y, const float* amax, const float* bias, T* out, int64_t M, int64_t N) {
  at::parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      const float a = amax[m];
      const float* yr = y + m * N;
      T* o = out + m * N;
      if (bias) {
        for (int64_t n = 0; n < N; ++n) { float t = yr[n] * a; t = t + bias[n]; o[n] = static_cast<T>(t); }
      } else {
        for (int64_t n = 0; n < N; ++n) o[n] = static_cast<T>(yr[n] * a);
      }
    }
  });
}

at::Tensor scale_rows(const at::Tensor& y, const at::Tensor& amax, const c10::optional<at::Tensor>& bias,
                      at::ScalarType dtype) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kFloat, "scale_rows: y f32 [M, N] contiguous");
  const int64_t M = y.size(0), N = y.size(1);
  auto out = at::empty({M, N}, y.options().dtype(dtype));
  at::Tensor bf;
  if (bias.has_value()) bf = bias->to(at::kFloat).contiguous();
  const float* bp = bias.has_value() ? bf.data_ptr<float>() : nullptr;
  auto a = amax.contiguous();
  if (dtype == at::kBFloat16) scale_impl(y.data_ptr<float>(), a.data_ptr<float>(), bp, out.data_ptr<at::BFloat16>(), M, N);
  else if (dtype == at::kFloat) scale_impl(y.data_ptr<float>(), a.data_ptr<float>(), bp, out.data_ptr<float>(), M, N);
  else TORCH_CHECK(false, "scale_rows: bf16 or f32 out");
  return out;
}

constexpr int LANES = 16;
constexpr int B = 16;       // keys per block of the online softmax (blocks of the row's visible keys, in order)
constexpr int ROW_TILE = 8; // rows that share the conversion of a block of the common prefix

// exp by range reduction and a polynomial: IEEE operations only (no contraction), so the loop and the
// scalar form round alike. Relative error ~2 ulp over [-87, 88]; below -87 it returns 0.
inline float exp_poly(float x) {
  const float big = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const float xc = std::fmin(std::fmax(x, -87.0f), 88.0f);
  const float t = xc * 1.44269504088896341f;
  const float n = (t + big) - big;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r;
  p = p + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(float));
  const float y = p * scale;
  return x < -87.0f ? 0.0f : y;
}

// The sum of 16 floats as a tree (halves, then quarters, ...): one order of additions whatever the ISA.
inline float tree_sum16(const float* p) {
  float t[8];
  for (int i = 0; i < 8; ++i) t[i] = p[i] + p[i + 8];
  for (int i = 0; i < 4; ++i) t[i] = t[i] + t[i + 4];
  return (t[0] + t[2]) + (t[1] + t[3]);
}

struct Pair {  // one (row, query head): its running max, sum and output
  const float* q;  // [D], pre-scaled
  float m, l;
  float* acc;      // [D]
};

#if defined(__AVX512F__)
// exp_poly on 16 lanes: the same IEEE operations, lane by lane.
inline __m512 exp_poly16(__m512 x) {
  const __m512 big = _mm512_set1_ps(12582912.0f);
  __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  __m512 t = _mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f));
  __m512 n = _mm512_sub_ps(_mm512_add_ps(t, big), big);
  __m512 r = _mm512_sub_ps(xc, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(under, y, _mm512_setzero_ps());
}
#endif

// One block of nb (<= B) keys, given as float rows (kt: the keys transposed, [D][B]; vb: values [B][D]), for pairs.
inline void block(Pair* pairs, int np, const float* __restrict kt, const float* __restrict vb, int nb, int64_t D) {
  alignas(64) float s[B];
  alignas(64) float p[B];
  for (int a = 0; a < np; ++a) {
    Pair& P = pairs[a];
    const float* __restrict q = P.q;
    float* __restrict acc = P.acc;
#if defined(__AVX512F__)
    // four chains over d (d % 4), added in a fixed order at the end: the same sums for every key
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 4) {
      s0 = _mm512_add_ps(s0, _mm512_mul_ps(_mm512_set1_ps(q[d]), _mm512_load_ps(kt + d * B)));
      s1 = _mm512_add_ps(s1, _mm512_mul_ps(_mm512_set1_ps(q[d + 1]), _mm512_load_ps(kt + (d + 1) * B)));
      s2 = _mm512_add_ps(s2, _mm512_mul_ps(_mm512_set1_ps(q[d + 2]), _mm512_load_ps(kt + (d + 2) * B)));
      s3 = _mm512_add_ps(s3, _mm512_mul_ps(_mm512_set1_ps(q[d + 3]), _mm512_load_ps(kt + (d + 3) * B)));
    }
    _mm512_store_ps(s, _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
#else
    for (int jj = 0; jj < B; ++jj) {  // the same four chains as the vector form
      float c[4] = {0.f, 0.f, 0.f, 0.f};
      for (int64_t d = 0; d < D; ++d) c[d % 4] = c[d % 4] + q[d] * kt[d * B + jj];
      s[jj] = (c[0] + c[1]) + (c[2] + c[3]);
    }
#endif
#if defined(__AVX512F__)
    const __mmask16 live = static_cast<__mmask16>((1u << nb) - 1u);
    const float bm = _mm512_mask_reduce_max_ps(live, _mm512_load_ps(s));  // a maximum: exact in any order
#else
    float bm = s[0];
    for (int jj = 1; jj < nb; ++jj) bm = s[jj] > bm ? s[jj] : bm;
#endif
    if (bm > P.m) {
      if (P.l > 0.f) {
        const float c = exp_poly(P.m - bm);
        P.l = P.l * c;
#pragma GCC ivdep
        for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] * c;
      }
      P.m = bm;
    }
    const float m = P.m;
#if defined(__AVX512F__)
    const __m512 pv = _mm512_maskz_mov_ps(live, exp_poly16(_mm512_sub_ps(_mm512_load_ps(s), _mm512_set1_ps(m))));
    _mm512_store_ps(p, pv);
#else
    for (int jj = 0; jj < B; ++jj) p[jj] = exp_poly(s[jj] - m);
    for (int jj = nb; jj < B; ++jj) p[jj] = 0.f;
#endif
    P.l = P.l + tree_sum16(p);  // one fixed order of additions on every ISA (a block's dead lanes are 0)
#if defined(__AVX512F__)
    if (D == 64) {
      __m512 a0 = _mm512_loadu_ps(acc), a1 = _mm512_loadu_ps(acc + 16), a2 = _mm512_loadu_ps(acc + 32),
             a3 = _mm512_loadu_ps(acc + 48);
      for (int jj = 0; jj < nb; ++jj) {
        const __m512 pj = _mm512_set1_ps(p[jj]);
        const float* vr = vb + jj * 64;
        a0 = _mm512_add_ps(a0, _mm512_mul_ps(pj, _mm512_load_ps(vr)));
        a1 = _mm512_add_ps(a1, _mm512_mul_ps(pj, _mm512_load_ps(vr + 16)));
        a2 = _mm512_add_ps(a2, _mm512_mul_ps(pj, _mm512_load_ps(vr + 32)));
        a3 = _mm512_add_ps(a3, _mm512_mul_ps(pj, _mm512_load_ps(vr + 48)));
      }
      _mm512_storeu_ps(acc, a0); _mm512_storeu_ps(acc + 16, a1); _mm512_storeu_ps(acc + 32, a2); _mm512_storeu_ps(acc + 48, a3);
      continue;
    }
#endif
    for (int jj = 0; jj < nb; ++jj) {
      const float pj = p[jj];
      const float* __restrict vr = vb + jj * D;
#pragma GCC ivdep
      for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] + pj * vr[d];
    }
  }
}

template <typename T>
inline void convert_row(const T* src, float* dst, int64_t D) {
#if defined(__AVX512F__)
  if constexpr (std::is_same<T, at::BFloat16>::value) {
    for (int64_t d = 0; d + 16 <= D; d += 16) {
      __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d));
      _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
    return;
  }
#endif
  for (int64_t d = 0; d < D; ++d) dst[d] = to_f(src[d]);
}

template <typename T>
void attend_impl(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const bool* mask,
                 int64_t mask_ld, int64_t prefix, const int64_t* limit, float scale, at::Tensor& out) {
  const int64_t H = q.size(0), n = q.size(1), D = q.size(2), Hkv = keys.size(0), S = keys.size(1);
  const int64_t g = H / Hkv;
  const T* qp = q.data_ptr<T>();
  const T* kp = keys.data_ptr<T>();
  const T* vp = values.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), vs0 = values.stride(0), vs1 = values.stride(1);
  // each row's visible keys, ascending: [0, contiguous[i]) and then extra[i] (a tree's ancestors)
  std::vector<int64_t> contiguous(n);
  std::vector<std::vector<int64_t>> extra(n);
  int64_t used = 0;  // keys any row reads
  for (int64_t i = 0; i < n; ++i) {
    if (mask) {
      contiguous[i] = std::min(prefix, S);
      for (int64_t j = contiguous[i]; j < S; ++j)
        if (mask[i * mask_ld + j]) extra[i].push_back(j);
      used = std::max(used, extra[i].empty() ? contiguous[i] : extra[i].back() + 1);
    } else {
      contiguous[i] = limit ? std::min<int64_t>(S, limit[i] + 1) : S;
    }
    used = std::max(used, contiguous[i]);
  }
  // the keys as float once: values row-major [Hkv][Sp][D], keys in transposed blocks [Hkv][Sp / B][D][B]
  const int64_t nblk = (used + B - 1) / B, Sp = nblk * B;
  std::unique_ptr<float[]> kt_all(new float[Hkv * Sp * D]), v_all(new float[Hkv * Sp * D]);  // no zero fill: every slot is written
  at::parallel_for(0, Hkv * nblk, 4, [&](int64_t b, int64_t e) {
    alignas(64) float row[128];
    for (int64_t t = b; t < e; ++t) {
      const int64_t kv = t / nblk, blk = t % nblk;
      float* kt = kt_all.get() + (kv * nblk + blk) * D * B;
      for (int jj = 0; jj < B; ++jj) {
        const int64_t j = blk * B + jj;
        float* vdst = v_all.get() + (kv * Sp + j) * D;
        if (j < used) {
          convert_row(kp + kv * ks0 + j * ks1, row, D);
          convert_row(vp + kv * vs0 + j * vs1, vdst, D);
        } else {
          std::fill(row, row + D, 0.f);
          std::fill(vdst, vdst + D, 0.f);
        }
        for (int64_t d = 0; d < D; ++d) kt[d * B + jj] = row[d];
      }
    }
  });
  // rows per task: ROW_TILE where there are rows enough, fewer so that every thread gets work
  const int64_t want = std::max<int64_t>(1, (n * Hkv) / (4 * at::get_num_threads()));
  const int64_t tile = std::min<int64_t>(ROW_TILE, want);
  const int64_t tiles = (n + tile - 1) / tile;
  at::parallel_for(0, Hkv * tiles, 1, [&](int64_t b, int64_t e) {
    std::vector<float> qf(ROW_TILE * g * D), acc(ROW_TILE * g * D);
    alignas(64) float ktbuf[128 * B], vbuf[B * 128];
    std::vector<Pair> pairs(ROW_TILE * g);
    for (int64_t t = b; t < e; ++t) {
      const int64_t kv = t / tiles, i0 = (t % tiles) * tile, i1 = std::min(n, i0 + tile);
      const int np = static_cast<int>((i1 - i0) * g);
      const float* ktk = kt_all.get() + kv * nblk * D * B;
      const float* vv = v_all.get() + kv * Sp * D;
      int64_t shared = S;
      for (int64_t i = i0; i < i1; ++i) shared = std::min(shared, contiguous[i]);
      shared = (shared / B) * B;  // whole blocks every row of the tile sees: read once for all its rows
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t hh = 0; hh < g; ++hh) {
          const int64_t a = (i - i0) * g + hh, h = kv * g + hh;
          const T* qr = qp + h * qs0 + i * qs1;
          for (int64_t d = 0; d < D; ++d) qf[a * D + d] = to_f(qr[d]) * scale;
          std::fill(acc.begin() + a * D, acc.begin() + (a + 1) * D, 0.f);
          pairs[a] = Pair{qf.data() + a * D, -std::numeric_limits<float>::infinity(), 0.f, acc.data() + a * D};
        }
      for (int64_t j0 = 0; j0 < shared; j0 += B)
        block(pairs.data(), np, ktk + (j0 / B) * D * B, vv + j0 * D, B, D);
      for (int64_t i = i0; i < i1; ++i) {  // the rest of each row's visible keys, in blocks continuing the count
        Pair* rp = pairs.data() + (i - i0) * g;
        const int64_t c = contiguous[i];
        int64_t j0 = shared;
        for (; j0 + B <= c; j0 += B) block(rp, static_cast<int>(g), ktk + (j0 / B) * D * B, vv + j0 * D, B, D);
        // the last partial run and the extras: gathered into one sequence of blocks
        std::vector<int64_t> idx;
        for (int64_t j = j0; j < c; ++j) idx.push_back(j);
        idx.insert(idx.end(), extra[i].begin(), extra[i].end());
        for (size_t c0 = 0; c0 < idx.size(); c0 += B) {
          const int nb = static_cast<int>(std::min<size_t>(B, idx.size() - c0));
          for (int jj = 0; jj < B; ++jj) {
            const int64_t j = jj < nb ? idx[c0 + jj] : idx[c0];
            const float* kcol = ktk + (j / B) * D * B + (j % B);
            for (int64_t d = 0; d < D; ++d) ktbuf[d * B + jj] = kcol[d * B];
            std::memcpy(vbuf + jj * D, vv + j * D, sizeof(float) * D);
          }
          block(rp, static_cast<int>(g), ktbuf, vbuf, nb, D);
        }
      }
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t hh = 0; hh < g; ++hh) {
          const Pair& P = pairs[(i - i0) * g + hh];
          T* o = op + i * (H * D) + (kv * g + hh) * D;
          const float inv = P.l > 0.f ? 1.0f / P.l : 0.f;
          for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(P.acc[d] * inv);
        }
    }
  });
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                  const c10::optional<at::Tensor>& mask, int64_t prefix, const c10::optional<at::Tensor>& limit,
                  double scale) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.dim() == 3, "attend: q [H, n, D], keys / values [Hkv, S, D]");
  TORCH_CHECK(q.stride(2) == 1 && keys.stride(2) == 1 && values.stride(2) == 1, "attend: unit stride in D");
  TORCH_CHECK(q.size(2) % LANES == 0 && q.size(2) <= 128, "attend: head_dim must be a multiple of 16, at most 128");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && q.scalar_type() == values.scalar_type(), "attend: one dtype");
  const int64_t H = q.size(0), n = q.size(1), D = q.size(2);
  auto out = at::empty({n, H * D}, q.options());
  at::Tensor mk, lim;
  const bool* mp = nullptr;
  int64_t mld = 0;
  if (mask.has_value()) {
    mk = mask->to(at::kBool).contiguous();
    TORCH_CHECK(mk.dim() == 2 && mk.size(0) == n && mk.size(1) >= keys.size(1), "attend: mask [n, >= S]");
    mp = mk.data_ptr<bool>();
    mld = mk.size(1);
  }
  const int64_t* lp = nullptr;
  if (limit.has_value()) {
    lim = limit->to(at::kLong).contiguous();
    lp = lim.data_ptr<int64_t>();
  }
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == at::kBFloat16) attend_impl<at::BFloat16>(q, keys, values, mp, mld, prefix, lp, sc, out);
  else if (q.scalar_type() == at::kFloat) attend_impl<float>(q, keys, values, mp, mld, prefix, lp, sc, out);
  else TORCH_CHECK(false, "attend: bf16 or f32");
  return out;
}

}  // namespace

// rms_norm   x [M, H] (bf16 / f32, unit stride in H), w [H] -> [M, H] in x's dtype:
//            w * round(x / sqrt(mean(x^2) + eps)) (the normed row rounded to x's dtype, then scaled),
//            the sum of squares in 16 lanes added in one fixed order: a row's result is its own.
template <typename T>
void rms_impl(const T* x, int64_t ldx, const T* w, T* out, int64_t M, int64_t H, float eps) {
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      const T* xr = x + m * ldx;
      float part[16] = {0.f};
      int64_t k = 0;
      for (; k + 16 <= H; k += 16)
        for (int l = 0; l < 16; ++l) { const float v = to_f(xr[k + l]); part[l] = part[l] + v * v; }
      for (; k < H; ++k) { const float v = to_f(xr[k]); part[k % 16] = part[k % 16] + v * v; }
      float ss = 0.f;
      for (int l = 0; l < 16; ++l) ss = ss + part[l];
      const float r = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
      T* o = out + m * H;
      for (int64_t j = 0; j < H; ++j) {
        const T normed = static_cast<T>(to_f(xr[j]) * r);
        o[j] = static_cast<T>(to_f(w[j]) * to_f(normed));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.is_contiguous() && w.scalar_type() == x.scalar_type(),
              "rms_norm: x [M, H] with unit stride, w [H] of x's dtype");
  const int64_t M = x.size(0), H = x.size(1);
  auto out = at::empty({M, H}, x.options());
  if (x.scalar_type() == at::kBFloat16)
    rms_impl(x.data_ptr<at::BFloat16>(), x.stride(0), w.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), M, H,
             static_cast<float>(eps));
  else
    rms_impl(x.data_ptr<float>(), x.stride(0), w.data_ptr<float>(), out.data_ptr<float>(), M, H, static_cast<float>(eps));
  return out;
}

// -- the int8 matmul ------------------------------------------------------------------------------
// pack_weight   qweight int8 [N, K] (N a multiple of 16, K of 4) -> int8 [N / 16][K / 4][16][4]
// int8_linear   q uint8 [M, K] (qx + 128), amax f32 [M, G], packed, colsum int32 [G, N] (128 x the sum of
//               each group's weights), scale f32 [N] (sw / 127), bias f32 [N] or None
//               -> y [M, N] = sum over groups g in order of float(acc_g - colsum_g) * scale * amax[:, g] (+ bias)
// Integer sums are exact, so any tiling gives the same acc; the float steps are per element, in one order.
// w int8 [N, K] -> [N / R][K / T][R][T]: blocks of R output rows by T inputs, each block's rows contiguous
static at::Tensor pack_blocks(const at::Tensor& w, int64_t R, int64_t T, const char* name) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar, name, ": int8 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 16 == 0 && K % T == 0, name, ": N a multiple of 16, K of ", T);
  auto wc = w.contiguous();
  auto out = at::empty({N / R, K / T, R, T}, w.options());
  const int8_t* src = wc.data_ptr<int8_t>();
  int8_t* dst = out.data_ptr<int8_t>();
  for (int64_t nb = 0; nb < N / R; ++nb)
    for (int64_t kb = 0; kb < K / T; ++kb)
      for (int64_t c = 0; c < R; ++c)
        for (int64_t t = 0; t < T; ++t) dst[((nb * (K / T) + kb) * R + c) * T + t] = src[(nb * R + c) * K + kb * T + t];
  return out;
}

at::Tensor pack_weight(const at::Tensor& w) { return pack_blocks(w, 16, 4, "pack_weight"); }

bool has_vnni() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int MR = 8;

template <typename T>
inline void store_row(T* dst, __m512 v, __mmask16 m) {
  if constexpr (std::is_same<T, float>::value) {
    _mm512_mask_storeu_ps(dst, m, v);
  } else {  // round to nearest even, as torch's float -> bfloat16
    __m512i b = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_or_si512(b, _mm512_set1_epi32(0x400000)));
    __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
    _mm256_mask_storeu_epi16(reinterpret_cast<void*>(dst), m, h);
  }
}

// One tile: R rows (a compile-time count, so the accumulators stay in registers) x 16 * C columns.
template <int R, int C, typename T>
inline void linear_tile(const uint8_t* q, int64_t ldq, const float* amax, int64_t G, const int8_t* packed,
                        const int32_t* colsum, int64_t N, int64_t nb, int64_t K4, const float* scale, const float* bias,
                        T* out, int64_t m0) {
  const int64_t Kg4 = K4 / G;
  alignas(64) float y[R][C][16];
  for (int64_t g = 0; g < G; ++g) {
    __m512i acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512();
    const int64_t k0 = g * Kg4;
    const uint8_t* qr = q + m0 * ldq;
    for (int64_t k4 = k0; k4 < k0 + Kg4; ++k4) {
      __m512i w[C];
      for (int c = 0; c < C; ++c) w[c] = _mm512_loadu_si512(packed + ((nb + c) * K4 + k4) * 64);
      for (int r = 0; r < R; ++r) {
        int32_t a;
        std::memcpy(&a, qr + r * ldq + k4 * 4, 4);
        const __m512i av = _mm512_set1_epi32(a);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], av, w[c]);
      }
    }
    for (int c = 0; c < C; ++c) {
      const __m512i cs = _mm512_loadu_si512(colsum + g * N + (nb + c) * 16);
      const __m512 sc = _mm512_loadu_ps(scale + (nb + c) * 16);
      for (int r = 0; r < R; ++r) {
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][c], cs)), sc);
        v = _mm512_mul_ps(v, _mm512_set1_ps(amax[(m0 + r) * G + g]));
        _mm512_store_ps(y[r][c], g == 0 ? v : _mm512_add_ps(_mm512_load_ps(y[r][c]), v));
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    const __m512 bv = bias ? _mm512_loadu_ps(bias + (nb + c) * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 v = _mm512_load_ps(y[r][c]);
      store_row(out + (m0 + r) * N + (nb + c) * 16, bias ? _mm512_add_ps(v, bv) : v, 0xFFFF);
    }
  }
}

template <int C, typename T>
inline void linear_cols(const uint8_t* q, int64_t ldq, const float* amax, int64_t G, const int8_t* packed,
                        const int32_t* colsum, int64_t N, int64_t nb, int64_t K4, const float* scale, const float* bias,
                        T* out, int64_t M) {
  int64_t m0 = 0;
  for (; m0 + MR <= M; m0 += MR) linear_tile<MR, C>(q, ldq, amax, G, packed, colsum, N, nb, K4, scale, bias, out, m0);
  switch (M - m0) {
    case 1: linear_tile<1, C>(q, ldq, amax, G, packed, colsum, N, nb, K4, scale, bias, out, m0); break;
    case 2: linear_tile<2, C>(q, ldq, amax, G, packed, colsum, N, nb, K4, scale, bias, out, m0); break;
    case 3: linear_tile<3, C>(q, ldq, amax, G, packed, colsum, N, nb, K4, scale, bias, out, m0); break;
    case 4: linear_tile<4, C>(q, ldq, amax, G, packed, colsum, N, nb, K4, scale, bias, out, m0); break;
    case 5: linear_tile<5, C>(q, ldq, amax, G, packed, colsum, N, nb, K4, scale, bias, out, m0); break;
    case 6: linear_tile<6, C>(q, ldq, amax, G, packed, colsum, N, nb, K4, scale, bias, out, m0); break;
    case 7: linear_tile<7, C>(q, ldq, amax, G, packed, colsum, N, nb, K4, scale, bias, out, m0); break;
    default: break;
  }
}

template <typename T>
void linear_impl(const uint8_t* q, int64_t ldq, const float* amax, int64_t G, const int8_t* packed, const int32_t* colsum,
                 const float* scale, const float* bias, T* out, int64_t M, int64_t N, int64_t K) {
  const int64_t NB = N / 16, K4 = K / 4;
  // columns split among the threads; each thread runs all rows over its columns (a weight tile read
  // once from memory, then from cache for the next rows)
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(64, NB / (2 * at::get_num_threads())));
  const int64_t pairs = NB / 2;  // column blocks two at a time (16 accumulators), a last single one
  at::parallel_for(0, pairs + (NB % 2), std::max<int64_t>(1, grain / 2), [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) {
      if (p < pairs) linear_cols<2>(q, ldq, amax, G, packed, colsum, N, 2 * p, K4, scale, bias, out, M);
      else linear_cols<1>(q, ldq, amax, G, packed, colsum, N, 2 * p, K4, scale, bias, out, M);
    }
  });
}
#endif

at::Tensor int8_linear(const at::Tensor& q, const at::Tensor& amax, const at::Tensor& packed, const at::Tensor& colsum,
                       const at::Tensor& scale, const c10::optional<at::Tensor>& bias, at::ScalarType dtype) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.stride(1) == 1, "int8_linear: q uint8 [M, K]");
  const int64_t M = q.size(0), K = q.size(1), N = packed.size(0) * 16, G = colsum.size(0);
  TORCH_CHECK(packed.size(1) * 4 == K && (K / 4) % G == 0 && amax.numel() == M * G, "int8_linear: shapes");
  auto out = at::empty({M, N}, q.options().dtype(dtype));
  auto a = amax.contiguous();
  at::Tensor bf;
  if (bias.has_value()) bf = bias->to(at::kFloat).contiguous();
  const float* bp = bias.has_value() ? bf.data_ptr<float>() : nullptr;
  if (dtype == at::kBFloat16)
    linear_impl(q.data_ptr<uint8_t>(), q.stride(0), a.data_ptr<float>(), G, packed.data_ptr<int8_t>(),
                colsum.data_ptr<int32_t>(), scale.data_ptr<float>(), bp, out.data_ptr<at::BFloat16>(), M, N, K);
  else
    linear_impl(q.data_ptr<uint8_t>(), q.stride(0), a.data_ptr<float>(), G, packed.data_ptr<int8_t>(),
                colsum.data_ptr<int32_t>(), scale.data_ptr<float>(), bp, out.data_ptr<float>(), M, N, K);
  return out;
#else
  TORCH_CHECK(false, "int8_linear: built without AVX512-VNNI");
#endif
}

// -- the int8 matmul without VNNI ---------------------------------------------------------------------
// AVX2's u8 x s8 instruction (vpmaddubsw, what oneDNN's and FBGEMM's AVX2 int8 kernels run) adds each
// pair of products into an int16 with saturation: 255 * 127 * 2 = 64,770 does not fit, so sums of large
// activations and weights come out wrong (measured: 80% of a random 20 x 1536 x 64 matmul's outputs).
// This kernel widens both operands to int16 first and multiplies by vpmaddwd, whose pair sums land in
// int32: exact, the same acc as vpdpbusd, so the same bits as the VNNI kernel above.
// pack_weight_avx2   qweight int8 [N, K] (N a multiple of 16, K of 2) -> int8 [N / 8][K / 2][8][2]
// int8_linear_avx2   int8_linear's arguments and result (packed by pack_weight_avx2)
bool has_avx2() {
#if defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

at::Tensor pack_weight_avx2(const at::Tensor& w) { return pack_blocks(w, 8, 2, "pack_weight_avx2"); }

#if defined(__AVX2__)
constexpr int MR2 = 6;  // rows per tile: 6 x 2 accumulators + 2 weights + 1 broadcast of AVX2's 16 registers

inline void store8(float* dst, __m256 v) { _mm256_storeu_ps(dst, v); }

inline void store8(at::BFloat16* dst, __m256 v) {  // round to nearest even, as torch's float -> bfloat16
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_srli_epi32(_mm256_blendv_epi8(r, _mm256_or_si256(b, _mm256_set1_epi32(0x400000)), nan), 16);
  const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), h);
}

// One tile: R rows x 16 columns (two blocks of 8). q16: the rows' q widened to int16 [M][K].
template <int R, typename T>
inline void linear_tile_avx2(const int16_t* q16, int64_t K, const float* amax, int64_t G, const int8_t* packed,
                             const int32_t* colsum, int64_t N, int64_t nb, const float* scale, const float* bias,
                             T* out, int64_t m0) {
  const int64_t K2 = K / 2, Kg2 = K2 / G;
  __m256 y[R][2];
  for (int64_t g = 0; g < G; ++g) {
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int64_t k2 = g * Kg2; k2 < (g + 1) * Kg2; ++k2) {
      __m256i w[2];  // 8 columns x 2 k, widened: each int32 lane holds one column's pair
      for (int c = 0; c < 2; ++c)
        w[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + ((nb + c) * K2 + k2) * 16)));
      for (int r = 0; r < R; ++r) {
        int32_t a;
        std::memcpy(&a, q16 + (m0 + r) * K + 2 * k2, 4);
        const __m256i av = _mm256_set1_epi32(a);
        for (int c = 0; c < 2; ++c) acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(av, w[c]));
      }
    }
    for (int c = 0; c < 2; ++c) {  // the VNNI kernel's epilogue, operation for operation
      const __m256i cs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(colsum + g * N + (nb + c) * 8));
      const __m256 sc = _mm256_loadu_ps(scale + (nb + c) * 8);
      for (int r = 0; r < R; ++r) {
        __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][c], cs)), sc);
        v = _mm256_mul_ps(v, _mm256_set1_ps(amax[(m0 + r) * G + g]));
        y[r][c] = g == 0 ? v : _mm256_add_ps(y[r][c], v);
      }
    }
  }
  for (int c = 0; c < 2; ++c) {
    const __m256 bv = bias ? _mm256_loadu_ps(bias + (nb + c) * 8) : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) store8(out + (m0 + r) * N + (nb + c) * 8, bias ? _mm256_add_ps(y[r][c], bv) : y[r][c]);
  }
}

template <typename T>
inline void linear_cols_avx2(const int16_t* q16, int64_t K, const float* amax, int64_t G, const int8_t* packed,
                             const int32_t* colsum, int64_t N, int64_t nb, const float* scale, const float* bias,
                             T* out, int64_t M) {
  int64_t m0 = 0;
  for (; m0 + MR2 <= M; m0 += MR2) linear_tile_avx2<MR2>(q16, K, amax, G, packed, colsum, N, nb, scale, bias, out, m0);
  switch (M - m0) {
    case 1: linear_tile_avx2<1>(q16, K, amax, G, packed, colsum, N, nb, scale, bias, out, m0); break;
    case 2: linear_tile_avx2<2>(q16, K, amax, G, packed, colsum, N, nb, scale, bias, out, m0); break;
    case 3: linear_tile_avx2<3>(q16, K, amax, G, packed, colsum, N, nb, scale, bias, out, m0); break;
    case 4: linear_tile_avx2<4>(q16, K, amax, G, packed, colsum, N, nb, scale, bias, out, m0); break;
    case 5: linear_tile_avx2<5>(q16, K, amax, G, packed, colsum, N, nb, scale, bias, out, m0); break;
    default: break;
  }
}

template <typename T>
void linear_impl_avx2(const int16_t* q16, const float* amax, int64_t G, const int8_t* packed, const int32_t* colsum,
                      const float* scale, const float* bias, T* out, int64_t M, int64_t N, int64_t K) {
  const int64_t tiles = N / 16;  // 16 columns a task; each runs every row over its columns
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(32, tiles / (2 * at::get_num_threads())));
  at::parallel_for(0, tiles, grain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) linear_cols_avx2(q16, K, amax, G, packed, colsum, N, 2 * t, scale, bias, out, M);
  });
}
#endif

at::Tensor int8_linear_avx2(const at::Tensor& q, const at::Tensor& amax, const at::Tensor& packed,
                            const at::Tensor& colsum, const at::Tensor& scale, const c10::optional<at::Tensor>& bias,
                            at::ScalarType dtype) {
#if defined(__AVX2__)
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte, "int8_linear_avx2: q uint8 [M, K]");
  const int64_t M = q.size(0), K = q.size(1), N = packed.size(0) * 8, G = colsum.size(0);
  TORCH_CHECK(packed.size(1) * 2 == K && (K / 2) % G == 0 && amax.numel() == M * G && N % 16 == 0,
              "int8_linear_avx2: shapes");
  const auto q16 = q.to(at::kShort).contiguous();  // 0..255: u8 x s8 products of int16s, pairs summed in int32
  auto out = at::empty({M, N}, q.options().dtype(dtype));
  auto a = amax.contiguous();
  at::Tensor bf;
  if (bias.has_value()) bf = bias->to(at::kFloat).contiguous();
  const float* bp = bias.has_value() ? bf.data_ptr<float>() : nullptr;
  if (dtype == at::kBFloat16)
    linear_impl_avx2(q16.data_ptr<int16_t>(), a.data_ptr<float>(), G, packed.data_ptr<int8_t>(),
                     colsum.data_ptr<int32_t>(), scale.data_ptr<float>(), bp, out.data_ptr<at::BFloat16>(), M, N, K);
  else
    linear_impl_avx2(q16.data_ptr<int16_t>(), a.data_ptr<float>(), G, packed.data_ptr<int8_t>(),
                     colsum.data_ptr<int32_t>(), scale.data_ptr<float>(), bp, out.data_ptr<float>(), M, N, K);
  return out;
#else
  TORCH_CHECK(false, "int8_linear_avx2: built without AVX2");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_rows", &quantize_rows, "int8 per-row quantization");
  m.def("scale_rows", &scale_rows, "int8 epilogue: rows times their scale (+ bias), to dtype");
  m.def("attend", &attend, "layout-invariant attention");
  m.def("pack_weight", &pack_weight, "int8 weight in the VNNI layout");
  m.def("rms_norm", &rms_norm, "RMSNorm, a row's sums in one fixed order");
  m.def("has_vnni", &has_vnni, "whether int8_linear was built");
  m.def("int8_linear", &int8_linear, "W8A8 matmul with per-row (and per-slice) activation scales");
  m.def("has_avx2", &has_avx2, "whether int8_linear_avx2 was built");
  m.def("pack_weight_avx2", &pack_weight_avx2, "int8 weight in the AVX2 (vpmaddwd) layout");
  m.def("int8_linear_avx2", &int8_linear_avx2, "int8_linear by exact int16 products (no VNNI)");
}
