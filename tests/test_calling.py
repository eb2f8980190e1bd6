"""How fwdcheck calls a model and reads what it returns, one rule for every check: the logits in a dict, a
ModelOutput or a tuple led by a loss; a forward that takes its ids by keyword only; a call that does not fit the
signature, told with the `forward:` adapter's two lines; the adapter called by every check (packing and
label-shift with their extras: document ids, labels) on a model in the shape of torchtitan's Decoder, whose forward
takes `tokens, positions, attention_masks`; and model code compiled at import run eagerly in every check.

Shapes: B (batch), T (sequence), d (width), V (vocabulary).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fwdcheck
from fwdcheck.model.calling import adapter_takes, call_convention_hint, ids_keyword
from tests.conftest import run_checks

V, WIDTH, HEADS = 48, 16, 2


def gate(module: nn.Module, checks: list[str] | None = None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fwdcheck.check_model(module, checks, **kw)


def not_passing(report) -> set[str]:
    return {f.code for r in report.results for f in r.findings if f.status.value in ("fail", "error", "warn")}


class Body(nn.Module):
    """embedding -> attention (causal, or within documents given by `mask`) -> head: the hidden states and logits.
    `leak` drops the causal mask."""

    def __init__(self, leak: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.leak = leak
        self.embed = nn.Embedding(V, WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, V)

    def hidden_and_logits(self, ids: torch.Tensor, mask: torch.Tensor | None = None):
        B, T = ids.shape
        x = self.embed(ids)  # (B, T, d)
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)  # 3 x (B, h, T, d_h)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=not self.leak)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = x + self.out(y.transpose(1, 2).reshape(B, T, WIDTH))  # (B, T, d)
        return h, self.head(h)  # (B, T, d), (B, T, V)


# =====================================================================================================================
# 5. The logits in what forward returns: one rule


class ReturnsMapping(Body):
    def forward(self, input_ids):
        hidden, logits = self.hidden_and_logits(input_ids)
        return {"hidden_states": hidden, "logits": logits}  # hidden states first: no check may take them


class ReturnsLossFirst(Body):
    """transformers' return_dict=False with labels: (loss, logits, ...)."""

    def forward(self, input_ids):
        hidden, logits = self.hidden_and_logits(input_ids)
        return logits.logsumexp(-1).mean(), logits, hidden


class ReturnsModelOutput(Body):
    def forward(self, input_ids):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        hidden, logits = self.hidden_and_logits(input_ids)
        return CausalLMOutputWithPast(logits=logits, hidden_states=(hidden,))


@pytest.mark.parametrize("model", [ReturnsMapping, ReturnsLossFirst])
@pytest.mark.ordinary
def test_every_check_reads_the_logits_by_one_rule(model):
    report = gate(model())
    assert report.exit_code == 0, not_passing(report)
    ledger = report.result("shape-ledger")
    assert ledger.status.value == "pass", ledger.findings
    assert any(row["name"] == "logits" and row["dims"][-1] == "V" for row in ledger.data["entries"]), ledger.data


@pytest.mark.slow  # imports transformers
@pytest.mark.ordinary
def test_a_model_output_object_is_read_by_the_same_rule():
    report = gate(ReturnsModelOutput())
    assert report.exit_code == 0, not_passing(report)


def test_a_leak_behind_a_mapping_output_is_still_caught():
    class Leaking(ReturnsMapping):
        def __init__(self):
            super().__init__(leak=True)

    report = gate(Leaking(), ["future-token"])
    assert report.result("future-token").status.value == "fail"


# =====================================================================================================================
# 6. Keyword-only forwards, and what a call that does not fit says


class KeywordOnly(Body):
    def forward(self, *, input_ids):
        return self.hidden_and_logits(input_ids)[1]


class TokensKeywordOnly(Body):
    def forward(self, *, tokens, cache=None):
        return self.hidden_and_logits(tokens)[1]


@pytest.mark.parametrize("model", [KeywordOnly, TokensKeywordOnly])
@pytest.mark.ordinary
def test_a_keyword_only_forward_is_called_by_keyword(model):
    report = gate(model())
    assert report.exit_code == 0, not_passing(report)


def test_the_keyword_is_read_off_the_signature():
    assert ids_keyword(KeywordOnly()) == "input_ids"
    assert ids_keyword(TokensKeywordOnly()) == "tokens"
    assert ids_keyword(ReturnsMapping()) is None  # positional: called as forward(input_ids)


class NeedsMasks(Body):
    """torchtitan's call convention, without an adapter: forward(tokens, attention_masks) with the mask required."""

    def forward(self, tokens, attention_masks):
        return self.hidden_and_logits(tokens, attention_masks)[1]


def test_a_call_that_does_not_fit_names_the_adapter_with_its_two_lines():
    report = gate(NeedsMasks(), ["future-token"])
    result = report.result("future-token")
    assert result.status.value == "error"
    (finding,) = result.findings
    assert "missing 1 required positional argument: 'attention_masks'" in finding.message
    assert "name a `forward:` adapter in the config" in finding.message
    assert "`def logits(model, input_ids, position_ids=None): return model(input_ids, attention_masks=...)`" in (
        finding.message
    )
    assert "(`fwdcheck explain FWD002`)" in finding.message


def test_only_a_call_convention_failure_gets_the_hint():
    assert call_convention_hint(TypeError("Decoder.forward() got an unexpected keyword argument 'document_ids'"))
    assert call_convention_hint(TypeError("M.forward() takes 2 positional arguments but 3 were given"))
    assert not call_convention_hint(TypeError("unsupported operand type(s) for +: 'Tensor' and 'str'"))
    assert not call_convention_hint(ValueError("M.forward() got an unexpected keyword argument 'x'"))


# =====================================================================================================================
# 7. Every check goes through the adapter


class TitanShaped(Body):
    """In the shape of torchtitan's Decoder: forward(tokens, positions, attention_masks) with the masks made by the
    model's get_attention_masks(positions), a new document wherever the positions restart at 0 (torchtitan's
    packed-document mask), and the loss computed by the caller: forward takes no labels. `leak`: the documents'
    mask opens the next document."""

    def __init__(self, leak: bool = False):
        super().__init__()
        self.opens_next = leak

    def get_attention_masks(self, positions: torch.Tensor) -> torch.Tensor:
        document = (positions == 0).cumsum(-1)  # (B, T): 1, 1, 1, 2, 2, ...
        same = document[:, :, None] == document[:, None, :]  # (B, T, T)
        if self.opens_next:
            same = same | (document[:, None, :] == document[:, :, None] + 1)
        T = positions.shape[-1]
        causal = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()
        return (same & causal)[:, None] if not self.opens_next else same[:, None]  # (B, 1, T, T)

    def forward(self, tokens, positions=None, attention_masks=None):
        assert attention_masks is not None, "attention_masks must be given (get_attention_masks(positions))"
        return self.hidden_and_logits(tokens, attention_masks)[1]


def titan_shaped(leak: bool = False) -> TitanShaped:
    return TitanShaped(leak)


def titan_logits(model, input_ids, position_ids=None, document_ids=None, labels=None, **extras):
    """The adapter a torchtitan user writes: positions from the document ids (restarting at each one), the masks
    from the model, and the loss the training loop computes from labels."""
    B, T = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
    if document_ids is not None:  # position of each token within its document
        starts = torch.ones_like(document_ids, dtype=torch.bool)
        starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
        index = torch.arange(T, device=input_ids.device).expand(B, T)
        start_of = torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values
        position_ids = index - start_of
    logits = model(input_ids, positions=position_ids, attention_masks=model.get_attention_masks(position_ids))
    if labels is None:
        return logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    return {"logits": logits, "loss": loss}


def titan_config(leak: bool = False) -> dict:
    return {
        "source": "python",
        "factory": "tests.test_calling:titan_shaped",
        "kwargs": {"leak": leak},
        "forward": "tests.test_calling:titan_logits",
        "vocab_size": V,
        "packing": {"argument": "document_ids", "form": "document_ids"},
        "loss": {"argument": "labels", "output": "loss"},
    }


@pytest.mark.ordinary
def test_packing_and_label_shift_go_through_the_adapter():
    report = run_checks(titan_config(), ["future-token", "packing", "label-shift"])
    for check in ("future-token", "packing", "label-shift"):
        result = report.result(check)
        assert result.status.value == "pass", (check, result.summary, result.findings)


def test_a_document_leak_is_caught_through_the_adapter():
    report = run_checks(titan_config(leak=True), ["packing"])
    assert report.result("packing").status.value == "fail", report.result("packing").summary


def test_an_adapter_that_takes_no_extras_says_which_call():
    def bare(model, input_ids):  # no **extras: the packing call's document_ids do not fit
        return titan_logits(model, input_ids)

    config = {**titan_config(), "forward": "tests.test_calling:bare_adapter"}
    globals()["bare_adapter"] = bare
    try:
        result = run_checks(config, ["packing"]).result("packing")
    finally:
        del globals()["bare_adapter"]
    assert result.status.value == "error"
    assert "unexpected keyword argument 'document_ids'" in result.summary and "adapter" in result.summary


def test_a_logits_adapter_that_drops_extras_leaves_them_to_the_module():
    """`**_` says the adapter drops what it is handed: the check with extras calls the module's own forward, as
    without an adapter; named extras or `**extras` take them."""
    assert not adapter_takes(lambda model, input_ids, **_: None, ["document_ids"])
    assert adapter_takes(lambda model, input_ids, **extras: None, ["document_ids"])
    assert adapter_takes(lambda model, input_ids, document_ids=None: None, ["document_ids"])
    assert not adapter_takes(lambda model, input_ids, labels=None: None, ["document_ids"])
    config = {
        "source": "python",
        "factory": "tests.test_packing:packed_gpt",
        "forward": "tests.test_calling:logits_only",
        "packing": {"argument": "doc_mask", "form": "mask", "position_ids": True},
    }
    assert run_checks(config, ["packing"]).result("packing").status.value == "pass"


def logits_only(model, input_ids, **_):
    return model(input_ids)


def torchtitan_llama3() -> nn.Module:
    """torchtitan's llama3 debug model (flex attention, its packed-document masks made from the positions)."""
    from torchtitan.models.llama3 import model_registry

    torch.manual_seed(0)
    model = model_registry("debugmodel", attn_backend="flex").model.build()
    model.init_weights()
    return model


@pytest.mark.slow
def test_torchtitan_llama3_through_its_adapter():
    """Where torchtitan is installed (not a test dependency: its datasets<4.8 pins huggingface-hub<2, which
    transformers 5.25 refuses), its own Decoder passes future-token and packing through the adapter above, and
    grad-causality skips: flex_attention has no backward on the CPU. Compiled at import, it runs eagerly."""
    pytest.importorskip("torchtitan")
    config = {
        **titan_config(),
        "factory": "tests.test_calling:torchtitan_llama3",
        "kwargs": {},
        "vocab_size": 2048,
    }
    report = run_checks(config, ["future-token", "packing", "grad-causality"], inputs={"batch_size": 2, "seq_len": 16})
    assert report.result("future-token").status.value == "pass", report.result("future-token").findings
    assert report.result("packing").status.value == "pass", report.result("packing").summary
    assert report.result("grad-causality").status.value in ("skip", "pass"), report.result("grad-causality").summary


# =====================================================================================================================
# 9. Model code compiled at import runs eagerly in every check


COMPILES: list[int] = []


def counting_backend(graph_module, example_inputs):
    COMPILES.append(1)
    return graph_module.forward


@torch.compile(backend=counting_backend)
def scaled(x: torch.Tensor) -> torch.Tensor:  # compiled at import, as torchtitan compiles flex_attention
    return x * 2.0


class CallsCompiledCode(Body):
    def forward(self, input_ids):
        hidden, _ = self.hidden_and_logits(input_ids)
        return self.head(scaled(hidden))


@pytest.mark.ordinary
def test_code_compiled_at_import_runs_eagerly_in_every_check():
    COMPILES.clear()
    report = gate(CallsCompiledCode(), ["shape-ledger", "future-token", "mask-audit", "grad-causality"])
    assert report.exit_code == 0, not_passing(report)
    assert COMPILES == []  # nothing compiled: every forward ran the Python as written
    with torch.no_grad():
        CallsCompiledCode()(torch.zeros(1, 4, dtype=torch.long))
    assert COMPILES == [1]  # outside a run it compiles as it would
    torch._dynamo.reset()
