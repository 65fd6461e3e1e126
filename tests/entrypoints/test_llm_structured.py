"""Constrained decoding end to end through the offline `LLM`, on a tiny random Qwen2.

A random model has no idea what JSON is, so every valid output here is the grammar's doing: 50 schemas
(greedy and sampled), regex, choice and EBNF; n > 1, seeds, preemption by recompute, a mixed batch, and
the errors for bad constraints.
"""

from __future__ import annotations

import json
import re
import sys

import jsonschema
import pytest

from qwick import LLM, SamplingParams
from qwick.sampling_params import StructuredOutputsParams as S
from tests.structured_output.schemas import MAX_TOKENS, SCHEMAS

pytest.importorskip("xgrammar")

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 45))]


@pytest.fixture(scope="module")
def llm(tiny_qwen2_dir):
    return LLM(tiny_qwen2_dir, dtype="float32", num_gpu_blocks_override=512, block_size=16, max_model_len=512)


def validate(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fifty_schemas_in_one_batch_all_validate(llm, temperature):
    params = [
        SamplingParams(
            max_tokens=MAX_TOKENS, temperature=temperature, seed=i, structured_outputs=S(json=schema)
        )
        for i, (_, _, schema) in enumerate(SCHEMAS)
    ]
    outs = llm.generate([f"give me {what}" for _, what, _ in SCHEMAS], params, use_tqdm=False)
    for (name, _, schema), out in zip(SCHEMAS, outs):
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", (name, comp.text)
        validate(comp.text, schema)


def test_bounded_strings_decode_to_what_the_grammar_counted(llm):
    """Sampled length-bounded strings are well-formed UTF-8 within their bounds: with the pattern `.`,
    xgrammar took overlong and surrogate byte sequences as one character each, which decoded to up to
    three U+FFFD each (seen on the GPU in the fifty schemas; here about one seed in ten)."""
    schema = {"type": "string", "minLength": 1, "maxLength": 12}
    params = [
        SamplingParams(max_tokens=64, temperature=1.0, seed=i, structured_outputs=S(json=schema))
        for i in range(64)
    ]
    for out in llm.generate([PROMPTS[0]] * len(params), params, use_tqdm=False):
        comp = out.outputs[0]
        assert comp.finish_reason == "stop" and "\ufffd" not in comp.text, comp.text
        validate(comp.text, schema)


def test_regex_choice_grammar_and_json_object(llm):
    constraints = [
        S(regex=r"[a-z]{3}-[0-9]{2,4}"),
        S(choice=["yes", "no", "it depends"]),
        S(grammar='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'),
        S(json_object=True),
    ]
    params = [
        SamplingParams(max_tokens=64, temperature=1.0, seed=3, structured_outputs=c) for c in constraints
    ]
    # A random model would fill an object's free-form keys until max_tokens; favour closing it.
    params[3].logit_bias = {llm.get_tokenizer().convert_tokens_to_ids("}"): 20.0}
    outs = [o.outputs[0] for o in llm.generate([PROMPTS[0]] * 4, params, use_tqdm=False)]
    assert all(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2,4}", outs[0].text)
    assert outs[1].text in ("yes", "no", "it depends")
    assert re.fullmatch(r"\([0-9]+(\+[0-9]+)*\)", outs[2].text)
    assert isinstance(json.loads(outs[3].text), dict)


def test_n_samples_each_follow_the_grammar_and_seeds_reproduce(llm):
    schema = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 6}
    params = SamplingParams(n=6, max_tokens=64, temperature=1.0, seed=11, structured_outputs=S(json=schema))
    first = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs
    again = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs
    for comp in first:
        validate(comp.text, schema)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert len({c.text for c in first}) > 1  # each sample has its own matcher (and draws)


def test_unconstrained_neighbours_are_unaffected(llm):
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate(PROMPTS[2], plain, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(
        [PROMPTS[0], PROMPTS[2]],
        [SamplingParams(max_tokens=12, temperature=0, structured_outputs=S(regex="[0-9]{12}")), plain],
        use_tqdm=False,
    )
    assert re.fullmatch("[0-9]{12}", mixed[0].outputs[0].text)
    assert mixed[1].outputs[0].token_ids == alone


def test_preemption_keeps_the_grammar_in_step(tiny_qwen2_dir):
    """16 usable blocks of 4 tokens for four requests that each grow to ~40 positions: requests are
    preempted and recomputed mid-answer. Their matchers must continue where their output is, so the
    outputs are those of a run with room to spare."""
    schema = {
        "type": "object",
        "properties": {"ids": {"type": "array", "items": {"type": "integer", "minimum": 100, "maximum": 999},
                               "minItems": 5, "maxItems": 5}},
        "required": ["ids"],
    }  # fmt: skip
    params = SamplingParams(max_tokens=48, temperature=0, structured_outputs=S(json=schema))
    kwargs = dict(dtype="float32", block_size=4, max_model_len=64, enable_prefix_caching=False)
    tight = LLM(tiny_qwen2_dir, num_gpu_blocks_override=17, **kwargs)
    roomy = LLM(tiny_qwen2_dir, num_gpu_blocks_override=256, **kwargs)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    got = tight.generate(prompts, params, use_tqdm=False)
    want = roomy.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.core.scheduler.get_stats().num_preemptions > 0
    for g, w in zip(got, want):
        validate(g.outputs[0].text, schema)
        assert g.outputs[0].token_ids == w.outputs[0].token_ids


@pytest.mark.parametrize(
    "constraint, match",
    [
        (S(json={"type": "object", "properties": {"a": {"type": "nope"}}}), 'Unsupported type "nope"'),
        (S(regex="(unclosed"), "invalid regex"),
        (S(grammar="root ::= missing"), 'Rule "missing" is not defined'),
    ],
)
def test_invalid_constraints_raise_value_error(llm, constraint, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([PROMPTS[0]], SamplingParams(structured_outputs=constraint), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_without_xgrammar_plain_requests_work_and_constrained_ones_say_why(llm, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` now raises ImportError
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="pip install xgrammar"):
        llm.generate([PROMPTS[0]], SamplingParams(structured_outputs=S(regex="never-seen-before")))


def test_grammar_that_fails_to_compile_in_the_engine_is_aborted(llm, monkeypatch):
    from qwick.structured_output import manager

    def boom(compiler, spec):
        raise RuntimeError("compiler crashed")

    monkeypatch.setattr(manager, "compile_spec", boom)
    params = [
        SamplingParams(max_tokens=4, structured_outputs=S(regex="[a-z]+ crash")),
        SamplingParams(max_tokens=4),
    ]
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], params, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "abort" and outs[0].outputs[0].token_ids == []
    assert len(outs[1].outputs[0].token_ids) > 0  # the rest of the batch is served
    assert llm.llm_engine.core.scheduler.get_stats().kv_cache_usage == 0.0
