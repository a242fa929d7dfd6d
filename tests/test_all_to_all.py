"""paratrain's point-to-point all-to-all (:mod:`paratrain.comm.all_to_all`, the
``--collectives ours`` token exchange of :class:`paratrain.parallel.expert.ExpertExchange`)
against torch's ``all_to_all_single`` on real gloo groups of 2, 3 and 4 ranks: uneven
splits with zero-sized pieces (a rank that sends nothing, one that receives nothing, empty
local pieces), several calls in a row with different splits (messages of successive calls
must not cross), rows of several columns, a sub-group whose ranks are not the world's;
the bytes the exchange counts equal the bytes it sent and the splits' own sum. And
``benchmarks/expert_parallel.py`` prints its alternating ratio table (structure only:
the ratio itself depends on the machine's load)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from paratrain.comm.all_to_all import all_to_all, partners
from paratrain.parallel.expert import ExpertExchange
from paratrain.parallel.process_groups import spawn

D = 3  # columns per row


def _splits(p: int, seed: int) -> torch.Tensor:
    """S[i, j]: rows group rank i sends to j; the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(seed)
    S = torch.randint(0, 5, (p, p), generator=g)
    S[S == 1] = 0  # plenty of empty pieces
    S[seed % p, :] = 0  # one rank sends nothing
    S[:, (seed + 1) % p] = 0  # one rank receives nothing
    return S


def _check(ex: ExpertExchange, group, p: int, rank: int, seed: int) -> dict:
    S = _splits(p, seed)
    in_splits, out_splits = S[rank].tolist(), S[:, rank].tolist()
    x = torch.arange(sum(in_splits) * D, dtype=torch.float64).view(-1, D) + 1000.0 * rank
    want = x.new_empty((sum(out_splits), D))
    dist.all_to_all_single(want, x, out_splits, in_splits, group=group)
    before = ex.wire_bytes
    got = ex.all_to_all(x, out_splits, in_splits)
    out = torch.full_like(want, float("nan"))
    sent = all_to_all(out, x, out_splits, in_splits, rank, group)
    return {"equal": torch.equal(got, want) and torch.equal(out, want),
            "counted": ex.wire_bytes - before, "sent": sent,
            "splits": (sum(in_splits) - in_splits[rank]) * D * x.element_size()}


def _worker(rank: int, world: int) -> list[dict]:
    ex = ExpertExchange(dist.group.WORLD, world, rank, world, "ours")
    out = [_check(ex, dist.group.WORLD, world, rank, seed) for seed in range(6)]
    if world == 4:  # a sub-group: group ranks 0, 1, 2 are world ranks 1, 2, 3
        sub = dist.new_group([1, 2, 3])
        if rank > 0:
            ex = ExpertExchange(sub, 3, rank - 1, 3, "ours")
            out += [_check(ex, sub, 3, rank - 1, seed) for seed in range(3)]
    return out


@pytest.mark.parametrize("p", [2, 3, 4])
def test_pairwise_all_to_all_equals_torch_and_counts_its_bytes(p):
    results = spawn(_worker, p, timeout_s=120)
    for rank, checks in enumerate(results):
        assert len(checks) == 6 + (3 if p == 4 and rank > 0 else 0)
        for c in checks:
            assert c["equal"], (rank, c)
            assert c["counted"] == c["sent"] == c["splits"], (rank, c)
    assert any(c["sent"] == 0 for r in results for c in r)  # the rank that sends nothing
    assert any(c["sent"] > 0 for r in results for c in r)


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_partners_meet_every_peer_once_and_rounds_match(p):
    for r in range(p):
        rounds = partners(p, r)
        assert sorted(d for d, _ in rounds) == sorted(s for _, s in rounds) == \
            [q for q in range(p) if q != r]
        for s, (dst, src) in enumerate(rounds):  # what r sends in round s, dst receives
            assert partners(p, dst)[s][1] == r and partners(p, src)[s][0] == r


BENCH = Path(__file__).parents[1] / "benchmarks" / "expert_parallel.py"


def test_benchmark_prints_the_alternating_ratio_table(tmp_path):
    out = tmp_path / "a2a.json"
    cmd = [sys.executable, str(BENCH), "--skip-moe", "--skip-steps", "--a2a-ranks", "2",
           "--mib", "0.01,0.02", "--runs", "2", "--reps", "2", "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.startswith("command: python ") and "--runs 2" in run.stdout
    assert "median ours/torch busbw, p = 2: 0.01 MiB " in run.stdout
    assert "(alternating " in run.stdout and ", back to back " in run.stdout
    records = json.loads(out.read_text())["a2a"]
    assert set(records) == {"p2_0.01MiB", "p2_0.02MiB"}
    for r in records.values():
        assert len(r["runs"]) == 2 and all(x["ours"] > 0 and x["torch"] > 0 for x in r["runs"])
        assert r["median_ratio"] == statistics.median(x["ratio"] for x in r["runs"])
        assert all(x["ours_burst"] > 0 and x["torch_burst"] > 0 for x in r["runs"])
        assert r["median_burst_ratio"] == statistics.median(x["burst_ratio"]
                                                            for x in r["runs"])
        assert all(x["ours_own"] > 0 and x["torch_own"] > 0 for x in r["runs"])
        assert r["median_own_ratio"] == statistics.median(x["own_ratio"] for x in r["runs"])


@pytest.mark.parametrize("flags", [["--mib", "1,x"], ["--a2a-ranks", "1"], ["--runs", "0"]])
def test_benchmark_bad_flags_are_one_error_line(flags):
    run = subprocess.run([sys.executable, str(BENCH), *flags], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.startswith("error: ")
    assert len(run.stderr.strip().splitlines()) == 1
