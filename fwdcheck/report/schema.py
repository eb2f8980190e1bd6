"""The JSON report's schema (`fwdcheck schema --json-report`). Consumers must ignore fields they do not know:
new fields are added without a schema_version bump; removing or changing one bumps it."""

from __future__ import annotations

from fwdcheck.report.record import SCHEMA_VERSION

STATUS = {"enum": ["pass", "warn", "fail", "skip", "error"]}

FINDING = {
    "type": "object",
    "required": ["code", "status", "message", "where"],
    "properties": {
        "code": {
            "type": "string",
            "description": "stable id: FWD10x future-token, FWD12x grad-causality and grad-reach, FWD2xx mask-audit, "
            "FWD3xx rope, FWD4xx shape-ledger, FWD5xx-FWD9xx the equivalence checks, FWD0xx fwdcheck itself; plugins "
            "use their own prefixes",
        },
        "status": STATUS,
        "message": {"type": "string"},
        "where": {"type": ["string", "null"], "description": "module path, positions, code paths"},
        "source": {"type": ["string", "null"], "description": "file:line of the model code, when known"},
        "ignored": {"type": ["string", "null"], "description": "the config's reason, when the code is ignored"},
    },
}

CHECK = {
    "type": "object",
    "required": ["name", "status", "summary", "findings", "metrics", "data", "duration_s"],
    "properties": {
        "name": {"type": "string"},
        "status": STATUS,
        "summary": {"type": "string"},
        "findings": {"type": "array", "items": FINDING},
        "metrics": {"type": "object", "description": "numbers: thresholds, measured changes, counts"},
        "data": {
            "type": "object",
            "description": "structured detail; shape-ledger: entries [{name, shape, dims}], "
            "future-token: leak_map, mask-audit: calls (with window {layer, declared, measured, judged, note} "
            "where the model declares one, chunk {layer, declared, measured, judged, note} on a chunked layer), "
            "attention-stats: calls (with scale, q_factor, k_factor, "
            "effective_scale, chain, declared), code-path checks: paths [{path, status, summary, codes}]",
        },
        "duration_s": {"type": "number"},
        "key_number": {
            "type": "string",
            "description": "the measurement the verdict rests on, as the terminal "
            "summary shows it; empty when the check names none",
        },
    },
}

JSON_REPORT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "fwdcheck report",
    "type": "object",
    "required": ["schema_version", "fwdcheck_version", "status", "exit_code", "model", "environment", "checks"],
    "properties": {
        "schema_version": {"const": SCHEMA_VERSION},
        "fwdcheck_version": {"type": "string"},
        "status": STATUS,
        "exit_code": {"enum": [0, 1, 3, 5, 130, 143]},
        "config": {"type": ["string", "null"]},
        "model": {"type": "object"},
        "environment": {
            "type": "object",
            "required": ["torch", "python", "device", "dtype", "seed"],
            "properties": {
                "torch": {"type": "string"},
                "python": {"type": "string"},
                "device": {"type": "string"},
                "dtype": {"type": "string"},
                "seed": {"type": "integer"},
                "batch_size": {"type": "integer"},
                "seq_len": {"type": "integer"},
            },
        },
        "notes": {"type": "array", "items": {"type": "string"}},
        "checks": {"type": "array", "items": CHECK},
    },
}
