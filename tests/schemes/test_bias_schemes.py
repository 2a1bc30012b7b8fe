"""The bias schemes kerple, sandwich and fire, checked against code nobody here wrote.

Each peer formula below is written from the peer's code (cited with repository and path) independently of
hf_posswap's modules, and compared on the same parameters: the bias values directly, and behaviourally through
a swapped model (with zeroed queries the attention weights are softmax(bias + mask), so ``output_attentions``
must equal the peer's bias softmaxed). The family x scheme matrix (tests/families/test_matrix.py,
test_call_paths_forward.py, test_checkpoints.py, ...) picks the schemes up from the registry."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import CAUSAL_FAMILIES, FAMILIES, VOCAB, make_model, save_tiny_checkpoint, swapped
from test_matrix import test_explicit_position_ids_reach_attention as explicit_position_ids_check

import hf_posswap as ps
from hf_posswap.cli import main as cli_main
from hf_posswap.errors import InvalidConfigError
from hf_posswap.persistence import export
from hf_posswap.schemes import SCHEME_REGISTRY, FireConfig, KerpleConfig, ModelSpec, SandwichConfig

NEW_SCHEMES = ["kerple", "sandwich", "fire"]
CAUSAL = {family: family in CAUSAL_FAMILIES for family in FAMILIES}


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


# --- peers ------------------------------------------------------------------------------------------------------


def peer_kerple(bias_p: torch.Tensor, bias_a: torch.Tensor, n: int, variant: str) -> torch.Tensor:
    """chijames/KERPLE, megatron/mpu/layers.py, ParallelKerpleLog.forward / ParallelKerplePower.forward (causal):
    diff = tril(i - j); log: -bias_p * log(1 + bias_a * diff); power: -bias_a * diff ** bias_p. [H, n, n], in the
    parameters' dtype"""
    diff = torch.tril(torch.arange(n).view(n, 1).repeat(1, n) + torch.arange(0, -n, -1)).to(bias_p.dtype)
    p, a = bias_p[:, None, None], bias_a[:, None, None]
    return -p * torch.log(1 + a * diff) if variant == "log" else -diff.pow(p) * a


def peer_sandwich(n: int, hidden: int, heads: int) -> torch.Tensor:
    """NVIDIA/NeMo, nemo/collections/nlp/modules/common/megatron/position_embedding/
    sandwich_relative_position_embedding.py, SandwichRelativePositionEmbedding.forward (bidirectional), in
    float64: sum_k cos(rel * inv_freq_k), inv_freq = 1 / 10000^(2 * arange(1, hidden/2 + 1) / hidden), then
    (bias - hidden/2) / (h * 8 / heads) for h = 1..heads. [H, n, n]"""
    position = torch.arange(n, dtype=torch.float64)
    relative = position[None, :] - position[:, None]
    inv_freq = 1.0 / (10000 ** (2 * torch.arange(1, hidden / 2 + 1, dtype=torch.float64) / hidden))
    bias = (relative[:, :, None] * inv_freq).cos().sum(-1).repeat(heads, 1, 1)
    scales = torch.arange(1, heads + 1, dtype=torch.float64)[:, None, None]
    return (bias - hidden / 2) / (scales * 8 / heads)


def peer_fire(mlp: torch.nn.Module, c: float, init_l: float, l_multiplier: float, n: int) -> torch.Tensor:
    """mcleish7/arithmetic, cramming/architectures/embeddings.py, FIRE.forward (the paper's appendix pseudocode;
    eval mode, positions 0..n-1): x = log(|c (i-j)| + 1) / (log(|c max(i, |L_mult L|)| + 1) + 1e-6), bias = mlp(x).
    [H, n, n], in the MLP's dtype"""
    dtype = mlp[0].weight.dtype
    positions = torch.arange(n, dtype=dtype)
    relative = positions[:, None] - positions[None, :]
    threshold = torch.abs(torch.tensor(l_multiplier * init_l, dtype=dtype))
    normalizer = torch.max(positions, threshold)[:, None]
    relative = torch.log(torch.abs(c * relative) + 1)
    normalizer = torch.log(torch.abs(c * normalizer) + 1)
    return mlp((relative / (normalizer + 1e-6)).unsqueeze(-1)).permute(2, 0, 1)


def kerple_peer_parameters(module) -> tuple[torch.Tensor, torch.Tensor]:
    """The peer's (bias_p, bias_a) for the module's (r1, r2)."""
    r1, r2 = (value.detach() for value in module.coefficients())
    return (r1, r2) if module.variant == "log" else (r2, r1)


# --- bias values against the peers -------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["log", "power"])
def test_kerple_equals_the_authors_code(variant: str) -> None:
    torch.manual_seed(0)
    module = KerpleConfig(variant=variant).build(make_spec())
    bias = module(torch.arange(40), torch.arange(40), 0, True)[0]
    expected = peer_kerple(*kerple_peer_parameters(module), 40, variant)
    lower = torch.ones(40, 40, dtype=torch.bool).tril()
    torch.testing.assert_close(bias[:, lower], expected[:, lower], atol=1e-6, rtol=1e-5)
    # encoders: the same kernel of |i - j| in both directions
    both = module(torch.arange(40), torch.arange(40), 0, False)[0]
    torch.testing.assert_close(both, both.transpose(-1, -2))
    torch.testing.assert_close(both[:, lower], expected[:, lower], atol=1e-6, rtol=1e-5)


def test_sandwich_equals_nemo() -> None:
    for dim, heads in ((128, 4), (64, 12)):
        module = SandwichConfig(dim=dim).build(make_spec(num_heads=heads))
        positions = torch.arange(200)
        expected = peer_sandwich(200, dim, heads)
        for causal in (True, False):  # symmetric: the same bias either way (causal masks the upper part)
            bias = module(positions, positions, 0, causal)[0]
            torch.testing.assert_close(bias.double(), expected, atol=2e-5, rtol=1e-5)


def test_sandwich_far_positions_stay_accurate() -> None:
    """Positions of a long context (explicit ids past 100k): the bias depends on the distance alone."""
    module = SandwichConfig().build(make_spec())
    near = module(torch.arange(64), torch.arange(64), 0, True)
    far = module(torch.arange(64) + 123_456, torch.arange(64) + 123_456, 0, True)
    torch.testing.assert_close(far, near, atol=0, rtol=0)


def test_fire_equals_the_papers_pseudocode() -> None:
    torch.manual_seed(0)
    module = FireConfig(init_c=0.3, init_threshold=12.0).build(make_spec())  # short L: max(i, L) varies
    function = module.functions[0]
    with torch.no_grad():
        for param in function.mlp.parameters():
            param.copy_(torch.randn_like(param))
        function.threshold_scale.fill_(1.5)  # L = 18
    bias = module(torch.arange(40), torch.arange(40), 0, True)[0]
    with torch.no_grad():
        expected = peer_fire(function.mlp, 0.3, 12.0, 1.5, 40)
    lower = torch.ones(40, 40, dtype=torch.bool).tril()  # the peer is causal: keys at or before the query
    torch.testing.assert_close(bias[:, lower], expected[:, lower], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scheme", ["kerple-log", "kerple-power", "fire"])
def test_a_float64_module_computes_its_bias_in_float64(scheme: str) -> None:
    """A model cast to float64 gets float64 biases (the peers run in float64 too): a float32 bias there was 1e-8
    off, the precision a float64 model is chosen for."""
    torch.manual_seed(0)
    n = 300
    lower = torch.ones(n, n, dtype=torch.bool).tril()
    if scheme == "fire":
        module = FireConfig(init_c=0.3, init_threshold=12.0).build(make_spec()).double()
        function = module.functions[0]
        with torch.no_grad():
            for param in function.mlp.parameters():
                param.copy_(torch.randn_like(param))
            expected = peer_fire(function.mlp, function.c.item(), 12.0, 1.0, n)  # c: float32's 0.3, made float64
    else:
        module = KerpleConfig(variant=scheme.removeprefix("kerple-")).build(make_spec()).double()
        expected = peer_kerple(*kerple_peer_parameters(module), n, module.variant)
    with torch.no_grad():
        bias = module(torch.arange(n), torch.arange(n), 0, True)[0]
    assert bias.dtype == torch.float64
    torch.testing.assert_close(bias[:, lower], expected[:, lower], atol=1e-12, rtol=1e-12)


def test_fire_starts_at_zero_and_tells_directions_apart_in_encoders() -> None:
    module = FireConfig().build(make_spec())
    positions = torch.arange(16)
    assert module(positions, positions, 0, True).abs().max() == 0  # the swap adds nothing before training
    with torch.no_grad():
        for param in module.functions[0].mlp.parameters():
            param.copy_(torch.randn_like(param))
    both = module(positions, positions, 0, False)[0]
    assert (both - both.transpose(-1, -2)).abs().max() > 1e-3  # key before vs after the query differ


def short_threshold_fire(family: str, attn: str) -> torch.nn.Module:
    """A swapped model whose FIRE threshold L = 4 lies inside the test rows, so psi(max(i, L)) changes with the
    query's position i (with the default L = 512 every test row reads the same normaliser)."""
    model = make_model(family, attn).eval()
    ps.swap(model, FireConfig(init_threshold=4.0))
    with torch.no_grad():
        generator = torch.Generator().manual_seed(3)
        for param in model.base_model.posswap_positions.functions[0].mlp.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    return model


FIRE_CASES = [("llama", "sdpa"), ("llama", "eager"), ("gpt2", "sdpa"), ("bert", "sdpa")]


@pytest.mark.parametrize(("family", "attn"), FIRE_CASES, ids=[f"{f}-{a}" for f, a in FIRE_CASES])
def test_fire_gives_a_padded_row_the_bias_of_the_row_alone(family: str, attn: str) -> None:
    """FIRE's normaliser reads the query's absolute position (Li et al. 2024), so padding must not count in it:
    a left-padded row (right-padded in BERT) equals the row alone (seen 7.6e-2 off when pads counted)."""
    model = short_threshold_fire(family, attn)
    row = tokens(1, 20)
    padding = torch.zeros(1, 7, dtype=torch.long)
    ids = torch.cat([row, padding], 1) if family == "bert" else torch.cat([padding, row], 1)
    mask = (torch.arange(27) < 20 if family == "bert" else torch.arange(27) >= 7).long()[None]
    with torch.no_grad():
        alone = model(input_ids=row).logits[0]
        padded = model(input_ids=ids, attention_mask=mask).logits[0, mask[0].bool()]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scheme", NEW_SCHEMES + ["alibi", "t5"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_float64_model_with_padding_stays_finite_in_eager_attention(family: str, scheme: str) -> None:
    """Masked logits hold float64's lowest value, which a float32 softmax read as -inf: a wholly masked padding
    row became NaN and spread to the real tokens in the next layer (GPT-2 is finite before the swap)."""
    model = swapped(family, scheme, attn="eager").to(torch.float64).eval()
    ids = torch.cat([torch.zeros(1, 5, dtype=torch.long), tokens(1, 10)], 1)
    mask = (torch.arange(15) >= 5).long()[None]
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask).logits[0, 5:]
        alone = model(input_ids=ids[:, 5:]).logits[0]
    assert torch.isfinite(padded).all()
    torch.testing.assert_close(padded, alone, atol=1e-10, rtol=1e-10)  # float64 throughout, softmax included


def test_fire_per_layer_functions() -> None:
    """shared_across_layers=False: each layer reads its own function; eager = sdpa."""
    models = {}
    for attn in ("eager", "sdpa"):
        model = make_model("llama", attn)
        ps.swap(model, "fire", shared_across_layers=False)
        functions = model.base_model.posswap_positions.functions
        assert len(functions) == 2
        torch.manual_seed(3)
        with torch.no_grad():
            for param in functions.parameters():
                param.copy_(torch.randn_like(param))
        models[attn] = model
    input_ids = tokens(1, 12)
    with torch.no_grad():
        eager, sdpa = models["eager"](input_ids=input_ids).logits, models["sdpa"](input_ids=input_ids).logits
        functions = models["sdpa"].base_model.posswap_positions.functions
        functions[1].load_state_dict(functions[0].state_dict())
        mixed = models["sdpa"](input_ids=input_ids).logits
    torch.testing.assert_close(eager, sdpa, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(sdpa, mixed, atol=1e-4)


# --- behaviour through a swapped model ---------------------------------------------------------------------------


def zero_queries(model: torch.nn.Module, family: str) -> None:
    """With q = 0 the attention logits are the position bias alone."""
    base = model.base_model
    with torch.no_grad():
        for module in base.modules():
            for name in ("q_proj", "query"):
                layer = getattr(module, name, None)
                if isinstance(layer, torch.nn.Linear):
                    layer.weight.zero_()
                    if layer.bias is not None:
                        layer.bias.zero_()
        if family == "gpt2":
            for block in base.h:  # c_attn packs q, k, v: zero the q third
                block.attn.c_attn.weight[:, :64] = 0
                block.attn.c_attn.bias[:64] = 0
        if family == "phi3":
            for layer in base.layers:  # qkv_proj packs [q | k | v] along its output: zero the q rows
                layer.self_attn.qkv_proj.weight[:64] = 0
        if family == "gpt_neox":
            for layer in base.layers:  # query_key_value packs (q, k, v) per head: [H * 3 * D] outputs
                layer.attention.query_key_value.weight.view(4, 3, 16, 64)[:, 0] = 0
                layer.attention.query_key_value.bias.view(4, 3, 16)[:, 0] = 0


def expected_bias(model: torch.nn.Module, scheme: str, family: str, n: int) -> torch.Tensor:
    """The peer's bias for the model's scheme parameters (encoders: hf_posswap's own, as the peers are causal)."""
    module = model.base_model.posswap_positions
    if not CAUSAL[family] and scheme != "sandwich":
        return module(torch.arange(n), torch.arange(n), 0, False)[0]
    if scheme == "kerple":
        return peer_kerple(*kerple_peer_parameters(module), n, module.variant)
    if scheme == "sandwich":
        return peer_sandwich(n, 128, 4).float()
    function = module.functions[0]
    return peer_fire(function.mlp, function.c.item(), function.initial_threshold, function.threshold_scale.item(), n)


@pytest.mark.parametrize(("family", "scheme"), [pytest.param(f, s, id=f"{f}-{s}") for f in FAMILIES
                                                for s in NEW_SCHEMES])
def test_attention_weights_are_the_peers_bias(family: str, scheme: str) -> None:
    model = swapped(family, scheme, "eager")
    zero_queries(model, family)
    with torch.no_grad():
        attentions = model(input_ids=tokens(1, 10), output_attentions=True).attentions
        bias = expected_bias(model, scheme, family, 10)
    if CAUSAL[family]:
        bias = bias.masked_fill(~torch.ones(10, 10, dtype=torch.bool).tril(), float("-inf"))
    for weights in attentions:  # one bias shared by both layers
        torch.testing.assert_close(weights[0], bias.softmax(-1), atol=1e-5, rtol=1e-4)


#: the default (fast) run keeps one family per scheme; CI runs every pair
FAST_PAIRS = {("llama", "kerple"), ("bert", "sandwich"), ("gpt2", "fire")}


def pairs() -> list:
    return [pytest.param(f, s, id=f"{f}-{s}", marks=() if (f, s) in FAST_PAIRS else pytest.mark.slow)
            for f in FAMILIES for s in NEW_SCHEMES]


@pytest.mark.parametrize(("family", "scheme"), pairs())
def test_explicit_position_ids(family: str, scheme: str) -> None:
    """tests/families/test_matrix.py's check (ids equal to the default, a shift, a skip, per-row ids) for these
    schemes."""
    explicit_position_ids_check(family, scheme)


def test_kerple_parameters_stay_in_range_whatever_the_optimiser_does() -> None:
    for variant in ("log", "power"):
        module = KerpleConfig(variant=variant).build(make_spec())
        with torch.no_grad():
            module.raw_r1.copy_(torch.tensor([-80.0, -5.0, 5.0, 40.0]))
            module.raw_r2.copy_(torch.tensor([-80.0, -5.0, 5.0, 80.0]))
        r1, r2 = module.coefficients()
        assert (r1 > 0).all() and (r2 > 0).all() and torch.isfinite(r1).all()
        if variant == "power":
            assert (r2 <= 2).all()
        assert torch.isfinite(module(torch.arange(50), torch.arange(50), 0, True)).all()


def test_kerple_uses_the_authors_initial_ranges() -> None:
    torch.manual_seed(0)
    log = KerpleConfig().build(make_spec(num_heads=256)).coefficients()
    power = KerpleConfig(variant="power").build(make_spec(num_heads=256)).coefficients()
    for (r1, r2), (high1, high2) in ((log, (2.0, 1.0)), (power, (1.0, 2.0))):
        assert r1.min() >= 1e-2 - 1e-7 and r1.max() <= high1 and r1.max() > 0.8 * high1
        assert r2.min() >= 1e-2 - 1e-7 and r2.max() <= high2 and r2.max() > 0.8 * high2


def test_sandwich_has_nothing_to_train_or_save() -> None:
    model = swapped("llama", "sandwich")
    assert ps.describe(model).new_parameters == []
    assert not [key for key in model.state_dict() if "posswap" in key]


@pytest.mark.parametrize("scheme", [pytest.param(s, marks=() if s == "fire" else pytest.mark.slow)
                                    for s in NEW_SCHEMES])
def test_trains_in_half_precision(scheme: str) -> None:
    """A bf16 model: the bias is computed in float32 from bf16 parameters and gets gradients."""
    model = swapped("llama", scheme).to(torch.bfloat16).train()
    input_ids = tokens(2, 16)
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    for name, _shape, trainable in ps.describe(model).new_parameters:
        grad = model.get_parameter(name).grad
        assert not trainable or (grad is not None and torch.isfinite(grad).all()), name


# --- configs -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("scheme", "options", "message"), [
    ("kerple", {"variant": "cubic"}, r"variant must be one of 'log', 'power', got 'cubic'\. Use variant='log'"),
    ("sandwich", {"dim": 63}, r"dim must be an even integer >= 2 .* got 63\. Use dim=128"),
    ("sandwich", {"dim": True}, r"dim must be an even integer >= 2 .* got True"),
    ("sandwich", {"base": 1.0}, r"base must be above 1 and at most .* got 1\.0.*Typical values"),
    ("sandwich", {"base": "big"}, r"base must be a number, got 'big'\. Use base=10000\.0"),
    ("fire", {"mlp_width": 0}, r"mlp_width must be an integer >= 1, got 0"),
    ("fire", {"init_c": -0.1}, r"init_c must be a positive finite number, got -0\.1\. Use init_c=0\.1"),
    ("fire", {"init_threshold": float("nan")}, r"init_threshold must be a positive finite number, got nan"),
    ("fire", {"shared_across_layers": "no"}, r"shared_across_layers must be True or False, got 'no'"),
])
def test_bad_values_are_named(scheme: str, options: dict, message: str) -> None:
    with pytest.raises(InvalidConfigError, match=message):
        SCHEME_REGISTRY.get(scheme)(**options)


def test_registered_everywhere() -> None:
    from hf_posswap.cli import parser as cli_parser
    from hf_posswap.cli.matrix import support_matrix_markdown

    for scheme in NEW_SCHEMES:
        assert scheme in ps.available_schemes() and scheme in cli_parser.SCHEMES
        assert f"`{scheme}`" in support_matrix_markdown()
        config = SCHEME_REGISTRY.get(scheme)
        assert config.kind == "bias" and "arXiv:" in config.paper


def test_cli_names_a_bad_option_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source = save_tiny_checkpoint("llama", tmp_path / "llama")
    code = cli_main(["swap", "--model", str(source), "--scheme", "kerple", "--option", "variant=cubic",
                     "--output", str(tmp_path / "out")])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("hf-posswap")]
    assert code == 1 and len(lines) == 1 and "Traceback" not in captured.err, captured.err[-2000:]
    assert "'cubic'" in lines[0] and "variant='log'" in lines[0]
    assert not (tmp_path / "out").exists()


MISSING_FROM_BUNDLE = [f"schemes/{s}" for s in NEW_SCHEMES if f"schemes/{s}" not in export.BUNDLED]


@pytest.mark.slow
@pytest.mark.skipif(bool(MISSING_FROM_BUNDLE), reason=f"hf_posswap/persistence/export.py BUNDLED lacks "
                                                       f"{MISSING_FROM_BUNDLE}: exports of these schemes fail")
@pytest.mark.parametrize(("family", "scheme"), [("llama", "kerple"), ("gpt2", "sandwich"), ("bert", "fire")])
def test_standalone_export_loads_without_hf_posswap(tmp_path: Path, family: str, scheme: str) -> None:
    from test_export import load_without_hf_posswap

    model = swapped(family, scheme)
    input_ids = tokens(1, 40)
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits
    torch.save({"input_ids": input_ids, "expected": expected}, tmp_path / "io.pt")
    ps.export_standalone(model, tmp_path / "export")
    auto = "AutoModelForMaskedLM" if family == "bert" else "AutoModelForCausalLM"
    assert "EQUAL" in load_without_hf_posswap(tmp_path / "export", tmp_path / "io.pt", auto)


def make_spec(num_heads: int = 4) -> ModelSpec:
    return ModelSpec(
        model_type="llama", hidden_size=16 * num_heads, num_layers=2, num_heads=num_heads, num_kv_heads=num_heads,
        head_dim=16, is_causal=True, max_positions=64, initializer_range=0.02, native_rope_theta=None,
        dtype=torch.float32, device=torch.device("cpu"),
    )

