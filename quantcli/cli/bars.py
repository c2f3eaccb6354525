"""Progress on stderr for the long jobs (the face; only commands.py uses it). Byte counts and
rates are binary units (KiB, MiB, GiB) everywhere, as human_bytes prints them, so the bar's rate
and the summary's rate are the same number.

- ConvertBar: the `convert` callback (bytes done, shard) as a bar that names shard i/N and the
  tensor being converted; before the shards, a phase (calibration, GPTQ's rounding) names itself
  and the bar fills by its layers; with `verbose`, one stderr line per tensor written (also
  without a terminal). The bar is transient: the command's one-line summary replaces it.
- counting_bar: a bar over N items (inspect --stats reads one module at a time).
- PhaseBar: modules done / total of a job in phases (verify: reading, then comparing), naming
  the module in hand; before the first report it pulses with the elapsed time.
"""

from __future__ import annotations

import re
from contextlib import nullcontext

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from quantcli.cli.render import human_bytes


class _BytesColumn(ProgressColumn):
    def render(self, task) -> Text:
        if task.fields.get("layers"):  # a phase before the shards: no byte is written yet, layers are
            return Text(task.fields["layers"])
        return Text(f"{human_bytes(task.completed)} / {human_bytes(task.total or 0)}")


class _RateColumn(ProgressColumn):
    def render(self, task) -> Text:
        if task.fields.get("layers"):  # the bar's fill is layers then, not bytes: no byte rate to show
            return Text("-")
        return Text("-" if task.speed is None else f"{human_bytes(task.speed)}/s")


# `calibrating: layer 3/32, ...`, `rounding (gptq): layer 0/32, ...` (calibrate/run.py's _LayerProgress
# and the walk's first report): how far a phase before the shards has come
_PHASE_LAYER = re.compile(r": layer (\d+)/(\d+)\b")


def elide(name: str, room: int) -> str:
    """`name` in `room` characters (at least 12), keeping what tells tensors apart: the layer
    index and the leaf (`model.layers.12.…o_proj`, `12.…o_proj`), the middle left out; a
    trailing `.weight` goes first. A name with no index keeps its start and its end."""
    room = max(12, room)
    if len(name) <= room:
        return name
    core = name[: -len(".weight")] if name.endswith(".weight") else name
    if len(core) <= room:
        return core
    m = re.search(r"[^.]+\.\d+\.", core)  # `layers.12.`: where the layer index is
    if m:
        rest = core[m.end():]
        heads = (core[: m.end()], m.group(0), m.group(0).split(".")[1] + ".")  # shorter and shorter
        # a leaf, then an expert's index in it, then a head with its word (`layers.`), then the
        # longest leaf, then the longest head
        *_, head, tail = max((bool(t), sum(p.isdigit() for p in t.split(".")), not h[0].isdigit(), len(t), len(h),
                              h, t) for h in heads for t in [_whole_parts(rest, room - len(h) - 1)])
        if tail == rest:  # only the start was left out
            return "…" + head + rest
        if tail:
            return head + "…" + tail
    half = (room - 1) // 2
    return core[:half] + "…" + core[-(room - 1 - half):]


def _whole_parts(rest: str, room: int) -> str:
    """The longest run of whole dot-separated parts that ends `rest` and fits in `room`."""
    out = ""
    for part in reversed(rest.split(".")):
        longer = f"{part}.{out}" if out else part
        if len(longer) > room:
            break
        out = longer
    return out


def shard_order(plan) -> dict[str, list]:
    """Per shard, its tensors in the order convert writes them: the writer goes through output
    names sorted (safetensors_io.build_header), producing a tensor at its first output."""
    out = {}
    for shard, planned in plan.by_shard().items():
        first = {t.name: min((o.name for o in t.outputs), default=t.name) for t in planned}
        out[shard] = sorted(planned, key=lambda t: first[t.name])
    return out


class _Shown:
    """A context around `self.progress`, a rich Progress or None when nothing is shown."""

    progress: Progress | None = None

    def __enter__(self):
        if self.progress is not None:
            self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)


class ConvertBar(_Shown):
    """The progress callback of a conversion: `bar(n, shard)` after each tensor (or once for a
    whole shard that --resume reused)."""

    def __init__(self, plan, stderr: Console, show_bar: bool, verbose: bool):
        self.order = shard_order(plan)
        self.shards = list(self.order)
        self.stderr, self.verbose = stderr, verbose
        self.shard, self.left = None, []
        # on a narrow terminal a short bar leaves the tensor's name room; the columns after the
        # name take the bar plus 48 characters ("110.03 MiB / 110.03 MiB", "16.52 MiB/s", "0:00:01")
        self.bar_width = 8 if stderr.width < 100 else 20
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(bar_width=self.bar_width), _BytesColumn(),
                                 _RateColumn(),
                                 TimeRemainingColumn(), console=stderr, transient=True) if show_bar else None
        first = next((ts[0].name for ts in self.order.values() if ts), "")
        start = self._describe(f"shard 1/{len(self.shards)}", first)
        # the bar's fill counts a phase's layers (calibration, GPTQ), not bytes: the data is read and
        # run before any shard
        self.in_phase = plan.options.calibration is not None
        if self.in_phase:
            start = "calibrating: reading the data"
        self.total = plan.bytes_in
        self.task = self.progress.add_task(start, total=self.total, layers="-" if self.in_phase else "") \
            if show_bar else None

    def __call__(self, n: int, shard: str) -> None:
        if not n and shard not in self.order:  # a phase before the shards (calibration) names itself
            if self.progress is not None:
                self._show_phase(shard)
            elif self.verbose:
                self.stderr.print(shard)
            return
        if shard != self.shard:
            self.shard, self.left = shard, list(self.order.get(shard, []))
        where = f"shard {self.shards.index(shard) + 1}/{len(self.shards)}" if shard in self.order else shard
        if self.left and n == sum(t.bytes_in for t in self.left) and len(self.left) > 1:
            self.left = []  # a shard --resume reused: reported whole
            if self.verbose:
                self.stderr.print(f"{where}: {shard} resumed (already written)")
        elif self.left:
            t = self.left.pop(0)
            if self.verbose:
                self.stderr.print(f"{where}: {t.name} {t.recipe or t.action} "
                                  f"{human_bytes(t.bytes_in)} -> {human_bytes(t.bytes_out)}")
        if self.progress is not None:
            current = self.left[0].name if self.left else "done"
            description = self._describe(where, current)
            if self.in_phase:  # the shards begin: the bar counts bytes from here, its rate and time anew
                self.in_phase = False
                self.progress.reset(self.task, total=self.total, completed=n, description=description, layers="")
            else:
                self.progress.update(self.task, advance=n, description=description)

    def _show_phase(self, text: str) -> None:
        """The phase's label; where it names its layer (`layer 3/32`), the bar fills by layers and the
        bytes column says so: a rounding phase takes most of a GPTQ run, and 0 B read as stuck."""
        m = _PHASE_LAYER.search(text)
        done, total = (int(m.group(1)), int(m.group(2))) if m and int(m.group(2)) > 0 else (0, 1)
        self.in_phase = True  # a phase without a layer count (tokenizing) starts its bar empty: "-"
        fields = dict(description=self._phase(text), completed=self.total * done / total,
                      layers=f"layer {done}/{total}" if m else "-")
        if done == 0:  # a phase starts (GPTQ's after calibration's): its time left from its own pace
            self.progress.reset(self.task, total=self.total, **fields)
        else:
            self.progress.update(self.task, **fields)

    def _phase(self, text: str) -> str:
        """A phase's line on one row: cut after its last `, ` part that fits beside the bar and
        the byte, rate and time columns (28 characters with nothing written yet)."""
        room = max(24, self.stderr.width - self.bar_width - 30)
        while len(text) > room and ", " in text:
            text = text.rsplit(", ", 1)[0]
        return text if len(text) <= room else text[:room - 1] + "…"

    def _describe(self, where: str, current: str) -> str:
        return f"{where} {elide(current, self.stderr.width - len(where) - 1 - self.bar_width - 48)}"


def counting_bar(stderr: Console, show: bool, what: str):
    """(context, advance(name, total)) for a job over items it counts as it goes; both do nothing
    when not `show`."""
    if not show:
        return nullcontext(), lambda name, total: None
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                        console=stderr, transient=True)
    task = progress.add_task(what, total=None)
    return progress, lambda name, total: progress.update(task, advance=1, total=total, description=f"{what} {name}")


class PhaseBar(_Shown):
    """A quantcli.verify progress callback, `bar(phase, done, total, current)`, drawn as a bar on
    stderr: `comparing ━━━━━━  12/64 0:00:41 model.layers.3.self_attn.q_proj`; does nothing when
    not `show`."""

    def __init__(self, stderr: Console, show: bool, what: str):
        self.stderr = stderr
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[current]}"),
                                 console=stderr, transient=True) if show else None
        self.task = self.progress.add_task(what, total=None, current="") if show else None

    def __call__(self, phase: str, done: int, total: int, current: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, description=phase, completed=done, total=total,
                                 current=self._tail(current))

    def _tail(self, name: str) -> str:
        return elide(name, self.stderr.width - 50)  # what the other columns leave


__all__ = ["ConvertBar", "PhaseBar", "counting_bar", "shard_order"]
