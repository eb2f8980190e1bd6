"""A stand-in for flash-attn's CUDA extension module (flash_attn_2_cuda), of which only fwd_kvcache is reproduced:
its real argument list, as flash_attn_with_kvcache hands it over, and a reference computation inside on any device.

k and v, when given, are written into the cache row at slots cache_seqlens[b] on (in place, as the kernel does);
row b then reads its cache row's slots from cache_leftpad[b] up to seqlen_k = cache_seqlens[b] (+ the new tokens),
its queries the last of those keys (bottom-right alignment), with causal and the window as flash-attn's other
kernels take them. No paged cache, rotary or alibi: what fwdcheck reads is the mask.
"""

from __future__ import annotations

import torch


def fwd_kvcache(
    q,
    k_cache,
    v_cache,
    k,
    v,
    cache_seqlens,
    rotary_cos,
    rotary_sin,
    cache_batch_idx,
    cache_leftpad,
    block_table,
    alibi_slopes,
    out,
    softmax_scale,
    is_causal,
    window_size_left,
    window_size_right,
    softcap,
    is_rotary_interleaved,
    num_splits,
):
    from flash_attn import _reference  # the package's own reference attention of one sequence

    B = q.shape[0]
    result = torch.empty_like(q)
    for b in range(B):
        row = int(cache_batch_idx[b]) if cache_batch_idx is not None else b
        held = int(cache_seqlens[b]) if cache_seqlens is not None else k_cache.shape[1]
        if k is not None:
            k_cache[row, held : held + k.shape[1]] = k[b]  # appended where the cache's sequence ends
            v_cache[row, held : held + v.shape[1]] = v[b]
            held += k.shape[1]
        start = int(cache_leftpad[b]) if cache_leftpad is not None else 0
        keys, values = k_cache[row, start:held], v_cache[row, start:held]  # (seqlen_k - start, h_kv, d)
        # bottom-right over the held keys: the query's slot counts from slot 0, its keys from the left pad
        left, right = window_size_left, window_size_right
        result[b] = _reference(q[b], keys, values, softmax_scale, is_causal, left, right, offset=start)
    return result, torch.empty(0)
