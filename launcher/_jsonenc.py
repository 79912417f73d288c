"""JSON encoding for the run path without importing the `json` package.

`json` imports its decoder and `re` (compiling six patterns) even to
encode: 2-3 ms of every `contain run`'s start-up (docs/performance.md).
`dumps` drives the same C encoder `json.dumps` uses for `indent=None`
(`_json.make_encoder`, the call json/encoder.py makes, unchanged from 3.11
to 3.13); where that is missing or takes other arguments, it is
`json.dumps` itself. Decoding (and pretty printing) uses `json`: the run
path does not need it.
"""
from __future__ import annotations

TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Callable


def _not_serializable(o: Any) -> Any:
    raise TypeError(f"Object of type {o.__class__.__name__} is not JSON serializable")


def _c_encoder() -> Callable[[Any, bool, str, str], str] | None:
    try:
        from _json import encode_basestring_ascii, make_encoder

        def encode(obj: Any, sort_keys: bool, item_sep: str, key_sep: str) -> str:
            if isinstance(obj, str):
                return str(encode_basestring_ascii(obj))
            # A fresh markers dict per call, as JSONEncoder.iterencode makes:
            # the circular-reference check, left consistent after an error.
            chunks = make_encoder({}, _not_serializable, encode_basestring_ascii, None,
                                  key_sep, item_sep, sort_keys, False, True)(obj, 0)
            return "".join(chunks)

        if encode({"a": [1, 2.5, None, True, "\u00e9"]}, True, ",", ":") != '{"a":[1,2.5,null,true,"\\u00e9"]}':
            return None
        return encode
    except (ImportError, TypeError, ValueError):
        return None


_encode = _c_encoder()


def dumps(obj: Any, *, compact: bool = False, sort_keys: bool = False) -> str:
    """`json.dumps(obj, sort_keys=sort_keys)`, with `separators=(",", ":")`
    when `compact`. TypeError for what JSON cannot hold, ValueError for a
    circular reference, as json.dumps."""
    item_sep, key_sep = (",", ":") if compact else (", ", ": ")
    if _encode is not None:
        return _encode(obj, sort_keys, item_sep, key_sep)
    import json

    return json.dumps(obj, separators=(item_sep, key_sep), sort_keys=sort_keys)


# Deeper than this, what we read is not ours: our records nest 10 levels. Every
# reader (status's rendering, to_dict, the inbox's `by`) may then recurse freely.
MAX_DEPTH = 64


def loads(data: bytes, what: str) -> Any:
    """One of our files or lines, decoded; ValueError (with `what`) when it
    is not JSON or nests deeper than MAX_DEPTH. json.loads alone let 790
    levels through (a request's `by`, a forged record.json), and every reader
    that walks what it got recursively (to_dict, status) then raised
    RecursionError: a traceback from `contain run` after its stop and from
    every `contain status` of the run."""
    try:
        import json     # lazy: `json` imports `re`

        obj = json.loads(data)
    except RecursionError:
        raise ValueError(f"{what}: nested too deeply") from None
    except ValueError as e:      # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"{what}: not JSON ({str(e)[:80]})") from None
    raw = data if isinstance(data, (bytes, bytearray)) else str(data).encode()
    if raw.count(b"{") + raw.count(b"[") > MAX_DEPTH and _too_deep(obj):
        raise ValueError(f"{what}: nested more than {MAX_DEPTH} levels deep")
    return obj


def _too_deep(obj: Any) -> bool:
    """(Only after the brace count said it could be: counting is C speed.)"""
    if not isinstance(obj, (dict, list)):
        return False
    stack = [(obj, 1)]
    while stack:
        v, d = stack.pop()
        if d > MAX_DEPTH:
            return True
        items = v.values() if isinstance(v, dict) else v
        stack.extend((x, d + 1) for x in items if isinstance(x, (dict, list)))
    return False
