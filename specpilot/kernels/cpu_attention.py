"""The batched CPU decode step's attention as a C++ kernel over each request's own keys (a few rows a request).

Why. A decode step of many requests reads every request's K/V once for one query row each. The two PyTorch forms
both read the longest request's keys for every request (the masked SDPA tiles them as GEMMs; the compiled
:func:`~specpilot.model.compiled_stack.masked_attention` loops over them and masks by a select): with the peer
workload's prompts (56-140 tokens) a quarter of the keys read are padding, and both ran at 8-10 GB/s of useful K/V
where this 2-core machine streams 52. This kernel walks each request's ``len`` keys in the pool's own layout
(``[slots, layers, slot_len, KVH, D]``: one position's heads are one contiguous row), scores all its query rows
against a key row while it is in cache (a committed key seen by every row, a key of its own rows where its mask
says: a chain's causal mask, a tree's ancestors), then the softmax, then the same walk over V. At SmolLM2's shape,
one row each, it took 0.40-0.78x the SDPA's time a layer at 1-32 requests and 0.54x the compiled masked attention's
at 32; its dot products run per query row, so at 4 rows a request it is about even with the SDPA's GEMMs and at 7
behind (``results/decode_attention_cpu_2026-12-06_adb92fe/run.json``, ``by_requests``, ``by_rows``).

Numerics: the same softmax(q k / sqrt(D)) v in float32, accumulated in another order (within ~5e-7 of the SDPA's on
unit-normal inputs); like any other GEMM order, it can move a rounding tie of the target's argmax.

Build. The kernel is compiled on first use with ``torch.utils.cpp_extension.load_inline`` (about 20 s on 2 cores;
cached by PyTorch in its extensions directory, so a later process loads it at once), for this machine's own
instruction set (``-march=native``) and threaded by ATen's ``at::parallel_for`` (torch's own thread pool: one
OpenMP runtime). Without a C++ compiler or ninja, :func:`available` is False and callers keep their PyTorch form.
:func:`~specpilot.kernels.batch_attention.batch_tree_attention_reference` (each request's SDPA over its own keys)
is the plain PyTorch form the tests hold it to.
"""

from __future__ import annotations

import warnings

import torch

_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

// One request's attention, or one KV head of it (h0 < h1 <= KVH). Its c rows sit at q[0 .. c) ([c, H, D] rows of
// H * D floats); its keys are n = s + c position-major rows of KVH * D floats: row i sees keys 0 .. s - 1 and key
// s + j where bit j of its mask words is set. Scores of the (head, row, query head) rows against each key while the
// key is in cache, softmax per row, then the weighted sum of V, written to out[0 .. c).
template <int DC>
static void one(const float* q, const float* kb, const float* vb, float* out, int64_t s0, int64_t c,
                const int32_t* words, int64_t nw, int64_t KVH, int64_t G, int64_t D_, int64_t h0, int64_t h1,
                float scale, std::vector<float>& sc, std::vector<float>& o) {
  const int64_t D = DC > 0 ? DC : D_, step = KVH * D, H = KVH * G, per_h = c * G, rows = (h1 - h0) * per_h;
  const int64_t n = s0 + c;
  sc.resize(rows * n);
  o.assign(rows * D, 0.f);
  for (int64_t t = 0; t < n; ++t) {  // the committed prefix (t < s0) seen by every row, no mask to read
    const float* row = kb + t * step;
    for (int64_t h = h0; h < h1; ++h) {
      const float* kk = row + h * D;
      for (int64_t i = 0; i < c; ++i) {
        float* dst = sc.data() + ((h - h0) * per_h + i * G) * n + t;
        if (t >= s0 && !((words[i * nw + (t - s0) / 32] >> ((t - s0) % 32)) & 1)) {
          for (int64_t g = 0; g < G; ++g) dst[g * n] = -INFINITY;
          continue;
        }
        const float* qi = q + i * H * D + h * G * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qq = qi + g * D;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t d = 0; d < D; ++d) acc += qq[d] * kk[d];
          dst[g * n] = acc * scale;
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = sc.data() + r * n;
    float m = -INFINITY;
    for (int64_t t = 0; t < n; ++t) m = std::max(m, sr[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      const float e = std::exp(sr[t] - m);  // exp(-inf) = 0: an unseen key
      sr[t] = e;
      sum += e;
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int64_t t = 0; t < n; ++t) sr[t] *= inv;
  }
  for (int64_t t = 0; t < n; ++t) {
    const float* row = vb + t * step;
    for (int64_t h = h0; h < h1; ++h) {
      const float* vv = row + h * D;
      for (int64_t r = 0; r < per_h; ++r) {
        const float p = sc[((h - h0) * per_h + r) * n + t];
        float* oo = o.data() + ((h - h0) * per_h + r) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) oo[d] += p * vv[d];
      }
    }
  }
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t i = 0; i < c; ++i)
      for (int64_t g = 0; g < G; ++g)
        std::copy_n(o.data() + ((h - h0) * per_h + i * G + g) * D, D, out + i * H * D + (h * G + g) * D);
}

template <int DC>
static void run(const float* q, const float* kp, const float* vp, const int64_t* slots, const int32_t* starts,
                const int32_t* counts, const int32_t* row_off, const int32_t* words, int64_t nw, int64_t r_max,
                float* out, int64_t B, int64_t KVH, int64_t G, int64_t D, int64_t L, int64_t T, int64_t layer,
                float scale) {
  // few requests: one work item per (request, KV head), so both threads work; else one per request, its key rows
  // read whole (contiguous, what the prefetcher streams best)
  const bool per_head = B < 2 * at::get_num_threads();
  const int64_t items = per_head ? B * KVH : B, HD = KVH * G * D;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sc, o;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = per_head ? w / KVH : w, h0 = per_head ? w % KVH : 0, h1 = per_head ? h0 + 1 : KVH;
      const int64_t base = (slots[b] * L + layer) * T * KVH * D;
      one<DC>(q + row_off[b] * HD, kp + base, vp + base, out + row_off[b] * HD, starts[b], counts[b],
              words + b * r_max * nw, nw, KVH, G, D, h0, h1, scale, sc, o);
    }
  });
}

at::Tensor tree_decode_attention(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vp, int64_t layer,
                                 const at::Tensor& slots, const at::Tensor& starts, const at::Tensor& counts,
                                 const at::Tensor& row_off, const at::Tensor& words) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [R, H, D] float32 contiguous");
  TORCH_CHECK(kp.dim() == 5 && kp.scalar_type() == at::kFloat && kp.is_contiguous() && vp.sizes() == kp.sizes() &&
              vp.scalar_type() == at::kFloat && vp.is_contiguous(), "pools: [S, L, T, KVH, D] float32 contiguous");
  const int64_t B = slots.numel(), H = q.size(1), D = q.size(2), KVH = kp.size(3);
  TORCH_CHECK(kp.size(4) == D && H % KVH == 0, "head sizes");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots: [B] int64");
  for (const at::Tensor* t : {&starts, &counts, &row_off})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->numel() == B, "starts, counts, row_off: [B] int32");
  TORCH_CHECK(words.dim() == 3 && words.scalar_type() == at::kInt && words.is_contiguous() && words.size(0) == B,
              "words: [B, r_max, ceil(r_max / 32)] int32");
  TORCH_CHECK(layer >= 0 && layer < kp.size(1), "layer");
  const int32_t *st = starts.data_ptr<int32_t>(), *ct = counts.data_ptr<int32_t>(), *ro = row_off.data_ptr<int32_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t r_max = words.size(1), nw = words.size(2), S = kp.size(0), T = kp.size(2);
  int64_t rows = 0;
  for (int64_t b = 0; b < B; ++b) {  // every row's keys and query rows inside their tensors
    TORCH_CHECK(sl[b] >= 0 && sl[b] < S && st[b] >= 0 && ct[b] >= 1 && ct[b] <= r_max && st[b] + ct[b] <= T &&
                ro[b] == rows && nw * 32 >= r_max, "rows: a request's slot, start, count or row offset out of range");
    rows += ct[b];
  }
  TORCH_CHECK(rows == q.size(0), "q has ", q.size(0), " rows, the requests ", rows);
  auto out = at::empty_like(q);
  const float scale = 1.f / std::sqrt((float)D);
  const float *qp = q.data_ptr<float>(), *k = kp.data_ptr<float>(), *v = vp.data_ptr<float>();
  const int32_t* wd = words.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const int64_t G = H / KVH, L = kp.size(1);
  if (D == 64) run<64>(qp, k, v, sl, st, ct, ro, wd, nw, r_max, op, B, KVH, G, D, L, T, layer, scale);
  else if (D == 128) run<128>(qp, k, v, sl, st, ct, ro, wd, nw, r_max, op, B, KVH, G, D, L, T, layer, scale);
  else run<0>(qp, k, v, sl, st, ct, ro, wd, nw, r_max, op, B, KVH, G, D, L, T, layer, scale);
  return out;
}
"""

#: the built extension under "m" (absent: not tried yet; False: the build failed, :func:`available` warned once)
_BUILT: dict[str, object] = {}


def _isa_tag() -> str:
    """8 hex digits of this CPU's instruction-set flags (``/proc/cpuinfo``; elsewhere the machine's name): part of
    the extension's name, so a build for ``-march=native`` in a cache shared between CPU models is never loaded by
    another model."""
    import hashlib
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1((flags or platform.machine()).encode()).hexdigest()[:8]


def _module():
    if "m" not in _BUILT:
        try:
            from torch.utils.cpp_extension import load_inline

            _BUILT["m"] = load_inline(f"specpilot_cpu_tree_decode_attention_{_isa_tag()}", cpp_sources=[_SOURCE],
                                      functions=["tree_decode_attention"],
                                      extra_cflags=["-O3", "-march=native", "-fopenmp"], verbose=False)
        except Exception as e:  # no compiler, no ninja, headers missing: callers keep their PyTorch form
            warnings.warn(f"the CPU decode attention kernel did not build ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); the batched CPU pass keeps its PyTorch "
                          "attention", stacklevel=3)
            _BUILT["m"] = False
    return _BUILT["m"]


def available() -> bool:
    """Whether the kernel is built or builds now (on first call: about 20 s, then cached on disk by PyTorch).
    False, with one warning, where this machine cannot build it."""
    return bool(_module())


def tree_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, layer: int,
                          slots: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, row_off: torch.Tensor,
                          words: torch.Tensor) -> torch.Tensor:
    """A batched pass's rows attending to their own request's keys in the pool: each request's committed prefix,
    and among its own rows what its mask allows (a chain's causal mask, a tree's ancestors-or-self).

    Args:
        q: ``[R, H, D]`` float32, contiguous: request 0's rows, then request 1's, ... (query head ``i`` reads KV
            head ``i // (H / KVH)``).
        k_pool, v_pool: ``[slots, layers, slot_len, KVH, D]`` float32, contiguous (a
            :class:`~specpilot.model.cache.KVPool`'s ``k, v``), the rows' own K/V already written at
            ``start .. start + count - 1`` of their slot.
        layer: the layer read. slots: ``[B] int64``; starts, counts, row_off: ``[B] int32`` (each request's committed
            positions, rows and first row in ``q``; :class:`~specpilot.model.batch.Prepared`'s); words:
            ``[B, r_max, ceil(r_max / 32)] int32``, each request's mask among its rows, bit ``j`` of row ``i`` set
            where row ``i`` sees row ``j`` (:func:`~specpilot.kernels.batch_attention.pack_batch_masks`).
    Returns:
        ``[R, H, D]`` float32: softmax(q k / sqrt(D)) v of each row over the keys it sees.
    Raises:
        RuntimeError: shapes, dtypes, layouts or rows out of range (the kernel checks them, before it reads), or
            the kernel is not :func:`available`.
    """
    m = _module()
    if not m:
        raise RuntimeError("the CPU decode attention kernel is not available on this machine")
    return m.tree_decode_attention(q, k_pool, v_pool, int(layer), slots, starts, counts, row_off, words)


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, layer: int, slots: torch.Tensor,
                     lens: torch.Tensor) -> torch.Tensor:
    """:func:`tree_decode_attention` of one query row per request: ``q [B, H, D]``, request ``b`` in slot
    ``slots[b]`` (``[B] int64``) seeing its keys ``0 .. lens[b] - 1`` (``[B] int64``, each at least 1). Returns
    ``[B, H, D]`` float32. Raises RuntimeError as :func:`tree_decode_attention`."""
    b = q.shape[0]
    ones = torch.ones(b, dtype=torch.int32)
    return tree_decode_attention(q, k_pool, v_pool, layer, slots, (lens - 1).int(), ones,
                                 torch.arange(b, dtype=torch.int32), ones.view(b, 1, 1))
