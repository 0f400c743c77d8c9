"""Cached ablation forwards for ``sensitivity()``: each ablation computes only what its quantizer changes.

Before the first ablation, one **reference forward** runs with every quantizer off (the ablation state, with the
baseline's indices); it keeps each op site's output (the value the forward went on with). The forward of
ablation ``k`` then runs as usual, but at every op site that does not depend on quantizer ``k`` it hands out the
cached value instead of computing the op (a module site's ``forward`` does not run, a function op is not called).
An op site is taken from the cache when it is not one of the sites quantizer ``k`` acts at (the sites whose plan
uses its fake quants; for the deployed stages the one site the IR replaces; a fused group's members before such a
site compute what they computed in the reference, so a ReLU's output fake quant reuses its conv's cached value) and
every input leaf is what it was in the reference forward: a tensor produced by the same op site occurrence and
itself clean in this forward, the same parameter, a bitwise-equal tensor (model inputs, buffers, values made
outside op sites: a copy is kept), or an equal Python value. So the outputs are the same tensors the full
forward computes, and the tables are identical.

* IR references (``convert`` on a qat IR baseline): the IR's data flow is explicit, so the nodes downstream of
  site ``k``'s last node run and every other node takes its cached outputs (the interpreter's kernel override).
* Not cached (every ablation is a full forward, as before): float torch models, models prepared at a
  consistency level that emulates integer rules or shares scales (their runtime keeps per-tensor state across
  op sites), ONNX.
* In-place ops: a site whose output is one of its inputs is never taken from the cache, and a cached value
  that the reference forward changed in place later is dropped; after every ablation the cached tensors'
  version counters are checked, and a cached tensor changed by the model makes that ablation rerun as a full
  forward and switches the cache off for the rest of the run.

**Memory.** The cache holds op site outputs in execution order up to ``max_bytes`` (default 1 GiB, or
``QUANTLENS_SENSITIVITY_CACHE_MB``; storages shared by views count once); op sites beyond it are computed in
every ablation (still without recomputing what is cached before them), so the budget only trades time for
memory. It lives for one ``sensitivity()`` call.

* :mod:`.base`: the memory budget and :class:`CacheUnusable`, shared by both caches;
* :mod:`.torch_cache`: :class:`TorchAblationCache` (prepared torch models) and :class:`CachedAblations`, the
  ablation runner ``sensitivity()`` drives over it;
* :mod:`.ir_cache`: :class:`IRAblationCache` (IR references) and its runner :class:`IRCachedAblations`.
"""

from quantlens.profiler.ablation.base import CacheUnusable, default_max_bytes
from quantlens.profiler.ablation.ir_cache import IRAblationCache, IRCachedAblations
from quantlens.profiler.ablation.torch_cache import CachedAblations, TorchAblationCache

__all__ = ["CacheUnusable", "TorchAblationCache", "IRAblationCache", "CachedAblations", "IRCachedAblations",
           "default_max_bytes"]
