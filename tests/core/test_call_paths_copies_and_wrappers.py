"""A swapped model keeps running the scheme after it is copied, saved, cast or wrapped: deepcopy and
``torch.save(model)`` give independent models that unswap, a cast to float64 runs and unswaps in the new dtype,
peft wrappers swap and unswap, and accelerate's hooks added before or after the swap (and removed again) keep the
scheme or the native model. Switching attention after the swap and position ids of the wrong length are refused
with errors that name them."""

from __future__ import annotations

import copy

import pytest
import torch
from call_path_inputs import padded_inputs, tokens
from conftest import FAMILIES, make_model, scheme_config, swapped

import hf_posswap as ps

# ---- casts, saves, copies and wrappers after the swap ----------------------------------------------------------------

@pytest.mark.parametrize(("family", "scheme"), [("llama", "alibi"), ("gpt2", "t5"), ("bert", "rope"), ("llama", "t5")])
def test_deepcopy_is_independent_and_can_be_unswapped(family: str, scheme: str) -> None:
    model, native = swapped(family, scheme), make_model(family)
    inputs = padded_inputs()
    with torch.no_grad():
        expected, native_logits = model(**inputs).logits, native(**inputs).logits
    twin = copy.deepcopy(model)
    assert vars(twin.base_model)["forward"].base is twin.base_model
    with torch.no_grad():
        torch.testing.assert_close(twin.base_model.forward(**inputs).last_hidden_state,
                                   model.base_model(**inputs).last_hidden_state)
        for param in twin.base_model.posswap_positions.parameters():
            param.mul_(3.0)  # the copy's positions are its own
        torch.testing.assert_close(model(**inputs).logits, expected)
    ps.unswap(twin)
    with torch.no_grad():
        torch.testing.assert_close(twin(**inputs).logits, native_logits)
        torch.testing.assert_close(model(**inputs).logits, expected)
    ps.unswap(model)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, native_logits)


def test_accelerate_hooks_added_after_the_swap_survive_unswap() -> None:
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    model, native = swapped("bert", "alibi"), make_model("bert")
    inputs = padded_inputs()
    with torch.no_grad():
        expected, native_logits = model(**inputs).logits, native(**inputs).logits
    add_hook_to_module(model.bert, ModelHook())
    with torch.no_grad():
        torch.testing.assert_close(model.bert.forward(**inputs).last_hidden_state,
                                   swapped("bert", "alibi").bert(**inputs).last_hidden_state)
        torch.testing.assert_close(model(**inputs).logits, expected)
    ps.unswap(model)  # accelerate's wrapper stays in place, ours passes through
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, native_logits)
    remove_hook_from_module(model.bert)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, native_logits)


def test_swap_over_an_accelerate_hook_keeps_it() -> None:
    from accelerate.hooks import ModelHook, add_hook_to_module

    class Counting(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Counting.calls += 1
            return args, kwargs

    model = make_model("llama")
    add_hook_to_module(model.model, Counting())
    ps.swap(model, "alibi")
    inputs = padded_inputs()
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, swapped("llama", "alibi")(**inputs).logits)
    assert Counting.calls == 1
    ps.unswap(model)
    from hf_posswap.core.context import PositionForward

    assert not isinstance(vars(model.model)["forward"], PositionForward)  # accelerate's own wrapper is back
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, make_model("llama")(**inputs).logits)
    assert Counting.calls == 2


@pytest.mark.parametrize(("family", "scheme"), [("llama", "alibi"), ("gpt2", "t5"), ("bert", "rope")])
def test_torch_save_of_a_whole_swapped_model_round_trips(tmp_path, family: str, scheme: str) -> None:
    model = swapped(family, scheme)
    inputs = padded_inputs()
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert vars(loaded.base_model)["forward"].base is loaded.base_model
    with torch.no_grad():
        torch.testing.assert_close(loaded.base_model.forward(**inputs).last_hidden_state,
                                   model.base_model(**inputs).last_hidden_state)
    ps.unswap(loaded)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, make_model(family)(**inputs).logits)


@pytest.mark.parametrize("scheme", ["alibi", "t5"])
def test_a_model_cast_to_float64_after_the_swap_runs(scheme: str) -> None:
    model = swapped("gpt2", scheme)
    inputs = padded_inputs()
    with torch.no_grad():
        expected = model(**inputs).logits
        model.to(torch.float64)
        torch.testing.assert_close(model(**inputs).logits.float(), expected, atol=1e-4, rtol=1e-4)


def test_switching_attention_after_the_swap_is_refused_not_silently_ignored() -> None:
    model = swapped("llama", "alibi")
    model.set_attn_implementation("eager")
    with pytest.raises(ps.IncompatibleAttentionError, match=r"changed to 'eager' after hf_posswap .*"
                       r"set_attn_implementation\('posswap_eager'\)"):
        model(input_ids=tokens(1, 8))
    model.set_attn_implementation("posswap_eager")
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=tokens(1, 8)).logits,
                                   swapped("llama", "alibi", "eager")(input_ids=tokens(1, 8)).logits)


def test_position_ids_of_the_wrong_length_are_named() -> None:
    model = swapped("llama", "alibi")
    with pytest.raises(ps.InvalidConfigError, match=r"position_ids has shape \(1, 5\) but the input has 12 tokens"):
        model(input_ids=tokens(2, 12), position_ids=torch.arange(5)[None])


@pytest.mark.parametrize("family", FAMILIES)
def test_unswap_after_a_cast_restores_native_modules_in_the_new_dtype(family: str) -> None:
    model = swapped(family, "alibi")
    model.to(torch.float64)
    ps.unswap(model)
    assert {p.dtype for p in model.parameters()} == {torch.float64}  # the put-back table/rotary follow the cast
    inputs = padded_inputs()
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, make_model(family).to(torch.float64)(**inputs).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_swap_and_unswap_through_a_peft_wrapper(family: str) -> None:
    from peft import get_peft_model

    model = make_model(family)
    peft_model = get_peft_model(model, ps.lora_config(model, r=2))
    assert ps.swap(peft_model, "alibi") is peft_model
    inputs = padded_inputs()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(**inputs).logits, swapped(family, "alibi")(**inputs).logits)
    assert ps.unswap(peft_model) is peft_model
    with torch.no_grad():
        torch.testing.assert_close(peft_model(**inputs).logits, make_model(family)(**inputs).logits)


def test_a_model_pickled_under_the_earlier_names_loads() -> None:
    """torch.save(model) pickles the wrapper by class and attribute names; a release that renamed them still loads
    the older pickles (PositionHook -> PositionInputs, PositionForward.hook -> .inputs)."""
    from hf_posswap.core import context

    model = swapped("llama", "alibi")
    forward = model.base_model.forward
    state = dict(vars(forward))
    state["hook"] = state.pop("inputs")
    older = object.__new__(type(forward))
    older.__setstate__(state)
    assert older.inputs is forward.inputs and context.PositionHook is context.PositionInputs


def test_a_swap_through_a_peft_wrapper_never_loses_trained_position_weights() -> None:
    """Position parameters added under an adapter would train but never be saved with it, and replacing a swap whose
    module the adapter trains (modules_to_save) would drop the adapter's copy: both refused, the model unchanged."""
    from peft import get_peft_model
    from test_errors import assert_untouched, fingerprint

    plain = get_peft_model(make_model("gpt2"), ps.lora_config(make_model("gpt2"), r=2))
    before = fingerprint(plain.get_base_model())
    with pytest.raises(ps.InvalidConfigError, match=(
            r"Swapping a peft model to 't5' adds trainable position parameters \(transformer.posswap_positions.tables"
            r".*Swap the base model before get_peft_model")):
        ps.swap(plain, "t5")
    assert_untouched(plain.get_base_model(), before)

    model = make_model("gpt2")
    ps.swap(model, "alibi", trainable_slopes=True)
    trained = get_peft_model(model, ps.lora_config(model, r=2))
    before = fingerprint(trained.get_base_model())
    with pytest.raises(ps.InvalidConfigError, match=(
            r"The 'alibi' position module\(s\) transformer.posswap_positions are trained by the peft adapter")):
        ps.swap(trained, "none", replace=True)
    assert_untouched(trained.get_base_model(), before)
    assert ps.describe(trained).scheme == "alibi"


@pytest.mark.parametrize(("family", "scheme"), [("llama", "alibi"), ("llama", "sinusoidal"), ("gpt2", "t5")])
def test_removing_an_accelerate_hook_added_before_the_swap_keeps_the_scheme(family: str, scheme: str) -> None:
    """accelerate's remove_hook_from_module puts back the forward it saved when hooking: the swap must survive it
    (losing it would run the model with no positions at all, native or swapped, without a word)."""
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    model, expected = make_model(family), swapped(family, scheme)
    input_ids = tokens(2, 16)
    add_hook_to_module(model.base_model, ModelHook())
    ps.swap(model, scheme_config(scheme))
    model.load_state_dict(expected.state_dict())  # the same (randomised) position weights
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=input_ids).logits, expected(input_ids=input_ids).logits)
        remove_hook_from_module(model.base_model)
        torch.testing.assert_close(model(input_ids=input_ids).logits, expected(input_ids=input_ids).logits)
    ps.unswap(model)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=input_ids).logits, make_model(family)(input_ids=input_ids).logits)


def test_unswap_under_an_accelerate_hook_then_removing_it_gives_the_native_model() -> None:
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    model = make_model("llama")
    add_hook_to_module(model.model, ModelHook())
    ps.swap(model, "alibi")
    ps.swap(model, "t5", replace=True)
    ps.unswap(model)
    input_ids = tokens(2, 16)
    native = make_model("llama")(input_ids=input_ids).logits.detach()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=input_ids).logits, native)
        remove_hook_from_module(model.model)
        torch.testing.assert_close(model(input_ids=input_ids).logits, native)


OFFLOADED = [("llama", "t5"), ("llama", "fire"), ("gpt2", "alibi-trainable"), ("bert", "t5"), ("llama", "layer-mix")]


def offload_case(family: str, scheme: str) -> torch.nn.Module:
    """A swapped model whose position weights are read directly (T5 tables, FIRE's MLP, slopes in a fused kernel)."""
    if scheme == "alibi-trainable":
        model = make_model(family)
        ps.swap(model, ps.AlibiConfig(trainable_slopes=True))
        return model
    if scheme == "layer-mix":
        model = make_model(family)
        ps.swap(model, ps.LayerMix(default="rope", overrides=[(scheme_config("t5"), [1])]))
        with torch.no_grad():
            for parameter in model.base_model.posswap_positions.parameters():
                parameter.copy_(torch.randn_like(parameter))
        return model
    return swapped(family, scheme)


@pytest.mark.parametrize(("family", "scheme"), OFFLOADED, ids=[f"{f}-{s}" for f, s in OFFLOADED])
def test_accelerate_offloading_gives_the_numbers_of_the_model_in_memory(family: str, scheme: str, tmp_path) -> None:
    """accelerate keeps offloaded weights on the meta device until the module holding them is called; the schemes
    read their submodules' weights directly, which failed ("Tensor on device meta is not on the expected device
    cpu") under cpu_offload and from_pretrained(device_map=..., offload_folder=...)."""
    from accelerate import cpu_offload
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    model = offload_case(family, scheme).eval()
    inputs = padded_inputs()
    with torch.no_grad():
        expected = model(**inputs).logits
        offloaded = cpu_offload(copy.deepcopy(model), execution_device=torch.device("cpu"))
        torch.testing.assert_close(offloaded(**inputs).logits, expected, rtol=0, atol=0)
    from transformers.utils import is_accelerate_available

    if not is_accelerate_available():  # transformers 5.5 asks a newer accelerate than 1.0.1 for any device_map
        return
    model.save_pretrained(tmp_path / "saved")
    auto = AutoModelForMaskedLM if family == "bert" else AutoModelForCausalLM
    reloaded = auto.from_pretrained(tmp_path / "saved", device_map="auto", max_memory={"cpu": "40KB"},
                                    offload_folder=tmp_path / "offload").eval()
    assert any(p.is_meta for p in reloaded.parameters())  # some weights did go to the disk
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scheme", ["alibi", "t5", "fire"])
def test_a_mask_made_for_one_layer_stays_its_own(scheme: str) -> None:
    """The per-forward memo names masks by id(); a mask a forward hook makes for one layer alone was freed when
    that layer returned, and the next layer's new mask could take its id and be served its merged mask (0.41 off
    in the logits with ALiBi). The memo now holds every mask it names until the forward ends."""
    import weakref

    model = swapped("llama", scheme, attn="eager").eval()
    ids = tokens(1, 24)
    length = ids.shape[1]

    def mask_for(layer: int) -> torch.Tensor:
        allowed = torch.ones(length, length, dtype=torch.bool).tril()
        if layer == 1:  # layer 1 also hides the first 8 keys
            allowed[:, :8] = False
            allowed[torch.arange(length), torch.arange(length)] = True
        return torch.zeros(1, 1, length, length).masked_fill(~allowed, torch.finfo(torch.float32).min)

    def run(keep: list | None) -> tuple[torch.Tensor, list]:
        made = []

        def hook(layer: int):
            def pre(module, args, kwargs):
                kwargs["attention_mask"] = mask = mask_for(layer)
                made.append(weakref.ref(mask))
                if keep is not None:
                    keep.append(mask)
                if layer == 1:  # layer 0's mask, made for it alone, must not have been freed (its id reused)
                    made.append(made[0]() is not None)
                return args, kwargs
            return pre

        handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True)
                   for i, layer in enumerate(model.model.layers)]
        try:
            with torch.no_grad():
                return model(input_ids=ids).logits, made
        finally:
            for handle in handles:
                handle.remove()

    freed, made = run(None)
    assert made[2] is True
    kept, _ = run([])
    torch.testing.assert_close(freed, kept, rtol=0, atol=0)


def test_record_paths_collects_its_own_threads_calls_only() -> None:
    """A serving process runs several models in threads: a ``record_paths`` block in one thread collected the
    attention calls of another thread's model too."""
    import threading

    from hf_posswap.core.paths import record_paths

    alibi, t5 = swapped("llama", "alibi").eval(), swapped("llama", "t5").eval()
    recording, other_done = threading.Event(), threading.Event()

    def other_thread() -> None:
        recording.wait()
        with torch.no_grad():
            t5(input_ids=tokens(1, 40))
        other_done.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with record_paths() as paths, torch.no_grad():
        recording.set()
        other_done.wait()  # the other thread's forward ran while this block recorded
        alibi(input_ids=tokens(1, 40))
    worker.join()
    assert set(paths) == {"fused-alibi"}, paths

