"""FlatSpecProvider, flat_gpt_spec and the ``--spec`` layer objects (one process).

What is checked: the provider is Megatron's backend provider for every stock method and only
swaps the MoE layer; the ``--spec`` object reads the FlatConfig installed when the model is
built (not when it is imported); with nothing installed it builds the stock local-spec model,
parameter for parameter.
"""

import dataclasses
import functools
import inspect
from unittest import mock

import pytest
import torch

from megatron_flat.config import FlatConfig

PIPELINED = FlatConfig(dispatch="pipelined", dispatch_chunk_tokens=5, llep_min_tokens_per_gemm=1)


@pytest.fixture(autouse=True)
def fresh_install():
    from megatron_flat.megatron import install as inst

    inst._reset_for_tests()
    yield inst
    inst._reset_for_tests()


# ---------------------------------------------------------------------------- helpers
def _shape(obj):
    """A spec tree as nested tuples that compare by value (0.19's partials compare by
    identity, so two builds of the same stock spec are otherwise never equal)."""
    if isinstance(obj, functools.partial):
        return ("partial", obj.func, tuple(_shape(a) for a in obj.args),
                tuple(sorted(((k, _shape(v)) for k, v in obj.keywords.items()),
                             key=lambda kv: kv[0])))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj), tuple((f.name, _shape(getattr(obj, f.name)))
                                 for f in dataclasses.fields(obj)))
    if isinstance(obj, dict):
        return tuple(sorted(((k, _shape(v)) for k, v in obj.items()), key=lambda kv: kv[0]))
    if isinstance(obj, (list, tuple)):
        return tuple(_shape(v) for v in obj)
    return obj


def _moe_module(mlp_spec):
    """The MoE layer class an ``mlp`` spec builds, or None for a dense MLP."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_flat.megatron import compat

    module = compat.moe_spec_module(mlp_spec)
    return module if module is not None and issubclass(module, MoELayer) else None


def _moe_flat(mlp_spec):
    """The ``flat=`` keyword an MoE spec passes to its layer (ModuleSpec params in 0.16,
    partial keywords in 0.19), or None."""
    if isinstance(mlp_spec, functools.partial):
        return mlp_spec.keywords.get("flat")
    return mlp_spec.params.get("flat")


def _without_flat(mlp_spec):
    """``mlp_spec`` as the stock MoELayer spec it was made from (module and ``flat`` undone)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron_flat.megatron import compat

    if isinstance(mlp_spec, functools.partial):
        keywords = {k: v for k, v in mlp_spec.keywords.items() if k != "flat"}
        return functools.partial(MoELayer, *mlp_spec.args, **keywords)
    return compat.replace_moe_module(
        dataclasses.replace(mlp_spec, params={k: v for k, v in mlp_spec.params.items()
                                              if k != "flat"}), MoELayer)


def _call_args(method):
    """Arguments for a provider method: its defaults, False for required flags."""
    params = list(inspect.signature(method).parameters.values())
    return [False for p in params if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _outcome(call):
    try:
        return "ok", _shape(call())
    except Exception as exc:  # the stock provider may refuse (e.g. inference MoE): same refusal
        return "raised", type(exc)


# ---------------------------------------------------------------------------- provider
@pytest.mark.parametrize("kind", ["LocalSpecProvider", "InferenceSpecProvider"])
def test_provider_gives_every_stock_method_the_stock_answer(kind):
    import megatron.core.models.backends as backends

    from megatron_flat.megatron.spec import FlatSpecProvider

    stock = getattr(backends, kind)()
    provider = FlatSpecProvider(PIPELINED, backend=stock)
    names = sorted(n for n in dir(type(stock))
                   if not n.startswith("_") and callable(getattr(stock, n)))
    protocol = {n for n in dir(backends.BackendSpecProvider) if not n.startswith("_")}
    assert protocol <= set(names)  # every protocol method is compared below
    assert backends.BackendSpecProvider in type(provider).__mro__
    for name in names:
        args = _call_args(getattr(stock, name))
        assert _outcome(lambda: getattr(provider, name)(*args)) == \
            _outcome(lambda: getattr(stock, name)(*args)), name


def test_provider_forwards_arguments_and_results():
    from megatron.core.models.backends import LocalSpecProvider

    from megatron_flat.megatron.spec import FlatSpecProvider

    inner = mock.create_autospec(LocalSpecProvider, instance=True)
    inner.extra_method = mock.Mock(return_value="extra")  # a provider's own additions
    provider = FlatSpecProvider(PIPELINED, backend=inner)
    # 0.16 takes (grouped_gemm, legacy_grouped_gemm), 0.19 (grouped_gemm): pass what it takes
    grouped = tuple(True for _ in _call_args(LocalSpecProvider().grouped_mlp_modules))
    calls = {
        "column_parallel_linear": ((), {}),
        "row_parallel_linear": ((), {}),
        "fuse_layernorm_and_linear": ((), {}),
        "column_parallel_layer_norm_linear": ((), {}),
        "layer_norm": ((), {"rms_norm": True, "for_qk": True}),
        "core_attention": ((), {}),
        "grouped_mlp_modules": (grouped, {}),
        "activation_func": ((), {}),
        "extra_method": ((1, 2), {"k": 3}),
    }
    for name, (args, kwargs) in calls.items():
        result = getattr(provider, name)(*args, **kwargs)
        getattr(inner, name).assert_called_once_with(*args, **kwargs)
        assert result is getattr(inner, name).return_value, name
    with pytest.raises(AttributeError):
        provider.no_such_method


def test_provider_default_backend_follows_transformer_engine():
    from megatron.core.models.backends import LocalSpecProvider

    from megatron_flat.megatron.spec import FlatSpecProvider
    from megatron_flat.runtime import extras

    assert type(FlatSpecProvider(transformer_engine=False).backend) is LocalSpecProvider
    default = FlatSpecProvider()
    assert default.transformer_engine == extras.available("transformer_engine")
    if not default.transformer_engine:
        assert type(default.backend) is LocalSpecProvider


def test_provider_moe_specs_carry_the_flat_layer():
    import megatron.core.models.gpt.gpt_layer_specs as gpt_layer_specs
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_flat.megatron.moe import FlatMoELayer
    from megatron_flat.megatron.spec import FlatSpecProvider

    provider = FlatSpecProvider(PIPELINED, transformer_engine=False)
    stock = get_moe_module_spec_for_backend(backend=LocalSpecProvider(), num_experts=4)
    built = {
        "moe_module_spec": provider.moe_module_spec(4),
        "mlp_module_spec": provider.mlp_module_spec(4),
        # Megatron's own function, given the provider as its backend
        "get_mlp_module_spec_for_backend":
            gpt_layer_specs.get_mlp_module_spec_for_backend(backend=provider, num_experts=4),
    }
    for name, spec in built.items():
        assert _moe_module(spec) is FlatMoELayer, name
        assert _moe_flat(spec) is PIPELINED, name
        # router, experts and shared experts are the stock spec's
        assert _shape(_without_flat(spec)) == _shape(stock), name
    assert _moe_module(provider.mlp_module_spec(None)) is None  # dense MLP: untouched
    off = FlatSpecProvider(FlatConfig(), transformer_engine=False)
    assert _moe_module(off.moe_module_spec(4)) is MoELayer
    assert _shape(off.moe_module_spec(4)) == _shape(stock)


def test_explicit_flatconfig_wins_over_the_installed_one():
    from megatron.core.transformer.moe.moe_layer import MoELayer

    import megatron_flat
    from megatron_flat.megatron.moe import FlatMoELayer
    from megatron_flat.megatron.spec import FlatSpecProvider, gpt_layer_local_spec

    follows_installed = FlatSpecProvider(transformer_engine=False)
    assert _moe_module(follows_installed.moe_module_spec(4)) is MoELayer  # nothing installed
    megatron_flat.install(PIPELINED)
    assert _moe_module(follows_installed.moe_module_spec(4)) is FlatMoELayer
    assert follows_installed.flat is PIPELINED
    off = FlatConfig()
    assert _moe_module(FlatSpecProvider(off).moe_module_spec(4)) is MoELayer
    assert _moe_module(gpt_layer_local_spec(off, num_experts=4).submodules.mlp) is MoELayer


def test_flat_gpt_spec_layer_and_block(megatron_cpu):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_flat.megatron.moe import FlatMoELayer
    from megatron_flat.megatron.spec import FlatSpecProvider, flat_gpt_spec, gpt_layer_spec
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import TinyMoE, transformer_config

    layer = flat_gpt_spec(PIPELINED, num_experts=4, normalization="RMSNorm",
                          use_transformer_engine=False)
    assert _moe_module(layer.submodules.mlp) is FlatMoELayer
    same = gpt_layer_spec(PIPELINED, num_experts=4, normalization="RMSNorm")
    assert _shape(layer) == _shape(same)
    # every other layer dense: the block spec keeps dense layers dense
    config = transformer_config(TinyMoE(num_layers=4), moe_layer_freq=[1, 0, 1, 0])
    with megatron_layout():
        block = flat_gpt_spec(PIPELINED, config, normalization="RMSNorm",
                              use_transformer_engine=False)
        stock_block = FlatSpecProvider(FlatConfig(), transformer_engine=False) \
            .decoder_block_spec(config, normalization="RMSNorm")
    modules = [_moe_module(s.submodules.mlp) for s in block.layer_specs]
    assert modules == [FlatMoELayer, None, FlatMoELayer, None]
    assert [_moe_module(s.submodules.mlp) for s in stock_block.layer_specs] == \
        [MoELayer, None, MoELayer, None]


# ---------------------------------------------------------------------------- --spec objects
def test_spec_object_imports_as_megatron_lm_does():
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_flat.megatron import spec

    # pretrain_gpt.py: transformer_layer_spec = import_module(args.spec)
    obj = import_module(["megatron_flat.megatron.spec", "flat_gpt_layer_spec"])
    assert obj is spec.flat_gpt_layer_spec
    assert isinstance(obj, ModuleSpec) and obj.module is TransformerLayer
    assert "flat_gpt_layer_spec" in spec.__all__ and "flat_gpt_layer_te_spec" in spec.__all__


def test_spec_object_resolves_the_installed_flatconfig(fresh_install):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    import megatron_flat
    from megatron_flat.megatron.moe import FlatMoELayer
    from megatron_flat.megatron.spec import flat_gpt_layer_spec

    assert _moe_module(flat_gpt_layer_spec.submodules.mlp) is MoELayer
    installed = megatron_flat.install(FlatConfig(dispatch="llep", llep_alpha=2.0))
    mlp = flat_gpt_layer_spec.submodules.mlp
    assert _moe_module(mlp) is FlatMoELayer and _moe_flat(mlp) is installed
    fresh_install._reset_for_tests()
    megatron_flat.install(FlatConfig(sco=True))  # installed, dispatch off: the stock layer
    assert _moe_module(flat_gpt_layer_spec.submodules.mlp) is MoELayer


def test_spec_object_is_the_stock_local_spec_when_off():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_flat.megatron.spec import flat_gpt_layer_spec

    stock = get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm")
    assert _shape(flat_gpt_layer_spec.resolve()) == _shape(stock)
    cached = flat_gpt_layer_spec.stock()
    for name in ("module", "params", "submodules", "metainfo"):  # the stock objects themselves
        assert getattr(flat_gpt_layer_spec, name) is getattr(cached, name), name


def test_te_spec_object_needs_transformer_engine():
    from megatron_flat.megatron.spec import flat_gpt_layer_te_spec
    from megatron_flat.runtime import extras

    if extras.available("transformer_engine"):
        pytest.skip("transformer-engine is importable here")
    with pytest.raises(RuntimeError, match="flat_gpt_layer_spec"):
        flat_gpt_layer_te_spec.submodules


def _tiny_model(layer_spec=None, seed=7):
    from megatron_flat.testing.tiny_gpt import TinyMoE, build_tiny_gpt, transformer_config

    tiny = TinyMoE()
    torch.manual_seed(seed)
    return build_tiny_gpt(tiny, transformer_config(tiny), layer_spec=layer_spec)


def _moe_layers(model):
    return [layer.mlp for layer in model.decoder.layers]


def test_spec_object_builds_the_stock_model_when_off(megatron_cpu, fresh_install):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_flat.megatron.spec import flat_gpt_layer_spec
    from megatron_flat.testing.distributed import megatron_layout

    with megatron_layout():
        stock = _tiny_model()
    with megatron_layout():
        model = _tiny_model(flat_gpt_layer_spec)
    assert [type(m) for m in _moe_layers(model)] == [MoELayer, MoELayer]
    ours = [(n, p.shape, p.dtype) for n, p in model.named_parameters()]
    theirs = [(n, p.shape, p.dtype) for n, p in stock.named_parameters()]
    assert ours == theirs
    for (name, p), q in zip(model.named_parameters(), stock.parameters()):  # same seed, same init
        assert torch.equal(p, q), name


def test_spec_object_builds_flat_moe_layers_when_installed(megatron_cpu, fresh_install):
    import megatron_flat
    from megatron_flat.megatron.moe import FlatMoELayer
    from megatron_flat.megatron.spec import flat_gpt_layer_spec
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import TinyMoE

    with megatron_layout():
        stock = _tiny_model()
    installed = megatron_flat.install(PIPELINED)
    with megatron_layout():
        model = _tiny_model(flat_gpt_layer_spec)
        tokens = torch.randint(0, TinyMoE().vocab_size, (2, 16),
                               generator=torch.Generator().manual_seed(0))
        positions = torch.arange(16).expand(2, 16)
        loss = model(tokens, positions, None, labels=tokens)
    layers = _moe_layers(model)
    assert all(type(m) is FlatMoELayer for m in layers)
    assert all(m.flat is installed and m.flat_dispatch is not None for m in layers)
    assert [(n, p.shape) for n, p in model.named_parameters()] == \
        [(n, p.shape) for n, p in stock.named_parameters()]
    assert loss.shape == (2, 16) and torch.isfinite(loss).all()
