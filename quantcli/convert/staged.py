"""A weight pass's products in the staging folder: one safetensors file per finished decoder layer,
`STAGE/.quantcli-weights/layer-00007.safetensors`, holding the tensors the layout writes for each
module the pass rounded in that layer (codes, scales, calibrated input scales: what the shard job
would have written for it), and in its metadata the pass's name, which planned tensor each
output belongs to, and what rounding it learned for the manifest.

A layer's file is written whole or not at all (temporary, fsync, rename), so its presence is the
record that the layer is finished: --resume continues after the last one. The shard job writes a
staged product byte for byte instead of quantizing, after checking it against the plan. The
folder is removed by finalize and never reaches DST.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Mapping

import torch

from quantcli.atomic import atomic_file
from quantcli.checkpoint.safetensors_io import OutSpec, ShardWriter, TensorReader, dtype_name, read_header, tensor_bytes
from quantcli.errors import CheckpointError
from quantcli.formats.layouts import Layout
from quantcli.planning.plan import TensorPlan

WEIGHTS_DIR = ".quantcli-weights"


def layer_path(stage: Path, layer: int) -> Path:
    return stage / WEIGHTS_DIR / f"layer-{layer:05d}.safetensors"


def staged_by(stage: Path) -> str | None:
    """The weight pass whose products the staging folder holds (None: none)."""
    files = sorted((stage / WEIGHTS_DIR).glob("layer-*.safetensors"))
    return _pass_of(read_header(files[0]).metadata, files[0]) if files else None


def discard_weights(stage: Path) -> None:
    """Finalize: the products are in the shards now."""
    if (stage / WEIGHTS_DIR).exists():
        shutil.rmtree(stage / WEIGHTS_DIR)


class StagedWeights:
    """The products of weight pass `pass_name` in `stage`."""

    def __init__(self, stage: Path, pass_name: str):
        self.stage = stage
        self.pass_name = pass_name
        self.resumed = (0, 0)  # (layers an interrupted run had staged, layers): --resume replays those
        self._index: dict[str, tuple[TensorReader, list[str], dict]] | None = None

    def write_layer(self, layer: int, tensors: Mapping[str, torch.Tensor], products: Mapping[str, list[str]],
                    learned: Mapping[str, dict]) -> None:
        """Layer `layer`'s products: `tensors` by output name, `products` {planned tensor: its
        output names}, `learned` {module: Learned fields}. Atomic: a kill leaves no layer file."""
        path = layer_path(self.stage, layer)
        path.parent.mkdir(exist_ok=True)
        meta = {"pass": self.pass_name, "products": json.dumps(dict(products), sort_keys=True),
                "learned": json.dumps(dict(learned), sort_keys=True)}
        specs = [OutSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
        with atomic_file(path) as f:
            writer = ShardWriter(f, specs, meta)
            for spec in writer.order:
                writer.write(spec.name, tensor_bytes(tensors[spec.name]))
            writer.finish()

    def finished(self, layers: int) -> int:
        """How many layers, from the first, an earlier run of this pass finished."""
        done = 0
        while done < layers and layer_path(self.stage, done).is_file():
            self.read_layer(done)  # a file of another pass, or unreadable, is refused here
            done += 1
        return done

    def read_layer(self, layer: int) -> tuple[TensorReader, dict[str, list[str]], dict[str, dict]]:
        """The layer's file (its tensors, by output name), {planned tensor: output names} and
        {module: Learned fields}."""
        path = layer_path(self.stage, layer)
        header = read_header(path)
        if _pass_of(header.metadata, path) != self.pass_name:
            raise CheckpointError(f"{path}: holds the products of weight pass {_pass_of(header.metadata, path)!r}, "
                                  f"not {self.pass_name!r}; rerun with --overwrite to start over")
        try:
            products, learned = json.loads(header.metadata["products"]), json.loads(header.metadata["learned"])
        except (KeyError, ValueError):
            raise CheckpointError(f"{path}: its metadata is not quantcli's record of a finished layer; rerun with "
                                  f"--overwrite to start over") from None
        return TensorReader(header), products, learned

    def layer_products(self, layer: int, taken: Mapping[str, TensorPlan],
                       layout: Layout) -> tuple[TensorReader, dict[str, TensorPlan]]:
        """Layer `layer`'s file and {planned tensor: its plan} for each product in it, every one
        checked against `taken` (what this run's pass rounds) and the plan's outputs."""
        reader, products, _ = self.read_layer(layer)
        out = {}
        for name, outputs in sorted(products.items()):
            if name not in taken:
                raise CheckpointError(f"{reader.header.path}: holds a product of {name}, which this run's weight pass "
                                      f"does not round; rerun with --overwrite to start over")
            out[name] = taken[name]
            check_product(taken[name], {n: _spec(reader, n) for n in outputs}, layout, reader.header.path)
        return reader, out

    def product(self, t: TensorPlan, layout: Layout) -> tuple[dict[str, memoryview], dict] | None:
        """The staged outputs of planned tensor `t` (exact bytes) and the Learned fields of its
        module, checked against the plan; None when no layer staged `t`."""
        if self._index is None:
            self._index = {}
            for path in sorted((self.stage / WEIGHTS_DIR).glob("layer-*.safetensors")):
                reader, products, learned = self.read_layer(int(path.stem.removeprefix("layer-")))
                for name, outputs in products.items():
                    self._index[name] = (reader, outputs, learned)
        if t.name not in self._index:
            return None
        reader, outputs, learned = self._index[t.name]
        check_product(t, {n: _spec(reader, n) for n in outputs}, layout, reader.header.path)
        return {n: reader.raw(n) for n in outputs}, learned.get(t.module, {})


    def close(self) -> None:
        """After the shard job: this process's maps of the layer files go, before finalize removes
        them (a file still open elsewhere would leave the folder non-empty on NFS)."""
        for reader, _, _ in (self._index or {}).values():
            reader.close()
        self._index = None


def check_product(t: TensorPlan, made: Mapping[str, OutSpec], layout: Layout, where: str) -> None:
    """The outputs a weight pass made for `t` must be the plan's, name for name, dtype and shape
    (all but the KV-cache scales, which the shard job adds from the facts); else refused, loudly."""
    kv = set(layout.kv_names(t.module).values()) if t.module else set()
    planned = {o.name: o for o in t.outputs if o.name not in kv}
    problems = [f"{n} is not in the plan" for n in sorted(set(made) - set(planned))]
    problems += [f"{n} is missing" for n in sorted(set(planned) - set(made))]
    problems += [f"{n} is {made[n].dtype} {list(made[n].shape)}, the plan says {o.dtype} {list(o.shape)}"
                 for n, o in sorted(planned.items()) if n in made and (made[n].dtype, tuple(made[n].shape))
                 != (o.dtype, tuple(o.shape))]
    if problems:
        raise CheckpointError(f"{where}: the weight pass's product for {t.name} does not match the plan: "
                              f"{'; '.join(problems)}")


def _spec(reader: TensorReader, name: str) -> OutSpec:
    info = reader.header.tensors.get(name)
    if info is None:
        raise CheckpointError(f"{reader.header.path}: its record names {name}, which the file does not hold; rerun "
                              f"with --overwrite to start over")
    return OutSpec(name, info.dtype, tuple(info.shape))


def _pass_of(metadata: Mapping[str, str] | None, path: Path) -> str:
    name = (metadata or {}).get("pass")
    if not name:
        raise CheckpointError(f"{path}: not a staged layer of a weight pass (no pass recorded); rerun with "
                              f"--overwrite to start over")
    return name
