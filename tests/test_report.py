"""`marlaas report` on small run dirs copied from real runs (tests/fixtures/report: the three modes of
tools/bench_modes.py, 2 tasks x 3 steps, hf engine; adapters and audit left out): figures are drawn from the
data, the Markdown's numbers are summary.json's, the comparison table is each run's."""
import json
import shutil
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from marlaas_hpc.cli import main as marlaas
from marlaas_hpc.report import comparison_row, load_run
from marlaas_hpc.scheduler import MODES

FIXTURES = Path(__file__).parent / "fixtures" / "report"


def cells(text: str) -> dict[str, list[str]]:
    rows = ([c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| "))
    return {row[0]: row for row in rows}


def not_blank(path: Path) -> bool:
    image = mpimg.imread(path)
    return len({tuple(px) for px in image[::5, ::5, :3].reshape(-1, 3).round(2).tolist()}) > 10


def test_report_compares_the_three_modes(tmp_path, capsys):
    runs = [FIXTURES / mode for mode in MODES]
    assert marlaas(["report", *map(str, runs), "-o", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    table = cells(text)
    for i, (mode, run_dir) in enumerate(zip(MODES, runs), start=1):
        summary = json.loads((run_dir / "summary.json").read_text())
        row = comparison_row(load_run(run_dir))
        assert row["e2e_s"] == summary["wall_time_s"]
        ttfs = [t["ttfs_s"] for t in summary["tasks"].values()]
        assert row["ttfs_mean_s"] == pytest.approx(sum(ttfs) / len(ttfs))
        assert table[mode][1:] == [f"{summary['wall_time_s']:.3f}"] + \
            [f"{summary['busy_fraction'][r]:.3f}" for r in ("rollout", "env", "trainer")] + \
            [f"{row['ttfs_mean_s']:.3f}", f"{row['tpts_mean_s']:.3f}"]
        for name in ("reward_curves", "utilisation_gantt", "ttfs_tpts"):
            assert not_blank(tmp_path / f"{i}-{mode}" / f"{name}.png")
    assert not_blank(tmp_path / "comparison.png")


def test_gantt_counts_only_busy_stages(tmp_path):
    run = load_run(FIXTURES / "async")
    stages = {(s["role"], s["stage"]) for s in run.timeline}
    assert stages and not {stage for _, stage in stages} & {"group", "publish"}
    raw = [json.loads(line) for f in (FIXTURES / "async" / "timeline").glob("*.jsonl")
           for line in f.read_text().splitlines()]
    assert any(r["stage"] == "group" for r in raw), "the fixture has notes to leave out"
    trainer_busy = sum(s["end"] - s["start"] for s in run.timeline if s["role"] == "trainer")
    summary = json.loads((FIXTURES / "async" / "summary.json").read_text())
    # the trainer's RankStats busy time and its timeline spans are the same clock's
    assert trainer_busy / summary["wall_time_s"] == pytest.approx(summary["busy_fraction"]["trainer"], rel=0.05)


def test_report_of_a_live_run_and_of_no_run(tmp_path, capsys):
    live = tmp_path / "live"
    shutil.copytree(FIXTURES / "async", live)
    summary = json.loads((live / "summary.json").read_text())
    (live / "summary.json").unlink()
    status = {"mode": summary["mode"], "elapsed_s": 3.0, "finished": False, "tasks": summary["tasks"]}
    (live / "status.json").write_text(json.dumps(status))
    assert marlaas(["report", str(live), "-o", str(tmp_path / "out")]) == 0
    assert "still running" in (tmp_path / "out" / "report.md").read_text()
    assert marlaas(["report", str(tmp_path / "nothing"), "-o", str(tmp_path / "out2")]) == 2
    assert "no summary.json" in capsys.readouterr().err
