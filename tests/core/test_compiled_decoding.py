"""Cached decoding under ``torch.compile``: the numbers of eager decoding, compiled once per shape kind.

``generate`` compiles the model's forward by itself when the KV cache is static and the device is a GPU (its
``CompileConfig``), and users compile ``model.forward`` for fast decoding. A swapped model used to recompile at every
step there: its per-forward memo keyed entries by the cache's length, which dynamo can only hash by fixing it in the
graph's guards, and kept bias rows were compared by value (a graph break per call). After eight recompiles dynamo
runs the frame eagerly, with a warning.

Checked here on the CPU with dynamo's ``eager`` backend (the tracing and guards are the compiler's; inductor would add
minutes of code generation, not other graphs):

- ``fullgraph=True`` over a dynamic cache: the whole forward is one graph (a graph break raises), and after the
  first steps have made the lengths dynamic, later steps never recompile (``error_on_recompile`` raises);
- the logits equal eager decoding's at every step;
- ``generate`` with a static cache and its own compilation: the same tokens as eager ``generate``, and as many
  graphs for 14 new tokens as for 4 (the static cache's length is read once a forward: one graph break);
- regional compilation (each decoder layer compiled, the forward eager) gives the eager numbers, and Sandwich's
  compiled table covers positions far apart (a context-parallel ring's blocks).

Rotary schemes inside attention (RoPE on GPT-2, xPos, mixes with RoPE parts) compile to one graph too: compiled,
a cache layer without an eager forward's record of rotated keys has every key rotated out of place, and a cache
handed between eager and compiled forwards keeps eager's logits. A learned table checks its range inside the
graph: compiled, a position past its end still raises with the fix named. Self-Extend and ReRoPE compile to one
graph too: compiled, they skip none of the shortcuts that read the data (keys past a chunk's last query, chunks that
group nothing), which give the same numbers.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from conftest import VOCAB, make_model, swapped
from torch._dynamo.utils import counters
from transformers import CompileConfig, DynamicCache

import hf_posswap as ps
from hf_posswap.schemes import SCHEME_REGISTRY
from hf_posswap.schemes.base import ModelSpec
from hf_posswap.transformers_internals import CACHE_KWARG

#: (family, scheme) pairs whose cached decoding compiles to one graph (fullgraph); the fast run takes the
#: ids tests/conftest.py FAST_SUBSET names
ONE_GRAPH = [
    ("llama", "alibi"), ("llama", "t5"), ("llama", "kerple"), ("llama", "sandwich"), ("llama", "fire"),
    ("llama", "rope"), ("llama", "sinusoidal"), ("llama", "none"), ("llama", "proportional"),
    ("llama", "learned"), ("llama", "xpos"), ("llama", "layer_mix"), ("llama", "head_mix"), ("llama", "llama4_irope"),
    ("gpt2", "alibi"), ("gpt2", "t5"), ("gpt2", "fire"), ("gpt2", "learned"), ("gpt2", "rope"), ("gpt2", "xpos"),
    ("phi3", "kerple"), ("gpt_neox", "t5"), ("llama", "self_extend"), ("llama", "rerope"),
]  # (not gemma3: its sliding layers' cache recompiles the native model too when the window fills)
#: models made otherwise than by one scheme's swap
BUILT = {
    # windows shorter than the prompt, so prefill and every step group the far keys
    "self_extend": lambda model: ps.extend_context(model, 128, "self_extend", neighbor_window=4, group_size=3),
    "rerope": lambda model: ps.extend_context(model, 128, "rerope", window=4),
    "llama4_irope": lambda model: ps.swap(model, ps.llama4_irope(model, no_rope_layer_interval=2, floor_scale=4)),
    "head_mix": lambda model: ps.swap(model, ps.HeadMix(bias="alibi", rotary="rope")),
}
#: pairs that still break the graph: decoding stays right and does not recompile per step
PROMPT = 8


def _model(family: str, scheme: str | None) -> torch.nn.Module:
    if scheme in BUILT:
        model = make_model(family)
        BUILT[scheme](model)
    else:
        model = make_model(family) if scheme is None else swapped(family, scheme)
    return model.eval()


def _prompt() -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(0))


def _step(forward, cache, token: torch.Tensor, step: int) -> torch.Tensor:
    """One greedy step fed as ``generate`` feeds it (with position ids): the step's logits."""
    return forward(input_ids=token, **{CACHE_KWARG: cache}, use_cache=True,
                   position_ids=torch.tensor([[PROMPT + step]])).logits


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _compiled_against_eager(family: str, scheme: str, fullgraph: bool) -> None:
    """Prefill and 9 steps, compiled and eager side by side (each step's token from the eager logits, so both
    sides see the same inputs); from the fourth step on a recompile raises."""
    model = _model(family, scheme)
    compiled = torch.compile(model.forward, backend="eager", fullgraph=fullgraph)
    compiled_cache, eager_cache = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with torch.no_grad():
        got = compiled(input_ids=_prompt(), **{CACHE_KWARG: compiled_cache}, use_cache=True).logits
        want = model(input_ids=_prompt(), **{CACHE_KWARG: eager_cache}, use_cache=True).logits
        torch.testing.assert_close(got, want, msg=lambda m: f"prefill: {m}")
        for step in range(9):
            token = want[:, -1:].argmax(-1)
            # the second step's new length makes the lengths dynamic (one recompile); none after that
            with torch._dynamo.config.patch(error_on_recompile=step >= 3):
                got = _step(compiled, compiled_cache, token, step)
            want = _step(model, eager_cache, token, step)
            torch.testing.assert_close(got, want, msg=lambda m, step=step: f"step {step}: {m}")


@pytest.mark.parametrize(("family", "scheme"), [pytest.param(f, s, id=f"{f}-{s}") for f, s in ONE_GRAPH])
def test_decoding_compiles_to_one_graph_and_never_recompiles(family: str, scheme: str) -> None:
    _compiled_against_eager(family, scheme, fullgraph=True)



@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["self_extend", "rerope"])
def test_two_pass_decoding_with_an_attention_mask_compiles_to_one_graph(scheme: str) -> None:
    """``generate``'s way: a 2-D attention mask at every step, over a left-padded batch. The rows' positions then
    come from the mask, which compiled is read without asking whether it pads (a graph break)."""
    model = _model("llama", scheme)
    compiled = torch.compile(model.forward, backend="eager", fullgraph=True)
    ids = torch.randint(3, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # row 0 left-padded
    caches = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with torch.no_grad():
        got = compiled(input_ids=ids, attention_mask=mask, **{CACHE_KWARG: caches[0]}, use_cache=True).logits
        want = model(input_ids=ids, attention_mask=mask, **{CACHE_KWARG: caches[1]}, use_cache=True).logits
        torch.testing.assert_close(got[0, 3:], want[0, 3:])
        torch.testing.assert_close(got[1], want[1])
        for step in range(6):
            token = want[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
            with torch._dynamo.config.patch(error_on_recompile=step >= 3):
                got = compiled(input_ids=token, attention_mask=mask, **{CACHE_KWARG: caches[0]}, use_cache=True).logits
            want = model(input_ids=token, attention_mask=mask, **{CACHE_KWARG: caches[1]}, use_cache=True).logits
            torch.testing.assert_close(got, want, msg=lambda m, step=step: f"step {step}: {m}")

def _generate(model: torch.nn.Module, new_tokens: int, compiled: bool) -> torch.Tensor:
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                    cache_implementation="static")
    if compiled:  # generate's own compilation, which it does by itself on a GPU with a static cache
        config = CompileConfig(backend="eager")
        config._compile_all_devices = True
        settings["compile_config"] = config
    else:
        settings["disable_compile"] = True
    with torch.no_grad():
        return model.generate(_prompt(), **settings)


def _graphs_of_compiled_generate(model: torch.nn.Module, new_tokens: int) -> tuple[int, torch.Tensor]:
    torch._dynamo.reset()
    counters.clear()
    tokens = _generate(model, new_tokens, compiled=True)
    return counters["stats"]["unique_graphs"], tokens


@pytest.mark.parametrize("scheme", ["alibi", *(pytest.param(s, marks=pytest.mark.slow) for s in
                                               ("t5", "kerple", "self_extend"))])
def test_generate_with_a_static_cache_compiles_once(scheme: str) -> None:
    model = _model("llama", scheme)
    short, _ = _graphs_of_compiled_generate(model, 4)
    long, tokens = _graphs_of_compiled_generate(model, 14)
    assert long == short, f"{long} graphs for 14 new tokens, {short} for 4: the model recompiles as it decodes"
    assert torch.equal(tokens, _generate(model, 14, compiled=False))


def test_native_model_compiles_as_before() -> None:
    """The reference the counts above are read against: the unswapped LLaMA, one graph for any length."""
    model = _model("llama", None)
    short, _ = _graphs_of_compiled_generate(model, 4)
    long, tokens = _graphs_of_compiled_generate(model, 14)
    assert long == short
    assert torch.equal(tokens, _generate(model, 14, compiled=False))


@pytest.mark.parametrize("scheme", ["t5", pytest.param("alibi", marks=pytest.mark.slow),
                                    pytest.param("sandwich", marks=pytest.mark.slow)])
def test_regional_compilation_matches_eager(scheme: str) -> None:
    """Each decoder layer compiled, the model's forward eager (regional compilation): the forward's memo is made
    eagerly and read inside compiled layers, where a tensor's id() is not its own. Gemma 3's sliding and full layers
    get different masks of one shape, which a memo keyed by id() would hand from one kind of layer to the other;
    a left-padded batch past the sliding window shows it."""
    model = swapped("gemma3_text", scheme).eval()
    ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        for layer in model.base_model.layers:
            layer.compile(backend="eager")
        got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got[:, 3:], want[:, 3:])


def test_sandwich_compiled_bias_of_positions_far_apart() -> None:
    """Under compilation Sandwich's table covers exactly the call's differences i - j, wherever the runs sit: queries
    far after their keys (a context-parallel ring's block of an earlier rank's keys) included."""
    spec = ModelSpec("llama", 64, 2, 4, 2, 16, True, 64, 0.02, 10_000.0, torch.float32, torch.device("cpu"))
    module = SCHEME_REGISTRY.get("sandwich")().resolve(spec).build(spec)
    compiled = torch.compile(lambda q, k: module(q, k, 0, True, None), backend="eager", fullgraph=True)
    for queries, keys in [(torch.arange(16, 23), torch.arange(0, 8)), (torch.arange(0, 5), torch.arange(3, 40))]:
        torch.testing.assert_close(compiled(queries, keys), module(queries, keys, 0, True, None))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_compiled_learned_table_still_refuses_positions_past_its_end(family: str) -> None:
    """The range check runs inside the graph (one graph, no host read of the positions), and still names the fix."""
    model = _model(family, "learned")
    compiled = torch.compile(model.forward, backend="eager", fullgraph=True)
    table = model.config.max_position_embeddings
    with torch.no_grad():
        compiled(input_ids=_prompt(), position_ids=torch.arange(table - PROMPT, table)[None])
        with pytest.raises(RuntimeError, match=r"past the end of the learned position table .*LearnedConfig"):
            compiled(input_ids=_prompt(), position_ids=torch.arange(table - PROMPT + 1, table + 1)[None])


@pytest.mark.parametrize(("family", "scheme"), [pytest.param("gpt2", "rope", id="gpt2-rope"),
                                                pytest.param("llama", "xpos", id="llama-xpos", marks=pytest.mark.slow)])
@pytest.mark.parametrize("prefill", ["eager", "compiled"])
def test_rotated_keys_continue_between_eager_and_compiled_forwards(family: str, scheme: str, prefill: str) -> None:
    """Keys rotated inside attention: an eager forward stores them rotated in the cache and records it, a compiled
    one (no record) rotates them out of place at every step. A cache handed back and forth keeps eager's logits:
    neither rotates a key twice nor leaves one unrotated."""
    model = _model(family, scheme)
    compiled = torch.compile(model.forward, backend="eager")
    mixed, eager = DynamicCache(config=model.config), DynamicCache(config=model.config)
    first = compiled if prefill == "compiled" else model
    with torch.no_grad():
        got = first(input_ids=_prompt(), **{CACHE_KWARG: mixed}, use_cache=True).logits
        want = model(input_ids=_prompt(), **{CACHE_KWARG: eager}, use_cache=True).logits
        torch.testing.assert_close(got, want)
        for step, forward in enumerate([compiled, compiled, model, model, compiled, model]):
            token = want[:, -1:].argmax(-1)
            got, want = _step(forward, mixed, token, step), _step(model, eager, token, step)
            torch.testing.assert_close(got, want, msg=lambda m, step=step: f"step {step}: {m}")
