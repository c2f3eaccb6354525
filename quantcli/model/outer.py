"""The model's modules outside its stack of layers (embeddings, rotary, the final norm, the head,
whatever an architecture puts there), loaded only when the model's own forward calls them.

A forward pre-hook on each such module gives it its own parameters from the checkpoint (through
the CheckpointMap, FP32) the first time it runs; `release` sends them back to the meta device.
So capturing layer 0's inputs loads the embedding and what runs before layer 0, and the tail
run loads the final norm and the head, with no list of names per architecture: a vision tower
a text-only forward never calls is never read."""

from __future__ import annotations

import torch

from quantcli.errors import QuantcliError
from quantcli.model.names import CheckpointMap, Get


def to_meta(module: torch.nn.Module) -> None:
    """`module`'s parameters and persistent buffers back on the meta device (memory freed); its
    non-persistent buffers (computed, not read from the checkpoint) stay as they are."""
    for mod in module.modules():
        _own_to_meta(mod)


def _own_to_meta(mod: torch.nn.Module) -> None:
    for name, p in list(mod._parameters.items()):
        if p is not None and p.device.type != "meta":
            mod._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=False)
    for name, b in list(mod._buffers.items()):
        if b is not None and name not in mod._non_persistent_buffers_set and b.device.type != "meta":
            mod._buffers[name] = b.to("meta")


def load_own(module: torch.nn.Module, path: str, names: CheckpointMap, get: Get, device: torch.device) -> list[str]:
    """Give `module` (at model path `path`) its own parameters and persistent buffers (not its
    children's) built from the checkpoint, FP32 on `device`; returns the checkpoint tensors read."""
    read: list[str] = []
    own = [*module._parameters.items(),
           *((n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set)]
    for name, t in own:
        if t is None or t.device.type != "meta":
            continue
        full = f"{path}.{name}" if path else name
        value = names.tensor(full, get)
        if tuple(value.shape) != tuple(t.shape):
            raise QuantcliError(f"{full}: the checkpoint's tensor has shape {list(value.shape)}, but config.json "
                                f"makes it {list(t.shape)}; the checkpoint does not match its architecture")
        value = value.to(device, torch.float32 if t.is_floating_point() else t.dtype)
        if name in module._parameters:
            module._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
        else:
            module._buffers[name] = value
        read += names.sources(full)
    return read


def load_module(module: torch.nn.Module, prefix: str, names: CheckpointMap, get: Get,
                device: torch.device) -> dict[str, torch.Tensor]:
    """Give the (meta) `module` at model path prefix `prefix` (ending in '.') its parameters and
    persistent buffers, built from checkpoint tensors `get(name)`, in FP32 (integer buffers keep
    their dtype); returns them by their name in it."""
    state = {}
    for n, meta in module.state_dict().items():
        t = names.tensor(prefix + n, get)
        if tuple(t.shape) != tuple(meta.shape):
            raise QuantcliError(f"{prefix}{n}: the checkpoint makes it {list(t.shape)}, but its config.json makes it "
                                f"{list(meta.shape)}; the checkpoint does not match its architecture")
        state[n] = t.to(device, torch.float32 if meta.is_floating_point() else meta.dtype)
    module.load_state_dict(state, assign=True)
    return state


class OuterWeights:
    """Pre-hooks that load each module outside `inside` (the layers) on its first call. `read`:
    the checkpoint tensors loaded so far; `release()` empties them again and removes the hooks."""

    def __init__(self, model: torch.nn.Module, inside: torch.nn.Module, names: CheckpointMap, get: Get,
                 device: torch.device):
        self.read: list[str] = []
        self.loaded: list[torch.nn.Module] = []
        skip = {id(m) for m in inside.modules()}
        self.hooks = [mod.register_forward_pre_hook(self._loader(path, names, get, device))
                      for path, mod in model.named_modules() if id(mod) not in skip]

    def _loader(self, path: str, names: CheckpointMap, get: Get, device: torch.device):
        def hook(module, args):
            found = load_own(module, path, names, get, device)
            if found:
                self.read += found
                self.loaded.append(module)
        return hook

    def release(self) -> None:
        for h in self.hooks:
            h.remove()
        for module in self.loaded:
            _own_to_meta(module)
        self.hooks, self.loaded = [], []

    def __enter__(self) -> OuterWeights:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
