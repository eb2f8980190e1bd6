"""What the mask-audit check declares (CheckInfo's fields), torch-free: `fwdcheck list` and `explain` import
this module, not the check; the check's class (fwdcheck/checks/mask_audit.py) reads it: `declared=SPEC`."""

from fwdcheck.config.registry import CheckInfo

SPEC = CheckInfo(
    description="reads every attention call's mask in its own convention and compares the keys it allows with causal",
    codes={
        "FWD201": "no causal restriction: every query reads every key",
        "FWD202": "a boolean mask in the other API's convention: its True region is the future",
        "FWD203": "a 0/1 float mask: added to the scores it shifts them by 1 and masks nothing",
        "FWD204": "the mask lets some queries read future keys (or, over a cache, slots not yet written)",
        "FWD205": "rows in which every key is masked: NaN or all-zero attention output",
        "FWD206": "attn_mask passed together with is_causal=True",
        "FWD207": "dropout is live in eval mode (dropout_p > 0 handed to attention, or a functional dropout of any "
        "form with training=True)",
        "FWD208": "with left padding, real tokens may read the padding keys",
        "FWD209": "a flex_attention BlockMask built for other lengths than the call it is handed to",
        "FWD210": "queries that may not read their own position (q > kv; causal aligned top left over a cache)",
        "FWD211": "a sliding-window layer's band is wider or narrower than the window the model declares (or a "
        "layer declared full attention reads a band)",
        "FWD212": "an encoder-decoder's cross-attention reads only part of the source it was given (a causal or "
        "truncated cross-attention mask)",
        "FWD213": "an encoder-decoder's logits do not move when its source changes: the cross-attention is dead",
        "FWD214": "a chunked-attention layer's mask is not the chunk the model declares (full causal, chunks of "
        "another size, boundaries elsewhere)",
        "FWD215": "a vision-language model's text logits do not move when its image changes: it does not read its "
        "image",
    },
    explain="""\
Observes every scaled_dot_product_attention, multi_head_attention_forward and eager attention (a q @ k^T product by
matmul, bmm, baddbmm or einsum whose scores, scaled, masked or biased, reach a softmax; a softmax over anything else,
such as a router's logits, is not attention), records the mask's kind (bool / float / none / is_causal), shape and
values, and derives the [L queries, S keys] set of keys each query may read under the API's own convention:
  SDPA bool: True = may attend.   nn.MultiheadAttention bool: True = masked out.   float (both): added to the scores,
  0 keeps, -inf (or very negative) drops.   is_causal: lower-triangular, aligned top left (also when L != S).
  eager: keys whose score is -inf or more than 80 below the row's maximum get no weight.
  torch's causal_upper_left / causal_lower_right (handed to SDPA as attn_mask): the diagonal aligned top left / bottom
  right. flex_attention: the BlockMask's mask_mod evaluated at every (batch, head, query, key) index the call covers,
  and the score_mod applied to a probe of zero scores (a score it makes -inf is masked); a BlockMask built for other
  (query, key) lengths than the call's is FWD209. flash-attn (flash_attn::_flash_attn_forward and
  _flash_attn_varlen_forward): causal and window_size (left, right) aligned bottom right, each packed sequence of
  cu_seqlens_q / cu_seqlens_k reading only its own keys. xformers (memory_efficient_attention's CUTLASS op,
  xformers::efficient_attention_forward_cutlass): the attn_bias as lowered to custom_mask_type (1 causal aligned top
  left: LowerTriangularMask, BlockDiagonalCausalMask; 2 bottom right: ...FromBottomRight...), window_size, the
  block-diagonal cu_seqlens and an additive bias tensor. Any other custom op named for attention is listed as
  "not judged: <kernel name>", never passed. torch.compile'd code runs eagerly while observed.
For a causal model, query i may read key slot j only if j <= p_i, its own position on the key axis:
  square calls (L = S): the sequence against itself, p_i = i.
  KV caches, chunked prefill, decode steps (L != S): p_i from an input_pos / cache_position / position_ids of L
  positions handed to the model's or the attention module's forward (key slot j holds position j); else from the L
  slots of S the attention module (or one around it) just wrote in place (index_copy_, scatter_, cache[..., idx] =),
  their positions the integer tensor it was handed that the slots are, or are modulo S (a ring buffer, Mistral's
  reference: slot j then holds the position last written there, and causal reads the slots holding positions
  <= p_i), or the slots themselves while none was written twice; else, when S is
  exactly the number of tokens that attention has been run with in this forward (a cache that grows by concatenation),
  the queries are the last L (bottom-right alignment, as Hugging Face and flash-attention use). Otherwise the call is
  reported "not judged: query positions unknown" - never counted as a pass. A mask that opens cache slots after p_i
  fails whether they hold future tokens or were never written (a correct mask closes both).
  cross-attention (keys from another sequence: within a module handed its hidden state and other tensors of its
  rank, q computed from its own input and k from the others only, followed op by op; nn.MultiheadAttention handed a
  key other than its query; or an attention module handed context / encoder_hidden_states / key_value_states / y /
  xa other than its input), and
  attention whose queries are not computed from the input ids (an encoder over a fixed source, followed op by op
  from the model's input): not judged for causality, reported as such; mask encoding (FWD203, FWD205-FWD207) is
  still checked.
The model's attention pattern by design (model.attention, or read off the model: is_encoder_decoder, is_decoder,
its attention modules' is_causal) decides what each call may read instead of plain causal:
  bidirectional (an encoder: BERT, a masked LM): self-attention may read every key; only the mask's encoding and
  padding are judged.   prefix (prefix_length P): queries before P read the prefix both ways and nothing after
  it, queries from P on are causal; the prefix reading the suffix is FWD204.   encoder-decoder: the decoder's
  self-attention is causal; the encoder's, over the source held fixed, is full attention and not judged; and
  cross-attention must let every decoder position read every source position it was given (the source is unpadded):
  a causal or truncated cross-attention mask is FWD212. An encoder-decoder built from `source: hf` with its source
  held fixed by fwdcheck also runs once beside another source: logits that do not move are FWD213 (a dead
  cross-attention).
A vision-language model from `source: hf` runs its text path once more with an image fwdcheck draws (the code-path
cell "with an image"): the image's ids come first and are judged as a prefix (what they read among themselves is
the model's design, PaliGemma's and Gemma 3's image block reading itself both ways; they must not read the text
after them, FWD204), the text reads them and is causal over itself. The text runs once more after another image:
logits that do not move beyond the run-to-run noise are FWD215 (the image's features not merged into the sequence,
zeroed, or overwritten).
  cross-attention). A decoder call over its own keys and the source's together (T5Gemma 2's merged self- and
  cross-attention, keys [T + S], the keys computed from both) is judged as those two blocks.
Besides the session's batch, the first row's first 16 tokens run alone (unless the code-path matrix runs batch size
1): a fast path taken only for a single sequence that forgets the mask is found there, and named "at B=1".
If no call could be judged and nothing else is wrong, the check skips with the reason. Findings name the module and
call; FWD204 shows (query position, key slot) pairs.
Why: the two boolean conventions are opposite, and `mask.float()` of a boolean mask gives 0/1, which added to the
scores masks nothing. Both run without an error and train to a good-looking loss.
How to fix: FWD202 -> pass ~mask, or build the mask for the API you call (SDPA: torch.ones(T, T).tril().bool();
MHA: torch.triu(torch.ones(T, T), 1).bool() or nn.Transformer.generate_square_subsequent_mask(T)); over a cache,
slice the rows of the causal mask by the query positions (causal_mask[None, None, input_pos]). FWD203 -> keep the
mask boolean, or turn it into 0/-inf with torch.zeros(T, T).masked_fill(~may_attend, float('-inf')). FWD207 -> pass
dropout_p=self.p if self.training else 0.0. FWD210 -> q_idx >= kv_idx, not >; over a cache, align the causal
mask bottom right (causal_lower_right, or slice the full causal mask by the query positions). FWD209 -> build the
BlockMask for each call's lengths.
Declared windows (FWD211): where the model declares a sliding window (a config's `window:`; transformers' sliding_window
on every layer, or on the layers its layer_types call sliding_attention, use_sliding_window false turning it off;
GPT-Neo's window_size on its "local" layers), the band each judged call's mask allows is compared with its layer's
window, counted as the keys a query may read itself included (transformers' masks keep key j for query i when
j > i - sliding_window: W keys). Rows whose query has more earlier keys than the window must read exactly W; one
key wider or narrower fails, naming the layer, the declared and the measured width. A layer declared full attention
beside sliding ones must read every earlier key past the widest window. A kernel's window argument (flash-attn's
window_size, xformers' attn_bias) is measured as the band it allows: window_size=(W, 0) reads W + 1 keys. The width
is "not judged" when the run's longest query does not reach past the window (raise inputs.seq_len above it); a model
that declares no window is not judged on width. FWD211 -> build the band as the config says: keep key j when
j > i - W (or flash-attn's window_size=(W - 1, 0)), and the sliding mask only on sliding layers. FWD212 -> hand
cross-attention the source's padding mask only (encoder_attention_mask, memory_key_padding_mask), never the
decoder's causal mask.
Declared chunks (FWD214): where the model declares chunked attention (transformers' attention_chunk_size on the
layers its layer_types call chunked_attention, as Llama 4's; a config's `chunk:`), the sequence is cut into chunks
of C tokens from its first, and the query at position p must read exactly the keys at positions C * (p // C) .. p,
itself included. Each judged call of such a layer is compared query by query and key by key; a query that reads
otherwise fails, naming the layer, the declared chunk and what the mask is (full causal attention, chunks of another
size, chunk boundaries at other positions, a sliding band) with the first query that reads otherwise. Chunks are
"not judged" when no query of the run holds a key of an earlier chunk (raise inputs.seq_len above C); the layers
declared full attention beside chunked ones must read every earlier key past the largest chunk (FWD211). FWD214 ->
build the chunked mask on the chunked layers (keep key j for query i when j // C == i // C, counted from the first
real token), with the config's chunk size. FWD215 -> merge the image's features where its tokens stand
(inputs_embeds.masked_scatter of the projected features at the image token's positions), and check that the
projector's output reaches them.
A model without attention calls fwdcheck can read (custom kernels) is skipped here; future-token still tests its
behaviour. For a cached forward whose calls are not judged, hand the positions to the attention module's forward as
input_pos or cache_position.""",
    order=30,
    detail_view="fwdcheck.checks.mask_audit_view:mask_table",
)
