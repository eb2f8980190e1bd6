"""kv-cache on OpenAI Whisper's decoder (openai-whisper from the package index, tiny random weights): its cache is a
dict keyed by each attention's key and value nn.Linear, filled by forward hooks (`install_kv_cache_hooks`), as
whisper's own decoding loop drives it. kv-cache runs it as one chain of calls through that very dict: a copy that
copied the modules too would find none of its entries, and nothing is copied.

Shapes: B (batch), T (tokens), A (audio frames), C (width).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.conftest import run_checks

whisper_model = pytest.importorskip("whisper.model")

DIMS = {  # tiny: the audio context longer than the text one, as in every released size (the hooks rely on it)
    "n_mels": 8,
    "n_audio_ctx": 24,
    "n_audio_state": 16,
    "n_audio_head": 2,
    "n_audio_layer": 1,
    "n_vocab": 64,
    "n_text_ctx": 16,
    "n_text_state": 16,
    "n_text_head": 2,
    "n_text_layer": 2,
}


class WhisperTextLM(nn.Module):
    """Whisper's text decoder over fixed audio features, as a causal LM: forward(input_ids) is the full forward;
    forward(input_ids, past_key_values=cache, use_cache=True) decodes through whisper's hook-based cache as
    whisper.decoding's PyTorchInference does, and returns (logits, cache)."""

    def __init__(self, eager: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.whisper = whisper_model.Whisper(whisper_model.ModelDimensions(**DIMS))
        # whisper leaves the text positions uninitialised (torch.empty: a checkpoint fills them), NaN at times
        nn.init.normal_(self.whisper.decoder.positional_embedding, std=0.02)
        self.eager = eager
        self.register_buffer("mel", torch.randn(1, DIMS["n_mels"], 2 * DIMS["n_audio_ctx"]))  # (1, mels, 2A)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        audio = self.whisper.embed_audio(self.mel.expand(input_ids.shape[0], -1, -1))  # (B, A, C)
        previous = whisper_model.MultiHeadAttention.use_sdpa
        whisper_model.MultiHeadAttention.use_sdpa = not self.eager
        try:
            if not use_cache:
                return self.whisper.logits(input_ids, audio)  # (B, T, V)
            cache, hooks = self.whisper.install_kv_cache_hooks(past_key_values)
            try:
                return self.whisper.decoder(input_ids, audio, kv_cache=cache), cache
            finally:
                for hook in hooks:
                    hook.remove()
        finally:
            whisper_model.MultiHeadAttention.use_sdpa = previous


def whisper_text(eager: bool = False) -> nn.Module:
    return WhisperTextLM(eager)


def kv_cache(eager: bool):
    model = {
        "source": "python",
        "factory": "tests.test_kv_cache_whisper:whisper_text",
        "kwargs": {"eager": eager},
        "cache": {"style": "hf"},
        "max_positions": DIMS["n_text_ctx"],
    }
    return run_checks(model, ["kv-cache"], inputs={"batch_size": 2, "seq_len": 8}).result("kv-cache")


def chunk_after_prefill(model: WhisperTextLM, ids: torch.Tensor, prefill: int) -> float:
    """Plain torch, no fwdcheck: the largest change of the logits of the two tokens after `prefill`, decoded as
    one chunk through whisper's cache, from the full forward's."""
    with torch.no_grad():
        full = model(ids)  # (B, T, V)
        _, cache = model(ids[:, :prefill], use_cache=True)
        chunk, _ = model(ids[:, prefill : prefill + 2], past_key_values=cache, use_cache=True)  # (B, 2, V)
    return float((chunk - full[:, prefill : prefill + 2]).abs().max())


def test_whisper_decodes_one_token_at_a_time_through_its_module_keyed_cache():
    """One token at a time, Whisper's cache gives the full forward's logits (its entries found under the model's own
    modules): no FWD501. Chunks of two after the prefill are a true finding about whisper itself: its attention
    aligns SDPA's causal mask top-left (is_causal over fewer queries than keys), which whisper's own decoding never
    meets (it decodes one token at a time) and plain torch shows below. (Its eager path raises on such a chunk:
    mask[:n, :n] does not cover the cached keys.)"""
    result = kv_cache(eager=False)
    assert {f.code for f in result.findings if f.status.value == "fail"} == {"FWD502"}, result.summary
    # one token at a time decodes through the prefill's cache, found under the model's own modules
    assert result.metrics["token_max_change"] <= result.metrics["threshold"] < 1e-4
    assert result.metrics["chunked_max_change"] > 100 * result.metrics["threshold"]
    # the same chunk straight after the prefill parts too: the mask, not what the one-token step cached
    assert result.metrics["chunk_after_prefill_max_change"] > 100 * result.metrics["threshold"]
    ids = torch.randint(0, DIMS["n_vocab"], (2, 8), generator=torch.Generator().manual_seed(0))
    assert chunk_after_prefill(WhisperTextLM(), ids, 4) > 1e-2  # the same in plain torch
