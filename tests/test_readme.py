"""The README's Python example runs as written (in a scratch directory) and shows what it claims."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_python_example_runs_and_finds_the_onset_it_prints(tmp_path, monkeypatch) -> None:
    text = README.read_text()
    section = text[text.index("### Python"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, "README.md (Python example)", "exec"), namespace)  # noqa: S102 - our own README
    claimed = re.search(r"SiteDiff\(site='([^']+)', step=(\d+)", code)
    onset = namespace["result"].onset()
    assert (onset.site, onset.step) == (claimed.group(1), int(claimed.group(2)))
    assert (tmp_path / "hf.trace" / "manifest.json").is_file()
