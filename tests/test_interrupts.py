"""Ctrl-C is one line and exit code 130 from the moment `blockdraft` starts (issue 43, item 4.6),
the imports of torch and transformers included."""

from __future__ import annotations

from blockdraft.cli import main


def test_ctrl_c_during_the_imports_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    """Never raised inside a module being imported (torch's native initialisation aborts there,
    numpy is left half-imported, importlib's lock callbacks drop it), but once the import is done."""
    import importlib
    import signal
    import sys
    import time

    import blockdraft.cli as cli

    (tmp_path / "slow_module.py").write_text(
        "import signal, time\nsignal.raise_signal(signal.SIGINT)\ntime.sleep(0.2)\nwhole = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reached = []

    def interrupted_import():  # Ctrl-C while torch and transformers are imported
        importlib.import_module("slow_module")
        time.sleep(2)  # the next import; the interrupt comes meanwhile
        reached.append(True)

    def caught_import():  # a library that catches it and goes on
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass
        return real()

    real = cli.build_parser
    for fake in (interrupted_import, caught_import):
        monkeypatch.setattr(cli, "build_parser", fake)
        assert main(["train", "--threads", "1", "--out", str(tmp_path / "r")]) == 130
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert err.startswith(("blockdraft: interrupted; nothing was done",  # before the flags were read
                               "blockdraft train: interrupted; no checkpoint was saved yet")), err
    whole = getattr(sys.modules.get("slow_module"), "whole", False)
    assert whole and not reached  # the module imported whole, the interrupt right after it
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
