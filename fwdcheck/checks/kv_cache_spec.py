"""What the kv-cache check declares (CheckInfo's fields), torch-free: `fwdcheck list` and `explain` import
this module, not the check; the check's class (fwdcheck/checks/kv_cache.py) reads it: `declared=SPEC`."""

from fwdcheck.config.registry import CheckInfo

SPEC = CheckInfo(
    order=50,  # after the other default built-ins, before plugins
    applies_when="causal models that decode through a KV cache (a transformers model, a declared `cache:`)",
    description="decoding through the KV cache (one token, then a chunk of two) matches the full forward",
    codes={
        "FWD501": "decoding one token at a time through the cache gives other logits than the full forward, or "
        "caches what makes the next call's differ",
        "FWD502": "decoding a chunk of 2 tokens over the cache gives other logits, one at a time does not",
        "FWD503": "the prefill with the cache on gives other logits than the full forward at the prompt's positions",
        "FWD504": "decoding through the cache gives NaN or Inf where the full forward is finite",
    },
    explain="""\
Verifies that running the session's inputs incrementally through the model's KV cache gives the logits of the full
forward. On the session's first two rows, one chain of four calls, each over the cache the calls before it filled:
a prefill of the first P tokens with the cache on (P = 4, or the widest sliding window the model declares where it
is narrower than T, so that the decoded tokens read a cache the window has cut; at most T - 4), positions P and P+1
one token per call (as generation runs: the second reads what the first cached through the same path), then
positions P+2 and P+3 as one chunk (speculative decoding, chunked prefill: fewer new queries than keys). Every
position must agree with the full forward within the session's threshold (the dtype tolerance, or 10x the noise
floor or 4x the model's own rounding against a float64 copy, where measured). The full forward's logits are the
session's at those positions (a causal model's logits of a prefix are the whole rows' first positions); a change
beyond what can pass unexamined is judged against a fresh forward of exactly the P + 4 decoded tokens, so that a
model whose logits depend on the row's length is judged at the length it decoded.
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
  FWD501  one token at a time differs (the message says whether the chunk after it does too): the new token's
          position (the cache length + 1, or 0 for the rotary embedding: `freqs[:T]` instead of
          `freqs[start:start + T]`), or what the cache hands back (keys stored before rotation). Compare the
          positions forward uses with the cache length. Also when the one-token step agrees but the chunk after it
          parts while the same chunk decoded straight after the prefill (a second prefill, on failure only) agrees:
          the step cached the wrong keys or values (a step that does not append).
  FWD502  the chunk of 2 differs while one token at a time agrees, straight after the prefill too: the mask of
          several new queries over the cached keys is aligned top-left (tril over (T_new, T_total) without the
          past_len offset, or torch's is_causal=True with a cache); build it bottom-right, tril(diagonal=past_len).
          A ring-buffer cache (sliding window) whose mask ignores the wrap fails the same way.
  FWD503  the prefill with the cache on differs from the forward without: the cache flag changes the computation
          (or the full forward reads future tokens: see future-token).
  FWD504  NaN or Inf from the cached path: a mask that leaves a query no key (eager softmax over all -inf).
Cost: 4 calls of 2 rows (P + 4 tokens a row, 8 without a window), each about the reading of every weight that a
forward's fixed cost is: about 0.3 of a forward at T = 128 on a GPT-2-small-sized model. A fresh forward of the decoded
tokens and the noise floor (two forwards) only when a change exceeds the tolerance; on a failure, one hooked forward
of one row and a replay, to name the layer, and where the chunk alone parts, a second prefill and the chunk.
Limits: skips models with no cache path it knows (declare `cache:`), bidirectional models, sequences shorter than
4, models that refuse one-token forwards, and --meta. It compares against the model's own full forward: a bug both
paths share is not its to see (future-token, rope). Decoding starts from one prefill length, on the session's first
two rows (in forwards of at most the baseline's rows), with the given tokens (teacher forcing), not sampled ones: a
cache that goes wrong only past P + 4 positions (a preallocated cache overflowing, a window the model does not
declare wrapping later) is not seen, nor what the chunk caches, which no later call reads.""",
)
