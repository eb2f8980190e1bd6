"""pydantic's validation errors in the words of a YAML file: what a value should be, said as a config's reader writes
it, never in pydantic's Python wording ("a valid dictionary or instance of Ignore", "a valid path for <class
'pathlib.Path'>"). Read by every place that turns a validation error into a line: configs, check options, the files
checks read."""

from __future__ import annotations

from pydantic_core import ErrorDetails

# pydantic's error types in the words of a YAML file (pydantic's own speak of Python: "a valid dictionary or
# instance of Ignore", "a valid path for <class 'pathlib.Path'>")
_PLAIN_WORDS = {
    "dict_type": "expected a mapping (key: value pairs)",
    "model_type": "expected a mapping (key: value pairs)",
    "model_attributes_type": "expected a mapping (key: value pairs)",
    "list_type": "expected a list",
    "tuple_type": "expected a list",
    "set_type": "expected a list",
    "string_type": "expected a text (a string)",
    "path_type": "expected a path (a string)",
    "int_type": "expected a whole number",
    "int_parsing": "expected a whole number",
    "int_from_float": "expected a whole number, not a fraction",
    "float_type": "expected a number",
    "float_parsing": "expected a number",
    "bool_type": "expected true or false",
    "bool_parsing": "expected true or false",
    "finite_number": "expected a finite number",
    "none_required": "expected nothing here (null)",
}
_BOUNDS = {"greater_than": "gt", "greater_than_equal": "ge", "less_than": "lt", "less_than_equal": "le"}
_BOUND_WORDS = {"gt": "greater than", "ge": "at least", "lt": "less than", "le": "at most"}


def in_plain_words(error: ErrorDetails) -> str:
    """What a value should be, said as a config's reader writes it: never pydantic's Python wording."""
    kind, context = error["type"], error.get("ctx") or {}
    if kind in _PLAIN_WORDS:
        return _PLAIN_WORDS[kind]
    if kind in _BOUNDS:
        bound, limit = _BOUNDS[kind], context.get(_BOUNDS[kind])
        return f"must be {_BOUND_WORDS[bound]} {f'{limit:g}' if isinstance(limit, float) else limit}"
    if kind in ("literal_error", "enum"):  # "'a', 'b' or 'c'": pydantic's list of the allowed values
        expected = str(context.get("expected", "")).replace("'", "")
        return f"expected {'one of ' if ' or ' in expected else ''}{expected}"
    if kind == "string_too_short":
        return (
            "must not be empty"
            if context.get("min_length") == 1
            else f"at least {context.get('min_length')} characters"
        )
    if kind == "string_too_long":
        return f"at most {context.get('max_length')} characters"
    if kind == "too_short":
        return f"needs at least {context.get('min_length')} item(s)"
    if kind == "too_long":
        return f"takes at most {context.get('max_length')} item(s)"
    if kind == "string_pattern_mismatch":
        return f"not of the expected form (the pattern {context.get('pattern')})"
    text = error["msg"]  # an error type not met before: pydantic's sentence, its Python words softened
    return text.replace("Input should be", "expected").replace("Input is not", "not").replace("Input ", "the value ")
