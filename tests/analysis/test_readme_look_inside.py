"""The "Look inside" page's short Python example (docs/tutorials/look-inside.md, the README's section
before the docs site) runs as written and prints the numbers it claims."""

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "tutorials" / "look-inside.md"


def test_look_inside_example_runs(capsys):
    section = PAGE.read_text().split("\n## Details", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    scope = {"__name__": "__readme__"}
    exec(compile(code, str(PAGE), "exec"), scope)
    assert scope["report"].ok
    assert scope["stats"].entropy.shape == (4,)
    assert capsys.readouterr().out.split() == [
        "1049728",
        str(3 * scope["tfm"].flops_per_token(scope["cfg"], 512).forward),
        str(2 * 4 * 2 * 32 * 512 * 8 * 2),
    ]
