// ringllm's CPU kernels for fp32 on AVX2 + FMA, registered as torch ops (torch.ops.ringllm_cpu.*) and
// built once on first use by runtime/cpu_kernels.py. A decode step on CPU spends its time streaming
// weights for a handful of rows, reading each sequence's K and V pages, and in small elementwise ops
// (each a handful of torch calls); each kernel here does one of those in one pass.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// The eight sums of a[0..7], one per lane.
inline __m256 hsum8(const __m256 a[8]) {
    const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

inline float dot(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < n; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
    return hsum(acc);
}

// y[m, n] for weight rows `n` (and `n2` when two: each x load then feeds two FMAs). Rows come four
// at a time; a short last group repeats row m and drops what it computes.
template <int R>
void weight_rows(const float *x, int64_t M, int64_t K, const float *w, const float *bias, float *y, int64_t N,
                 int64_t n, int64_t n2) {
    const float *p[2] = {w + n * K, w + n2 * K};
    const int64_t out[2] = {n, n2};
    for (int64_t m = 0; m < M; m += 4) {
        const float *xs[4];
        for (int j = 0; j < 4; j++) xs[j] = x + std::min(m + j, M - 1) * K;
        __m256 acc[R][4];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8) {
            __m256 v[R];
            for (int r = 0; r < R; r++) v[r] = _mm256_loadu_ps(p[r] + k);
            for (int j = 0; j < 4; j++) {
                const __m256 s = _mm256_loadu_ps(xs[j] + k);
                for (int r = 0; r < R; r++) acc[r][j] = _mm256_fmadd_ps(s, v[r], acc[r][j]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 4 && m + j < M; j++) y[(m + j) * N + out[r]] = hsum(acc[r][j]) + (bias ? bias[out[r]] : 0.f);
    }
}

// y = x W^T (+ b) for few rows of x, bound by the weight's memory traffic. Each thread streams a
// contiguous share of W's rows as two long sequential runs (its first half and its second), which
// the hardware prefetcher follows; neighbouring rows taken together, or a oneDNN GEMM, streamed at
// half the memory bandwidth on a 2-core AVX2 EPYC.
at::Tensor skinny_linear(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
    const int64_t N = weight.size(0), K = weight.size(1);
    TORCH_CHECK(weight.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat && weight.is_contiguous(),
                "skinny_linear takes fp32 inputs and a contiguous weight");
    TORCH_CHECK(K % 8 == 0 && x.size(-1) == K, "skinny_linear needs in_features divisible by 8, and x's to match");
    const at::Tensor rows = x.reshape({-1, K}).contiguous();
    const int64_t M = rows.size(0);
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = N;
    at::Tensor y = at::empty(shape, x.options());
    const at::Tensor b = bias && bias->defined() ? bias->contiguous() : at::Tensor();
    const float *xp = rows.data_ptr<float>(), *wp = weight.data_ptr<float>(), *bp = b.defined() ? b.data_ptr<float>() : nullptr;
    float *yp = y.data_ptr<float>();
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
        const int64_t half = (end - begin) / 2;
        for (int64_t i = 0; i < half; i++) weight_rows<2>(xp, M, K, wp, bp, yp, N, begin + i, begin + half + i);
        if ((end - begin) % 2) weight_rows<1>(xp, M, K, wp, bp, yp, N, end - 1, end - 1);
    });
    return y;
}

// Decode attention straight from the paged pool: q [B, H, D]; pool [pages, 2 (K, V), page slots, KV
// heads, D]; pages [B, width], each sequence's pages in order; kv_lens [B]; window: the last tokens a row
// sees (0: all); softcap: scores s become softcap·tanh(s/softcap) (0: as they are); sinks [H]: a logit per head that
// joins the softmax's sum (GPT-OSS; none: nothing joins). Query heads g·G .. g·G+G-1
// share KV head g (Hugging Face's repeat_kv order). Work is split over (sequence, KV head) pairs, and a
// thread takes the pairs of one sequence in one sweep over its rows: a slot's heads lie side by side,
// so the sweep reads whole cache lines once (one pair at a time read each slot's lines three times
// over with 3 KV heads, and ran no faster than gathering the pages for SDPA). Per sweep: every score,
// the softmax, then the weighted sum of V.
void attend(const float *q, const float *kv, const int64_t *pages, int64_t first, int64_t end, int64_t S, int64_t KVH,
            int64_t G, int64_t D, int64_t g0, int64_t g1, float scale, float softcap, const float *sinks, float *out,
            std::vector<float> &scores, std::vector<const float *> &keys) {
    using Vec = at::vec::Vectorized<float>;
    const int64_t heads = (g1 - g0) * G, row = KVH * D, L = end - first;
    keys.resize(L);  // tokens first..end-1's K rows (V rows lie S rows further): no division per token and head
    for (int64_t t = 0; t < L; t++) keys[t] = kv + (pages[(first + t) / S] * 2 * S + (first + t) % S) * row;
    q += g0 * G * D;
    out += g0 * G * D;
    scores.resize(heads * L);
    int64_t t = 0;
    for (; t + 8 <= L; t += 8) {  // eight tokens, every head: their rows are read once, whole
        for (int64_t h = 0; h < heads; h++) {  // eight dots at once: one dot alone waits on its chain of FMAs
            const float *qh = q + h * D;
            const int64_t offset = (g0 + h / G) * D;
            __m256 acc[8];
            for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 qd = _mm256_loadu_ps(qh + d);
                for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(keys[t + i] + offset + d), acc[i]);
            }
            _mm256_storeu_ps(scores.data() + h * L + t, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)));
        }
    }
    for (; t < L; t++)
        for (int64_t h = 0; h < heads; h++) scores[h * L + t] = dot(q + h * D, keys[t] + (g0 + h / G) * D, D) * scale;
    if (softcap > 0)
        for (int64_t i = 0; i < heads * L; i++) scores[i] = softcap * std::tanh(scores[i] / softcap);
    std::fill(out, out + heads * D, 0.f);
    for (int64_t h = 0; h < heads; h++) {
        float *s = scores.data() + h * L;
        const float sink = sinks ? sinks[g0 * G + h] : -INFINITY;
        const float top = std::max(*std::max_element(s, s + L), sink);
        at::vec::map([top](Vec v) { return (v - Vec(top)).exp_u20(); }, s, s, L);
        const float sum = at::vec::reduce_all<float>([](Vec a, Vec b) { return a + b; }, s, L);
        const float norm = 1.f / (sinks ? sum + std::exp(sink - top) : sum);
        at::vec::map([norm](Vec v) { return v * Vec(norm); }, s, s, L);
    }
    for (int64_t t = 0; t < L; t++) {
        const float *v = keys[t] + S * row + g0 * D;
        for (int64_t h = 0; h < heads; h++) {
            const float w = scores[h * L + t], *vh = v + (h / G) * D;
            float *o = out + h * D;
            for (int64_t d = 0; d < D; d++) o[d] += w * vh[d];
        }
    }
}

at::Tensor paged_decode_attention(const at::Tensor &q, const at::Tensor &pool, const at::Tensor &pages,
                                  const at::Tensor &kv_lens, double scale, int64_t window, double softcap,
                                  const std::optional<at::Tensor> &sinks) {
    TORCH_CHECK(q.scalar_type() == at::kFloat && pool.scalar_type() == at::kFloat && pool.is_contiguous(),
                "paged_decode_attention takes fp32 q and a contiguous fp32 pool");
    TORCH_CHECK(pages.scalar_type() == at::kLong && kv_lens.scalar_type() == at::kLong, "pages and kv_lens are int64");
    const at::Tensor qc = q.contiguous(), pc = pages.contiguous(), lc = kv_lens.contiguous();
    const int64_t B = qc.size(0), H = qc.size(1), D = qc.size(2);
    const int64_t S = pool.size(2), KVH = pool.size(3), width = pc.size(1);
    TORCH_CHECK(pool.size(4) == D && D % 8 == 0 && H % KVH == 0, "head sizes disagree, or D is not a multiple of 8");
    const int64_t *lens = lc.data_ptr<int64_t>();
    const at::Tensor sc = sinks && sinks->defined() ? sinks->to(at::kFloat).contiguous() : at::Tensor();
    TORCH_CHECK(!sc.defined() || sc.numel() == qc.size(1), "a sink a query head");
    const float *sink = sc.defined() ? sc.data_ptr<float>() : nullptr;
    for (int64_t b = 0; b < B; b++) TORCH_CHECK(0 < lens[b] && lens[b] <= width * S, "a sequence's length does not fit its pages");
    at::Tensor out = at::empty_like(qc);
    const float *qp = qc.data_ptr<float>(), *kv = pool.data_ptr<float>();
    const int64_t *page = pc.data_ptr<int64_t>();
    float *op = out.data_ptr<float>();
    at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores;
        std::vector<const float *> keys;
        for (int64_t pair = begin; pair < end;) {
            const int64_t b = pair / KVH, g0 = pair % KVH, g1 = std::min(KVH, g0 + end - pair);
            const int64_t first = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
            attend(qp + b * H * D, kv, page + b * width, first, lens[b], S, KVH, H / KVH, D, g0, g1, scale, softcap, sink,
                   op + b * H * D, scores, keys);
            pair += g1 - g0;
        }
    });
    return out;
}

// RMSNorm over the last dimension, in Hugging Face's order of operations: weight * (x * rsqrt(mean(x²) +
// eps)). torch's rms_norm ran as seven small ops, ~40 us a call for a decode step's 4 rows.
void norm_rows(const float *x, const float *weight, float eps, int64_t n, float *out) {
    using Vec = at::vec::Vectorized<float>;
    const float squares = at::vec::map_reduce_all<float>([](Vec v) { return v * v; }, [](Vec a, Vec b) { return a + b; }, x, n);
    const float scale = 1.f / std::sqrt(squares / n + eps);
    at::vec::map2([scale](Vec v, Vec w) { return w * (v * Vec(scale)); }, out, x, weight, n);
}

constexpr int64_t ELEMENTWISE_GRAIN = 1 << 15;  // floats a thread takes at least: a decode step's rows stay on one

at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &weight, double eps) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm takes fp32");
    const int64_t n = x.size(-1);
    const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
    at::Tensor out = at::empty_like(xc);
    const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>();
    float *op = out.data_ptr<float>();
    at::parallel_for(0, xc.numel() / n, std::max<int64_t>(1, ELEMENTWISE_GRAIN / n), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; r++) norm_rows(xp + r * n, wp, eps, n, op + r * n);
    });
    return out;
}

// In place, as the CUDA op sets do: residual += x, then x = rms_norm(residual).
void add_rms_norm(at::Tensor &x, at::Tensor &residual, const at::Tensor &weight, double eps) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && residual.scalar_type() == at::kFloat && x.is_contiguous() &&
                residual.is_contiguous() && x.sizes() == residual.sizes(), "add_rms_norm takes contiguous fp32 of one shape");
    using Vec = at::vec::Vectorized<float>;
    const int64_t n = x.size(-1);
    const at::Tensor wc = weight.contiguous();
    float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>();
    const float *wp = wc.data_ptr<float>();
    at::parallel_for(0, x.numel() / n, std::max<int64_t>(1, ELEMENTWISE_GRAIN / n), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; r++) {
            at::vec::map2([](Vec a, Vec b) { return a + b; }, rp + r * n, xp + r * n, rp + r * n, n);
            norm_rows(rp + r * n, wp, eps, n, xp + r * n);
        }
    });
}

// [rows, 2I] -> [rows, I]: silu(gate) * up, with torch's silu (x / (1 + exp(-x))).
at::Tensor silu_and_mul(const at::Tensor &gate_up) {
    TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.size(-1) % 2 == 0, "silu_and_mul takes fp32 [..., 2I]");
    using Vec = at::vec::Vectorized<float>;
    const at::Tensor in = gate_up.contiguous();
    const int64_t width = in.size(-1) / 2;
    std::vector<int64_t> shape(in.sizes().begin(), in.sizes().end());
    shape.back() = width;
    at::Tensor out = at::empty(shape, in.options());
    const float *ip = in.data_ptr<float>();
    float *op = out.data_ptr<float>();
    at::parallel_for(0, in.numel() / (2 * width), std::max<int64_t>(1, ELEMENTWISE_GRAIN / width), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; r++)
            at::vec::map2([](Vec g, Vec u) { return g / (Vec(1.f) + g.neg().exp()) * u; }, op + r * width,
                          ip + 2 * r * width, ip + (2 * r + 1) * width, width);
    });
    return out;
}

}  // namespace

TORCH_LIBRARY(ringllm_cpu, m) {
    m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
    m.def("paged_decode_attention(Tensor q, Tensor pool, Tensor pages, Tensor kv_lens, float scale, int window=0, float softcap=0, Tensor? sinks=None) -> Tensor");
    m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
    m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
    m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(ringllm_cpu, CPU, m) {
    m.impl("skinny_linear", &skinny_linear);
    m.impl("paged_decode_attention", &paged_decode_attention);
    m.impl("rms_norm", &rms_norm);
    m.impl("add_rms_norm", &add_rms_norm);
    m.impl("silu_and_mul", &silu_and_mul);
}
