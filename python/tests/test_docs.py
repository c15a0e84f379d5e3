"""The Python examples of README.md and docs/python.md that need no GPU, framework or cluster
run as they are written (a receiver in this process, host memory where there is no GPU)."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def python_blocks(path: pathlib.Path):
    """The ```python blocks of a Markdown file, in order."""
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("doc", ["README.md", "docs/python.md"])
def test_the_first_python_example_runs_as_written(doc):
    blocks = python_blocks(ROOT / doc)
    assert blocks, f"{doc} has no Python example"
    ran = subprocess.run([sys.executable, "-c", blocks[0]], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    # What the comment beside the print promises.
    assert re.match(r"w F32 \(2, 3\) (cuda:0|cpu)$", ran.stdout.strip()), ran.stdout
