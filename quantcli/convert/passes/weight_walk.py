"""Running a weight pass (kinds.WeightPass) on the layer walk (model/layers.py), layer by layer.

Per decoder layer, on every rank over its share of the calibration batches:
1. observe: each module the pass rounds records its input rows per batch (model/inputs.py, the
   observer calibration uses); the ranks ship them batch by batch to the lead, which sums the
   pass's statistic of groups of rows taken in global batch order (ordered_sum.py), so it holds
   the one-process bits;
2. the lead hands each module's weight and statistic to the pass, and stages what the layout
   writes for the result: one file per layer, written atomically (convert/staged.py);
3. every rank loads the layer's weights decoded from that file (as an engine decodes them) and
   runs its batches again: the quantized layer's outputs are the next layer's inputs.

--resume: the staged files are the record of finished layers. A finished layer is replayed, not
redone: loaded from its file and run once, which rebuilds the activations the next layer needs
with no statistic and no rounding. Storing the activations instead would write the whole buffer
per layer, and only for the split of batches over ranks that wrote it; a replay costs one forward
per finished layer and works for any number of ranks. The fresh run decodes the layer from the
very file a replay reads, so both feed the next layer the same bits.
"""

from __future__ import annotations

from dataclasses import asdict, replace

import torch

from quantcli.checkpoint.safetensors_io import OutSpec, dtype_name
from quantcli.convert.passes.kinds import ModuleWork, Rounded, WeightPass
from quantcli.convert.passes.ordered_sum import OrderedSum
from quantcli.convert.passes.side_by_side import side_by_side, solve_bytes, solve_cost
from quantcli.convert.reading import ModuleReader
from quantcli.convert.shard import compute_threads, learned_of
from quantcli.convert.staged import StagedWeights, check_product
from quantcli.convert.world import World
from quantcli.errors import QuantcliError
from quantcli.formats.decode import decode_module
from quantcli.formats.facts import NO_FACTS, ModuleFacts
from quantcli.model.inputs import input_hooks
from quantcli.model.layers import LayerPass, Observed, batches, layer_sources, load_layer
from quantcli.model.samples import token_ids
from quantcli.model.threads import walk_threads

# calibrate/run.py imports convert/passes/kinds.py: walk_source is imported where the pass runs,
# which breaks the import cycle (the only import inside a function here).


def run_weight_pass(wp: WeightPass, reader: ModuleReader, facts: dict[str, ModuleFacts], world: World) -> StagedWeights:
    """Stage `wp`'s products for every decoder layer not already staged (--resume)."""
    plan, cal = reader.plan, reader.plan.options.calibration
    if cal is None:
        raise QuantcliError(f"weight pass {wp.name} needs --calibration DATA: it rounds each layer from the "
                            f"inputs that reach it")
    if reader.stage is None:
        raise RuntimeError("internal: a weight pass stages its products in the staging folder")
    from quantcli.calibrate.run import walk_source

    staged = StagedWeights(reader.stage, wp.name)
    layers = plan.walk.layers
    finished = world.from_lead(lambda: staged.finished(layers))
    staged.resumed = (finished, layers)
    if finished < layers:
        verb = f"rounding ({wp.name})"
        if reader.progress is not None:  # else the bar still says the calibration's last layer
            reader.progress(0, f"{verb}: tokenizing the data")
        ids = token_ids(cal, plan.source.root)
        walk = WeightWalk(wp, reader, facts, world, staged, finished, len(batches(ids, cal.batch)))
        with walk_threads(reader.device, sum(map(len, ids)) / max(1, walk.batches), plan.source.config):
            world.settle(lambda: walk_source(plan, reader.tensors, reader.device, walk, ids, reader.progress,
                                             part=(world.rank, world.size), verb=verb))
    return staged


def expert_key(key: str, expert: int | None) -> str:
    """The statistic's key of one expert of a 3-D stack module (each expert has its own inputs)."""
    return f"{key}|expert {expert}"


class WeightWalk(LayerPass):
    """The LayerPass that runs weight pass `wp` (see the module docstring)."""

    changes_weights = True
    reads_last_outputs = False  # the rounded last layer's outputs feed nothing

    def __init__(self, wp: WeightPass, reader: ModuleReader, facts: dict[str, ModuleFacts], world: World,
                 staged: StagedWeights, finished: int, batches: int):
        self.wp, self.reader, self.facts, self.world, self.staged = wp, reader, facts, world, staged
        self.finished, self.batches = finished, batches
        self.index: dict[str, int] = {}  # layer prefix -> layer index, from the model the walk runs
        plan = reader.plan
        self.rounded = {t.name: t for t in plan.tensors if t.action == "quantize" and wp.takes(plan, t)}
        self.feeds_changed = wp.feeds_quantized(plan)  # sequential: each layer's inputs from those rounded before
        self.matmul_dtype = wp.matmul_dtype(plan)
        # Modules of a fused group (q/k/v, gate/up, w1/w3) read the same input: one statistic each
        # group, recorded once per batch (the same tensor reaches every member's hook).
        self.key = {t.module: t.fused_group or t.module for t in self.rounded.values()}
        self.layer_tensors: list = []
        self.sums: OrderedSum | None = None
        self.statistics: tuple[dict[str, torch.Tensor], dict[str, int]] = ({}, {})
        # the layer's solves, side by side on the CPU: as many as torch's threads before the walk
        # narrowed them (walk_threads); each solve runs on one intra-op thread (compute_threads)
        self.solvers = torch.get_num_threads()

    def begin(self, stack) -> None:
        self.index = {stack.layer_prefix(i): i for i in range(len(stack.layers))}

    def replay(self, prefix: str):
        i = self.index[prefix]
        if i >= self.finished:
            return None
        return self._staged_weights(i) if self.feeds_changed else self.reader.source_tensor

    def observe(self, layer, prefix: str, names) -> list:
        self.layer_tensors = [self.rounded[n] for n in layer_sources(layer, prefix, names) if n in self.rounded]
        modules = {t.module for t in self.layer_tensors}
        stacks = {t.module for t in self.layer_tensors if len(t.logical_shape) == 3}
        sums = self.sums = OrderedSum(self.world, self.batches, keep=self.world.lead, statistic=self.wp.statistic)
        self.seen: dict[str, torch.Tensor] = {}  # this batch: each key's input, recorded once
        # Every key the layer's modules can record. Once a batch has recorded them all, the rest of
        # its observing run is not needed (its outputs are thrown away): stopped there, from the
        # second batch on, the first running whole so that a module called twice is still refused.
        # With the source's weights kept (not feeds_changed) the observing run writes the outputs.
        every = {self.key[m] for m in modules - stacks} | {
            expert_key(self.key[t.module], e) for t in self.layer_tensors if t.module in stacks
            for e in range(t.logical_shape[0])}
        self.first_batch = True

        def record(module: str, x: torch.Tensor, expert: int | None = None) -> None:
            if module not in modules:
                return
            key = expert_key(self.key[module], expert) if module in stacks else self.key[module]
            if self.seen.get(key) is x:  # another member of the fused group, the same input
                return
            if key in self.seen:
                raise RuntimeError(f"internal: the members of fused group {key} read different inputs")
            self.seen[key] = x
            rows = x.detach().reshape(-1, x.shape[-1])
            if rows.shape[0]:
                sums.add(key, rows)
            if self.feeds_changed and not self.first_batch and len(self.seen) == len(every):
                raise Observed

        return input_hooks(layer, prefix, names, record)

    def batch_done(self, j: int) -> None:
        self.seen, self.first_batch = {}, False
        self.sums.end_batch()

    def layer_done(self, layer, prefix: str, names, cache) -> None:
        self.statistics = self.sums.finish()
        self.sums = None

    def update(self, layer, prefix: str, names, rerun: bool) -> None:
        i = self.index[prefix]
        self.world.lead_alone(lambda: self._stage(i))
        self.statistics = ({}, {})
        if rerun:  # the next layer's inputs come from the rounded weights, as decoded from the staged file
            load_layer(layer, prefix, self._staged_weights(i), names, self.reader.device)

    def _stage(self, i: int) -> None:
        """The lead: round every module of layer `i` the pass takes, stage the layer's file."""
        plan, reader = self.reader.plan, self.reader
        tensors, products, learned = {}, {}, {}
        with compute_threads(reader.device):
            results = side_by_side(self.wp.quantize, lambda j: self._work(self.layer_tensors[j]),
                                   [self.key[t.module] for t in self.layer_tensors],
                                   self.solvers if reader.device.type == "cpu" else 1,
                                   [solve_cost(t.logical_shape) for t in self.layer_tensors],
                                   [solve_bytes(t.logical_shape) for t in self.layer_tensors])
            for j, t in enumerate(self.layer_tensors):
                result, results[j] = results[j], None
                recipe, facts = plan.recipes[t.recipe], self.facts.get(t.module, NO_FACTS)
                rounding = result if isinstance(result, Rounded) else None  # how it rounded: record, note
                q = result.q if rounding is not None else result
                if q.recipe != t.recipe or tuple(q.shape) != t.logical_shape:
                    raise RuntimeError(f"internal: weight pass {self.wp.name} returned {q.recipe} {list(q.shape)} "
                                       f"for {t.name}, planned as {t.recipe} {list(t.logical_shape)}")
                out = plan.layout.to_disk(t.module, q.to("cpu"), facts=facts)
                check_product(t, {n: OutSpec(n, dtype_name(v.dtype), tuple(v.shape)) for n, v in out.items()},
                              plan.layout, f"weight pass {self.wp.name}")
                tensors.update(out)
                products[t.name] = sorted(out)
                module_learned = learned_of(recipe, q, facts)
                if rounding is not None:
                    module_learned = replace(module_learned, rounding=rounding.record, note=rounding.note)
                learned[t.module] = asdict(module_learned)
        self.staged.write_layer(i, tensors, products, learned)

    def _work(self, t) -> ModuleWork:
        """Module `t`'s weight and statistic (or, for a 3-D expert stack, each expert's) for the pass."""
        plan, reader = self.reader.plan, self.reader
        sums, rows = self.statistics
        key = self.key[t.module]
        stat = sums.get(key)
        experts = None
        if len(t.logical_shape) == 3:  # a 3-D expert stack: one statistic per expert
            experts = tuple((sums.get(expert_key(key, e)), rows.get(expert_key(key, e), 0))
                            for e in range(t.logical_shape[0]))
            experts = tuple((None if h is None else h.to(reader.device), n) for h, n in experts)
        return ModuleWork(t, plan.recipes[t.recipe], reader.weight(t), None if stat is None else
                          stat.to(reader.device), rows.get(key, 0), self.facts.get(t.module, NO_FACTS),
                          reader.backend, plan.options, experts)

    def _staged_weights(self, i: int):
        """get(name) for loading layer `i`: its staged products decoded, the rest from the source."""
        plan, reader = self.reader.plan, self.reader
        files, products = self.staged.layer_products(i, self.rounded, plan.layout)

        def get(name: str) -> torch.Tensor:
            t = products.get(name)
            if t is None:
                return reader.source_tensor(name)
            recipe = plan.recipes[t.recipe]
            q = plan.layout.from_disk(t.module, recipe, files.tensor, files.header.tensors)
            return decode_module(plan.layout, t.module, recipe, q, transpose=t.transpose, backend=reader.backend,
                                 device=reader.device)

        return get
