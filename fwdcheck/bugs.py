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
}
