"""The bad-input matrix (`leancompile check-inputs`): every row raises a clear error that names
what was wrong."""

import pytest

from leancompile.check_inputs import main, run_cases


@pytest.fixture(scope="module")
def records():
    return run_cases()


def test_every_row_raises_an_error_naming_the_bad_value(records):
    assert len(records) >= 40
    bad = [r for r in records if not r["ok"]]
    assert not bad, bad
    # The matrix covers every public entry point.
    entries = {r["entry"] for r in records}
    assert {"backend", "install", "lean_compile", "GRPOConfig", "GRPOTrainer",
            "GRPOTrainer.compute_gradients", "GRPOTrainer.load", "check_rewards",
            "layout.assign", "p2p.start_exchange"} <= entries


def test_the_command_prints_the_matrix(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "rows raise a clear error" in out and "BAD" not in out
