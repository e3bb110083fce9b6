"""Structured outputs: the request fields that constrain the output, mapped onto :class:`GuidedDecodingParams`
(decoded with speculation: the grammar masks the target's rows and, where tokens are forced, the drafts).

    response_format {"type": "json_object"}                   -> any JSON object
    response_format {"type": "json_schema", "json_schema": {"schema": S}}  -> JSON valid under S
    guided_json S, guided_regex R, guided_grammar G (Lark, llguidance's syntax), guided_choice [a, b, ...]
    structured_outputs {"json": S} / {"regex": R} / {"grammar": G} / {"choice": [...]} / {"json_object": true}
    tools with tool_choice "required" or a named function   -> the tool call's JSON (serve/tool_calls.py)

At most one of them per request; ``response_format {"type": "text"}`` constrains nothing."""
from __future__ import annotations

from typing import Any

from ..config import GuidedDecodingParams
from .errors import APIError
from .requests import GenerationRequest

JSON_OBJECT = {"type": "object"}
_STRUCTURED_OUTPUTS_KINDS = ("json", "regex", "grammar", "choice", "json_object")


def guided_decoding(body: GenerationRequest, tool_schema: dict[str, Any] | None = None
                    ) -> tuple[GuidedDecodingParams | None, str | None]:
    """(the request's grammar, the field that gave it), or (None, None); a 400 naming the field when it is
    malformed or one of several."""
    given = [(name, value) for name, value in _constraints(body, tool_schema) if value is not None]
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise APIError(400, f"give at most one output constraint; this request has {names}", given[1][0])
    if not given:
        return None, None
    name, fields = given[0]
    try:
        return GuidedDecodingParams(**fields), name
    except ValueError as err:  # pydantic's ValidationError: the first problem, one line
        first = err.errors()[0] if hasattr(err, "errors") else {"msg": str(err)}
        raise APIError(400, f"{name}: {first['msg']}", name) from None


def _constraints(body: GenerationRequest, tool_schema: dict[str, Any] | None
                 ) -> list[tuple[str, dict[str, Any] | None]]:
    """(field, GuidedDecodingParams fields or None) for every field that may constrain the output."""
    return [("response_format", _response_format(body.response_format)),
            ("guided_json", None if body.guided_json is None else {"json_schema": body.guided_json}),
            ("guided_regex", None if body.guided_regex is None else {"regex": body.guided_regex}),
            ("guided_grammar", None if body.guided_grammar is None else {"lark": body.guided_grammar}),
            ("guided_choice", None if body.guided_choice is None else {"regex": choice_regex(body.guided_choice)}),
            ("structured_outputs", _structured_outputs(body.structured_outputs)),
            ("tools", None if tool_schema is None else {"json_schema": tool_schema})]


def _response_format(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is None or value.get("type") == "text":
        return None
    kind = value.get("type")
    if kind == "json_object":
        return {"json_schema": JSON_OBJECT}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise APIError(400, "response_format.json_schema must be an object with a 'schema'", "response_format")
        return {"json_schema": spec["schema"]}
    raise APIError(400, f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   "response_format")


def _structured_outputs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is None:
        return None
    given = {k: v for k, v in value.items() if v not in (None, False)}
    unknown = sorted(set(given) - set(_STRUCTURED_OUTPUTS_KINDS))
    if unknown or len(given) != 1:
        raise APIError(400, f"structured_outputs takes exactly one of {', '.join(_STRUCTURED_OUTPUTS_KINDS)}; got "
                       f"{', '.join(sorted(given)) or 'none'}", "structured_outputs")
    (kind, spec), = given.items()
    if kind == "choice":
        return {"regex": choice_regex(spec)}
    return {"json_schema": JSON_OBJECT} if kind == "json_object" else \
        {{"json": "json_schema", "regex": "regex", "grammar": "lark"}[kind]: spec}


def choice_regex(choices: object) -> str:
    """A regular expression matching exactly one of ``choices`` (strings), each character that is not a letter
    or digit written as a hex escape (llguidance's regex syntax is Rust's)."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise APIError(400, "a choice constraint must be a non-empty list of non-empty strings", "guided_choice")
    return "|".join("".join(ch if ch.isalnum() else f"\\x{{{ord(ch):x}}}" for ch in c) for c in choices)
