"""The command line's one error path: every way a run can end becomes an exit code and at most
one line on stderr. Usage mistakes and bad input exit 2, bugs exit 3, Ctrl-C 130 and SIGTERM 143;
tracebacks only with QUANTCLI_DEBUG=1."""

from __future__ import annotations

import difflib
import errno
import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import typer

from quantcli import __version__
from quantcli.errors import QuantcliError, Terminated
from quantcli.reports import SCHEMA_VERSION

# render (rich, torch) is imported inside the functions that print: a usage error or a Ctrl-C
# while the commands load ends in one line without loading it.

# Set in the environment of the ranks --workers spawns (cli/launch.py): they say nothing when
# interrupted (rank 0 says it once for the job). Here, not in launch.py, so that the Ctrl-C path
# imports nothing (launch.py imports torch).
SPAWNED_RANK = "QUANTCLI_SPAWNED_RANK"

try:  # newer typer carries its own copy of click and raises that copy's exception classes
    from typer._click import exceptions as click_errors
except ImportError:  # older typer raises click's own
    from click import exceptions as click_errors

EXIT_CODES = ("Exit codes: 0 done (verify: passed), 1 verify found a problem, 2 bad input or usage, "
              "3 internal error (a bug: please report it), 130 interrupted (143 on SIGTERM), "
              "141 output closed early (| head).")

# Key in the click context's meta (shared by every nested context): the line printed when the
# run is interrupted or runs out of disk. `convert` sets it, because its staging folder is kept.
INTERRUPT_LINE = "quantcli.interrupt_line"
RESUME_LINE = "interrupted; rerun with --resume to continue"
ARGV = "quantcli.argv"  # key in the context's meta: the arguments main() was given
STARTED = "quantcli.started"  # key in the context's meta: when this process started (time.time())
DESTINATION = "quantcli.destination"  # convert's DST (absolute), for an interrupt after it was installed


COMPLETE_VAR = "_QUANTCLI_COMPLETE"  # set by the shell's completion function (--install-completion)


def run(command, args: list[str], started: float | None = None) -> int:
    """Run the click `command` on `args` -> its exit code, every failure turned into one line.
    `started`: when the program started (time.time()), for convert's summary; default now."""
    if os.environ.get(COMPLETE_VAR):  # the shell asks for completions: click's own path, no command runs
        return complete(command)
    _json_errors[:] = [_json_command(command, args)]
    if _json_errors[0] is not NO_JSON:
        from quantcli.cli.render import start_json

        start_json()
    try:
        return _run(command, args, started)
    finally:
        _json_errors[:] = []


def _run(command, args: list[str], started: float | None) -> int:
    ctx = None
    try:
        ctx = command.make_context("quantcli", args)
        ctx.meta[ARGV] = list(args)  # the command line --workers ranks run again
        ctx.meta[STARTED] = started  # convert's summary counts start-up too
        with ctx:
            result = command.invoke(ctx)
        sys.stdout.flush()  # a closed pipe shows up here, not in interpreter shutdown
        return result if isinstance(result, int) else 0
    except typer.Exit as exc:  # --help, --version and every command's own exit code
        return _flushed(exc.exit_code)
    except click_errors.UsageError as exc:  # unknown option, missing argument, --top abc
        return _fail(_usage_message(exc, args), 2)
    except QuantcliError as exc:
        if _debug():
            raise
        return _fail(str(exc), exc.exit_code)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (errors.Terminated)
        if _installed(ctx):  # what was left (the summary, --json, a push) did not happen: still 130
            push = ctx.params.get("push_to_hub")
            upload = f"; upload it with: quantcli push {ctx.meta[DESTINATION]} {push}" if push else ""
            return _fail(f"interrupted after {ctx.meta[DESTINATION]} was complete and in place (nothing to resume"
                         f"{upload})", getattr(exc, "exit_code", 130), prefix="")
        line = _interrupt_line(ctx)
        if os.environ.get(SPAWNED_RANK):  # a --workers rank: rank 0 says it, once, for the job
            return getattr(exc, "exit_code", 130)
        return _fail(line, getattr(exc, "exit_code", 130), prefix="")
    except BrokenPipeError:  # stdout or stderr piped into `head` that has stopped reading: end quietly
        return _broken_pipe()
    except OSError as exc:  # the file system said no where no check turned it into a QuantcliError
        if _debug():
            raise
        return _fail(_os_error_message(exc, resumable=ctx is not None and INTERRUPT_LINE in ctx.meta), 2)
    except typer.Abort:
        return _fail("aborted", 130, prefix="")
    except Exception as exc:  # a bug: say so in one line, the traceback only on request
        if _debug():
            raise
        return _fail(f"internal error: {type(exc).__name__}: {exc} "
                     "(rerun with QUANTCLI_DEBUG=1 for the traceback and report it)", 3)


def complete(command) -> int:
    """Print the completions the shell asked for through COMPLETE_VAR (typer's `complete_bash`,
    as its installed script sets it, or click's `bash_complete` order) -> exit code."""
    instruction = os.environ[COMPLETE_VAR]
    first, _, second = instruction.partition("_")
    if first in ("bash", "zsh", "fish", "powershell", "pwsh"):  # click's SHELL_INSTRUCTION order
        os.environ[COMPLETE_VAR] = f"{second}_{first}"  # typer reads INSTRUCTION_SHELL
    try:
        command.main([], prog_name="quantcli", complete_var=COMPLETE_VAR)
    except SystemExit as exc:  # click ends completion with sys.exit
        sys.stdout.flush()
        return exc.code if isinstance(exc.code, int) else 0
    except Exception:  # noqa: BLE001 - a completion that fails prints no candidates, never a traceback
        return 1
    return 0


def process_started() -> float:
    """When this process started, as time.time(): from /proc on Linux (the interpreter's and the
    imports' start-up included), else now. For the `quantcli` program only: a caller that embeds
    main() started long before the command did."""
    try:
        with open("/proc/self/stat") as f:  # field 22 (after the parenthesised name): start, in ticks since boot
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def _debug() -> bool:
    return bool(os.environ.get("QUANTCLI_DEBUG"))


def _fail(message: str, code: int, prefix: str = "error: ") -> int:
    line = " ".join(message.split())
    try:
        print(prefix + line, file=sys.stderr, flush=True)
        if _json_errors and _json_errors[0] is not NO_JSON:
            _print_error_document(_json_errors[0], line, code)
    except BrokenPipeError:  # stderr is a closed pipe too: nothing can be said, exit as for a closed pipe
        return _broken_pipe()
    return code


# Under --json a failure also prints its error document on stdout (quantcli/schemas/error.json),
# so that a script reading stdout gets JSON either way. Holds the command's name (None when the
# command itself is missing or unknown) while run() runs, NO_JSON without --json.
NO_JSON = object()
_json_errors: list = []
ERROR_KINDS = {2: "bad input or usage", 3: "internal error", 130: "interrupted", 143: "terminated"}


def _json_command(command, args: list[str]):
    """The command a --json run names (None if none or unknown), or NO_JSON."""
    if "--json" not in args or os.environ.get("RANK", "0") != "0":  # one document per job: rank 0's
        return NO_JSON
    names = getattr(command, "commands", {})
    first = next((a for a in args if not a.startswith("-")), None)
    return first if first in names else None


def _print_error_document(command: str | None, message: str, code: int) -> None:
    from quantcli.cli.render import json_was_written

    if json_was_written():  # the command's own document is out already: one document on stdout
        return
    doc = {"quantcli_version": __version__, "schema_version": SCHEMA_VERSION, "command": command,
           "error": {"exit_code": code, "kind": ERROR_KINDS.get(code, "bad input or usage"), "message": message}}
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    sys.stdout.flush()


def _flushed(code: int) -> int:
    """`code`, once what is buffered for stdout is written (141 if the pipe closed meanwhile)."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        return _broken_pipe()
    return code


def _broken_pipe() -> int:
    """A closed stdout or stderr (`| head -1`): print nothing more and exit 141, as a process
    killed by SIGPIPE would. A convert stopped by it keeps DST.partial for --resume, as Ctrl-C does."""
    _discard_output()
    return 128 + signal.SIGPIPE


def _usage_message(exc: click_errors.UsageError, args: list[str] = ()) -> str:
    command = exc.ctx.command_path if exc.ctx is not None else "quantcli"
    if isinstance(exc, click_errors.NoSuchOption):
        # the one closest option, if any is close (difflib, as click's own suggestion)
        near = difflib.get_close_matches(exc.option_name, sorted(exc.possibilities or []), n=1, cutoff=0.6)
        text = f"no such option {exc.option_name} for '{command}'"
        text += f"; did you mean {near[0]}?" if near else ""
    elif isinstance(exc, click_errors.BadParameter) and exc.param is not None and _PYDANTIC.search(str(exc.message)):
        # typer's type and range checks speak pydantic: one plain line with the value given instead
        opt = exc.param.opts[0] if getattr(exc.param, "opts", None) else exc.param.name
        given = _given(args, getattr(exc.param, "opts", []))
        said = str(exc.message)
        for pydantic, ours in _BOUND_WORDS:
            said = re.sub(pydantic, ours, said)
        text = f"{opt} {given!r}: {said}" if given is not None else f"{opt}: {said}"
    else:
        text = exc.format_message().rstrip(".")
        text = text[:1].lower() + text[1:]
    return f"{text} (see '{command} --help')"


_PYDANTIC = re.compile(r"[Ii]nput should be")
_BOUND_WORDS = ((r"[Ii]nput should be greater than or equal to (\S+)", r"must be at least \1"),
                (r"[Ii]nput should be less than or equal to (\S+)", r"must be at most \1"),
                (r"[Ii]nput should be greater than (\S+)", r"must be more than \1"),
                (r"[Ii]nput should be less than (\S+)", r"must be less than \1"),
                (r"[Ii]nput should be a valid integer.*", "not an integer"),
                (r"[Ii]nput should be a valid number.*", "not a number"),
                (r"[Ii]nput should be a valid boolean.*", "not true or false"))


def _given(args: list[str], opts: list[str]) -> str | None:
    """What the command line gave `opts` (`--top abc` or `--top=abc`), the last time, or None."""
    value = None
    for i, arg in enumerate(args):
        for opt in opts:
            if arg == opt and i + 1 < len(args):
                value = args[i + 1]
            elif arg.startswith(opt + "="):
                value = arg[len(opt) + 1:]
    return value


# errno -> what to add to the OS's own text, where that text leaves the cause unclear.
_ERRNO_HINTS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "over the file-size limit, see ulimit -f",
}


def _os_error_message(exc: OSError, resumable: bool) -> str:
    text = str(exc.strerror or exc)
    if exc.filename is not None:  # None where the OS call had only a file descriptor
        where = exc.filename if exc.filename2 is None else f"{exc.filename} -> {exc.filename2}"
        text = f"{where}: {text}"
    if exc.errno in _ERRNO_HINTS:
        text += f" ({_ERRNO_HINTS[exc.errno]})"
        if resumable:
            text += "; once fixed, rerun with --resume to continue"
    return text


def _discard_output() -> None:
    """Point stdout and stderr at /dev/null so that nothing more is written into a closed pipe
    and the interpreter's final flush does not fail a second time."""
    for stream in (sys.stdout, sys.stderr):
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # replaced by a test harness: nothing to do
            pass


def _resumable(ctx) -> bool:
    """Whether --resume would continue this run: a convert (not --dry-run) whose DST.partial
    exists. A Ctrl-C before the staging folder was made (while the source is read, or the
    --workers ranks start) leaves nothing to resume."""
    if ctx is None or INTERRUPT_LINE not in ctx.meta:
        return False
    dst = ctx.meta.get(DESTINATION)
    return dst is None or os.path.isdir(f"{dst}.partial")  # as convert/destination.staging_dir names it


def _interrupt_line(ctx) -> str:
    """The line a Ctrl-C prints: convert's (promising --resume) only when there is something to resume."""
    return ctx.meta[INTERRUPT_LINE] if _resumable(ctx) else "interrupted"


def _installed(ctx) -> bool:
    """Whether this command was a convert whose DST this process already put in place."""
    if ctx is None or DESTINATION not in ctx.meta:
        return False
    # Imports nothing: a Ctrl-C can land while torch is half imported, and importing it again
    # here would raise from the half-built module instead of printing one line.
    destination = sys.modules.get("quantcli.convert.destination")
    return destination is not None and ctx.meta[DESTINATION] in destination.INSTALLED


@contextmanager
def sigterm_raises_terminated() -> Iterator[None]:
    """SIGTERM raises errors.Terminated (a KeyboardInterrupt) so that it runs the Ctrl-C path."""
    def raise_terminated(signum, frame):
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, raise_terminated)
    except ValueError:  # not the main thread (an embedding caller): leave signals alone
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)

