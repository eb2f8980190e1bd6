"""The bugs the reference transformer can plant (kept free of torch so the config can name them cheaply)."""

# Each planted bug, with the line of real code it imitates.
BUGS: dict[str, str] = {
    "no-causal-mask": "attention gets no mask at all: every query reads every key, the future included",
    "inverted-bool-mask": "a True-means-masked boolean mask (nn.MultiheadAttention's convention) handed to SDPA, "
    "where True means 'may attend'",
    "float-mask-01": "the causal mask turned into 0/1 floats with .float(): it adds +1 to allowed scores "
    "and masks nothing",
    "sdpa-dropout-in-eval": "dropout_p=self.dropout passed to scaled_dot_product_attention whether or not training",
    "batch-mix": "queries split into heads with permute+reshape instead of view+transpose: heads of one sample "
    "take the queries of another",
    "rope-k-unrotated": "the rotary embedding is applied to the queries but not to the keys",
    "rope-pairing-mismatch": "queries rotated with rotate_half pairing, keys with interleaved pairing",
    "rope-absolute-offset": "the caller's position offset (position_ids) reaches the queries only; the keys are "
    "rotated at 0..T-1",
    "kv-cache-position-off-by-one": "decoding through the KV cache, the new tokens' positions start at "
    "past_len + 1 (the 1-based count of tokens seen) instead of past_len",
    "kv-cache-mask-top-left": "the causal mask of several new queries over past + new keys built as "
    "torch.ones(T, S).tril() (aligned top-left, as torch's is_causal=True) instead of .tril(diagonal=past_len)",
    "kv-cache-rope-restart": "decoded tokens rotated at positions 0..T-1 of the new chunk (freqs[:T]) instead of "
    "freqs[start_pos:start_pos + T]",
    "eager-scale-1-over-d": "the eager attention path scales the scores by 1/d (attn_weights = q @ "
    "k.transpose(-2, -1) / self.head_dim) instead of 1/sqrt(d); the SDPA path is right",
    "sdpa-scale-dropped": "scaled_dot_product_attention handed scale=1.0 (copied from a model that folds "
    "1/sqrt(d) into its query projection's init, as T5 does): the scores are sqrt(d) times too large; the eager "
    "path is right",
    "heads-swapped": "the heads' outputs put side by side in another order than the output projection's columns "
    "expect (the first two heads swapped, as a port that reorders a per-head ModuleList does): every shape and "
    "every mask stay right",
    "rope-angles-in-model-dtype": "rotary angles computed in the activations' dtype (freqs = position_ids.to(x.dtype)"
    "[..., None] * inv_freq.to(x.dtype)): in bfloat16 or float16 the angles of long positions are off by radians",
    "label-no-shift": "the loss compares each position's logits with its own label (F.cross_entropy(logits.view(-1, "
    "V), labels.view(-1))) instead of logits[:, :-1] with labels[:, 1:]",
    "label-double-shift": "labels shifted once on the flattened batch (flat[1:]) and again per row (labels[:, 1:]): "
    "each position is scored two tokens ahead, and the last of each row against the next row's first label",
    "sliding-window-one-wider": "the sliding band built as torch.ones(T, S).tril() & ~torch.ones(T, S)"
    ".tril(-window - 1): each query reads window + 1 keys, one more than the declared window (needs the model's "
    "window set)",
    "scale-applied-twice": "q multiplied by 1/sqrt(d) after its projection (q = q_proj(x) * self.scaling) and handed "
    "to an attention that scales by 1/sqrt(d) again (SDPA's default, or the eager path's own): the scores are "
    "q . k / d",
    "packing-positions-not-reset": "packed documents run at position_ids = torch.arange(T): positions continue "
    "across document boundaries instead of restarting at 0",
    "packing-no-document-mask": "packed documents get the plain causal mask: document_ids never reach the "
    "attention, so each document reads the ones before it",
}
