"""debug=profile's helper: a readable trace of exactly the profiled steps, and a short table."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch
from torch import nn

from reprotrain.profiling import TABLE_NAME, TRACE_NAME, Profiler


def tiny_steps(n: int, prof: Profiler | None) -> torch.Tensor:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    for _ in range(n):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if prof is not None:
            prof.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def trace_events(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_profiles_the_requested_steps_into_a_chrome_trace_and_a_short_table(
    tmp_path: Path,
) -> None:
    prof = Profiler(tmp_path / "profile", steps=3, warmup=1).start()
    tiny_steps(6, prof)  # 1 warm-up + 3 profiled; the last 2 run without the profiler
    table = prof.stop()
    assert prof.done
    events = trace_events(tmp_path / "profile" / TRACE_NAME)
    step_marks = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert step_marks == {"ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"}
    assert any(e.get("name") == "aten::addmm" for e in events)
    lines = table.splitlines()
    assert lines[0].startswith("top 15 ops by self CPU time, per step, over 3 profiled steps")
    assert len(lines) == 3 + 15 and max(map(len, lines)) <= 100
    assert "aten::addmm" in table
    assert (tmp_path / "profile" / TABLE_NAME).read_text().strip() == table


def test_a_run_shorter_than_the_profile_still_leaves_what_was_recorded(tmp_path: Path) -> None:
    prof = Profiler(tmp_path, steps=10, warmup=1).start()
    tiny_steps(4, prof)  # 1 warm-up + 3 of the 10 planned
    table = prof.stop()
    assert table is not None and "over 3 profiled steps (of 10 planned)" in table
    assert trace_events(tmp_path / TRACE_NAME)


def test_profiling_does_not_change_the_numbers(tmp_path: Path) -> None:
    plain = tiny_steps(5, None)
    with Profiler(tmp_path, steps=2) as prof:
        profiled = tiny_steps(5, prof)
    assert torch.equal(plain, profiled)
