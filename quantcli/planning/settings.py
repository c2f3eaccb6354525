"""Options declared once. A `Setting` is one option of a family (today GPTQ's `--gptq-*`): its
name, what it accepts, its help. Everything else is derived from it: the command-line flag and
its help with the default (cli/declared_options.py puts it on `quantcli convert`), the recipe-file
key and its check (planning/options_file.py), the value's check and the error naming where the
user gave it (planning/rounding.py), the manifest record and its read-back (planning/rounding.py,
planning/from_manifest.py). The default is the field's default in the dataclass that holds the
value (GptqSettings or Rounding), so it is written once, where the algorithm reads it; the
fingerprint is that dataclass's repr, so a new field enters it by itself.

Adding a GPTQ option: a field with its default on GptqSettings (rounding/gptq.py), a Setting in
planning/rounding.py's GPTQ_SETTINGS, and the code that reads the field."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields

from quantcli.errors import QuantcliError, pick


@dataclass(frozen=True)
class Setting:
    key: str  # the field it sets, the manifest's key, and (after the family's prefix) flag and file key
    owner: type  # the dataclass whose field holds the value and its default
    metavar: str
    help: str  # --help, without the default (added from the field)
    kind: type = str  # str (one of `choices`), int or float
    choices: tuple[str, ...] = ()
    valid: Callable[[object], bool] | None = None  # numbers: whether a value is allowed
    expected: str = ""  # what `valid` allows, for the message: "a positive integer"
    noun: str = ""  # what a value is, for messages: "GPTQ column order" (default: the key in words)
    prefix: str = "gptq"
    # a manifest written before the setting existed holds no value: it ran with the default
    absent_means_default: bool = False

    @property
    def flag(self) -> str:
        return f"--{self.prefix}-{self.key.replace('_', '-')}"

    @property
    def file_key(self) -> str:
        """The recipe file's key (and the command's parameter name): gptq_dampening."""
        return f"{self.prefix}_{self.key}"

    @property
    def default(self) -> object:
        found = next(f for f in fields(self.owner) if f.name == self.key)
        return found.default if found.default is not MISSING else found.default_factory()  # type: ignore[misc]

    def checked(self, value: object, where: str) -> object:
        """`value` as the field holds it, or a one-line error naming `where` the user gave it."""
        if self.choices:
            if not isinstance(value, str):
                raise QuantcliError(f"{where}: expected a string, one of {', '.join(self.choices)}, got {value!r}")
            return pick(where, self.noun or self.key.replace("_", " "), value, list(self.choices))
        number = not isinstance(value, bool) and isinstance(value, (int, float) if self.kind is float else int)
        if not number or (self.valid is not None and not self.valid(value)):
            raise QuantcliError(f"{where}: must be {self.expected}, got {value!r}")
        return self.kind(value)

    def read_back(self, record: dict) -> object:
        """The value a manifest's record holds (KeyError, TypeError or ValueError if it cannot)."""
        value = record.get(self.key, self.default) if self.absent_means_default else record[self.key]
        if isinstance(value, bool) or (self.choices and value not in self.choices):
            raise ValueError(f"{self.key} {value!r}")
        return self.kind(value)
