"""The batched CPU decode step's attention as a C++ kernel over each request's own keys (one query row a request).

Why. A decode step of many requests reads every request's K/V once for one query row each. The two PyTorch forms
both read the longest request's keys for every request (the masked SDPA tiles them as GEMMs; the compiled
:func:`~specpilot.model.compiled_stack.masked_attention` loops over them and masks by a select): with the peer
workload's prompts (56-140 tokens) a quarter of the keys read are padding, and both ran at 8-10 GB/s of useful K/V
where this 2-core machine streams 52. This kernel walks each request's ``len`` keys in the pool's own layout
(``[slots, layers, slot_len, KVH, D]``: one position's heads are one contiguous row), scores all the query heads
against a row while it is in cache, then the softmax, then the same walk over V. At SmolLM2's shape and 32 requests
it took 0.38-0.47x the compiled masked attention's time a layer (``probes/decode_attention_cpu.py``).

Numerics: the same softmax(q k / sqrt(D)) v in float32, accumulated in another order (within ~5e-7 of the SDPA's on
unit-normal inputs); like any other GEMM order, it can move a rounding tie of the target's argmax.

Build. The kernel is compiled on first use with ``torch.utils.cpp_extension.load_inline`` (about 20 s on 2 cores;
cached by PyTorch in its extensions directory, so a later process loads it at once), for this machine's own
instruction set (``-march=native``) and threaded by ATen's ``at::parallel_for`` (torch's own thread pool: one
OpenMP runtime). Without a C++ compiler or ninja, :func:`available` is False and callers keep their PyTorch form.
:func:`decode_attention_reference` is the plain PyTorch form the tests hold it to.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

// One request's attention, or one KV head of it (h0 < h1 <= KVH): scores of its G query rows per KV head against
// each of its n keys (position-major rows of KVH * D floats), softmax per query row, then the weighted sum of V.
template <int DC>
static void one(const float* q, const float* kb, const float* vb, float* out, int64_t n, int64_t KVH, int64_t G,
                int64_t D_, int64_t h0, int64_t h1, float scale, std::vector<float>& s, std::vector<float>& o) {
  const int64_t D = DC > 0 ? DC : D_, step = KVH * D, rows = (h1 - h0) * G;
  s.resize(rows * n);
  o.assign(rows * D, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const float* row = kb + j * step;
    for (int64_t h = h0; h < h1; ++h) {
      const float* kk = row + h * D;
      for (int64_t g = 0; g < G; ++g) {
        const float* qq = q + (h * G + g) * D;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < D; ++d) acc += qq[d] * kk[d];
        s[((h - h0) * G + g) * n + j] = acc * scale;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s.data() + r * n;
    float m = -INFINITY;
    for (int64_t j = 0; j < n; ++j) m = std::max(m, sr[j]);
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      const float e = std::exp(sr[j] - m);
      sr[j] = e;
      sum += e;
    }
    const float inv = 1.f / sum;
    for (int64_t j = 0; j < n; ++j) sr[j] *= inv;
  }
  for (int64_t j = 0; j < n; ++j) {
    const float* row = vb + j * step;
    for (int64_t h = h0; h < h1; ++h) {
      const float* vv = row + h * D;
      for (int64_t g = 0; g < G; ++g) {
        const float p = s[((h - h0) * G + g) * n + j];
        float* oo = o.data() + ((h - h0) * G + g) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) oo[d] += p * vv[d];
      }
    }
  }
  std::copy(o.begin(), o.end(), out + h0 * G * D);
}

template <int DC>
static void run(const float* q, const float* kp, const float* vp, const int64_t* slots, const int64_t* lens, float* out,
                int64_t B, int64_t KVH, int64_t G, int64_t D, int64_t L, int64_t T, int64_t layer, float scale) {
  // few requests: one work item per (request, KV head), so both threads work; else one per request, its rows read
  // whole (contiguous, what the prefetcher streams best)
  const bool per_head = B < 2 * at::get_num_threads();
  const int64_t items = per_head ? B * KVH : B, hd = G * D;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s, o;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = per_head ? w / KVH : w, h0 = per_head ? w % KVH : 0, h1 = per_head ? h0 + 1 : KVH;
      const int64_t base = (slots[b] * L + layer) * T * KVH * D;
      one<DC>(q + b * KVH * hd, kp + base, vp + base, out + b * KVH * hd, lens[b], KVH, G, D, h0, h1, scale, s, o);
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vp, int64_t layer,
                            const at::Tensor& slots, const at::Tensor& lens) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [B, H, D] float32 contiguous");
  TORCH_CHECK(kp.dim() == 5 && kp.scalar_type() == at::kFloat && kp.is_contiguous() && vp.sizes() == kp.sizes() &&
              vp.scalar_type() == at::kFloat && vp.is_contiguous(), "pools: [S, L, T, KVH, D] float32 contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = kp.size(3);
  TORCH_CHECK(kp.size(4) == D && H % KVH == 0, "head sizes");
  TORCH_CHECK(slots.scalar_type() == at::kLong && lens.scalar_type() == at::kLong && slots.numel() == B &&
              lens.numel() == B && slots.is_contiguous() && lens.is_contiguous(), "slots, lens: [B] int64");
  TORCH_CHECK(layer >= 0 && layer < kp.size(1), "layer");
  auto out = at::empty_like(q);
  const float scale = 1.f / std::sqrt((float)D);
  const float *qp = q.data_ptr<float>(), *k = kp.data_ptr<float>(), *v = vp.data_ptr<float>();
  const int64_t *sl = slots.data_ptr<int64_t>(), *ln = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t G = H / KVH, L = kp.size(1), T = kp.size(2);
  if (D == 64) run<64>(qp, k, v, sl, ln, op, B, KVH, G, D, L, T, layer, scale);
  else if (D == 128) run<128>(qp, k, v, sl, ln, op, B, KVH, G, D, L, T, layer, scale);
  else run<0>(qp, k, v, sl, ln, op, B, KVH, G, D, L, T, layer, scale);
  return out;
}
"""

#: the built extension (None: not tried yet; False: the build failed, :func:`available` says so once)
_BUILT: dict[str, object] = {}


def _module():
    if "m" not in _BUILT:
        try:
            from torch.utils.cpp_extension import load_inline

            _BUILT["m"] = load_inline("specpilot_cpu_decode_attention", cpp_sources=[_SOURCE],
                                      functions=["decode_attention"],
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


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, layer: int, slots: torch.Tensor,
                     lens: torch.Tensor) -> torch.Tensor:
    """One query row per request attending to its own keys in the pool.

    Args:
        q: ``[B, H, D]`` float32, contiguous: request ``b``'s query row (query head ``i`` reads KV head
            ``i // (H / KVH)``).
        k_pool, v_pool: ``[slots, layers, slot_len, KVH, D]`` float32, contiguous (a
            :class:`~specpilot.model.cache.KVPool`'s ``k, v``).
        layer: the layer read; slots: ``[B] int64``, each request's slot; lens: ``[B] int64``, the keys it sees
            (positions ``0 .. lens[b] - 1``, each at least 1 and at most ``slot_len``).
    Returns:
        ``[B, H, D]`` float32: softmax(q k / sqrt(D)) v per request and head.
    Raises:
        RuntimeError: shapes, dtypes or layouts other than the above (the kernel checks them), or the kernel is not
            :func:`available`.
    """
    m = _module()
    if not m:
        raise RuntimeError("the CPU decode attention kernel is not available on this machine")
    return m.decode_attention(q, k_pool, v_pool, int(layer), slots, lens)


def decode_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, layer: int,
                               slots: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """:func:`decode_attention` in plain PyTorch: each request's SDPA over its own keys, one at a time (the oracle
    of the tests). Same arguments and result."""
    kvh = k_pool.shape[3]
    g = q.shape[1] // kvh
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n, s = int(lens[b]), int(slots[b])
        k = k_pool[s, layer, :n].repeat_interleave(g, dim=1).transpose(0, 1)  # [H, n, D]
        v = v_pool[s, layer, :n].repeat_interleave(g, dim=1).transpose(0, 1)
        out[b] = F.scaled_dot_product_attention(q[b][:, None], k, v)[:, 0]
    return out
