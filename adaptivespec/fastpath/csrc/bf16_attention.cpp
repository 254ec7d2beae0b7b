// Attention of bfloat16 rows over a long cache with AVX512-BF16 dot products (built and loaded by
// adaptivespec/fastpath/native.py; called through adaptivespec/fastpath/forward.py's AttentionPlan).
//
// attend_bf16  q [n, H, D] (row-major per row and head, unit stride in D), keys / values [Hkv, S, D]
//              (a cache layer's buffers: strided over heads and keys, unit stride in D), `past`,
//              visibility: row i sees keys [0, past) and, beyond them, key past + j where
//              mask[i][j] (a tree, mask [n, S - past]), or where j <= i (causal, no mask, causal=true),
//              or every key (no mask, causal=false)  -> out [n, H * D] bf16. Keys a row sees lie in
//              ascending order of position (a tree's ancestors before their descendants).
// attend_slab  the same for several requests' packed rows, each over its own slot of a slab of caches.
//
// Why: torch's CPU flash attention spends ~1.5 ns per score (row x head x key) on a 2-vCPU AMD EPYC,
// six times slower per flop than the same machine's bf16 matmuls; most of a 4k prompt's prefill and
// most of what a tree's row costs at 4k keys. Here one (row, query head) pair sits in each AVX-512
// lane, a KV head's query heads folded into its rows (the cache is read once for all of them); the
// keys are read in place (a key's two dims broadcast against the pairs' queries, VDPBF16PS), the
// values are packed once per call as key pairs per dim; scores are summed in float32 from exact bf16
// products, and the probabilities are rounded to bf16 for the value product, as torch's kernel rounds
// them. The prefix every row sees is read without a mask; only the blocks that hold the tree or the
// causal edge are masked (the cascade of Hydragen / FlashInfer, in one kernel).
//
// Batch-invariant: a lane's softmax takes its exact maximum first and then sums its keys one by one in
// ascending order (no running maximum to rescale by, no key ranges merged), so its bits depend on its
// own visible keys alone, never on the rows, blocks, tasks or threads beside it (see Tile below). With
// the fixed-order linear (bf16_linear.cpp) this makes the bf16 forward's row for a token the same in a
// tree, a prefill chunk, one row's step or a batch: the ground a seed's sampled tokens stand on.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define ADAPTIVESPEC_BF16_ATTENTION 1
#endif

namespace {

#if defined(ADAPTIVESPEC_BF16_ATTENTION)

inline __m512 exp16(__m512 x) {  // e^x to ~1e-7 relative; 0 below -87 (a masked key's -inf too)
  // 2^t with t = x log2(e) = n + f, |f| <= 1/2: a degree-5 polynomial for 2^f, scaled by 2^n (VSCALEFPS)
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.0f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.33335581e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.61812911e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55041087e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40226507e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147182e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), p, n);  // masked keys: 0
}

constexpr int L = 16;  // pairs (row, query head) per task: one per lane
constexpr int KJ = 16; // keys per block

// acc + a . (the 32-bit pair at p, broadcast to every lane): VDPBF16PS with an embedded broadcast, one
// instruction (written out: the compiler emits a separate broadcast, half of the loop's vector work)
inline __m512 dp_bcast(__m512 acc, __m512bh a, const uint32_t* p) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*p));
  return acc;
}

// One tile: up to 16 pairs (row, query head) of one KV head, one pair per lane. A block's 16 scores are
// 16 vectors over the pairs (a key's two dims broadcast against the pairs' packed queries); nothing is
// summed across lanes. Three passes, each a lane's own arithmetic in one fixed order:
//   scores  every visible key's score (an invisible key's: -inf) and the lane's maximum (exact, so the
//           same whichever blocks or tasks found it);
//   probs   p = exp(score - maximum), rounded to bf16, packed as key pairs (the earlier key in the high
//           half: VDPBF16PS adds the high product first, then the low one, two float32 roundings);
//   values  acc[d] and the sum l over the keys in order, one VDPBF16PS per key pair.
// So a lane's output is the same sequence of roundings over its visible keys in ascending order, and an
// invisible key between them (p = 0, an exact no-op) changes nothing: a row gives the same bits whether
// its keys lie in a tree, a prefill chunk, one row's step or another request's slab, and wherever the
// blocks, tasks or the keys' two-key pairs fall (the batch-invariance the seeds rely on).
template <int D>
struct Tile {
  alignas(64) uint32_t qp[D / 2][L];  // the pairs' queries, two dims per 32-bit lane
  int row[L], head[L];
  int np;
};

// scores of one block of keys (rows of D bf16, `lk` apart) into s [KJ][L]; the lanes' running maximum
template <int D>
inline void tile_scores(const Tile<D>& T, const uint16_t* k, int64_t lk, int nb, const uint16_t* lanes, float scale,
                        float* s, float* mx) {
  alignas(64) uint16_t pad[KJ * D];
  if (nb < KJ || lk != D) {  // keys as rows of D / 2 32-bit lanes, D apart; a partial block zero-padded
    for (int j = 0; j < KJ; ++j) {
      if (j < nb) std::memcpy(pad + j * D, k + j * lk, sizeof(uint16_t) * D);
      else std::memset(pad + j * D, 0, sizeof(uint16_t) * D);
    }
    k = pad;
  }
  const uint32_t* kb = reinterpret_cast<const uint32_t*>(k);
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0, s8 = s0, s9 = s0,
         s10 = s0, s11 = s0, s12 = s0, s13 = s0, s14 = s0, s15 = s0;
  for (int d2 = 0; d2 < D / 2; ++d2) {
    const __m512bh q = (__m512bh)_mm512_load_si512(T.qp[d2]);
#define ADAPTIVESPEC_QK(j) s##j = dp_bcast(s##j, q, kb + (j) * (D / 2) + d2);
    ADAPTIVESPEC_QK(0) ADAPTIVESPEC_QK(1) ADAPTIVESPEC_QK(2) ADAPTIVESPEC_QK(3) ADAPTIVESPEC_QK(4) ADAPTIVESPEC_QK(5)
    ADAPTIVESPEC_QK(6) ADAPTIVESPEC_QK(7) ADAPTIVESPEC_QK(8) ADAPTIVESPEC_QK(9) ADAPTIVESPEC_QK(10) ADAPTIVESPEC_QK(11)
    ADAPTIVESPEC_QK(12) ADAPTIVESPEC_QK(13) ADAPTIVESPEC_QK(14) ADAPTIVESPEC_QK(15)
#undef ADAPTIVESPEC_QK
  }
  const __m512 sv[KJ] = {s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15};
  const __m512 sc = _mm512_set1_ps(scale);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m = _mm512_loadu_ps(mx);
  for (int j = 0; j < KJ; ++j) {
    const __mmask16 vis = j < nb ? (lanes ? static_cast<__mmask16>(lanes[j]) : static_cast<__mmask16>(0xFFFF)) : 0;
    const __m512 v = _mm512_mask_blend_ps(vis, ninf, _mm512_mul_ps(sv[j], sc));
    _mm512_storeu_ps(s + j * L, v);
    m = _mm512_max_ps(m, v);
  }
  _mm512_storeu_ps(mx, m);
}

// s [KJ][L] -> pp [KJ / 2][L] (in place: pp's pair j2 overwrites no score not yet read)
inline void tile_probs(float* s, const float* mx) {
  const __m512 m = _mm512_loadu_ps(mx);
  uint32_t* pp = reinterpret_cast<uint32_t*>(s);
  for (int j2 = 0; j2 < KJ / 2; ++j2) {
    const __m512 p0 = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + 2 * j2 * L), m));
    const __m512 p1 = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + (2 * j2 + 1) * L), m));
    const __m512i a = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p0));
    const __m512i b = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p1));
    _mm512_storeu_si512(pp + j2 * L, _mm512_or_si512(b, _mm512_slli_epi32(a, 16)));  // the earlier key high
  }
}

// acc[d0 .. d0 + 16) over blocks [0, nblk) of packed probabilities pp (KJ / 2 x L words a block) and values
// vp (KJ / 2 x D words a block); with `l`, also the sum of the probabilities, key by key
template <int D>
inline void tile_values(const uint32_t* pp, int64_t pstride, const uint32_t* vp, int64_t nblk, int d0, float* acc,
                        float* l) {
#define ADAPTIVESPEC_ACC(c) __m512 a##c = _mm512_setzero_ps();
  ADAPTIVESPEC_ACC(0) ADAPTIVESPEC_ACC(1) ADAPTIVESPEC_ACC(2) ADAPTIVESPEC_ACC(3) ADAPTIVESPEC_ACC(4) ADAPTIVESPEC_ACC(5)
  ADAPTIVESPEC_ACC(6) ADAPTIVESPEC_ACC(7) ADAPTIVESPEC_ACC(8) ADAPTIVESPEC_ACC(9) ADAPTIVESPEC_ACC(10)
  ADAPTIVESPEC_ACC(11) ADAPTIVESPEC_ACC(12) ADAPTIVESPEC_ACC(13) ADAPTIVESPEC_ACC(14) ADAPTIVESPEC_ACC(15)
#undef ADAPTIVESPEC_ACC
  __m512 ls = _mm512_setzero_ps();
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t blk = 0; blk < nblk; ++blk) {
    const uint32_t* pb = pp + blk * pstride;
    const uint32_t* vb = vp + blk * (KJ / 2) * D + d0;
    for (int j2 = 0; j2 < KJ / 2; ++j2) {
      const __m512i pw = _mm512_loadu_si512(pb + j2 * L);
      const __m512bh p = (__m512bh)pw;
      const uint32_t* vr = vb + j2 * D;
#define ADAPTIVESPEC_PV(c) a##c = dp_bcast(a##c, p, vr + (c));
      ADAPTIVESPEC_PV(0) ADAPTIVESPEC_PV(1) ADAPTIVESPEC_PV(2) ADAPTIVESPEC_PV(3) ADAPTIVESPEC_PV(4) ADAPTIVESPEC_PV(5)
      ADAPTIVESPEC_PV(6) ADAPTIVESPEC_PV(7) ADAPTIVESPEC_PV(8) ADAPTIVESPEC_PV(9) ADAPTIVESPEC_PV(10)
      ADAPTIVESPEC_PV(11) ADAPTIVESPEC_PV(12) ADAPTIVESPEC_PV(13) ADAPTIVESPEC_PV(14) ADAPTIVESPEC_PV(15)
#undef ADAPTIVESPEC_PV
      if (l) {  // the earlier key's p (high half), then the later one's
        ls = _mm512_add_ps(ls, _mm512_castsi512_ps(_mm512_and_si512(pw, hi)));
        ls = _mm512_add_ps(ls, _mm512_castsi512_ps(_mm512_slli_epi32(pw, 16)));
      }
    }
  }
#define ADAPTIVESPEC_ST(c) _mm512_storeu_ps(acc + (d0 + c) * L, a##c);
  ADAPTIVESPEC_ST(0) ADAPTIVESPEC_ST(1) ADAPTIVESPEC_ST(2) ADAPTIVESPEC_ST(3) ADAPTIVESPEC_ST(4) ADAPTIVESPEC_ST(5)
  ADAPTIVESPEC_ST(6) ADAPTIVESPEC_ST(7) ADAPTIVESPEC_ST(8) ADAPTIVESPEC_ST(9) ADAPTIVESPEC_ST(10)
  ADAPTIVESPEC_ST(11) ADAPTIVESPEC_ST(12) ADAPTIVESPEC_ST(13) ADAPTIVESPEC_ST(14) ADAPTIVESPEC_ST(15)
#undef ADAPTIVESPEC_ST
  if (l) _mm512_storeu_ps(l, ls);
}

// values [KJ][D] (rows `lv` apart) -> vp [KJ/2][D] 32-bit lanes (V[2j][d] high, V[2j+1][d] low); missing keys 0
template <int D>
inline void pack_values(const uint16_t* v, int64_t lv, int nb, uint32_t* vp) {
  for (int j2 = 0; j2 < KJ / 2; ++j2) {
    const int a = 2 * j2, b = 2 * j2 + 1;
    for (int d0 = 0; d0 < D; d0 += 16) {
      __m256i ra = a < nb ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + a * lv + d0)) : _mm256_setzero_si256();
      __m256i rb = b < nb ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + b * lv + d0)) : _mm256_setzero_si256();
      _mm512_storeu_si512(vp + j2 * D + d0, _mm512_or_si512(_mm512_cvtepu16_epi32(rb), _mm512_slli_epi32(_mm512_cvtepu16_epi32(ra), 16)));
    }
  }
}

// One sequence's rows and keys: rows [row0, row0 + n) of q (and of out), keys / values [Hkv, S, D]
// from kb / vb (strides over heads and keys), visibility as attend_bf16's.
struct Seq {
  int64_t row0, n;
  const uint16_t *kb, *vb;
  int64_t ks0, ks1, vs0, vs1, S, past;
  const bool* mask;
  int64_t mld;
  bool causal;
  int64_t reach(int64_t i) const { return mask ? S : (causal ? std::min(S, past + i + 1) : S); }
  bool visible(int64_t i, int64_t j) const { return j < past || (mask ? mask[i * mld + (j - past)] : j < reach(i)); }
};

template <int D>
void attend_impl(const uint16_t* qptr, int64_t qs0, int64_t qs1, int64_t H, int64_t Hkv, const std::vector<Seq>& seqs,
                 float scale, uint16_t* op, int64_t ldo) {
  const int64_t g = H / Hkv;
  const int64_t blk_words = (KJ / 2) * D, sblk = KJ * L;  // a block's packed values; a block's scores per tile
  // values packed once per call (key pairs per dim); keys are read in place. Task lists over all sequences.
  std::vector<int64_t> blk0(seqs.size() + 1, 0), tile0(seqs.size() + 1, 0), tiles(seqs.size());
  for (size_t s = 0; s < seqs.size(); ++s) {
    blk0[s + 1] = blk0[s] + Hkv * ((seqs[s].S + KJ - 1) / KJ);
    tiles[s] = (seqs[s].n * g + L - 1) / L;
    tile0[s + 1] = tile0[s] + Hkv * tiles[s];
  }
  auto seq_of = [](const std::vector<int64_t>& starts, int64_t t) {
    return static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), t) - starts.begin() - 1);
  };
  // A tiny call (one row over a few hundred keys: < 64 tile-blocks) runs on the calling thread, where
  // waking the other costs what it would save (one row over 300 keys: 1.04x the time on two threads;
  // from 8 tree rows at 300 keys on, two threads take 0.6-0.85x the time of one).
  int64_t work = 0;
  for (size_t s = 0; s < seqs.size(); ++s) work += Hkv * tiles[s] * ((seqs[s].S + KJ - 1) / KJ);
  const int64_t one = std::numeric_limits<int64_t>::max() / 4;  // a grain no call reaches: one thread
  const int64_t g1 = work < 64 ? one : 1, g16 = work < 64 ? one : 16;
  std::unique_ptr<uint32_t[]> vpack(new uint32_t[blk0.back() * blk_words]);
  at::parallel_for(0, blk0.back(), g16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const Seq& q = seqs[seq_of(blk0, t)];
      const int64_t local = t - blk0[seq_of(blk0, t)], nblk = (q.S + KJ - 1) / KJ;
      const int64_t kv = local / nblk, j0 = (local % nblk) * KJ;
      pack_values<D>(q.vb + kv * q.vs0 + j0 * q.vs1, q.vs1, static_cast<int>(std::min<int64_t>(KJ, q.S - j0)),
                     vpack.get() + t * blk_words);
    }
  });
  // A tile's pairs, their rows' first partly hidden key (`full`) and the end of their keys (`last`).
  struct Info { size_t seq; int64_t kv, full, last, nblk; };
  const int64_t ntiles = tile0.back();
  std::vector<Info> info(ntiles);
  std::vector<Tile<D>> T(ntiles);
  at::parallel_for(0, ntiles, g16, [&](int64_t b, int64_t e) {
    for (int64_t tile = b; tile < e; ++tile) {
      const size_t si = seq_of(tile0, tile);
      const Seq& sq = seqs[si];
      const int64_t local = tile - tile0[si], kv = local / tiles[si], pairs = sq.n * g;
      const int64_t a0 = (local % tiles[si]) * L, a1 = std::min(pairs, a0 + L);
      Tile<D>& t = T[tile];
      t.np = static_cast<int>(a1 - a0);
      int64_t full = sq.S, last = 0;
      for (int lane = 0; lane < L; ++lane) {
        const int64_t a = a0 + std::min<int64_t>(lane, t.np - 1);  // idle lanes repeat the last pair
        const int64_t i = a / g, hh = a % g;
        t.row[lane] = static_cast<int>(i);
        t.head[lane] = static_cast<int>(kv * g + hh);
        const uint32_t* qr = reinterpret_cast<const uint32_t*>(qptr + (sq.row0 + i) * qs0 + (kv * g + hh) * qs1);
        for (int d2 = 0; d2 < D / 2; ++d2) t.qp[d2][lane] = qr[d2];
        full = std::min(full, sq.mask ? sq.past : sq.reach(i));
        last = std::max(last, sq.reach(i));
      }
      info[tile] = Info{si, kv, full, last, (last + KJ - 1) / KJ};
    }
  });
  // scores of blocks [b0, b1) for the tiles [t0, t0 + count) of one (sequence, KV head), each block read
  // once for all of them while it is in L1; s(tile, blk) is where a tile's block goes, mx(tile) its maxima
  auto scores = [&](int64_t t0, int64_t count, int64_t b0, int64_t b1, auto s, auto mx) {
    alignas(64) uint16_t lanes[KJ];
    const Seq& sq = seqs[info[t0].seq];
    const int64_t kv = info[t0].kv;
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t j0 = blk * KJ;
      const int nb = static_cast<int>(std::min<int64_t>(KJ, sq.S - j0));
      const uint16_t* kblk = sq.kb + kv * sq.ks0 + j0 * sq.ks1;
      for (int64_t c = 0; c < count; ++c) {
        const Info& in = info[t0 + c];
        if (blk >= in.nblk) continue;  // past every key this tile's rows see
        const Tile<D>& t = T[t0 + c];
        const uint16_t* lp = nullptr;
        if (j0 + KJ > in.full) {  // the edge: each key's lanes that see it
          for (int jj = 0; jj < KJ; ++jj) {
            uint16_t bits = 0;
            if (jj < nb)
              for (int lane = 0; lane < L; ++lane)
                if (sq.visible(t.row[lane], j0 + jj)) bits |= static_cast<uint16_t>(1u << lane);
            lanes[jj] = bits;
          }
          lp = lanes;
        }
        tile_scores<D>(t, kblk, sq.ks1, nb, lp, scale, s(t0 + c, blk), mx(t0 + c));
      }
    }
  };
  auto write = [&](int64_t tile, const float* l, const float* acc) {
    const Tile<D>& t = T[tile];
    const Seq& sq = seqs[info[tile].seq];
    for (int lane = 0; lane < t.np; ++lane) {
      uint16_t* o = op + (sq.row0 + t.row[lane]) * ldo + t.head[lane] * D;
      const float inv = l[lane] > 0.f ? 1.0f / l[lane] : 0.f;
      for (int d = 0; d < D; ++d) o[d] = c10::BFloat16(acc[d * L + lane] * inv).x;
    }
  };
  auto vals_of = [&](int64_t tile) {
    const Info& in = info[tile];
    const int64_t nblk = (seqs[in.seq].S + KJ - 1) / KJ;
    return vpack.get() + (blk0[in.seq] + in.kv * nblk) * blk_words;
  };
  // Groups of up to GT tiles of one (sequence, KV head) read each key block once for all of them.
  constexpr int64_t GT = 4;
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> grp0(seqs.size() + 1, 0), groups(seqs.size());
  int64_t longest = 0;
  for (size_t q = 0; q < seqs.size(); ++q) {
    groups[q] = (tiles[q] + GT - 1) / GT;
    grp0[q + 1] = grp0[q] + Hkv * groups[q];
    longest = std::max(longest, (seqs[q].S + KJ - 1) / KJ);
  }
  const int64_t ngroups = grp0.back();
  auto group_tiles = [&](int64_t grp, int64_t& t0, int64_t& count) {
    const size_t si = seq_of(grp0, grp);
    const int64_t glocal = grp - grp0[si], kv = glocal / groups[si], first = (glocal % groups[si]) * GT;
    t0 = tile0[si] + kv * tiles[si] + first;
    count = std::min(GT, tiles[si] - first);
  };
  const bool few = ngroups < 4 * threads && ntiles * longest * sblk * 4 <= (int64_t(64) << 20);
  if (!few) {  // many groups (prefill chunks, big trees, batches): a task runs a group's three passes
    at::parallel_for(0, ngroups, g1, [&](int64_t b, int64_t e) {
      std::vector<float> buf;
      alignas(64) float mx[GT][L], acc[D * L], l[L];
      for (int64_t grp = b; grp < e; ++grp) {
        int64_t t0, count;
        group_tiles(grp, t0, count);
        int64_t nmax = 0;
        for (int64_t c = 0; c < count; ++c) nmax = std::max(nmax, info[t0 + c].nblk);
        buf.resize(static_cast<size_t>(count * nmax * sblk));
        for (int64_t c = 0; c < count; ++c) std::fill(mx[c], mx[c] + L, -std::numeric_limits<float>::infinity());
        scores(t0, count, 0, nmax, [&](int64_t tile, int64_t blk) { return buf.data() + ((tile - t0) * nmax + blk) * sblk; },
               [&](int64_t tile) { return mx[tile - t0]; });
        for (int64_t c = 0; c < count; ++c) {
          float* s = buf.data() + c * nmax * sblk;
          for (int64_t blk = 0; blk < info[t0 + c].nblk; ++blk) tile_probs(s + blk * sblk, mx[c]);
          const uint32_t* pp = reinterpret_cast<const uint32_t*>(s);
          for (int d0 = 0; d0 < D; d0 += 16)
            tile_values<D>(pp, sblk, vals_of(t0 + c), info[t0 + c].nblk, d0, acc, d0 == 0 ? l : nullptr);
          write(t0 + c, l, acc);
        }
      }
    });
    return;
  }
  // Few groups (a plain step, a small tree): the passes are split further so that every thread has work,
  // scores by key ranges, values by ranges of dims, through one buffer [tile][block][KJ][L].
  constexpr int64_t RB = 32;  // blocks per score task
  const int64_t nranges = (longest + RB - 1) / RB;
  // (left unfilled: every block a pass reads, the pass before wrote; zeroing it cost a step's worth of
  // memset at long context, ~0.8 MB a layer for one row at 4k)
  std::unique_ptr<float[]> buf(new float[ntiles * longest * sblk]);
  std::vector<float> rmax(static_cast<size_t>(ntiles * nranges * L), -std::numeric_limits<float>::infinity());
  auto sp = [&](int64_t tile, int64_t blk) { return buf.get() + (tile * longest + blk) * sblk; };
  at::parallel_for(0, ngroups * nranges, g1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      int64_t t0, count;
      group_tiles(t / nranges, t0, count);
      const int64_t r = t % nranges;
      scores(t0, count, r * RB, std::min(longest, (r + 1) * RB), sp,
             [&](int64_t tile) { return rmax.data() + (tile * nranges + r) * L; });
    }
  });
  std::unique_ptr<float[]> mx(new float[ntiles * L]);
  for (int64_t tile = 0; tile < ntiles; ++tile)
    for (int lane = 0; lane < L; ++lane) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t r = 0; r < nranges; ++r) m = std::max(m, rmax[(tile * nranges + r) * L + lane]);
      mx[tile * L + lane] = m;
    }
  at::parallel_for(0, ntiles * nranges, g1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t tile = t / nranges, r = t % nranges;
      for (int64_t blk = r * RB; blk < std::min(info[tile].nblk, (r + 1) * RB); ++blk) tile_probs(sp(tile, blk), &mx[tile * L]);
    }
  });
  constexpr int64_t DG = D / 16;
  std::unique_ptr<float[]> acc(new float[ntiles * D * L]), lsum(new float[ntiles * L]);
  at::parallel_for(0, ntiles * DG, g1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t tile = t / DG, d0 = (t % DG) * 16;
      tile_values<D>(reinterpret_cast<const uint32_t*>(sp(tile, 0)), sblk, vals_of(tile), info[tile].nblk,
                     static_cast<int>(d0), &acc[tile * D * L], d0 == 0 ? &lsum[tile * L] : nullptr);
    }
  });
  at::parallel_for(0, ntiles, g16, [&](int64_t b, int64_t e) {
    for (int64_t tile = b; tile < e; ++tile) write(tile, &lsum[tile * L], &acc[tile * D * L]);
  });
}

template <int D>
void attend_one(const at::Tensor& q, const std::vector<Seq>& seqs, int64_t Hkv, float scale, at::Tensor& out) {
  attend_impl<D>(reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()), q.stride(0), q.stride(1), q.size(1),
                 Hkv, seqs, scale, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), out.stride(0));
}

void dispatch(const at::Tensor& q, const std::vector<Seq>& seqs, int64_t Hkv, float scale, at::Tensor& out) {
  const int64_t D = q.size(2);
  if (D == 64) attend_one<64>(q, seqs, Hkv, scale, out);
  else if (D == 128) attend_one<128>(q, seqs, Hkv, scale, out);
  else if (D == 32) attend_one<32>(q, seqs, Hkv, scale, out);
  else TORCH_CHECK(false, "attend_bf16: head_dim 32, 64 or 128");
}
#endif

bool available() {
#if defined(ADAPTIVESPEC_BF16_ATTENTION)
  return true;
#else
  return false;
#endif
}

at::Tensor attend_bf16(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t past,
                       const c10::optional<at::Tensor>& mask, bool causal, double scale) {
  TORCH_CHECK(available(), "attend_bf16: built without AVX512-BF16");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.dim() == 3, "attend_bf16: q [n, H, D], keys / values [Hkv, S, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
              values.scalar_type() == at::kBFloat16, "attend_bf16: bfloat16 tensors");
  TORCH_CHECK(q.stride(2) == 1 && keys.stride(2) == 1 && values.stride(2) == 1, "attend_bf16: unit stride in D");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), Hkv = keys.size(0), S = keys.size(1);
  TORCH_CHECK(H % Hkv == 0 && values.size(0) == Hkv && values.size(1) == S, "attend_bf16: heads / keys disagree");
  TORCH_CHECK(past >= 0 && past <= S, "attend_bf16: past outside the keys");
  auto out = at::empty({n, H * D}, q.options());
  at::Tensor mk;
  const bool* mp = nullptr;
  int64_t mld = 0;
  if (mask.has_value()) {
    mk = mask->to(at::kBool).contiguous();
    TORCH_CHECK(mk.dim() == 2 && mk.size(0) == n && mk.size(1) >= S - past, "attend_bf16: mask [n, >= S - past]");
    mp = mk.data_ptr<bool>();
    mld = mk.size(1);
  }
#if defined(ADAPTIVESPEC_BF16_ATTENTION)
  auto kb = reinterpret_cast<const uint16_t*>(keys.data_ptr<at::BFloat16>());
  auto vb = reinterpret_cast<const uint16_t*>(values.data_ptr<at::BFloat16>());
  std::vector<Seq> seqs{Seq{0, n, kb, vb, keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), S, past,
                            mp, mld, causal}};
  dispatch(q, seqs, Hkv, static_cast<float>(scale), out);
#endif
  return out;
}

// attend_slab  q [R, H, D] (packed rows of several requests), the slab's keys / values [slots, Hkv, cap, D],
//              meta int64 [m, 5]: per request (first row, rows, slot, past, mask offset or -1: causal),
//              masks: the requests' tree masks [rows, rows] flattened one after another (bool),
//              out [R, H * D]: the requests' rows written in place (the others untouched).
void attend_slab(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& meta,
                 const at::Tensor& masks, double scale, at::Tensor& out) {
  TORCH_CHECK(available(), "attend_slab: built without AVX512-BF16");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.dim() == 4, "attend_slab: q [R, H, D], slab [slots, Hkv, cap, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
              values.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, "attend_slab: bfloat16 tensors");
  TORCH_CHECK(q.stride(2) == 1 && keys.stride(3) == 1 && values.stride(3) == 1 && out.stride(1) == 1,
              "attend_slab: unit stride in D");
  TORCH_CHECK(meta.dim() == 2 && meta.size(1) == 5 && meta.scalar_type() == at::kLong, "attend_slab: meta int64 [m, 5]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == q.size(0) && out.size(1) == q.size(1) * q.size(2), "attend_slab: out [R, H * D]");
  auto mt = meta.contiguous();
  auto mk = masks.to(at::kBool).contiguous();
  const int64_t* m = mt.data_ptr<int64_t>();
  const bool* mp = mk.numel() ? mk.data_ptr<bool>() : nullptr;
  const int64_t Hkv = keys.size(1);
  TORCH_CHECK(q.size(1) % Hkv == 0, "attend_slab: heads / KV heads disagree");
  std::vector<Seq> seqs;
  for (int64_t r = 0; r < mt.size(0); ++r) {
    const int64_t row0 = m[5 * r], n = m[5 * r + 1], slot = m[5 * r + 2], past = m[5 * r + 3], off = m[5 * r + 4];
    TORCH_CHECK(row0 >= 0 && n >= 1 && row0 + n <= q.size(0) && slot >= 0 && slot < keys.size(0) &&
                past >= 0 && past + n <= keys.size(2), "attend_slab: a request's rows, slot or keys out of range");
    TORCH_CHECK(off < 0 || off + n * n <= mk.numel(), "attend_slab: mask offset out of range");
#if defined(ADAPTIVESPEC_BF16_ATTENTION)
    auto kb = reinterpret_cast<const uint16_t*>(keys.data_ptr<at::BFloat16>()) + slot * keys.stride(0);
    auto vb = reinterpret_cast<const uint16_t*>(values.data_ptr<at::BFloat16>()) + slot * values.stride(0);
    seqs.push_back(Seq{row0, n, kb, vb, keys.stride(1), keys.stride(2), values.stride(1), values.stride(2), past + n, past,
                       off >= 0 ? mp + off : nullptr, n, off < 0});
#endif
  }
#if defined(ADAPTIVESPEC_BF16_ATTENTION)
  if (!seqs.empty()) dispatch(q, seqs, Hkv, static_cast<float>(scale), out);
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether the kernel was built (AVX512-BF16)");
  m.def("attend_slab", &attend_slab, "attend_bf16 for several requests' rows over a slab of caches, in one call");
  m.def("attend_bf16", &attend_bf16, "bf16 attention over a cache: a prefix every row sees, then a tree or causal edge");
}
