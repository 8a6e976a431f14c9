"""Structured output: a request with SamplingParams.json_schema generates only text that
the schema's grammar accepts. The grammar library is xgrammar (the optional extra
`pip install 'sarathi_rt[structured]'`), imported on the first such request only.

The grammar state lives on the driver, beside the request's tokens: before each step
that samples a request, its matcher writes the allowed tokens as a bitmask (RowSampling
.allowed, plain bytes, so any executor ships it); the worker's sampler masks that row
alone; the driver then advances the matcher by the token it got. A preempted request
keeps its generated tokens and so its matcher; an aborted or finished one drops it with
the rest of its state. Speculative decoding walks the matcher through a request's
proposals, to cut them where the grammar refuses one and to mask each verification row
as of its own position, and rolls it back at once: only the tokens the request keeps
advance it."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from sarathi_rt.text.tokenizer import Tokenizer

EXTRA = "pip install 'sarathi_rt[structured]'"
# Compiled grammars kept, by the bytes xgrammar reports for them: a second request with a
# schema seen before compiles nothing.
_CACHE_BYTES = 256 << 20
# The schema_complexity a server accepts by default (see schema_complexity).
DEFAULT_MAX_SCHEMA_COMPLEXITY = 20_000


def schema_complexity(schema: Any) -> int:
    """A measure of what compiling `schema` (parsed JSON) costs, cheap to compute before
    compiling: every JSON value in it counts 1, an object with k optional properties (not
    in its `required`) adds k*k // 64 and an `enum` of k values adds k*k // 10_000, since
    xgrammar 0.2.9's compile grows about as the cube of the former and the square of the
    latter. Any dict counts as a schema, so a property named "properties" or "enum" may
    count twice: the measure errs towards refusing.

    Measured once on a 2-core machine (tiny and 49k-token vocabularies alike; the
    vocabulary hardly matters): 1000 optional integer properties (17.6k) 1.1 s, 1250
    (26.9k) 2.5 s, 1500 (38.2k) 5.9 s; 1000 required objects of an 8-value enum and a
    bounded integer (17k) 0.9 s, 2000 (34k) 3.4 s, 4000 (68k) 13 s; an enum of 10k
    strings (20k) 1.9 s, 20k (60k) 7.2 s. DEFAULT_MAX_SCHEMA_COMPLEXITY, 20k, thus keeps
    a compile within about 2 s there."""
    total = 0
    stack = [schema]
    while stack:  # not recursive: a deeply nested schema must not overflow the stack
        node = stack.pop()
        total += 1
        if isinstance(node, dict):
            stack.extend(node.values())
            total += _superlinear(node)
        elif isinstance(node, list):
            stack.extend(node)
    return total


def _superlinear(node: dict[str, Any]) -> int:
    properties, required, enum = node.get("properties"), node.get("required"), node.get("enum")
    cost = 0
    if isinstance(properties, dict):
        names = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
        optional = len(properties.keys() - names)
        cost += optional * optional // 64
    if isinstance(enum, list):
        cost += len(enum) * len(enum) // 10_000
    return cost


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise ValueError(f"json_schema (structured output) needs the xgrammar library, an optional extra: "
                         f"{EXTRA}") from None
    return xgrammar


class Grammar:
    """One request's position in its grammar."""

    __slots__ = ("_matcher", "_bitmask", "_special")

    def __init__(self, matcher: Any, bitmask: Any, special: frozenset[int]) -> None:
        self._matcher = matcher
        self._bitmask = bitmask
        # Token ids with no text, which no grammar accepts (xgrammar logs a warning for
        # each one it is asked to accept, and proposers do propose them).
        self._special = special

    def allowed(self) -> bytes:
        """The tokens the grammar allows next, bit t%32 of little-endian int32 word t//32."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        return self._bitmask.numpy().tobytes()

    def cut(self, draft: list[int]) -> list[int]:
        """The longest prefix of `draft` (speculative proposals) the grammar accepts,
        token by token, without completing: past a completing token (the value's end, a
        stop token) the grammar allows nothing to mask the next row with, and the token
        is the target's to sample (it ends the request either way). The matcher ends
        where it began, so rejected proposals never advance it."""
        walked = kept = 0
        for token in draft:
            if token in self._special or not self._matcher.accept_token(token):
                break
            walked += 1
            if self._matcher.is_terminated():
                break
            kept += 1
        if walked:
            self._matcher.rollback(walked)
        return draft[:kept]

    def allowed_after(self, draft: list[int]) -> list[bytes]:
        """allowed() after each prefix draft[:1], draft[:2], ... of proposals that `cut`
        kept whole: the masks of a verification's rows after its first (row i samples
        the token that follows the first i proposals). The matcher ends where it began."""
        masks = []
        for token in draft:
            if not self._matcher.accept_token(token):
                break
            masks.append(self.allowed())
        if masks:
            self._matcher.rollback(len(masks))
        if len(masks) < len(draft):
            raise ValueError(f"draft holds token {draft[len(masks)]} at {len(masks)}, which the grammar refuses "
                             "there: cut() it first")
        return masks

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; True once the grammar is complete (the request is
        done). The sampler only picks allowed tokens, so a refusal is an engine bug."""
        if not self._matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token}, which its own mask allowed")
        return bool(self._matcher.is_terminated())


class GrammarCompiler:
    """Compiles schemas against one vocabulary. Built on the first structured request, so
    an engine without any never needs xgrammar."""

    def __init__(self, tokenizer: object, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        if not isinstance(tokenizer, Tokenizer):
            has = "none" if tokenizer is None else type(tokenizer).__name__
            raise ValueError("json_schema (structured output) needs the engine's tokenizer (a "
                             f"sarathi_rt Tokenizer); this engine has {has}")
        xgr = _xgrammar()
        strings, kind, prefix_space = tokenizer.grammar_vocabulary()
        # The logits may be wider than the vocabulary (padded) or, for a model trained on a
        # smaller one, narrower: ids past the strings are never allowed.
        strings = strings[:vocab_size]
        vocab_type = {"byte_level": xgr.VocabType.BYTE_LEVEL, "byte_fallback": xgr.VocabType.BYTE_FALLBACK,
                      "raw": xgr.VocabType.RAW}[kind]
        eos = [t for t in eos_token_ids or tokenizer.eos_token_ids if t < vocab_size]
        if not eos:  # xgrammar needs one; a request ends when its grammar completes anyway
            eos = [next(i for i, s in enumerate(strings) if s == "")] if "" in strings else [vocab_size - 1]
        info = xgr.TokenizerInfo(strings, vocab_type, vocab_size=vocab_size, stop_token_ids=eos,
                                 add_prefix_space=prefix_space)
        self.tokenizer_info = info  # what xgrammar reads each token as
        self._special = frozenset(info.special_token_ids)
        self._xgr = xgr
        self._vocab_size = vocab_size
        # The cache is ours, keyed by the schema text as SamplingParams holds it, so a cached
        # schema skips _prepared's parse and rewrite too.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[str, Any] = OrderedDict()  # least recently used first
        self._cache_bytes = 0
        self._cache_lock = threading.Lock()

    def cached(self, schema: str) -> bool:
        """Whether `schema` is compiled already (so `compile` returns at once)."""
        with self._cache_lock:
            return schema in self._cache

    def compile(self, schema: str) -> Any:
        """`schema` (JSON text) compiled, from the cache after the first time; safe from
        any thread. A schema xgrammar cannot compile raises ValueError naming json_schema."""
        with self._cache_lock:
            compiled = self._cache.get(schema)
            if compiled is not None:
                self._cache.move_to_end(schema)
                return compiled
        try:
            compiled = self._compiler.compile_json_schema(_prepared(schema), any_whitespace=False)
        except RuntimeError as exc:  # xgrammar reports bad schemas as RuntimeError
            raise ValueError(f"json_schema is not a schema xgrammar supports: {_reason(exc)}") from None
        self._keep(schema, compiled)
        return compiled

    def _keep(self, schema: str, compiled: Any) -> None:
        size = compiled.memory_size_bytes
        with self._cache_lock:
            if schema in self._cache:  # compiled twice at once: the first one stays
                return
            self._cache[schema] = compiled
            self._cache_bytes += size
            while self._cache_bytes > _CACHE_BYTES and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cache_bytes -= old.memory_size_bytes

    def grammar(self, schema: str, stop_token_ids: frozenset[int]) -> Grammar:
        """A fresh matcher for `schema`. The request ends at one of its stop tokens once
        the text is complete, or right at completion when it has none (ignore_eos)."""
        compiled = self.compile(schema)
        stops = sorted(stop_token_ids)
        matcher = self._xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None,
                                           terminate_without_stop_token=not stops)
        return Grammar(matcher, self._xgr.allocate_token_bitmask(1, self._vocab_size), self._special)


def _prepared(schema: str) -> str:
    """`schema` as xgrammar is to compile it: every node checked by _satisfiable and
    rewritten by _bounded_string."""
    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        node = {k: walk(v) for k, v in node.items()}
        _satisfiable(node)
        return _bounded_string(node)

    return json.dumps(walk(json.loads(schema)))


def _satisfiable(node: dict[str, Any]) -> None:
    """Refuse an object that requires a property its additionalProperties: false forbids:
    xgrammar compiles it to `{}`, which is no value of the schema."""
    required, properties = node.get("required"), node.get("properties") or {}
    if node.get("additionalProperties") is False and isinstance(required, list) and "patternProperties" not in node:
        missing = [name for name in required if name not in properties]
        if missing:
            raise ValueError(f"json_schema has no value: it requires {missing[0]!r}, which its "
                             "additionalProperties: false forbids (it is not in properties)")


def _bounded_string(node: dict[str, Any]) -> dict[str, Any]:
    """A string (or a type list with "string") bounded by minLength/maxLength alone, written
    as the same bound on a pattern of JSON's unescaped characters. xgrammar 0.2.9 compiles
    such a string to [^"\\\r\n]{min,max}, which lets control characters through raw (invalid
    JSON: a random model writes them), while its patterns exclude them. A pattern
    constrains only strings, so the other types of a list stay as they were."""
    types = node.get("type")
    string = types == "string" or isinstance(types, list) and "string" in types
    if string and {"minLength", "maxLength"} & node.keys() and \
            not {"pattern", "format", "enum", "const"} & node.keys():
        low, high = node.pop("minLength", 0), node.pop("maxLength", "")
        node["pattern"] = f'^[^\\x00-\\x1f"\\\\]{{{low},{high}}}$'
    return node


def _reason(exc: BaseException) -> str:
    """xgrammar's message without its "[time] file.cc:line: " prefix."""
    text = str(exc).strip()
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text

