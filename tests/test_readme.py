"""The README's Python quick start runs exactly as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def quick_start() -> str:
    """The first ```python block of the "## Quick start" section."""
    section = README.read_text().split("## Quick start", 1)[-1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert blocks, "README.md has no ```python block under '## Quick start'"
    return blocks[0]


def test_quick_start_runs_as_written(tmp_path, monkeypatch, capsys):
    code = quick_start()
    assert len(code.strip().splitlines()) <= 12  # "a 10-line Python example"
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
    assert "parameters" in capsys.readouterr().out
    assert (tmp_path / "runs" / "tiny" / "model.safetensors").is_file()
