"""One error family. Every message names the file, tensor or option, the value, the
constraint and the fix; `main()` prints it on one line (QUANTCLI_DEBUG=1 shows the traceback)."""


class QuantcliError(Exception):
    """A user-facing error: exit code 2 (bad input or usage)."""

    exit_code = 2


class RecipeError(QuantcliError):
    """A tensor that the recipe cannot take (shape, dtype, values)."""


class LayoutError(QuantcliError):
    """A (recipe, layout) pair or on-disk form that a layout cannot write or read."""


class CheckpointError(QuantcliError):
    """A source or destination checkpoint that cannot be used as given."""


class ManifestError(QuantcliError):
    """A manifest that is malformed or disagrees with the files it describes."""
