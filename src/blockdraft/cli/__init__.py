"""`blockdraft` command line: parse, dispatch, end (`parsers` has the flags, `commands` the glue that calls
the library, `exits` how a command ends).

Importing this package imports nothing heavy (no torch, no transformers, none of the library): `main`
puts the stop-signal handlers in place first, then builds the parser of the one command named (its
flags come from the library's option classes), and a command imports what it needs when it runs.
`blockdraft --help` and a mistaken command answer at once, and SIGTERM or SIGUSR1 at any moment after
the process starts is handled (`stop_handlers`), never the silent death by the signal."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

from ..options import check_parsed
from . import commands
from .exits import interrupts, preempted, rerun_hint, exit_after_group, one_line  # noqa: F401
from .parsers import train_parser, build, command_of, train_config, unused_sampling  # noqa: F401 (its names)
from .commands import speed_settings  # noqa: F401

COMMANDS = {"train": commands.cmd_train, "regenerate": commands.cmd_regenerate, "prompts": commands.cmd_prompts,
            "extract": commands.cmd_extract, "engine": commands.cmd_engine, "convert": commands.cmd_convert, "doctor": commands.cmd_doctor,
            "generate": commands.cmd_generate, "bench": commands.cmd_bench}


def build_parser(only: tuple[str, ...] | None = None) -> argparse.ArgumentParser:
    """Every command's parser, each with its function; with `only`, the flags of those commands alone
    (`parsers.build`)."""
    p = build(only)
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        parser.set_defaults(fn=COMMANDS[name])
    return p


# Token-by-token generation keeps OpenMP's default spin-waiting: a decode step is ~200 small
# parallel products, and waking sleeping threads for each one doubled its time on 2 threads
# (SmolLM2: 24 -> 50 ms; `benchmarks/verify_step.py`).
LATENCY_COMMANDS = ("generate", "bench")


def main(argv: list[str] | None = None) -> int:
    """The command line; Ctrl-C at any point after it starts (the imports of torch and transformers
    take seconds) is one line and exit code 130, also where a library caught the interrupt midway
    through an import and failed later on the half-imported module."""
    seen: dict = {}
    argv = sys.argv[1:] if argv is None else list(argv)
    with interrupts() as interrupted:
        try:
            with stop_handlers(command_of(argv), seen):  # before the parser: building it imports the library
                return _main(argv, seen, interrupted)
        except BaseException as e:
            if not (interrupted or isinstance(e, KeyboardInterrupt)):
                group = sys.modules.get("blockdraft.train.distributed")
                if group is not None and not isinstance(e, SystemExit):  # a fault: the other ranks stop too
                    group.post_abort(f"{type(e).__name__}: {one_line(e)}")
                raise
            interrupted.append("handled")
            args = seen.get("args")
            cmd = f" {args.cmd}" if getattr(args, "cmd", None) else ""
            by = seen.get("signal")  # SIGTERM or SIGUSR1 to a command other than train (`stop_handlers`)
            print(f"blockdraft{cmd}: {f'stopped by {by}' if by else 'interrupted'}; {rerun_hint(args)}",
                  file=sys.stderr)
            return 128 + int(getattr(signal, by)) if by else 130


def _main(argv: list[str], seen: dict, interrupted: list) -> int:
    cmd = command_of(argv)
    parser = build_parser((cmd,) if cmd else ())
    args = seen["args"] = parser.parse_args(argv)
    if getattr(args, "cmd", None):  # the paths and devices the flags name, before any work
        command = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.cmd]
        check_parsed(command, args)
        unused = unused_sampling(args)  # a sampling flag greedy decoding would ignore
        if unused:
            command.error(unused)
    args.argv = argv[1:]  # the command's own flags (for --config replays)
    if args.cmd not in LATENCY_COMMANDS:
        # Spin-waiting OpenMP threads stall every small parallel region when another process
        # shares the cores (up to ~8x measured on a busy 2-core machine); passive waiting costs
        # little to throughput jobs. Must be set before torch starts its thread pool, hence here.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if not getattr(args, "fn", None):
        parser.print_help()
        return 2
    return _run(args, interrupted)


# the commands a stop signal ends as a Ctrl-C does (train saves and stops; engine's server has its own)
SIGNAL_AS_INTERRUPT = ("regenerate", "prompts", "extract", "convert", "doctor", "generate", "bench")


def stop_handlers(cmd: str | None, seen: dict):
    """From the first line of `main`, before the flags are read (building the parser imports the
    library, seconds): `train`: SIGTERM or SIGUSR1 from here to the training loop (the imports, the
    target, the data, the engines) stops the run cleanly before its first step (`preempt.starting_up`).
    The commands of SIGNAL_AS_INTERRUPT, and `blockdraft` with no command or a mistaken one, end on
    them as on Ctrl-C (what was finished is kept; one line naming the signal and the rerun; exit 128 +
    the signal), instead of dying with no word. `engine` keeps the signals' defaults for its server."""
    if cmd == "engine":
        return contextlib.nullcontext()
    if cmd != "train":
        return _signal_as_interrupt(seen)
    from ..preempt import starting_up

    return starting_up(os.environ.get("RANK", "0") == "0")  # torchrun's rank: the group is not joined yet


@contextlib.contextmanager
def _signal_as_interrupt(seen: dict):
    """SIGTERM and SIGUSR1 raise the interrupt Ctrl-C raises (`interrupts` delivers it outside any
    import), `seen["signal"]` naming which; the handlers before are put back after."""
    import _thread
    import threading

    from .exits import importing

    def note(signum, frame):
        seen.setdefault("signal", signal.Signals(signum).name)
        if callable(signal.getsignal(signal.SIGINT)):  # `interrupts` is there: it delivers it outside imports
            _thread.interrupt_main()
        elif importing(frame):  # SIGINT ignored (a background job): never inside an import, again in 50 ms
            threading.Timer(0.05, _thread.interrupt_main, args=(signum,)).start()
        else:
            raise KeyboardInterrupt

    before = {}
    try:
        for name in ("SIGTERM", "SIGUSR1"):
            num = getattr(signal, name)
            before[num] = signal.signal(num, note)
    except ValueError:  # not the main thread: the signals keep their default
        pass
    try:
        yield
    finally:
        for num, old in before.items():
            signal.signal(num, old if old is not None else signal.SIG_DFL)


def _run(args, interrupted: list) -> int:
    from safetensors import SafetensorError

    from ..engines import EngineFailed
    from ..preempt import Preempted

    if interrupted:  # an interrupt during the imports that a library caught and went on from
        raise KeyboardInterrupt

    try:
        if hasattr(args, "chat_template"):
            from ..data.chat import use_template

            use_template(args.chat_template, args.thinking)  # every rendering of this command
        rc = int(args.fn(args) or 0)
        group = sys.modules.get("blockdraft.train.distributed")  # not imported: this process joined no group
        if group is not None:
            group.leave()  # after a clean finish only: a rank that failed must not wait for the others here
        return rc
    except Preempted as e:  # a signal asked the run to stop: every rank saved the same step, and leaves
        return preempted(args, e)
    except (ValueError, OSError, SafetensorError, EngineFailed) as e:  # a user's mistake, the machine's, an
        # engine's: one line (an engine's names vLLM's own reason and its log), exit 2
        if args.debug:
            raise
        print(f"blockdraft {args.cmd}: error: {one_line(e)}", file=sys.stderr)
        group = sys.modules.get("blockdraft.train.distributed")
        if group is not None:  # in a group: the other ranks stop now, not at the group's timeout
            group.post_abort(one_line(e))
        return 2


def entry() -> int:
    """The `blockdraft` command and `python -m blockdraft`: `main`, then `exit_after_group`."""
    rc = main()
    exit_after_group(rc)
    return rc

