"""Every way a client calls a swapped model's forward runs the scheme: ``model(...)``, ``model.forward(...)``,
``model.base_model.forward(...)`` (sentence-transformers), peft wrappers, ``torch.compile``, gradient checkpointing
(reentrant too), sentence-transformers and pipelines; each gives the same numbers, and trained position
parameters get the same gradients."""

from __future__ import annotations

import warnings

import pytest
import torch
from call_path_inputs import padded_inputs, tokens
from conftest import FAMILIES, SCHEMES, make_model, save_tiny_checkpoint, swapped

import hf_posswap as ps

MATRIX = [pytest.param(f, s, id=f"{f}-{s}") for f in FAMILIES for s in SCHEMES]


@pytest.mark.parametrize(("family", "scheme"), MATRIX)
def test_every_call_path_runs_the_scheme(family: str, scheme: str) -> None:
    model = swapped(family, scheme)
    base = model.base_model
    inputs = padded_inputs()
    with torch.no_grad():
        through_call = model(**inputs).logits
        base_call = base(**inputs).last_hidden_state
        torch.testing.assert_close(model.forward(**inputs).logits, through_call, rtol=0, atol=0)
        torch.testing.assert_close(base.forward(**inputs).last_hidden_state, base_call, rtol=0, atol=0)
        positional = base.forward(inputs["input_ids"], attention_mask=inputs["attention_mask"])
        torch.testing.assert_close(positional.last_hidden_state, base_call, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_direct_forward_differs_from_the_unswapped_model(family: str) -> None:
    """The check above can fail: with the scheme skipped, base.forward would equal the native model."""
    model, native = swapped(family, "alibi"), make_model(family)
    inputs = padded_inputs()
    with torch.no_grad():
        ours = model.base_model.forward(**inputs).last_hidden_state
        theirs = native.base_model.forward(**inputs).last_hidden_state
    assert not torch.allclose(ours, theirs, atol=1e-3)


def test_signature_of_the_wrapped_forward_is_the_models() -> None:
    """sentence-transformers and Trainer pick keyword arguments from inspect.signature(model.forward)."""
    import inspect

    model, native = swapped("bert", "alibi"), make_model("bert")
    assert inspect.signature(model.base_model.forward) == inspect.signature(native.base_model.forward)
    assert "token_type_ids" in inspect.signature(model.bert.forward).parameters


@pytest.mark.parametrize("scheme", ["alibi", "t5", "rope"])
def test_peft_wrapped_model_runs_the_scheme_on_every_path(scheme: str) -> None:
    from peft import get_peft_model

    model = swapped("llama", scheme)
    inputs = padded_inputs()
    with torch.no_grad():
        expected = model(**inputs).logits
    peft_model = get_peft_model(model, ps.lora_config(model, r=2))
    with torch.no_grad():  # LoRA B starts at zero: same numbers
        torch.testing.assert_close(peft_model(**inputs).logits, expected)
        torch.testing.assert_close(peft_model.forward(**inputs).logits, expected)
        torch.testing.assert_close(peft_model.base_model.model.forward(**inputs).logits, expected)


@pytest.mark.parametrize(("family", "scheme"), [
    pytest.param("llama", "t5", marks=pytest.mark.slow), ("gpt2", "rope"),
    pytest.param("bert", "alibi", marks=pytest.mark.slow),
])
@pytest.mark.slow
def test_torch_compile_matches_eager(family: str, scheme: str) -> None:
    model = swapped(family, scheme)
    inputs = padded_inputs()
    torch._dynamo.reset()  # dynamo warns once per process and call site: a fresh start lets every case see it
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(compiled(**inputs).logits, model(**inputs).logits)
        torch.testing.assert_close(compiled.forward(**inputs).logits, model(**inputs).logits)
    # dynamo warns when it traces through a cached function (the hook reads forward's parameter names)
    assert not [str(w.message) for w in caught if "lru_cache" in str(w.message)]


TRAINED_POSITIONS = [
    pytest.param(f, s, o, id=f"{f}-{s}") for f in FAMILIES
    for s, o in [("t5", {}), ("alibi", {"trainable_slopes": True})]
]


@pytest.mark.parametrize(("family", "scheme", "options"), TRAINED_POSITIONS)
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_gradient_checkpointing_trains_position_parameters(family, scheme, options, reentrant: bool) -> None:
    grads = []
    for checkpointing in (False, True):
        model = make_model(family)
        ps.swap(model, scheme, **options)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        input_ids = tokens(2, 16)
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if "posswap_positions" in n})
    for name, grad in grads[0].items():
        assert grads[1][name] is not None, f"{name} gets no gradient under checkpointing"
        torch.testing.assert_close(grads[1][name], grad)


# ---- sentence-transformers and pipelines ----------------------------------------------------------------------

def _mean_pooled(model, tokenizer, sentences: list[str]) -> torch.Tensor:
    encoded = tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        states = model(**encoded).last_hidden_state
    mask = encoded["attention_mask"][..., None].to(states.dtype)
    return (states * mask).sum(1) / mask.sum(1)


@pytest.mark.slow
def test_sentence_transformers_embeds_with_the_swapped_positions(tmp_path) -> None:
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    directory = save_tiny_checkpoint("bert", tmp_path / "plain")
    model = AutoModel.from_pretrained(directory).eval()
    ps.swap(model, "alibi")
    model.save_pretrained(tmp_path / "alibi")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.save_pretrained(tmp_path / "alibi")
    sentences = ["positions matter here", "a longer sentence, so that padding shows up in the batch"]
    embedded = SentenceTransformer(str(tmp_path / "alibi"), device="cpu").encode(sentences, convert_to_tensor=True)
    torch.testing.assert_close(embedded, _mean_pooled(model, tokenizer, sentences), atol=1e-5, rtol=1e-4)
    native = SentenceTransformer(str(directory), device="cpu").encode(sentences, convert_to_tensor=True)
    assert not torch.allclose(embedded, native, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["alibi", "t5", "rope"])
def test_sentence_transformers_on_minilm(tmp_path, scheme: str) -> None:
    """all-MiniLM-L6-v2 swapped, saved, loaded through SentenceTransformer(dir): the same embeddings as the model."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer, pipeline

    from hf_posswap.persistence.offline_checkpoints import minilm_dir

    model = AutoModel.from_pretrained(minilm_dir()).eval()
    ps.swap(model, scheme)
    if scheme == "t5":  # zero tables carry no signal
        with torch.no_grad():
            for param in model.posswap_positions.parameters():
                param.normal_(0.0, 1.0)
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir())
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    sentences = ["The cat sits on the mat.", "Positions are swapped inside this sentence encoder, quietly."]
    expected = _mean_pooled(model, tokenizer, sentences)
    st_model = SentenceTransformer(str(tmp_path), device="cpu")
    embedded = st_model.encode(sentences, convert_to_tensor=True, normalize_embeddings=False)
    torch.testing.assert_close(embedded, expected, atol=1e-5, rtol=1e-4)
    native = SentenceTransformer(str(minilm_dir()), device="cpu").encode(sentences, convert_to_tensor=True)
    assert (embedded - native).abs().max() > 1e-3
    extractor = pipeline("feature-extraction", model=model, tokenizer=tokenizer)
    features = torch.tensor(extractor(sentences[0]))[0]  # [tokens, hidden]
    torch.testing.assert_close(features.mean(0), expected[0], atol=1e-5, rtol=1e-4)
