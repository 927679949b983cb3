"""ModuleTensors lists what named_parameters()/named_buffers() would, without walking the module
again until something may have changed it."""

import torch
from torch import nn

from dynamix_byteps.torch.module_tensors import ModuleTensors


def _model() -> nn.Module:
    shared = nn.Linear(4, 4)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), shared, nn.Sequential(shared, nn.ReLU()), nn.Linear(4, 2))


def _named(pairs):
    return [(name, id(t)) for name, t in pairs]


def _expected(module: nn.Module, kind: str) -> list:
    """What ``module.named_parameters()`` (``kind`` "parameters") or ``named_buffers()`` lists, by a
    walk that :func:`_walks` does not count."""
    counted = module.__dict__.pop("named_modules", None)
    try:
        return _named(getattr(module, f"named_{kind}")())
    finally:
        if counted is not None:
            module.named_modules = counted


def _walks(module: nn.Module) -> list:
    """Counts the walks of ``module`` (calls of its ``named_modules``)."""
    calls = []
    walk = module.named_modules
    module.named_modules = lambda *args, **kwargs: calls.append(1) or walk(*args, **kwargs)
    return calls


def test_it_lists_what_named_parameters_and_named_buffers_list():
    model = _model()
    tensors = ModuleTensors(model)
    assert _named(tensors.parameters()) == _named(model.named_parameters())
    assert _named(tensors.buffers()) == _named(model.named_buffers())


def test_it_walks_again_only_after_a_registration_or_a_replaced_tensor():
    model = _model()
    tensors = ModuleTensors(model)
    tensors.parameters()
    walks = _walks(model)
    tensors.parameters(), tensors.buffers(), tensors.parameters()
    assert walks == []

    model.append(nn.Linear(2, 2))  # a submodule registered after the first walk
    assert _named(tensors.parameters()) == _expected(model, "parameters")
    model[0].bias = nn.Parameter(torch.zeros(4))  # a parameter registered in place of another
    assert _named(tensors.parameters()) == _expected(model, "parameters")
    model.register_buffer("scale", torch.ones(1))
    assert _named(tensors.buffers()) == _expected(model, "buffers")
    assert len(walks) == 3


def test_buffers_replaced_by_a_conversion_are_listed_anew():
    model = _model()
    tensors = ModuleTensors(model)
    tensors.buffers()
    model.double()  # Module._apply replaces the float buffers without a registration
    listed = dict(tensors.buffers())
    assert all(listed[name] is buffer for name, buffer in model.named_buffers())
    assert listed["1.running_mean"].dtype == torch.float64


def test_a_submodule_swapped_in_its_parents_dict_is_listed_anew():
    model = _model()
    spare = nn.Linear(4, 2)  # built before the walk: its registrations do not come after it
    tensors = ModuleTensors(model)
    tensors.parameters()
    # What torch.ao.quantization's convert and NamedMemberAccessor.swap_submodule do: no registration hook runs
    model._modules["4"] = spare
    assert _named(tensors.parameters()) == _expected(model, "parameters")
    del model[2]  # a removed submodule's tensors are no longer listed
    assert _named(tensors.parameters()) == _expected(model, "parameters")
