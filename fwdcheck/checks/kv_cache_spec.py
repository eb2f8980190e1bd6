"""What the kv-cache check declares (CheckInfo's fields), torch-free: `fwdcheck list` and `explain` import
this module, not the check; the check's class (fwdcheck/checks/kv_cache.py) reads it: `declared=SPEC`."""

from fwdcheck.config.registry import CheckInfo

SPEC = CheckInfo(
    order=50,  # after the other default built-ins, before plugins
    applies_when="causal models that decode through a KV cache (a transformers model, a declared `cache:`)",
    description="decoding through the KV cache (token by token and in chunks) matches the full forward",
    codes={
        "FWD501": "decoding one token at a time through the cache gives other logits than the full forward",
        "FWD502": "decoding 2-3 tokens at a time through the cache gives other logits, one at a time does not",
        "FWD503": "the prefill with the cache on gives other logits than the full forward at the prompt's positions",
        "FWD504": "decoding through the cache gives NaN or Inf where the full forward is finite",
    },
    explain="""\
Verifies that running the session's inputs incrementally through the model's KV cache gives the logits of the full
forward. On the session's rows cut to L = min(T, 64) tokens, a prefill of the first P = L - D tokens
(D = min(L/2, 4)) with the cache on, then, from copies of its cache,
the next 2 positions one token per call (as generation runs) and the last D positions in chunks of 2-3 tokens
(speculative decoding, chunked prefill: fewer new queries than keys). Every position must agree with the full
forward within the session's threshold (the dtype tolerance, or 10x the noise floor or 4x the model's own
rounding against a float64 copy, where measured).
Why it matters: the cache path is the one generation takes, and the forward that training and evaluation run never
exercises it. A position off by one, RoPE restarted at 0 for the new tokens, or a causal mask aligned top-left over
the cache generates plausible text from wrong logits, and no loss curve shows it.
How it drives the model: Hugging Face transformers models as generate does (a DynamicCache made from the config,
use_cache=True, the new tokens' position_ids; cache_position and an all-ones attention_mask where forward takes
them); the reference transformer through its past_key_values; a python model through what its config declares:
  cache: {style: hf}    forward(input_ids, past_key_values=cache, use_cache=True) returns the logits and the cache
                        (.past_key_values, .cache, or a tuple (logits, cache)); no cache on the first call, and the
                        model derives the positions from its cache;
  cache: {style: gpt-fast, setup: setup_caches}
                        model.setup_caches(max_batch_size, max_seq_length), then forward(input_ids, input_pos) with
                        input_pos the positions [T_new] (litgpt: setup: set_kv_cache).
The cached calls go to the module itself, by the cache protocol declared for it; a `forward:` adapter is the full
forward they are compared with (the shared baseline), as a prefill through the cache is.
Attributes, modules and buffers a cache setup adds are removed afterwards.
Findings (each names the first sample and position that parts and, from a replay with forward hooks on the layer
stack, the first layer whose output parts there):
  FWD501  one token at a time differs (the message says whether the chunks do too): the new token's position (the
          cache length + 1, or 0 for the rotary embedding: `freqs[:T]` instead of `freqs[start:start + T]`), or what
          the cache hands back (keys stored before rotation, a step that does not append). Compare the positions
          forward uses with the cache length.
  FWD502  chunks of 2-3 differ while one token at a time agrees: the mask of several new queries over the cached
          keys is aligned top-left (tril over (T_new, T_total) without the past_len offset, or torch's
          is_causal=True with a cache); build it bottom-right, tril(diagonal=past_len). A ring-buffer cache (sliding
          window) whose mask ignores the wrap fails the same way.
  FWD503  the prefill with the cache on differs from the forward without: the cache flag changes the computation
          (or the full forward reads future tokens: see future-token).
  FWD504  NaN or Inf from the cached path: a mask that leaves a query no key (eager softmax over all -inf).
Cost: 1 + 2 + D/2 calls (5 at T >= 8: a prefill of L - 4 tokens, 2 of one token, 2 of two), about the tokens of
1.5 forwards at T = 8, of 1 up to T = 64 and of 64/T beyond; while the weights dominate (short T) each call costs
about a forward. The noise floor (two forwards) only when a change exceeds the tolerance; on a failure, one hooked
forward of one row and a replay, to name the layer.
Limits: skips models with no cache path it knows (declare `cache:`), bidirectional models, sequences shorter than
4, models that refuse one-token forwards, and --meta. It compares against the model's own full forward: a bug both
paths share is not its to see (future-token, rope). Decoding starts from one prefill length (at most 60), in the
session's batch (rows in forwards of at most the baseline's), with the given tokens (teacher forcing), not sampled
ones: a cache that goes wrong only past 64 positions is not seen.""",
)
