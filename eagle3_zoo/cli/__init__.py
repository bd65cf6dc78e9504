"""`eagle3-zoo` command line (also `python -m eagle3_zoo`): subcommands -> API calls, exceptions -> exit codes.

The subcommands live in `train` (fit, prepare, plan, consolidate), `evaluate` (eval) and `hub` (export, check,
publish, pull, zoo); each handler calls the library, prints what it returned and returns an exit code. Library code
raises; `main` below is the only place where an exception becomes a message and an exit code, the same for every
subcommand:

    0    success
    1    a verdict failed (`check` found errors, `plan` does not fit, `eval --strict` was not lossless) or the work
         failed for a reason other than the input (an unreachable network or server, a diverged run, a bug)
    2    bad input: arguments, recipe, data, paths, names, an invalid drafter (the message says what to change)
    130  interrupted (Ctrl-C)
    143  terminated (SIGTERM: a scheduler's preemption; `fit` stops at the end of a step, saying what it kept)

An error is one line on stderr (`error: ...`); `--debug` (before or after the subcommand) or `EAGLE3_ZOO_DEBUG=1`
adds the Python traceback. What a command prints and logs, its error line and traceback included, has the run's
secrets redacted (`eagle3_zoo.util.redaction`). Heavy imports (torch, transformers, Lightning) happen inside the
handlers, after the CPU thread count is chosen (`eagle3_zoo.util.threads`), so `eagle3-zoo --help` is instant.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

DEBUG_ENV = "EAGLE3_ZOO_DEBUG"
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143
# errors a user fixes by changing what they passed (file names, recipe keys, repo ids, arguments)
BAD_INPUT = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, ImportError,
             KeyError)
# huggingface_hub's "no such repo / revision / file": a name the user typed (checked by class name: importing
# huggingface_hub here would slow down every command)
_BAD_INPUT_NAMES = ("RepositoryNotFoundError", "RevisionNotFoundError", "EntryNotFoundError")
LONG_COMMANDS = ("fit", "prepare", "eval")  # they log the CPU thread choice


class UsageError(ValueError):
    """A command line argparse refused (unknown option, missing argument, bad value)."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (a `UsageError` that `main` prints) instead of a usage block and `sys.exit`.

    `intermixed=True` accepts options between positionals (`prepare r.yaml --rank 0 trainer.seed=3`): plain argparse
    gives a `nargs="*"` positional only the words before the first option.
    """

    def __init__(self, *args: Any, intermixed: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.intermixed = intermixed
        self._in_intermixed = False

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (`{self.prog} --help` lists the options)")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        # the subcommand dispatcher calls this method, and on older Pythons the intermixed parse calls it again
        if not self.intermixed or self._in_intermixed:
            return super().parse_known_args(args, namespace)
        self._in_intermixed = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._in_intermixed = False


def _common_options(top: bool) -> argparse.ArgumentParser:
    """`--debug`, `-v` and `--threads`, accepted before the subcommand and after it (where they default to unset,
    so that a value given before is kept)."""
    p = argparse.ArgumentParser(add_help=False)
    unset = {} if top else {"default": argparse.SUPPRESS}
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging", **unset)
    p.add_argument("--debug", action="store_true", help=f"show the Python traceback of an error (also: {DEBUG_ENV}=1)",
                   **unset)
    p.add_argument("--threads", metavar="N|auto", help="CPU threads for torch (default: auto = the usable cores not "
                   "busy with other work; also EAGLE3_ZOO_THREADS)", **({"default": None} if top else unset))
    return p


def build_parser() -> Parser:
    """The `eagle3-zoo` parser with every subcommand (imports no torch)."""
    from eagle3_zoo import __version__
    from eagle3_zoo.cli import evaluate, hub, train

    parser = Parser(prog="eagle3-zoo", description="Train, evaluate and publish EAGLE-3 drafters.",
                    parents=[_common_options(top=True)])
    parser.add_argument("--version", action="version", version=f"eagle3-zoo {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    common = _common_options(top=False)
    train.register(sub, common)
    evaluate.register(sub, common)
    hub.register(sub, common)
    return parser


def _not_printed_by_lightning(record: logging.LogRecord) -> bool:
    """Root-handler filter: Lightning's records are printed by the console handler that `import lightning` attaches
    to its own logger (whenever it is imported, so the CLI cannot remove it up front without importing torch)."""
    return not (record.name.startswith("lightning") and logging.getLogger("lightning").handlers)


def configure_logging(level: int) -> None:
    """One line per log record: ours through the root handler, Lightning's through its own; every record redacted
    (`eagle3_zoo.util.redaction`), whichever handler prints it."""
    from eagle3_zoo.util.redaction import install_log_redaction

    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_not_printed_by_lightning)
    install_log_redaction()


def is_bad_input(error: BaseException) -> bool:
    """Whether `error` is the caller's to fix (exit 2) rather than a failure of the work itself (exit 1)."""
    if isinstance(error, (ConnectionError, TimeoutError)):  # unreachable hosts are OSErrors too, but not bad input
        return False
    return isinstance(error, BAD_INPUT) or any(c.__name__ in _BAD_INPUT_NAMES for c in type(error).__mro__)


def error_line(error: BaseException) -> str:
    """The one line printed for `error`: its message; for a failure that is not bad input, after the exception's
    class (`NonFiniteError: ...`, `HubUnreachableError: ...`), which names what went wrong to search for."""
    from eagle3_zoo.util.redaction import redact

    message = error.args[0] if isinstance(error, KeyError) and error.args else error
    text = redact(" ".join(str(message).split())) or type(error).__name__  # one line, whatever the message holds
    return f"error: {text}" if is_bad_input(error) else f"error: {type(error).__name__}: {text}"


def _debug_requested(argv: Sequence[str]) -> bool:
    # read before parsing, so that a traceback of a parse error can be shown too
    return "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _parse(parser: Parser, argv: list[str]) -> argparse.Namespace:
    args, extra = parser.parse_known_args(argv)
    # `fit RECIPE --print-config a=b`: argparse stops filling a positional list at the first option; dotlist
    # overrides after an option are still overrides
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        raise UsageError(f"eagle3-zoo {args.command}: unrecognized arguments: {' '.join(extra)} "
                         f"(`eagle3-zoo {args.command} --help` lists the options)")
    return args


@contextlib.contextmanager
def _redacted_output() -> Iterator[None]:
    """What a command prints (its results, a server command line, warnings) with its secrets redacted."""
    from eagle3_zoo.util.redaction import RedactingStream

    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = RedactingStream(sys.stdout), RedactingStream(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def main(argv: Sequence[str] | None = None) -> int:
    """Run `eagle3-zoo ARGV...` and return its exit code (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _debug_requested(argv)
    try:
        args = _parse(build_parser(), argv)
        configure_logging(logging.DEBUG if args.verbose else logging.INFO)
        from eagle3_zoo.util.progress import bars_and_logs, progress_interval_s, quiet_third_party_output
        from eagle3_zoo.util.threads import configure_threads

        progress_interval_s()  # a bad EAGLE3_ZOO_LOG_EVERY_S is refused now, not after a long data stage
        # before the handler imports torch and the Hugging Face libraries: they read these settings at import
        choice = configure_threads(args.threads)
        quiet_third_party_output()
        # the long commands say it (speeds depend on it); the others only with -v
        logging.getLogger(__name__).log(logging.INFO if args.command in LONG_COMMANDS else logging.DEBUG,
                                        "%s", choice.describe())
        with bars_and_logs(), _redacted_output():
            return int(args.func(args) or EXIT_OK)
    except SystemExit as e:  # --help / --version (argparse prints them and exits); SIGTERM in a Lightning run
        if type(e).__name__ in ("FitTerminated", "SIGTERMException"):  # by name: no Lightning import here
            print(f"terminated (SIGTERM): {' '.join(str(e).split())}" if str(e) else "terminated (SIGTERM)",
                  file=sys.stderr)
            return EXIT_TERMINATED
        return e.code if isinstance(e.code, int) else EXIT_OK
    except KeyboardInterrupt as e:  # Ctrl-C; an interrupted `fit` says what it kept (`FitInterrupted`)
        print(f"interrupted: {' '.join(str(e).split())}" if str(e) else "interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # library code raises; only here does an exception become a message and an exit code
        if debug:
            from eagle3_zoo.util.redaction import redact

            print(redact(traceback.format_exc()), end="", file=sys.stderr)
        hint = "" if debug else f" (run with --debug or {DEBUG_ENV}=1 for the traceback)"
        bad = is_bad_input(e)
        print(error_line(e) + ("" if bad else hint), file=sys.stderr)
        return EXIT_BAD_INPUT if bad else EXIT_FAILED
