"""A module's named parameters and buffers, walked again only when something may have changed them.

``Module.named_parameters()`` walks every submodule (about a microsecond each), and the DDP wrapper
needs the parameters and buffers several times per step, so a model of a few hundred modules spent
milliseconds per step walking. :class:`ModuleTensors` keeps the result of a walk and walks again
when it may be stale:

* a parameter, buffer or submodule was registered on any module of the process since (torch's
  global registration hooks, which ``__setattr__``, ``register_parameter``, ``register_buffer``
  and ``add_module`` run), or
* a tensor or submodule it walked is no longer in its parent's dictionary, checked at every call:
  ``Module._apply`` (behind ``.to()`` and ``.half()``) replaces buffers there without a
  registration, ``del model.fc`` removes a submodule, and ``torch.ao.quantization``'s convert or
  ``NamedMemberAccessor.swap_submodule`` put another (possibly built before the walk) in its place.

A new name written straight into a module's ``_parameters``, ``_buffers`` or ``_modules``
dictionary, bypassing ``register_*``/``add_module``, is not seen until the next registration.
"""

from __future__ import annotations

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

# Registrations of a parameter, buffer or submodule on any module of this process since the first
# ModuleTensors: process-wide, as the hooks that count them.
_registrations = 0
_watching = False


def _count_registration(*_) -> None:
    global _registrations
    _registrations += 1


def _watch_registrations() -> None:
    global _watching
    if not _watching:
        _watching = True
        for register in (register_module_parameter_registration_hook, register_module_buffer_registration_hook,
                         register_module_module_registration_hook):
            register(_count_registration)


class ModuleTensors:
    """The parameters and buffers of ``module``, in ``named_parameters()``/``named_buffers()``
    order and naming (shared tensors once, as there).

    Args:
        module: the ``torch.nn.Module`` to list.
    """

    def __init__(self, module: torch.nn.Module):
        _watch_registrations()
        self._module = module
        self._walked_at = -1
        self._parameters: list[tuple[str, torch.Tensor]] = []
        self._buffers: list[tuple[str, torch.Tensor]] = []
        # (parent's _parameters, _buffers or _modules, key, what the walk found there)
        self._places: list[tuple[dict, str, torch.Tensor | torch.nn.Module]] = []

    def parameters(self) -> list[tuple[str, torch.Tensor]]:
        """``list(module.named_parameters())``, walked again only when it may have changed."""
        self._refresh()
        return self._parameters

    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        """``list(module.named_buffers())``, walked again only when it may have changed."""
        self._refresh()
        return self._buffers

    def _refresh(self) -> None:
        if self._walked_at == _registrations and all(place.get(key) is found for place, key, found in self._places):
            return
        self._walked_at = _registrations
        self._parameters, self._buffers, self._places = [], [], []
        seen_parameters, seen_buffers = set(), set()
        for prefix, module in self._module.named_modules():
            self._places += [(module._modules, key, child) for key, child in module._modules.items() if child is not None]
            for place, listed, seen in ((module._parameters, self._parameters, seen_parameters),
                                        (module._buffers, self._buffers, seen_buffers)):
                for key, tensor in place.items():
                    if tensor is None or id(tensor) in seen:
                        continue
                    seen.add(id(tensor))
                    listed.append((f"{prefix}.{key}" if prefix else key, tensor))
                    self._places.append((place, key, tensor))
