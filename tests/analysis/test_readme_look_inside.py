"""The README's "Look inside" Python example runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_look_inside_example_runs(capsys):
    section = README.read_text().split("## Look inside", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    scope = {"__name__": "__readme__"}
    exec(compile(code, str(README), "exec"), scope)
    assert scope["report"].ok
    assert scope["stats"].entropy.shape == (4,)
    assert capsys.readouterr().out.split() == [
        "1049728",
        str(3 * scope["tfm"].flops_per_token(scope["cfg"], 512).forward),
        str(2 * 4 * 2 * 32 * 512 * 8 * 2),
    ]
