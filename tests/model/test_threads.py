"""torch's thread count is set deliberately: half the usable cores by default, or what the user asks."""

from __future__ import annotations

import pytest
import torch

from model.threads import default_threads, set_threads, usable_cores


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_default_is_half_the_usable_cores(restore_threads, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_threads() == max(1, usable_cores() // 2)
    assert set_threads(None) == torch.get_num_threads() == default_threads()
    assert set_threads(1) == torch.get_num_threads() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(max(1, usable_cores())))  # torchrun: the cores are shared
    assert default_threads() == 1
    with pytest.raises(ValueError):
        set_threads(0)


def _generate_threads(monkeypatch, capsys, args: tuple[str, ...], env: dict) -> tuple[int, str, str]:
    """`txlserve generate ARGS` in this process, up to where it sets the thread count: (status, the thread count
    it set, stderr). A bad count is refused by the parser (SystemExit) or the command (status 2)."""
    import server.cli as cli

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cli, "_cmd_generate", lambda ns: (cli._set_threads(ns), print(torch.get_num_threads()), 0)[-1])
    try:
        code = cli.main(["generate", "--prompt", "x", *args])
    except SystemExit as stop:
        code = stop.code
    out = capsys.readouterr()
    return code, out.out.strip(), out.err


@pytest.mark.parametrize("args,env,want", [((), {}, str(default_threads())), (("--threads", "3"), {}, "3"),
                                           ((), {"TXLSERVE_THREADS": "3"}, "3"),
                                           (("--threads", "3"), {"TXLSERVE_THREADS": "7"}, "3")])
def test_cli_sets_the_thread_count(args, env, want, restore_threads, monkeypatch, capsys):
    monkeypatch.delenv("TXLSERVE_THREADS", raising=False)
    code, threads, err = _generate_threads(monkeypatch, capsys, args, {"LOCAL_WORLD_SIZE": "1", **env})
    assert code == 0 and threads == want, err


@pytest.mark.parametrize("args,env,says", [(("--threads", "0"), {}, "argument --threads: expected a whole number "
                                                                   "from 1 to"),
                                           ((), {"TXLSERVE_THREADS": "many"}, "TXLSERVE_THREADS='many' is not"),
                                           ((), {"TXLSERVE_THREADS": "0"}, "TXLSERVE_THREADS must be from 1 to")])
def test_bad_thread_counts_are_one_line(args, env, says, restore_threads, monkeypatch, capsys):
    """Named as given: TXLSERVE_THREADS=0 said "--threads must be ..." (found by a helper)."""
    code, _, err = _generate_threads(monkeypatch, capsys, args, env)
    assert code == 2 and says in err.splitlines()[-1] and "Traceback" not in err, err
