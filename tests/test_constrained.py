"""Constrained decoding core (bicache_sgl.constrained): token tables, DFA/index, the block DP
(against brute force), feasibility, JSON schema -> regex, choices, errors and limits, and a
property test that simulates diffusion decoding with random logits and random unmask orders."""

from __future__ import annotations

import itertools
import json
import random
import re
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bicache_sgl.constrained import (
    ConstraintError,
    ConstraintState,
    Limits,
    NoCompletion,
    choices_regex,
    compile_constraint,
    constrained_decide,
    schema_to_regex,
    token_table,
)
from bicache_sgl.constrained.json_schema import integer_range, json_object_regex
from bicache_sgl.decoding import select_transfer

jsonschema = pytest.importorskip("jsonschema")


# ------------------------------------------------------------------------------- tokenizers
@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from bicache_sgl.testing import save_byte_tokenizer
    d = tmp_path_factory.mktemp("bytetok")
    save_byte_tokenizer(d)
    return AutoTokenizer.from_pretrained(str(d))


@pytest.fixture(scope="module")
def bundled_tok():
    from bicache_sgl.models.loader import default_model_path, load_tokenizer
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def bpe_tok():
    """A small byte-level BPE with merges (multi-byte tokens, 'Ġ'-prefixed words)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    corpus = ["the cat sat on the mat", "name: Alice, age: 30", '{"name": "Bob", "age": 42}',
              "ABC-1234 XYZ-9876", "true false null", "café crème € 3.14", "the answer is 42"] * 20
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=420, special_tokens=["<|eos|>", "<|mask|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|eos|>", mask_token="<|mask|>")


@pytest.fixture(scope="module")
def tiny_tok():
    """Seven tokens, one of them two characters long: small enough to brute-force."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<eos>": 0, "<mask>": 1, "a": 2, "b": 3, "ab": 4, "1": 5, "2": 6, " ": 7}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tk.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", mask_token="<mask>")


# ------------------------------------------------------------------------------- token table
@pytest.mark.parametrize("name", ["byte_tok", "bundled_tok", "bpe_tok"])
def test_token_table_matches_decode(request, name):
    tok = request.getfixturevalue(name)
    table = token_table(tok)
    assert token_table(tok) is table  # cached
    specials = set(tok.all_special_ids)
    assert all(table.tokens[i] is None for i in specials)
    texts = ["hello world", "ABC-1234", '{"a": [1, 2.5e3, null]}', "x\ty\nz", "the cat sat"]
    if name != "bundled_tok":
        texts += ["café € 3.14", "日本語"]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(table.tokens[i] for i in ids) == text.encode("utf-8")
        assert tok.decode(ids) == text
    rng = random.Random(0)
    normal = [i for i, b in enumerate(table.tokens) if b is not None]
    for _ in range(50):
        ids = [rng.choice(normal) for _ in range(rng.randint(1, 6))]
        joined = b"".join(table.tokens[i] for i in ids)
        try:
            text = joined.decode("utf-8")
        except UnicodeDecodeError:
            continue
        assert tok.decode(ids) == text


# ------------------------------------------------------------------------------- DFA / index
def _tok_ids_for(tok, chars):
    table = token_table(tok)
    return [i for i, b in enumerate(table.tokens) if b is not None and len(b) == 1 and chr(b[0]) in chars]


@pytest.mark.parametrize("name", ["byte_tok", "bundled_tok"])
@pytest.mark.parametrize("rx", [r"[ab]{1,3}c?", r"(ab|ba)+", r"a*b|c", r"-?(0|[1-9][0-9]?)", r"(a|bc){2}"])
def test_index_full_match_equals_re(request, name, rx):
    """Every token sequence over a small alphabet: matches() == re.fullmatch, and a sequence
    the index keeps alive always has a completion that fully matches."""
    tok = request.getfixturevalue(name)
    c = compile_constraint("regex", rx, tok)
    ids = _tok_ids_for(tok, "abc-019")
    table = token_table(tok)
    for n in range(0, 5):
        for seq in itertools.product(ids, repeat=n):
            text = b"".join(table.tokens[i] for i in seq).decode()
            assert c.matches(list(seq)) == bool(re.fullmatch(rx, text)), (rx, text)
            q = c.walk(list(seq))
            if q >= 0:  # viable: follow the shortest completion
                comp = []
                while not c.is_accepting(q):
                    d = c.min_tokens(q)
                    t = next(t for t in c.allowed_tokens(q).tolist() if c.min_tokens(c.next_state(q, t)) == d - 1)
                    comp.append(t)
                    q = c.next_state(q, t)
                full = b"".join(table.tokens[i] for i in list(seq) + comp).decode()
                assert re.fullmatch(rx, full), (rx, text, full)


_FINITE = {
    r"the (cat|mat)": {"the cat", "the mat"},
    r"ABC-[0-9]{2}": {f"ABC-{i:02d}" for i in range(100)},
    r"(na|me){1,2}: ?[0-9]": {w + ":" + sp + d for w in ["na", "me", "nana", "name", "mena", "meme"]
                              for sp in ("", " ") for d in "0123456789"},
}


@pytest.mark.parametrize("name", ["byte_tok", "bpe_tok"])
@pytest.mark.parametrize("rx", list(_FINITE))
def test_index_allowed_tokens_exact(request, name, rx):
    """Finite languages: the index spells exactly the language, and in every reachable state a
    token is allowed iff text + token is a prefix of some word (both tokenizers have every single
    byte, so any prefix completes)."""
    tok = request.getfixturevalue(name)
    c = compile_constraint("regex", rx, tok)
    table = token_table(tok)
    words = set()
    stack = [(c.initial, b"")]
    while stack:
        q, text = stack.pop()
        if c.is_accepting(q) and not c.ended(q):
            words.add(text)
        for t in c.allowed_tokens(q).tolist():
            if t in c.end_ids:
                continue
            stack.append((c.next_state(q, t), text + table.tokens[t]))
    assert words == {w.encode() for w in _FINITE[rx]}
    prefixes = {w[:k] for w in words for k in range(len(w) + 1)}
    seen = set()
    stack = [(c.initial, b"")]
    while stack:
        q, text = stack.pop()
        if (q, text) in seen:
            continue
        seen.add((q, text))
        allowed = set(c.allowed_tokens(q).tolist())
        for t, b in enumerate(table.tokens):
            if b is None:
                continue
            assert (t in allowed) == (text + b in prefixes), (rx, text, b)
            if t in allowed:
                stack.append((c.next_state(q, t), text + b))


@pytest.mark.parametrize("name", ["byte_tok", "bundled_tok", "bpe_tok"])
def test_special_tokens_only_end_ids_in_accepting_states(request, name):
    tok = request.getfixturevalue(name)
    eos = tok.eos_token_id
    c = compile_constraint("regex", r"[0-9]{1,3}( [a-z]+)?", tok, end_ids=(eos,))
    specials = set(tok.all_special_ids) - {eos}
    for q in range(c.n_states):
        allowed = set(c.allowed_tokens(q).tolist())
        assert not (allowed & specials)
        assert (eos in allowed) == c.is_accepting(q)
        if c.ended(q):
            assert allowed == {eos}
    assert c.can_end(c.walk(tok.encode("42", add_special_tokens=False)))
    assert not c.can_end(c.walk([]))


def test_regex_not_in_vocabulary(bundled_tok):
    # 'é' is not in the bundled (ASCII) vocabulary: alternatives still work, a must is refused
    c = compile_constraint("regex", "(é|e)x", bundled_tok)
    assert c.matches(bundled_tok.encode("ex", add_special_tokens=False))
    with pytest.raises(ConstraintError, match="vocabulary"):
        compile_constraint("regex", "éx", bundled_tok)


# ------------------------------------------------------------------------------- the DP
def _ref_valid(rx, strs, eos, prefix, block, tail, exact):
    """Reference (no automaton): the block after ``prefix`` can be completed within ``tail``
    positions to an output that fully matches (end id only after a full match)."""
    text, ended = prefix, False
    for t in block:
        if ended:
            if t != eos:
                return False
        elif t == eos:
            if exact or not re.fullmatch(rx, text):
                return False
            ended = True
        elif t not in strs:
            return False
        else:
            text += strs[t]
    if ended:
        return True
    lengths = [tail] if exact else range(tail + 1)
    return any(re.fullmatch(rx, text + "".join(strs[t] for t in comp))
               for n in lengths for comp in itertools.product(list(strs), repeat=n))


@pytest.mark.parametrize("rx", [r"(ab|a1)2?", r"a*b", r"[ab]{2,3}1", r"(a|b)+ 2", r"1|22|ab", r"a(b|1)*2"])
@pytest.mark.parametrize("exact", [False, True])
def test_block_path_is_brute_force_optimum(tiny_tok, rx, exact):
    eos = tiny_tok.eos_token_id
    c = compile_constraint("regex", rx, tiny_tok, end_ids=() if exact else (eos,))
    strs = {i: token_table(tiny_tok).tokens[i].decode() for i in (2, 3, 4, 5, 6, 7)}
    cand = list(strs) + ([] if exact else [eos])
    rng = random.Random(zlib.crc32(f"{rx}{exact}".encode()))
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    checked = 0
    for _ in range(120):
        if checked >= 15:
            break
        L = rng.choice([3, 4])
        remaining = rng.choice([1, 2, 2, 3, 4, 6])
        # a committed prefix (0-2 tokens the index allows; it may leave no room: NoCompletion)
        pre, q = [], c.initial
        for _ in range(rng.randint(0, 2)):
            opts = [t for t in c.allowed_tokens(q).tolist() if t in strs]
            if not opts:
                break
            pre.append(rng.choice(opts))
            q = c.next_state(q, pre[-1])
        st = ConstraintState(q, remaining)
        prefix = "".join(strs[t] for t in pre)
        block = torch.full((L,), 1)
        masked = torch.ones(L, dtype=torch.bool)
        for i in range(L):
            if rng.random() < 0.3:
                masked[i] = False
                block[i] = rng.choice(cand)
        n = int(masked.sum())
        scores = torch.randn(n, len(tiny_tok), generator=g, dtype=torch.float64)
        Lc = min(L, remaining)
        best, best_assign = None, None
        mpos = masked.nonzero()[:, 0].tolist()
        for assign in itertools.product(cand, repeat=n):
            full = block.clone()
            full[masked] = torch.tensor(assign, dtype=torch.long) if n else full[masked]
            if not _ref_valid(rx, strs, eos, prefix, full[:Lc].tolist(), remaining - Lc, exact):
                continue
            s = sum(float(scores[k, assign[k]]) for k in range(n) if mpos[k] < Lc)
            if best is None or s > best + 1e-12:
                best, best_assign = s, assign
        if best is None:
            with pytest.raises(NoCompletion):
                c.block_path(st, block, masked, scores)
            continue
        path = c.block_path(st, block, masked, scores)
        full = block.clone()
        full[masked] = path
        assert _ref_valid(rx, strs, eos, prefix, full[:Lc].tolist(), remaining - Lc, exact)
        got = sum(float(scores[k, path[k]]) for k in range(n) if mpos[k] < Lc)
        assert got == pytest.approx(best, abs=1e-9), (rx, best_assign, path)
        for k in range(n):  # positions cut off by max_new_tokens: their argmax
            if mpos[k] >= Lc:
                assert int(path[k]) == int(scores[k].argmax())
        assert (full[~masked] == block[~masked]).all()
        checked += 1
    assert checked >= 8


def test_block_path_avoids_filtered_tokens_but_stays_valid(byte_tok):
    c = compile_constraint("regex", r"[0-9]{3}", byte_tok)
    st = c.start(8)
    L = 4
    block, masked = torch.full((L,), 0), torch.ones(L, dtype=torch.bool)
    scores = torch.full((L, len(byte_tok)), float("-inf"))
    scores[:, byte_tok.convert_tokens_to_ids("7")] = 0.0  # '7' allowed by the filter
    path = c.block_path(st, block, masked, scores)
    assert byte_tok.decode(path[:3]) == "777"
    scores[:] = float("-inf")  # everything filtered: still a valid path
    path = c.block_path(st, block, masked, scores)
    assert re.fullmatch(r"[0-9]{3}", byte_tok.decode(path[:3]))


def test_no_completion(byte_tok):
    eos = byte_tok.eos_token_id
    c = compile_constraint("regex", r"[0-9]{10}", byte_tok, end_ids=(eos,))
    assert c.min_tokens(c.initial) == 10
    assert not c.feasible(c.start(5)) and c.feasible(c.start(10))
    L = 8
    with pytest.raises(NoCompletion, match="fits"):
        c.block_path(c.start(5), torch.zeros(L, dtype=torch.long), torch.ones(L, dtype=torch.bool),
                     torch.randn(L, len(byte_tok)))
    # a fixed token that the constraint does not allow
    block = torch.zeros(L, dtype=torch.long)
    block[2] = byte_tok.convert_tokens_to_ids("x")
    masked = torch.ones(L, dtype=torch.bool)
    masked[2] = False
    with pytest.raises(NoCompletion):
        c.block_path(c.start(16), block, masked, torch.randn(L - 1, len(byte_tok)))
    # exact length (no end ids): "ab" cannot fill 3 positions, "a+" can
    c2 = compile_constraint("regex", "ab", byte_tok, end_ids=())
    assert c2.feasible(c2.start(2)) and not c2.feasible(c2.start(3))
    c3 = compile_constraint("regex", "a+", byte_tok, end_ids=())
    assert all(c3.feasible(c3.start(n)) for n in (1, 7, 100)) and not c3.feasible(c3.start(0))
    # with end ids, shorter is fine
    c4 = compile_constraint("regex", "ab", byte_tok, end_ids=(eos,))
    assert c4.feasible(c4.start(2)) and c4.feasible(c4.start(3))


def test_stop_token_as_end_id(byte_tok):
    """A text token passed as an end id (a stop token) ends the output and is text no more."""
    nl = byte_tok.convert_tokens_to_ids("\u010a")  # byte-level "\n"
    assert token_table(byte_tok).tokens[nl] == b"\n"
    c = compile_constraint("regex", "a\nb|cc", byte_tok, end_ids=(byte_tok.eos_token_id, nl))
    assert c.min_tokens(c.initial) == 2  # only "cc" is left
    assert not c.matches(byte_tok.encode("a\nb", add_special_tokens=False))
    assert c.matches(byte_tok.encode("cc\nzz", add_special_tokens=False))  # ends at the stop token
    for seed in range(3):
        assert byte_tok.decode(simulate(c, byte_tok, 8, 4, seed=seed)) == "cc"


def test_advance_and_states(bundled_tok):
    c = compile_constraint("regex", r"[A-Z]{3}-[0-9]{2}", bundled_tok, end_ids=(0,))
    ids = bundled_tok.encode("ABC-12", add_special_tokens=False)
    st = c.start(8)
    st = c.advance(st, torch.tensor(ids[:4]))
    assert st.remaining == 4 and not c.can_end(st)
    st = c.advance(st, torch.tensor(ids[4:] + [0, 0]))
    assert st.remaining == 0 and c.ended(st) and c.can_end(st)
    with pytest.raises(ConstraintError):
        c.advance(c.start(8), torch.tensor(bundled_tok.encode("ab", add_special_tokens=False)))
    # positions past max_new_tokens are not checked
    st = c.advance(c.start(2), torch.tensor(ids[:2] + [bundled_tok.convert_tokens_to_ids("z")]))
    assert st.remaining == 0


# ------------------------------------------------------------------------------- decoding simulation
def simulate(c, tok, max_new, block, *, seed, threshold=None, temperature=0.0, scale=3.0, eos_bias=0.0):
    """Diffusion decoding with random logits: semi-autoregressive blocks, random numbers of
    positions unmasked per step (and random confidence orders), the constrained path used as x0.
    Returns the output ids (cut at the first end id) or raises NoCompletion."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    mask_id = tok.mask_token_id
    V = len(tok)
    n_blocks = -(-max_new // block)
    x = torch.full((n_blocks * block,), mask_id, dtype=torch.long)
    st = c.start(max_new)
    for b in range(n_blocks):
        blk = x[b * block:(b + 1) * block]
        while bool((blk == mask_id).any()):
            m = blk == mask_id
            logits = torch.randn(int(m.sum()), V, generator=g) * scale
            logits[:, mask_id] = float("-inf")
            logits[:, list(c.end_ids)] += eos_bias
            x0, conf, _ = constrained_decide(c, st, blk, m, logits, temperature=temperature, top_k=-1, top_p=1.0,
                                             remasking=rng.choice(["low_confidence", "random"]), generator=g)
            chosen = select_transfer(conf, rng.randint(1, int(m.sum())), threshold)
            pos = m.nonzero()[:, 0][chosen]
            blk[pos] = x0[chosen]
        st = c.advance(st, blk)
    out = x[:max_new].tolist()
    for k, t in enumerate(out):
        if t in c.end_ids:
            return out[:k]
    return out


_LIT = st.sampled_from(list("abc01 -") + ["é", "€", r"\.", r"\?", r"\(", r"\d", r"\w", r"\s", r"\D", r"\W"])
_CLS = st.sampled_from(["[a-c]", "[0-9]", "[^ab]", "[x-z0]", "."])
_LEAF = st.one_of(_LIT, _CLS)


def _regexes():
    atom = st.recursive(_LEAF, lambda ch: st.one_of(
        st.tuples(ch, ch).map(lambda t: t[0] + t[1]),
        st.tuples(ch, ch).map(lambda t: f"(?:{t[0]}|{t[1]})"),
        ch.map(lambda x: f"(?:{x})?"),
        ch.map(lambda x: f"(?:{x})*"),
        ch.map(lambda x: f"(?:{x})+"),
        st.tuples(ch, st.integers(0, 2), st.integers(0, 2)).map(lambda t: f"(?:{t[0]}){{{t[1]},{t[1] + t[2]}}}"),
    ), max_leaves=5)
    return st.lists(atom, min_size=1, max_size=4).map("".join)


@pytest.mark.parametrize("name", ["byte_tok", "bundled_tok", "bpe_tok"])
def test_property_random_regex_decoding(request, name):
    tok = request.getfixturevalue(name)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(rx=_regexes(), max_new=st.integers(1, 14), block=st.sampled_from([1, 2, 4, 8]),
           threshold=st.sampled_from([None, 0.3, 0.9]), use_eos=st.booleans(), temperature=st.sampled_from([0.0, 1.0]),
           eos_bias=st.sampled_from([0.0, -6.0]), seed=st.integers(0, 1 << 20))
    def run(rx, max_new, block, threshold, use_eos, temperature, eos_bias, seed):
        try:
            c = compile_constraint("regex", rx, tok, end_ids=(tok.eos_token_id,) if use_eos else ())
        except ConstraintError as e:  # e.g. 'é' in the ASCII-only bundled vocabulary
            assert "vocabulary" in str(e), (rx, str(e))
            return
        feasible = c.feasible(c.start(max_new))
        if not feasible:
            with pytest.raises(NoCompletion):
                simulate(c, tok, max_new, block, seed=seed, threshold=threshold, temperature=temperature)
            return
        out = simulate(c, tok, max_new, block, seed=seed, threshold=threshold, temperature=temperature,
                       eos_bias=eos_bias)
        text = tok.decode(out)
        assert re.fullmatch(rx, text) and re.fullmatch(rx, text, re.ASCII), (rx, text, out)
        assert c.matches(out)
        if not use_eos:
            assert len(out) == max_new

    run()


# ------------------------------------------------------------------------------- JSON schema
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}, "c": {"enum": ["x", 1, None]},
                                      "d": {"type": "number"}}, "required": ["c"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                               "minItems": 1, "maxItems": 3},
                                      "point": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                                 "y": {"type": "integer"}},
                                                "required": ["x", "y"]}},
     "required": ["tags", "point"]},
    {"$defs": {"Pet": {"type": "object", "properties": {"kind": {"const": "cat"},
                                                        "lives": {"type": "integer", "exclusiveMaximum": 10}},
                       "required": ["kind"], "title": "Pet"}},
     "type": "object", "properties": {"pet": {"$ref": "#/$defs/Pet"},
                                      "owner": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "null"}]}},
     "required": ["pet", "owner"], "title": "Model"},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 4},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"},
                                      "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"}},
     "required": ["when", "id"]},
    {"type": "object", "properties": {"p": {"type": "number", "minimum": 0}, "q": {"type": ["integer", "string"]}},
     "required": ["p", "q"], "additionalProperties": False},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_json_schema_outputs_validate(byte_tok, bundled_tok, schema):
    rx = schema_to_regex(schema)
    for tok in (byte_tok, bundled_tok):
        c = compile_constraint("json_schema", schema, tok)
        for seed in range(3):
            out = simulate(c, tok, 72, 24, seed=seed, threshold=0.5 if seed % 2 else None)
            text = tok.decode(out)
            assert re.fullmatch(rx, text), text
            jsonschema.validate(json.loads(text), schema)
    assert compile_constraint("json_schema", json.dumps(schema), bundled_tok).regex == c.regex


def test_json_schema_regex_accepts_and_rejects():
    rx = schema_to_regex(SCHEMAS[0])
    assert re.fullmatch(rx, '{"name": "Al", "age": 30}') and re.fullmatch(rx, '{"name":"Al","age":0}')
    assert not re.fullmatch(rx, '{"name": "Al"}')  # required
    assert not re.fullmatch(rx, '{"name": "Al", "age": 121}')  # maximum
    assert not re.fullmatch(rx, '{"name": "Al", "age": 007}')
    assert not re.fullmatch(rx, '{ "name": "Al", "age": 30 }')  # whitespace policy
    opt = schema_to_regex({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                                            "c": {"type": "integer"}}, "required": ["b"]})
    for text in ['{"b": 1}', '{"a": 1, "b": 2}', '{"b": 2, "c": 3}', '{"a": 1, "b": 2, "c": 3}']:
        assert re.fullmatch(opt, text), text
    for text in ['{}', '{"a": 1}', '{"b": 1,}', '{"c": 1, "b": 2}']:
        assert not re.fullmatch(opt, text), text
    allopt = schema_to_regex({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}})
    for text in ['{}', '{"a": 1}', '{"b": 2}', '{"a": 1, "b": 2}']:
        assert re.fullmatch(allopt, text), text
    assert not re.fullmatch(allopt, '{, "b": 2}')


@pytest.mark.parametrize("lo,hi", [(0, 0), (0, 9), (5, 123), (-17, 17), (-250, -3), (None, 42), (-42, None),
                                   (7, None), (None, -7), (100, 1000), (0, None), (None, 0)])
def test_integer_range_regex(lo, hi):
    rx = integer_range(lo, hi)
    for n in range(-1100, 1101):
        inside = (lo is None or n >= lo) and (hi is None or n <= hi)
        assert bool(re.fullmatch(rx, str(n))) == inside, (lo, hi, n)
    assert not re.fullmatch(rx, "-0") and not re.fullmatch(rx, "01")
    if hi is None:
        assert re.fullmatch(rx, "123456789")


def test_json_object(byte_tok, bundled_tok):
    rx = json_object_regex()
    assert re.fullmatch(rx, '{"a": {"b": 1}, "c": [1, "x"], "d": null}') and re.fullmatch(rx, "{}")
    assert not re.fullmatch(rx, '{"a": {"b": [1]}}')
    assert not re.fullmatch(rx, '{"a": {"b": {"c": 1}}}')  # deeper than the bound (2)
    assert not re.fullmatch(rx, "[1]")
    for tok in (byte_tok, bundled_tok):
        c = compile_constraint("json_object", None, tok)
        for seed in range(3):
            text = tok.decode(simulate(c, tok, 40, 20, seed=seed))
            assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "string", "not": {"const": "x"}}, "not"),
    ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    ({"type": "object", "patternProperties": {"^x": {}}}, "patternProperties"),
    ({"type": "array", "items": {}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "number", "maximum": 3.5}, "maximum"),
    ({"type": "string", "format": "email"}, "format"),
    ({"if": {"type": "string"}, "then": {"maxLength": 3}}, "if"),
    ({"allOf": [{"type": "string"}, {"maxLength": 2}]}, "allOf"),
    ({"$ref": "https://example.com/schema.json"}, "$ref"),
])
def test_json_schema_unsupported_keyword(schema, keyword):
    with pytest.raises(ConstraintError, match=re.escape(f"'{keyword}'")):
        schema_to_regex(schema)


def test_json_schema_invalid():
    with pytest.raises(ConstraintError, match="not valid JSON"):
        schema_to_regex('{"type": "object",')
    with pytest.raises(ConstraintError, match="invalid JSON schema: 5 is not valid"):
        schema_to_regex({"type": 5})
    with pytest.raises(ConstraintError, match="minLength"):
        schema_to_regex({"type": "string", "minLength": 5, "maxLength": 2})
    with pytest.raises(ConstraintError, match="deeper"):
        schema_to_regex({"$defs": {"N": {"type": "object", "properties": {"next": {"$ref": "#/$defs/N"}},
                                         "required": ["next"]}}, "$ref": "#/$defs/N"})


# ------------------------------------------------------------------------------- choices
def test_choices(byte_tok, bpe_tok):
    choices = ["yes", "no", "maybe so", "a.b*c?(d)[e]{f}|g^h$i\\j+k", "café", "no way"]
    rx = choices_regex(choices)
    for ch in choices:
        assert re.fullmatch(rx, ch)
    assert not re.fullmatch(rx, "nope") and not re.fullmatch(rx, "a")
    for tok in (byte_tok, bpe_tok):
        c = compile_constraint("choices", choices, tok)
        for ch in choices:
            assert c.matches(tok.encode(ch, add_special_tokens=False))
        assert not c.matches(tok.encode("ye", add_special_tokens=False))
        for seed in range(6):
            assert tok.decode(simulate(c, tok, 32, 8, seed=seed)) in choices
    with pytest.raises(ConstraintError):
        choices_regex([])
    with pytest.raises(ConstraintError):
        choices_regex(["a", 3])


# ------------------------------------------------------------------------------- errors and limits
@pytest.mark.parametrize("rx,msg", [
    ("a(b", "missing \\), unterminated subpattern at position 1"),
    ("[z-a]", "bad character range z-a"),
    ("a**", "multiple repeat"),
    (r"(a)\1", "backreferences"),
    ("(?=a)a", "lookahead"),
    (r"\bword", "word boundaries"),
    ("a^b", "anchors"),
])
def test_invalid_regex_messages(byte_tok, rx, msg):
    with pytest.raises(ConstraintError, match=msg):
        compile_constraint("regex", rx, byte_tok)


@pytest.mark.parametrize("rx", [r"[]a]", r"[^]a]", r"[a&&b]", r"[a~~b]", r"[[a]", r"\d\D", r"[^\d]", r"\w\W",
                                r"\s\S", r"[\s\d]", r"[^\Da]", r"[^\w]"])
def test_perl_classes_and_set_syntax(byte_tok, rx):
    """What the index accepts also matches under Python's re, Unicode and ASCII mode (\\d is ASCII,
    \\D excludes every Unicode digit...), and Python-literal set members stay literal."""
    import warnings
    c = compile_constraint("regex", rx, byte_tok)
    chars = [chr(i) for i in range(32, 127)] + ["\t", "\n", "\x1c", "\u0663", "\u00b2", "\u00e9", "\xa0"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for n in (1, 2):
            for w in itertools.product(chars, repeat=n):
                w = "".join(w)
                py = re.fullmatch(rx, w) is not None
                if c.matches(byte_tok.encode(w, add_special_tokens=False)):
                    assert py and re.fullmatch(rx, w, re.ASCII), (rx, w)
                elif py and re.fullmatch(rx, w, re.ASCII) and w.isascii():
                    raise AssertionError(("ASCII match refused", rx, w))


def test_anchors_and_kinds(byte_tok):
    c = compile_constraint("regex", r"^[0-9]+$", byte_tok)
    assert c.regex == "[0-9]+" and c.matches(byte_tok.encode("12", add_special_tokens=False))
    with pytest.raises(ConstraintError, match="ebnf"):
        compile_constraint("ebnf", "root ::= 'a'", byte_tok)
    with pytest.raises(ConstraintError, match="unknown constraint kind"):
        compile_constraint("grammar", "x", byte_tok)
    assert compile_constraint("regex", r"^[0-9]+$", byte_tok) is c  # cached


def test_pathological_regex_is_bounded(byte_tok):
    import time
    t = time.perf_counter()
    with pytest.raises(ConstraintError, match="regex too complex"):
        compile_constraint("regex", "(?:a{1000}){1000}", byte_tok)
    assert time.perf_counter() - t < 0.5
    # written out instead of (a|b){24}: the up-front estimate probes counted repeats only, so these
    # reach the build worker, whose time and memory limits stop them
    t = time.perf_counter()
    with pytest.raises(ConstraintError, match="regex too complex.*longer than 1 s"):
        compile_constraint("regex", "(a|b)*a" + "(a|b)" * 24, byte_tok, limits=Limits(build_timeout_s=1.0))
    assert time.perf_counter() - t < 5
    with pytest.raises(ConstraintError, match="regex too complex.*memory"):
        compile_constraint("regex", "(a|b)*a" + "(a|b)" * 19, byte_tok, limits=Limits(build_memory_mb=48))
    t = time.perf_counter()  # the refusal is cached
    with pytest.raises(ConstraintError, match="regex too complex"):
        compile_constraint("regex", "(a|b)*a" + "(a|b)" * 24, byte_tok, limits=Limits(build_timeout_s=1.0))
    assert time.perf_counter() - t < 0.1
    with pytest.raises(ConstraintError, match="DFA states"):
        compile_constraint("regex", "(a|b)*a(a|b){8}", byte_tok, limits=Limits(max_states=100))
    # the worker restarts for the next build
    assert compile_constraint("regex", "[ab]{2}", byte_tok).matches(byte_tok.encode("ab", add_special_tokens=False))


@pytest.mark.parametrize("rx,states", [("(a|b)*a(a|b){24}", 2**25), ("(c|q)*c(c|q){17}", 2**18),
                                       ("x(?:[ab]*a[ab]{30})y", 2**31)])
def test_exponential_regex_refused_before_any_build(byte_tok, rx, states):
    """A counted repeat after an unbounded one doubles the DFA with each repetition: the
    estimate (constrained/estimate.py) finds it before the build, so no build worker is used and
    the index cache is untouched; the message names the limit and the estimated size."""
    from bicache_sgl.constrained import cache_info

    before = cache_info()["constraint_index_cache_entries"]
    with pytest.raises(ConstraintError, match=r"regex too complex: its automaton would have about .* states "
                                              r"\(limit 200000, estimated before building") as e:
        compile_constraint("regex", rx, byte_tok)
    est = float(str(e.value).split("about ")[1].split(" states")[0])
    assert states / 2 <= est <= states * 2, (est, states)
    assert cache_info()["constraint_index_cache_entries"] == before  # nothing was built
    with pytest.raises(ConstraintError, match="estimated before building"):  # refused again (remembered)
        compile_constraint("regex", rx, byte_tok)


@pytest.mark.parametrize("rx", ["(c|q)*c(c|q){12}", "[0-9]{2000}", "(abc|abd){500}x", "a{3}(b|c){40}d*"])
def test_legitimate_regexes_pass_the_estimate(byte_tok, rx):
    """Under the limit, or large but not exponential: built and matched as before."""
    c = compile_constraint("regex", rx, byte_tok)
    assert c.index.n_states <= Limits().max_states


def test_schema_size_limits_refused_up_front(byte_tok):
    from bicache_sgl.constrained import cache_info

    before = cache_info()["constraint_index_cache_entries"]
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(101)}}
    with pytest.raises(ConstraintError, match=r"101 properties \(limit 100 per object, max_schema_properties"):
        compile_constraint("json_schema", wide, byte_tok)
    huge = {"type": "object", "properties": {"a": {"enum": list(range(30_000))}}}
    with pytest.raises(ConstraintError, match=r"more than 20000 values .*max_schema_nodes"):
        compile_constraint("json_schema", json.dumps(huge), byte_tok)
    assert cache_info()["constraint_index_cache_entries"] == before
    # at the limits: still compiled (and each limit is a Limits field a caller may raise)
    ok = {"type": "object", "properties": {f"p{i}": {"type": "boolean"} for i in range(20)}, "required": ["p0"]}
    assert compile_constraint("json_schema", ok, byte_tok).n_edges > 0
    with pytest.raises(ConstraintError, match=r"20 properties \(limit 5 per object"):  # a caller's own limit
        compile_constraint("json_schema", ok, byte_tok, limits=Limits(max_schema_properties=5))


def test_in_process_build(byte_tok):
    c = compile_constraint("regex", "x[0-9]", byte_tok, limits=Limits(isolate=False))
    assert c.matches(byte_tok.encode("x5", add_special_tokens=False))


def test_build_worker_over_its_memory_bound_is_restarted(byte_tok, monkeypatch):
    """A worker keeps the heap of its largest build; past BUILD_WORKER_MAX_RSS_MB
    (BICACHE_SGL_BUILD_WORKER_MAX_RSS_MB) it is stopped after the build and the next build starts
    a fresh one, so the workers' memory settles. Under the bound it is kept."""
    from bicache_sgl.constrained import index

    compile_constraint("regex", "[0-9]{2}q", byte_tok)  # a worker is running
    alive = [w for w in index._WORKERS._all if w.proc is not None]
    assert alive
    monkeypatch.setattr(index, "BUILD_WORKER_MAX_RSS_MB", 1)  # every worker is over 1 MiB
    for k in range(index.BUILD_WORKERS):  # the pool hands its workers out in turn: each builds once
        compile_constraint("regex", f"[0-9]{{{k + 3}}}q", byte_tok)
    assert index._WORKERS.alive() == 0
    monkeypatch.setattr(index, "BUILD_WORKER_MAX_RSS_MB", 1 << 20)
    c = compile_constraint("regex", "[0-9]{9}q", byte_tok)  # a fresh worker builds it
    assert c.matches(byte_tok.encode("123456789q", add_special_tokens=False))
    assert index._WORKERS.alive() >= 1


def test_memory_bounds_read_from_the_environment(monkeypatch):
    from bicache_sgl.constrained.index import env_int

    monkeypatch.setenv("BICACHE_SGL_TEST_BOUND", "12")
    assert env_int("BICACHE_SGL_TEST_BOUND", 5) == 12
    monkeypatch.delenv("BICACHE_SGL_TEST_BOUND")
    assert env_int("BICACHE_SGL_TEST_BOUND", 5) == 5
    for bad in ("0", "-3", "lots"):
        monkeypatch.setenv("BICACHE_SGL_TEST_BOUND", bad)
        with pytest.raises(ValueError, match="BICACHE_SGL_TEST_BOUND must be an integer >= 1"):
            env_int("BICACHE_SGL_TEST_BOUND", 5)
