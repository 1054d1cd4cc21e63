"""Structured output on a canvas: a JSON schema as a token automaton, and the two questions a canvas
decoder asks of it (numpy on the host; no torch).

A schema becomes a regular expression (`outlines_core.json_schema.build_regex_from_schema`, compact: no
whitespace between tokens) and that a DFA over the model's tokens (`outlines_core.Index`), kept here as
edge arrays (`src`, `tok`, `dst`). Past the document's last token, EOS leads to a `done` state that
takes only PAD and EOS, so an answer is the document, EOS, then padding.

A canvas decoder writes C positions at once, re-deciding every position every step, and commits a
canvas whole; left-to-right masks do not apply as they are. Instead, per canvas:

- `Grammar.plan(state, C, budget)`: from the automaton state its committed prefix reached, which tokens
  each of the canvas's positions may hold on *some* path that stays completable: a path of C tokens
  from `state` whose end state still reaches `done` within the budget left after the canvas (or, when
  the budget ends inside this canvas, reaches `done` by then). A forward pass (states reachable at
  each position) and a backward one (states that can still finish) over the edges; the masks are
  their product. Positions with one allowed token are the schema's scaffolding (keys, punctuation);
  the others are value slots with their own token sets (digits, enum choices, string text).
- `Grammar.best(state, logprobs, budget)`: the canvas's tokens when it stops: the path of highest summed
  log-probability among those same paths (Viterbi over the automaton), so per-position choices that
  would not join into a valid document (a digit, a space, a digit) are never committed. The padding
  after the document's EOS scores nothing: the document, its end included, is what is chosen.

Every committed canvas therefore keeps the answer completable to a valid document within `budget`
tokens, and the last one completes it. `Grammar.min_tokens` (document + EOS) is what validation checks
against a line's max_tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

UNREACHABLE = 1 << 30


@dataclass(frozen=True)
class TokenTexts:
    """The text each token id stands for (None: special, or a partial UTF-8 byte), and EOS / PAD."""

    texts: tuple[str | None, ...]
    eos: int
    pad: int
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.texts, self.eos, self.pad)))

    def __hash__(self) -> int:
        """Computed once: `cached_grammar` hashes its vocabulary at every row's first canvas, and a
        tuple's hash walks every element (under a ms at the real vocabulary's 262,144 texts)."""
        return self._hash

    @classmethod
    def from_tokenizer_file(cls, path: str, eos: int, pad: int) -> TokenTexts:
        """From a HF `tokenizer.json`: each token's text as it reads after another token (a leading
        space kept, which decoding a token alone may drop)."""
        from tokenizers import Tokenizer

        tk = Tokenizer.from_file(path)
        specials = {i for i, t in tk.get_added_tokens_decoder().items() if t.special} | {eos, pad}
        anchor = tk.token_to_id("a")
        head = tk.decode([anchor]) if anchor is not None else ""
        texts: list[str | None] = []
        for i in range(tk.get_vocab_size()):
            if i in specials:
                texts.append(None)
                continue
            text = tk.decode([anchor, i]) if anchor is not None else tk.decode([i])
            text = text[len(head) :] if anchor is not None and text.startswith(head) else tk.decode([i])
            texts.append(text if text and "\ufffd" not in text else None)
        return cls(tuple(texts), eos, pad)


class Unfinishable(ValueError):
    """No path of the automaton from this state ends the document within the budget."""


class Grammar:
    """A schema's token automaton: states 0..Q-1 (`start`), `done` = Q; edges (src, tok, dst)."""

    def __init__(
        self, transitions: dict[int, dict[int, int]], start: int, finals, eos: int, pad: int, V: int
    ):
        ids = {s: i for i, s in enumerate(sorted(set(transitions) | {start} | set(finals)))}
        for edges in transitions.values():
            for dst in edges.values():
                ids.setdefault(dst, len(ids))
        self.done, self.start, self.V = len(ids), ids[start], V
        self.Q = len(ids) + 1
        arcs = [(ids[q], t, ids[d]) for q, out in transitions.items() for t, d in out.items() if t != eos]
        arcs += [(ids[f], eos, self.done) for f in finals]
        arcs += [(self.done, t, self.done) for t in (eos, pad)]
        table = np.asarray(arcs, dtype=np.int64)
        self.src, self.tok, self.dst = table[:, 0].copy(), table[:, 1].copy(), table[:, 2].copy()
        self.tokens = np.unique(self.tok)  # every token some edge takes
        self.dist = self._distances()
        self.min_tokens = int(self.dist[self.start])

    def _distances(self) -> np.ndarray:
        """[Q] tokens from each state to `done` (EOS counted), UNREACHABLE where none."""
        dist = np.full(self.Q, UNREACHABLE, dtype=np.int64)
        dist[self.done] = 0
        while True:
            new = dist.copy()
            np.minimum.at(new, self.src, dist[self.dst] + 1)
            if (new == dist).all():
                return dist
            dist = new

    def _ends(self, C: int, budget: int) -> tuple[int, np.ndarray]:
        """(position p, states allowed there): after min(C, budget) tokens, the states that finish within
        the budget left; past the budget only `done` remains, and it stays `done`."""
        p = min(C, budget)
        return p, self.dist <= budget - p

    def _backward(self, C: int, budget: int) -> list[np.ndarray]:
        """back[i] [Q] bool: states at position i from which the canvas's rest keeps the document
        completable (`_ends`)."""
        p, ends = self._ends(C, budget)
        back = [np.ones(self.Q, dtype=bool) for _ in range(C + 1)]
        back[C] = ends if p == C else back[C]
        for i in range(C - 1, -1, -1):
            ok = np.zeros(self.Q, dtype=bool)
            ok[self.src[back[i + 1][self.dst]]] = True
            back[i] = ok & ends if i == p else ok
        return back

    def plan(self, state: int, C: int, budget: int) -> np.ndarray:
        """[C, V] bool: the tokens each position of a canvas starting in `state` may hold (see the module
        docstring); `budget`: answer tokens left from the canvas's first position."""
        back = self._backward(C, budget)
        if not back[0][state]:
            raise Unfinishable(f"the document cannot be finished within {budget} tokens")
        masks = np.zeros((C, self.V), dtype=bool)
        here = np.zeros(self.Q, dtype=bool)
        here[state] = True
        for i in range(C):
            here &= back[i]
            take = here[self.src] & back[i + 1][self.dst]
            masks[i, self.tok[take]] = True
            here = np.zeros(self.Q, dtype=bool)
            here[self.dst[take]] = True
        return masks

    def best(self, state: int, logprobs: np.ndarray, budget: int) -> tuple[list[int], int]:
        """The canvas's tokens (the highest-scoring completable path from `state` under `logprobs`
        [C, V]) and the state they end in."""
        C = logprobs.shape[0]
        back = self._backward(C, budget)
        if not back[0][state]:
            raise Unfinishable(f"the document cannot be finished within {budget} tokens")
        score = np.full(self.Q, -np.inf)
        score[state] = 0.0
        via = np.zeros((C, self.Q), dtype=np.int64)  # the edge that reached each state at each position
        free = self.src == self.done  # the padding after the document's EOS scores nothing
        for i in range(C):
            gain = logprobs[i, self.tok]
            gain[free] = 0.0
            cand = score[self.src] + gain
            cand[~back[i + 1][self.dst]] = -np.inf
            live = np.nonzero(np.isfinite(cand))[0]
            order = live[np.lexsort((cand[live], self.dst[live]))]  # by state, best edge last
            last = np.ones(len(order), dtype=bool)
            last[:-1] = self.dst[order[:-1]] != self.dst[order[1:]]
            won = order[last]
            score = np.full(self.Q, -np.inf)
            score[self.dst[won]] = cand[won]
            via[i, self.dst[won]] = won
        end = int(np.argmax(score))
        toks, q = [], end
        for i in range(C - 1, -1, -1):
            e = via[i, q]
            toks.append(int(self.tok[e]))
            q = int(self.src[e])
        return toks[::-1], end

    def walk(self, state: int, tokens: list[int]) -> int:
        """The state after `tokens` from `state` (ValueError if the automaton refuses one)."""
        for t in tokens:
            hit = np.nonzero((self.src == state) & (self.tok == t))[0]
            if not len(hit):
                raise ValueError(f"token {t} is not allowed in state {state}")
            state = int(self.dst[hit[0]])
        return state


# digits of a number, bounded: an integer has at most 18 (int64's), a fraction 17, an exponent 3
_BOUNDED_DIGITS = (
    ("(0|[1-9][0-9]*)", "(0|[1-9][0-9]{0,17})"),
    ("(\\.[0-9]+)", "(\\.[0-9]{1,17})"),
    ("([eE][+-][0-9]+)", "([eE][+-][0-9]{1,3})"),
)


def schema_regex(schema: dict) -> str:
    """The compact regular expression of a (supported) JSON schema (properties in the schema's order,
    numbers' digits bounded: `_BOUNDED_DIGITS`)."""
    from outlines_core.json_schema import build_regex_from_schema  # type: ignore[import-untyped]

    regex = build_regex_from_schema(json.dumps(schema), "")
    for unbounded, bounded in _BOUNDED_DIGITS:
        regex = regex.replace(unbounded, bounded)
    return regex


# A row that thinks first: free text up to the document's first "{" or "[", then the document
# (`compile_grammar(think=True)`; `split_thought` parts the text again).
THINK = "[^{\\[]*"


def split_thought(text: str) -> tuple[str, str]:
    """(the thought, the document) of a text decoded with `THINK` before its document."""
    cut = min((i for i in (text.find("{"), text.find("[")) if i >= 0), default=len(text))
    return text[:cut].rstrip("\n"), text[cut:]


def compile_grammar(schema: dict, texts: TokenTexts, think: bool = False) -> Grammar:
    """A schema's automaton over these tokens (compiled once per distinct schema: `cached_grammar`);
    `think`: free text (`THINK`) before the document."""
    import outlines_core  # type: ignore[import-untyped]

    table: dict[str, list[int]] = {}
    for i, text in enumerate(texts.texts):
        if text is not None:
            table.setdefault(text, []).append(i)
    regex = (THINK if think else "") + schema_regex(schema)
    index = outlines_core.Index(regex, outlines_core.Vocabulary(texts.eos, table))
    return Grammar(
        index.get_transitions(),
        index.get_initial_state(),
        index.get_final_states(),
        texts.eos,
        texts.pad,
        len(texts.texts),
    )


@lru_cache(maxsize=64)
def _cached(schema_json: str, texts: TokenTexts, think: bool) -> Grammar:
    return compile_grammar(json.loads(schema_json), texts, think)


def cached_grammar(schema: dict, texts: TokenTexts, think: bool = False) -> Grammar:
    """`compile_grammar`, once per distinct schema, vocabulary and `think` in a process (the key keeps
    the schema's key order: properties are generated in it)."""
    return _cached(json.dumps(schema), texts, think)


@lru_cache(maxsize=8)
def token_texts(tokenizer_file: str, eos: int | None = None, pad: int | None = None) -> TokenTexts:
    """`TokenTexts` of a `tokenizer.json` (once per process); EOS / PAD default to its `<eos>` / `<pad>`."""
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(tokenizer_file)
    eos = eos if eos is not None else tk.token_to_id("<eos>")
    pad = pad if pad is not None else tk.token_to_id("<pad>")
    if eos is None or pad is None:
        raise ValueError(f"{tokenizer_file}: no <eos> / <pad> token; give their ids")
    return TokenTexts.from_tokenizer_file(tokenizer_file, eos, pad)


def output_problem(text: str, schema: dict) -> str | None:
    """Why `text` is not a JSON document valid under `schema`, or None (the check of every finished
    constrained row). The message is `jsonschema.validate`'s (its best-matching error)."""
    return schema_check(json.dumps(schema, sort_keys=True))(text)


@lru_cache(maxsize=256)
def schema_check(schema_json: str) -> Callable[[str], str | None]:
    """`output_problem` for one schema (its JSON, keys sorted), built once: a document is passed by
    `fastjsonschema`'s compiled check (3 us a row against jsonschema's 45 us: the decode loop pays it
    per finished row), and one it refuses is checked again by jsonschema, whose best-matching error
    is the message, and which alone decides: a document valid to it is not refused."""
    import fastjsonschema
    import jsonschema  # type: ignore[import-untyped]

    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)  # `jsonschema.validate` checks the schema on every call (2.4 ms a row)
    reference = cls(schema)
    fast = fastjsonschema.compile(schema)

    def problem(text: str) -> str | None:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"not JSON: {exc}"
        try:
            fast(doc)
            return None
        except fastjsonschema.JsonSchemaException:
            error = jsonschema.exceptions.best_match(reference.iter_errors(doc))
            return None if error is None else f"does not match the schema: {error.message}"

    return problem
