"""What the packing check declares (CheckInfo's fields), torch-free: `fwdcheck list` and `explain` import
this module, not the check; the check's class (fwdcheck/checks/packing.py) reads it: `declared=SPEC`."""

from fwdcheck.config.registry import CheckInfo

SPEC = CheckInfo(
    order=52,  # after the other default built-ins, before plugins
    applies_when=(
        "causal models that offer a way to keep packed documents apart (document ids, a mask keyword, a "
        "declared `packing:`)"
    ),
    description="documents packed in one row give the logits of each run alone; none reads another",
    codes={
        "FWD601": "documents are not isolated: changing one document moves the logits of the documents after it",
        "FWD602": "a packed document's logits differ from the document run alone although no other document "
        "reaches it: positions do not restart at the document boundary",
        "FWD603": "the first document, at the unpacked row's own positions, changes when packed: the packed path "
        "computes differently (a mask letting it read later documents?)",
        "FWD604": "the packed forward gives NaN or Inf",
    },
    explain="""\
Builds two packed rows of L = min(T, 8) tokens and three documents each (2w + 3 when the model declares a sliding
window of w and T holds them: documents 2 and 3 one token longer than the band), from the session's inputs: document 1 =
row 0's first a tokens, document 2 = row 1's first b tokens, document 3 = row 0's first b tokens (a = L - 2b,
b = (L-1)//2); the second row
changes every token of document 1. Both run in one forward, told where the documents are the way the model offers:
  Hugging Face, mask builder handed position_ids (Llama, Mistral, Qwen2, GPT-2, ... in transformers 5): position_ids
    restarting per document, no attention_mask, use_cache=False (transformers finds packed documents from the
    positions only without a cache);
  Hugging Face otherwise (OPT): a 4-D additive block-diagonal causal attention_mask [N, 1, T, T] with restarting
    position_ids; models with sliding-window or chunked attention skip (one 4-D mask would drop their window);
  the reference model: document_ids;
  python models: `packing: {argument: NAME, form: document_ids | mask, position_ids: true | false}` in the model
    section (mask: [N, 1, T, T] booleans, True = may attend).
Compared with the session's threshold (tolerance of the dtype, or 10x the noise floor):
  FWD601 documents 2 and 3 of the two rows must agree: a change in document 1 that reaches them is a leak;
  FWD602 documents 2 and 3 must equal their tokens run alone (confirmed by running them alone): with isolation
    intact, a difference means positions continue across the boundary (learned or absolute positions);
  FWD603 document 1 must equal the unpacked row's prefix (the same tokens at the same positions).
Why: a packed batch whose documents read each other trains on contexts that never occur at inference (and leaks
across examples); positions that do not restart train documents at positions they will not have alone.
How to fix: FWD601 -> build the mask from the document ids (same_document & causal) and hand it to every attention
call, or pass restarting position_ids with use_cache=False and no attention_mask to transformers models; FWD602 ->
restart position_ids at each document (position - first index of the document); FWD603 -> the document mask must
stay causal.
Limits: with a rotary (relative) position encoding, positions that do not restart give the same logits once the
documents are isolated: not a finding, and not visible. A model that offers no isolation skips: restarting
position_ids alone leave a causal model reading the earlier documents, by design.""",
)
