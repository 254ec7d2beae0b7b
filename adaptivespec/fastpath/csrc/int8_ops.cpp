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
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>

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

template <typename T>
inline float dot(const float* q, const T* k, int64_t D) {
  float part[LANES] = {0.f};
  for (int64_t d = 0; d < D; d += LANES)
    for (int l = 0; l < LANES; ++l) part[l] += q[d + l] * to_f(k[d + l]);
  float s = 0.f;
  for (int l = 0; l < LANES; ++l) s += part[l];
  return s;
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
  at::parallel_for(0, H * n, 1, [&](int64_t b, int64_t e) {
    std::vector<float> qf(D), acc(D);
    for (int64_t t = b; t < e; ++t) {
      const int64_t i = t / H, h = t % H, kv = h / g;
      const T* qr = qp + h * qs0 + i * qs1;
      for (int64_t d = 0; d < D; ++d) qf[d] = to_f(qr[d]) * scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      float m = -std::numeric_limits<float>::infinity(), l = 0.f;
      const int64_t last = mask ? S : std::min<int64_t>(S, limit ? limit[i] + 1 : S);
      for (int64_t j = 0; j < last; ++j) {
        if (mask && j >= prefix && !mask[i * mask_ld + j]) continue;
        const T* kr = kp + kv * ks0 + j * ks1;
        const float s = dot(qf.data(), kr, D);
        if (s > m) {
          const float c = std::exp(m - s);  // 0 on the first key
          l = l * c;
          for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] * c;
          m = s;
        }
        const float p = std::exp(s - m);
        l = l + p;
        const T* vr = vp + kv * vs0 + j * vs1;
        for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] + p * to_f(vr[d]);
      }
      T* o = op + i * (H * D) + h * D;
      const float inv = l > 0.f ? 1.0f / l : 0.f;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[d] * inv);
    }
  });
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                  const c10::optional<at::Tensor>& mask, int64_t prefix, const c10::optional<at::Tensor>& limit,
                  double scale) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.dim() == 3, "attend: q [H, n, D], keys / values [Hkv, S, D]");
  TORCH_CHECK(q.stride(2) == 1 && keys.stride(2) == 1 && values.stride(2) == 1, "attend: unit stride in D");
  TORCH_CHECK(q.size(2) % LANES == 0, "attend: head_dim must be a multiple of 16");
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_rows", &quantize_rows, "int8 per-row quantization");
  m.def("scale_rows", &scale_rows, "int8 epilogue: rows times their scale (+ bias), to dtype");
  m.def("attend", &attend, "layout-invariant attention");
}
