"""`paratrain bench collectives|calibrate` smoke tests: tiny sizes, few iterations."""

from __future__ import annotations

import json
import subprocess
import sys

from paratrain.cli import main
from paratrain.cost.hardware import load_hardware

KEYS = {"op", "algorithm", "impl", "nproc", "bytes", "time_us", "algbw_gbps", "busbw_gbps",
        "wrong"}


def test_bench_commands_import_no_torch():
    code = ("import sys, paratrain.cli.bench, paratrain.cli.viz; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bench_collectives_json(capsys):
    rc = main(["bench", "collectives", "--nproc", "2", "--ops", "all_reduce,all_gather",
               "--algorithms", "ring,halving_doubling", "--min-bytes", "1K", "--max-bytes", "2K",
               "--iters", "2", "--warmup", "1", "--repeats", "1", "--json"])
    assert rc == 0
    records = json.loads(capsys.readouterr().out)
    assert all(KEYS <= set(r) for r in records)
    got = {(r["op"], r["algorithm"], r["impl"], r["bytes"]) for r in records}
    for op in ("all_reduce", "all_gather"):
        for b in (1024, 2048):
            assert {(op, "ring", "ours", b), (op, "native", "native", b),
                    (op, "halving_doubling", "ours", b)} <= got
    assert all(r["wrong"] == 0 and r["time_us"] > 0 and r["nproc"] == 2 for r in records)
    ar = next(r for r in records if r["op"] == "all_reduce")
    assert ar["busbw_gbps"] == ar["algbw_gbps"] * 2 * (2 - 1) / 2


def test_bench_collectives_table_and_bad_flags(capsys):
    rc = main(["bench", "collectives", "--nproc", "2", "--ops", "broadcast",
               "--algorithms", "tree", "--min-bytes", "1K", "--max-bytes", "1K",
               "--iters", "2", "--warmup", "0", "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and "# broadcast" in out and "busbw" in out and "physical limits" in out
    assert main(["bench", "collectives", "--ops", "allreduce"]) == 2
    assert main(["bench", "collectives", "--max-bytes", "64Q"]) == 2


def test_bench_calibrate_writes_a_loadable_profile(tmp_path, capsys, monkeypatch):
    """The profile's writing, not the stability rule (tests/test_calibrate_stability.py
    checks that with injected timings): the first round counts, so the machine's load
    cannot fail it."""
    monkeypatch.setenv("PARATRAIN_STABLE_CV", "inf")
    monkeypatch.setenv("PARATRAIN_STABLE_ROUNDS", "1")
    path = tmp_path / "hw.toml"
    rc = main(["bench", "calibrate", "--nproc", "2", "--min-bytes", "4", "--max-bytes", "4K",
               "--factor", "32", "--iters", "2", "--algorithms", "ring,tree", "--out", str(path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "ping-pong" in out and "pred(us)" in out and "meas/pred" in out
    hw = load_hardware(str(path))
    assert hw.peak_flops > 0 and hw.intra_bw > 0 and hw.eta == 1.0
    assert hw.topology == "switch" and hw.hbm_bytes > 1e8
