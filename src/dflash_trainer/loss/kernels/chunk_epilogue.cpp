// The fused draft loss's element-wise work on the CPU, one row at a time (built and called by
// dflash_trainer/loss/native.py; the math is _chunk_epilogue's in fused.py, tested equal in float64).
//
// Why a hand-written kernel: with a bf16 head the chunk's GEMMs run at 5x the fp32 rate, and what is
// left is the exponentials. Code generated from whole-chunk tensor expressions recomputes them (four or
// more per logit with KL); this kernel walks one row while it stays in the core's cache and computes
// exactly one exponential per logit and distribution (plus one per logit for T != 1 or Tc != 1):
//
//   pass 1  raw logits (head dtype) -> transformed z (scale, softcap) in scratch, row max, argmax
//   pass 2  e = exp(z - max) for student and teacher: the sums every loss term needs
//   pass 3  the gradient G w.r.t. the raw logits, from the stored e, in the head dtype
//
// Row results: lse, z_y, entropy (CAP statistic), KL, student and teacher argmax; with DSpark's per-row
// terms also the acceptance a = sum min(p, q) and the Renyi-1/2 term -2 log sum sqrt(p q) of the student
// p and the teacher q at T = 1 (pass 2 stores the teacher's e^u at T = 1 and sums sqrt(e^d e^u); one
// more pass over the two stored rows sums the acceptance; pass 3 adds the Renyi gradient); with top_k > 0
// the K largest student logits and their ids (row_top_k: reads only the blocks of the row that can hold
// them, found from pass 1's block maxima). The compute type is
// float for bf16/fp32 heads (sums accumulated in blocks, then in double) and double for fp64 heads.
// Plain C++ for the compiler's auto-vectorizer (-O3 -march=native -fopenmp-simd); no libraries.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

namespace {

using bf16 = uint16_t;
constexpr int64_t BLOCK = 1024;  // elements summed in the compute type before the sum moves to double

inline float load(bf16 x) {
    uint32_t bits = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
inline float load(float x) { return x; }
inline double load(double x) { return x; }

template <typename I, typename C>
inline I store(C x);
template <>
inline bf16 store<bf16, float>(float x) {  // round to nearest even, as torch does; NaN stays NaN
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return x != x ? bf16(0x7FC0) : bf16(rounded);
}
template <>
inline float store<float, float>(float x) { return x; }
template <>
inline double store<double, double>(double x) { return x; }

// exp for float: 2^n e^r with n = round(x log2 e), r = x - n ln 2 (Cody-Waite split), e^r by its Taylor
// polynomial of degree 7 (truncation 5e-9 relative on |r| <= ln2/2, below float rounding). Branch-free
// so that loops calling it vectorize; exp(x) = 0 below -87 (the smallest normal float is e^-87.3), NaN
// stays NaN (both comparisons are false for NaN, and NaN flows through the polynomial).
inline float exp_c(float x) {
    const float lo = -87.0f, hi = 88.0f, magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    float xc = x < lo ? lo : (x > hi ? hi : x);
    float t = xc * 1.44269504088896341f + magic;
    int32_t tbits;
    std::memcpy(&tbits, &t, 4);
    int32_t n = tbits - 0x4B400000;  // the integer round(x log2 e), read off the mantissa of t
    float nf = t - magic;
    float r = xc - nf * 0.693359375f;  // ln 2 = 0.693359375 - 2.12194440e-4, the first part exact in float
    r = r + nf * 2.12194440e-4f;
    float p = 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t sbits = (n + 127) << 23;
    float scale;
    std::memcpy(&scale, &sbits, 4);
    return x < lo ? 0.0f : p * scale;
}
inline double exp_c(double x) { return std::exp(x); }

struct Terms {
    double kl_weight, temperature, cap_temperature, logit_scale, softcap;  // softcap <= 0: none
    double renyi_weight;  // the Renyi term's weight beta (0: acceptance and value only)
    bool per_row;         // acceptance and Renyi (needs the teacher)
};

// A row of logits as the passes read it: raw head-dtype values times the logit scale (S = the head
// dtype), or, with a softcap, values already transformed into scratch by pass 1 (S = C, scale 1).
// Re-reading the raw row is cheaper than storing a float copy of it: 2 bytes per logit instead of 4.
template <typename S, typename C>
struct Logits {
    const S* p;
    C scale;
    C operator[](int64_t j) const { return load(p[j]) * scale; }
};

// Pass 1: the row maximum, and the index of its first occurrence in *argmax; the maximum of each block
// of BLOCK logits stays in block_max (the top-K selection below reads it).
template <typename S, typename C>
C row_max(Logits<S, C> z, int64_t V, int64_t* argmax, std::vector<C>& block_max) {
    block_max.resize((V + BLOCK - 1) / BLOCK);
    C m = -std::numeric_limits<C>::infinity();
    for (int64_t b0 = 0, b = 0; b0 < V; b0 += BLOCK, ++b) {
        const int64_t b1 = b0 + BLOCK < V ? b0 + BLOCK : V;
        C mb = -std::numeric_limits<C>::infinity();
#pragma omp simd reduction(max : mb)
        for (int64_t j = b0; j < b1; ++j) {
            const C v = z[j];
            mb = v > mb ? v : mb;
        }
        block_max[b] = mb;
        m = mb > m ? mb : m;
    }
    *argmax = 0;  // a row of NaN has no maximum; its loss is NaN anyway
    for (int64_t b0 = 0, b = 0; b0 < V; b0 += BLOCK, ++b) {
        if (block_max[b] != m) continue;
        const int64_t b1 = b0 + BLOCK < V ? b0 + BLOCK : V;
        for (int64_t j = b0; j < b1; ++j) {
            if (z[j] == m) {
                *argmax = j;
                return m;
            }
        }
    }
    return m;
}

// The K largest logits of a row and their ids, sorted descending, ties by the lower id (DFlash2's
// candidates). No full pass of its own over the row: the K-th largest of pass 1's block maxima is a
// lower bound lb on the K-th largest logit (the K block maxima are K distinct logits), so only blocks
// whose maximum reaches lb can hold one (about K blocks of the V / BLOCK). In those, sub-blocks of
// SUB logits whose (vectorized) maximum is below the current threshold are skipped; a logit enters a
// min-heap of K (its top the worst kept) only when it beats that top.
template <typename S, typename C>
void row_top_k(Logits<S, C> z, int64_t V, const std::vector<C>& block_max, int64_t K, int64_t* ids, C* vals) {
    constexpr int64_t SUB = 64;
    struct Entry {
        C v;
        int64_t j;
    };
    const auto better = [](const Entry& x, const Entry& y) { return x.v > y.v || (x.v == y.v && x.j < y.j); };
    static thread_local std::vector<Entry> heap;
    static thread_local std::vector<C> maxima;
    heap.clear();
    const int64_t blocks = int64_t(block_max.size());
    C lb = -std::numeric_limits<C>::infinity();
    if (K <= blocks) {
        maxima.assign(block_max.begin(), block_max.end());
        std::nth_element(maxima.begin(), maxima.begin() + (K - 1), maxima.end(), std::greater<C>());
        lb = maxima[K - 1];
    }
    C thr = lb;  // logits below it cannot enter: lb, then the worst kept once the heap holds K
    for (int64_t b = 0; b < blocks; ++b) {
        if (block_max[b] < lb) continue;
        const int64_t b1 = (b + 1) * BLOCK < V ? (b + 1) * BLOCK : V;
        for (int64_t s0 = b * BLOCK; s0 < b1; s0 += SUB) {
            const int64_t s1 = s0 + SUB < b1 ? s0 + SUB : b1;
            C ms = -std::numeric_limits<C>::infinity();
#pragma omp simd reduction(max : ms)
            for (int64_t j = s0; j < s1; ++j) {
                const C v = z[j];
                ms = v > ms ? v : ms;
            }
            if (ms < thr) continue;
            for (int64_t j = s0; j < s1; ++j) {
                const Entry e{z[j], j};
                if (e.v < thr) continue;
                if (int64_t(heap.size()) < K) {
                    heap.push_back(e);
                    std::push_heap(heap.begin(), heap.end(), better);
                } else if (better(e, heap.front())) {
                    std::pop_heap(heap.begin(), heap.end(), better);
                    heap.back() = e;
                    std::push_heap(heap.begin(), heap.end(), better);
                } else {
                    continue;
                }
                if (int64_t(heap.size()) == K) thr = heap.front().v;
            }
        }
    }
    std::sort_heap(heap.begin(), heap.end(), better);  // best first
    const int64_t kept = int64_t(heap.size());
    for (int64_t i = 0; i < K; ++i) {  // fewer than K only in a row with NaN (never compared as kept)
        ids[i] = i < kept ? heap[i].j : -1;
        vals[i] = i < kept ? heap[i].v : std::numeric_limits<C>::quiet_NaN();
    }
}

// The softcap z = cap tanh(scale raw / cap), into scratch (tanh is the costly part: done once per logit).
template <typename I, typename C>
void softcapped(const I* raw, int64_t V, double scale, double cap, C* z) {
    const C k = C(scale / cap), c = C(cap);
    for (int64_t j = 0; j < V; ++j) z[j] = c * std::tanh(load(raw[j]) * k);
}

// Pass 2: the row sums. With d = z - m_s (student) and u = (zt - m_t) / T (teacher):
//   s[0] = sum e^d, s[1] = sum e^d d                    (softmax normalizer, entropy at Tc = 1)
//   s[2] = sum e^u, s[3] = sum e^u u, s[4] = sum e^u d  (teacher normalizer, its entropy, cross term)
//   s[5] = sum e^(d/T)                                  (tempered student normalizer, T != 1)
//   s[6] = sum e^(d/Tc), s[7] = sum e^(d/Tc) d          (CAP entropy at Tc != 1)
//   s[8] = sum e^u1, s[9] = sum sqrt(e^d e^u1)           (per-row terms; u1 = zt - m_t, the teacher at T = 1)
// e^d goes to es, e^u to eu, e^u1 to et (only the later passes read them). With KL at T = 1, u1 = u:
// et is eu and s[8] is s[2], not computed twice. sqrt(e^d e^u1) flushes to 0 below 1e-19 (float), far
// below anything that moves the sum: the Bhattacharyya sum is at least sqrt(e^u1) at the student's argmax.
template <bool KL, bool TEMPERED, bool CAP_TEMPERED, bool PER_ROW, typename S, typename C>
void row_sums(Logits<S, C> z, Logits<S, C> zt, C* es, C* eu, C* et, int64_t V, C m_s, C m_t, C inv_t, C inv_tc,
              double* s) {
    for (int k = 0; k < 10; ++k) s[k] = 0.0;
    for (int64_t b0 = 0; b0 < V; b0 += BLOCK) {
        const int64_t b1 = b0 + BLOCK < V ? b0 + BLOCK : V;
        C a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0, a8 = 0, a9 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3, a4, a5, a6, a7, a8, a9)
        for (int64_t j = b0; j < b1; ++j) {
            const C d = z[j] - m_s;
            const C e = exp_c(d);
            es[j] = e;
            a0 += e;
            a1 += e * d;
            C q = 0;
            if (KL) {
                const C u = (zt[j] - m_t) * inv_t;
                q = exp_c(u);
                eu[j] = q;
                a2 += q;
                a3 += q * u;
                a4 += q * d;
            }
            if (PER_ROW) {
                C q1 = q;
                if (!KL || TEMPERED) {
                    q1 = exp_c(zt[j] - m_t);
                    et[j] = q1;
                    a8 += q1;
                }
                a9 += std::sqrt(e * q1);
            }
            if (TEMPERED) a5 += exp_c(d * inv_t);
            if (CAP_TEMPERED) {
                const C ec = exp_c(d * inv_tc);
                a6 += ec;
                a7 += ec * d;
            }
        }
        s[0] += a0, s[1] += a1, s[2] += a2, s[3] += a3, s[4] += a4, s[5] += a5, s[6] += a6, s[7] += a7;
        s[8] += a8, s[9] += a9;
    }
}

// The acceptance sum_j min(p_j, q_j) = sum_j min(es_j / sum_s, et_j / sum_t), from the stored rows.
template <typename C>
double row_acceptance(const C* es, const C* et, int64_t V, C inv_sum_s, C inv_sum_t) {
    double total = 0.0;
    for (int64_t b0 = 0; b0 < V; b0 += BLOCK) {
        const int64_t b1 = b0 + BLOCK < V ? b0 + BLOCK : V;
        C acc = 0;
#pragma omp simd reduction(+ : acc)
        for (int64_t j = b0; j < b1; ++j) {
            const C p = es[j] * inv_sum_s, q = et[j] * inv_sum_t;
            acc += p < q ? p : q;
        }
        total += acc;
    }
    return total;
}

// Pass 3: G = coef [ (1-a)(p - e_y) + a T (p^T - q) + beta (p - sqrt(p q1) / BC) ] * dz/draw, written in
// the head dtype, where p = es / sum_s, q = eu / sum_u, p^T = e^(d/T) / sum_T, q1 the teacher at T = 1,
// BC = sum sqrt(p q1) and dz/draw = scale (1 - (z/cap)^2). sqrt(p q1) / BC = sqrt(es et) / s[9]: the
// Renyi term needs no normalizer beyond its own sum, and its p part joins k_p.
template <typename C>
struct GradientTerms {
    C k_p, k_q, k_pt;      // coef ((1-a) + beta) / sum_s (coef (1 + beta) / sum_s at T = 1), coef a (T) / sum_u, coef a T
    C m_s, inv_t, inv_sum_t_pt;
    C scale, inv_cap;
    bool softcap;
    C k_r;  // coef beta / s[9] (the Renyi term)
};

// G at logit j with `label` = coef (1-a) subtracted (the -e_y term: nonzero only at the label).
template <bool KL, bool GENERAL, bool RENYI, typename S, typename C>
inline C gradient_at(const Logits<S, C>& z, const C* es, const C* eu, const C* et, int64_t j,
                     const GradientTerms<C>& k, C label) {
    C v = k.k_p * es[j];
    if (KL) v -= k.k_q * eu[j];
    if (RENYI) v -= k.k_r * std::sqrt(es[j] * et[j]);
    if (!GENERAL) return (v - label) * k.scale;
    const C zj = z[j];
    if (KL) v += k.k_pt * exp_c((zj - k.m_s) * k.inv_t) * k.inv_sum_t_pt;
    v -= label;
    C chain = k.scale;
    if (k.softcap) {
        const C r = zj * k.inv_cap;
        chain = k.scale * (C(1) - r * r);
    }
    return v * chain;
}

template <bool KL, bool GENERAL, bool RENYI, typename S, typename I, typename C>
void row_gradient(Logits<S, C> z, const C* es, const C* eu, const C* et, int64_t V, const GradientTerms<C>& k,
                  int64_t y, C label, I* g) {
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) g[j] = store<I>(gradient_at<KL, GENERAL, RENYI>(z, es, eu, et, j, k, C(0)));
    g[y] = store<I>(gradient_at<KL, GENERAL, RENYI>(z, es, eu, et, y, k, label));
}

// The eight gradient loops: (KL, GENERAL, RENYI) as template flags, so each loop holds only its work.
template <typename S, typename I, typename C>
void row_gradient_of(bool kl, bool general, bool renyi, Logits<S, C> z, const C* es, const C* eu, const C* et,
                     int64_t V, const GradientTerms<C>& k, int64_t y, C label, I* g) {
    const int variant = (kl ? 4 : 0) | (general ? 2 : 0) | (renyi ? 1 : 0);
    switch (variant) {
        case 0: row_gradient<false, false, false>(z, es, eu, et, V, k, y, label, g); break;
        case 1: row_gradient<false, false, true>(z, es, eu, et, V, k, y, label, g); break;
        case 2: row_gradient<false, true, false>(z, es, eu, et, V, k, y, label, g); break;
        case 3: row_gradient<false, true, true>(z, es, eu, et, V, k, y, label, g); break;
        case 4: row_gradient<true, false, false>(z, es, eu, et, V, k, y, label, g); break;
        case 5: row_gradient<true, false, true>(z, es, eu, et, V, k, y, label, g); break;
        case 6: row_gradient<true, true, false>(z, es, eu, et, V, k, y, label, g); break;
        default: row_gradient<true, true, true>(z, es, eu, et, V, k, y, label, g); break;
    }
}

// Rows [r0, r1) of a chunk, on one thread, reading the logits through views of type Logits<S, C>:
// S = I (the raw rows) without a softcap, S = C (transformed copies in scratch) with one.
template <bool SOFTCAP, typename S, typename I, typename C>
void rows_of_chunk(const I* zs_raw, const I* zt_raw, int64_t r0, int64_t r1, int64_t V, const int64_t* labels,
                   const C* coef, I* g, const Terms& t, C* lse, C* z_y, C* entropy, C* kl, int64_t* s_arg,
                   int64_t* t_arg, C* accept, C* renyi, int64_t top_k, int64_t* top_ids, C* top_vals) {
    const double a = t.kl_weight, T = t.temperature, Tc = t.cap_temperature;
    const bool kl_on = zt_raw != nullptr && a > 0, tempered = kl_on && T != 1.0, cap_tempered = Tc != 1.0;
    const bool per_row = t.per_row && zt_raw != nullptr, renyi_on = per_row && t.renyi_weight > 0;
    const bool softcap = SOFTCAP;
    // e^d, e^u, e^u1 (per-row terms), and with a softcap both rows' z: reused across calls
    static thread_local std::vector<C> scratch, block_max;
    scratch.resize((softcap ? 5 : 3) * V);
    C *es = scratch.data(), *eu = es + V;
    C* et = (kl_on && !tempered) ? eu : eu + V;  // the teacher at T = 1: e^u itself when T = 1
    for (int64_t r = r0; r < r1; ++r) {
        Logits<S, C> z, zt;
        if constexpr (!SOFTCAP) {  // the raw rows, scaled as they are read
            z = {zs_raw + r * V, C(t.logit_scale)};
            zt = {zt_raw == nullptr ? nullptr : zt_raw + r * V, C(t.logit_scale)};
        } else {
            C *zs_cap = es + 3 * V, *zt_cap = es + 4 * V;
            softcapped(zs_raw + r * V, V, t.logit_scale, t.softcap, zs_cap);
            if (zt_raw != nullptr) softcapped(zt_raw + r * V, V, t.logit_scale, t.softcap, zt_cap);
            z = {zs_cap, C(1)};
            zt = {zt_cap, C(1)};
        }
        const C m_s = row_max(z, V, &s_arg[r], block_max);
        if (top_k > 0) row_top_k(z, V, block_max, top_k, top_ids + r * top_k, top_vals + r * top_k);
        C m_t = 0;
        if (zt_raw != nullptr) m_t = row_max(zt, V, &t_arg[r], block_max);
        const int64_t y = labels != nullptr ? labels[r] : t_arg[r];
        z_y[r] = z[y];

        double s[10];
        const C inv_t = C(1.0 / T), inv_tc = C(1.0 / Tc);
        // The combinations of (KL, T != 1, Tc != 1, per-row terms): each inner loop holds only the work it needs.
        const int variant = (per_row ? 8 : 0) | (kl_on ? 4 : 0) | (tempered ? 2 : 0) | (cap_tempered ? 1 : 0);
#define DFLASH_SUMS(K, TT, CT, PR) row_sums<K, TT, CT, PR>(z, zt, es, eu, et, V, m_s, m_t, inv_t, inv_tc, s)
        switch (variant) {
            case 0: DFLASH_SUMS(false, false, false, false); break;
            case 1: DFLASH_SUMS(false, false, true, false); break;
            case 4: DFLASH_SUMS(true, false, false, false); break;
            case 5: DFLASH_SUMS(true, false, true, false); break;
            case 6: DFLASH_SUMS(true, true, false, false); break;
            case 7: DFLASH_SUMS(true, true, true, false); break;
            case 8: DFLASH_SUMS(false, false, false, true); break;
            case 9: DFLASH_SUMS(false, false, true, true); break;
            case 12: DFLASH_SUMS(true, false, false, true); break;
            case 13: DFLASH_SUMS(true, false, true, true); break;
            case 14: DFLASH_SUMS(true, true, false, true); break;
            case 15: DFLASH_SUMS(true, true, true, true); break;
            default: break;  // T != 1 matters only with KL (tempered implies kl_on)
        }
#undef DFLASH_SUMS
        const double log_sum = std::log(s[0]);
        lse[r] = C(double(m_s) + log_sum);
        entropy[r] = cap_tempered ? C(std::log(s[6]) - s[7] / (Tc * s[6])) : C(log_sum - s[1] / s[0]);
        // KL(q^T || p^T) = sum q log q - sum q log p^T = (s3/s2 - log s2) - (s4 / (T s2) - log sum_T)
        const double log_sum_t_pt = tempered ? std::log(s[5]) : log_sum;
        kl[r] = kl_on ? C(s[3] / s[2] - std::log(s[2]) - s[4] / (T * s[2]) + log_sum_t_pt) : C(0);
        const double sum_t1 = (kl_on && !tempered) ? s[2] : s[8];  // the teacher's normalizer at T = 1
        if (per_row) {
            accept[r] = C(row_acceptance(es, et, V, C(1.0 / s[0]), C(1.0 / sum_t1)));
            // -2 log BC with BC = s[9] / sqrt(s[0] sum_t1)
            renyi[r] = C(-2.0 * std::log(s[9]) + log_sum + std::log(sum_t1));
        }

        if (g == nullptr) continue;
        const double c = coef[r];
        const double beta = renyi_on ? t.renyi_weight : 0.0;
        // T = 1: (1-a) p + a (p - q) = p - a q. T != 1: (1-a) p + a T (p^T - q).
        const GradientTerms<C> k{
            C(c * ((tempered ? 1 - a : 1.0) + beta) / s[0]),
            kl_on ? C(c * a * (tempered ? T : 1.0) / s[2]) : C(0),
            C(c * a * T),
            m_s,
            inv_t,
            tempered ? C(1.0 / s[5]) : C(0),
            C(t.logit_scale),
            C(softcap ? 1.0 / t.softcap : 0.0),
            softcap,
            renyi_on ? C(c * beta / s[9]) : C(0),
        };
        const C label = C(c * (1 - a));
        row_gradient_of(kl_on, tempered || softcap, renyi_on, z, es, eu, et, V, k, y, label, g + r * V);
    }
}

// A chunk's rows split across `threads` threads: OpenMP's, the same runtime and pool as torch's where
// the library was built with -fopenmp (libgomp is found by its soname, already loaded by torch).
template <typename I, typename C>
int chunk(const I* zs_raw, const I* zt_raw, int64_t rows, int64_t V, const int64_t* labels, const C* coef, I* g,
          const Terms& t, int threads, C* lse, C* z_y, C* entropy, C* kl, int64_t* s_arg, int64_t* t_arg,
          C* accept, C* renyi, int64_t top_k, int64_t* top_ids, C* top_vals) {
    if (V < 1 || rows < 0 || top_k < 0 || top_k > V) return 1;
    if (threads < 1) threads = 1;
    if (threads > rows) threads = int(rows);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int i = 0; i < threads; ++i) {
        const int64_t r0 = rows * i / threads, r1 = rows * (i + 1) / threads;
        if (t.softcap > 0)
            rows_of_chunk<true, C>(zs_raw, zt_raw, r0, r1, V, labels, coef, g, t, lse, z_y, entropy, kl, s_arg, t_arg,
                                   accept, renyi, top_k, top_ids, top_vals);
        else
            rows_of_chunk<false, I>(zs_raw, zt_raw, r0, r1, V, labels, coef, g, t, lse, z_y, entropy, kl, s_arg, t_arg,
                                    accept, renyi, top_k, top_ids, top_vals);
    }
    return 0;
}

}  // namespace

extern "C" {

// One entry point per (head dtype, compute dtype). Arrays are contiguous rows of V; zt_raw, labels and
// g may be null (no teacher; teacher labels; no gradient), accept and renyi are read only with per_row
// (which needs zt_raw), top_ids and top_vals (rows of top_k) only with top_k > 0. Returns 0, or 1 for
// an unsupported request.
#define DFLASH_ENTRY(NAME, I, C)                                                                                  \
    int NAME(const I* zs, const I* zt, int64_t rows, int64_t V, const int64_t* labels, const C* coef, I* g,      \
             double a, double T, double Tc, double scale, double cap, double renyi_weight, int per_row,         \
             int threads, C* lse, C* z_y, C* entropy, C* kl, int64_t* s_arg, int64_t* t_arg, C* accept,        \
             C* renyi, int64_t top_k, int64_t* top_ids, C* top_vals) {                                           \
        if (per_row && zt == nullptr) return 1;                                                                  \
        return chunk(zs, zt, rows, V, labels, coef, g, Terms{a, T, Tc, scale, cap, renyi_weight, per_row != 0},  \
                     threads, lse, z_y, entropy, kl, s_arg, t_arg, accept, renyi, top_k, top_ids, top_vals);     \
    }

DFLASH_ENTRY(dflash_chunk_bf16, bf16, float)
DFLASH_ENTRY(dflash_chunk_f32, float, float)
DFLASH_ENTRY(dflash_chunk_f64, double, double)
#undef DFLASH_ENTRY

// Whether the rows of a chunk run on OpenMP threads (else one thread: the caller splits them).
int dflash_openmp() {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

// The float exponential above over n values, for its accuracy test.
void dflash_exp_f32(const float* x, float* out, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = exp_c(x[i]);
}

}  // extern "C"
