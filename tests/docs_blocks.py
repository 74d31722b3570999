"""The shell commands of README.md and docs/*.md, as the docs tests read them.

Every fenced ``bash`` block is run by tests/test_docs.py unless the line just before its fence is a
directive comment:

    <!-- docs-test: skip REASON -->   not run here (REASON says why: needs GPUs, SLURM, minutes …);
                                      its omniweave flags and recipe keys are still checked
    <!-- docs-test: file PATH -->     not a command: the block is written to PATH in the workspace
                                      (a recipe, a job script) before the doc's commands run

Runs are scaled down by rewriting the documented flags, never by flags of the test's own:
``--samples N`` (at most 160), ``--eval-samples N`` (at most 20), ``--rl-samples N`` (at most 64),
``train.steps=N`` (N // 20, at least 2), an ``omniweave train`` / ``rl`` / ``demo`` without a
step count gets 2 steps, and a ``python bench/X.py …`` gets ``--quick --out bench_out`` (every
benchmark's smoke run: tiny sizes whatever the command gives, the results in the workspace).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_LANGS = ("bash", "sh", "shell")
DIRECTIVE = re.compile(r"<!--\s*docs-test:\s*(skip|file)\s+(.+?)\s*-->")


@dataclass
class Block:
    doc: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    action: str  # "run" | "skip" | "file"
    arg: str = ""  # skip: the reason; file: the path

    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    out, lines = [], doc.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        d = DIRECTIVE.search(prev)
        out.append(Block(doc, start + 1, lang, "\n".join(lines[start + 1:j]) + "\n",
                         d.group(1) if d else "run", d.group(2) if d else ""))
        i = j + 1
    return out


def shell_blocks(doc: Path) -> list[Block]:
    return [b for b in blocks(doc) if b.lang in SHELL_LANGS or b.action == "file"]


def logical_lines(text: str) -> list[str]:
    """Lines with backslash continuations joined; blank lines and whole-line comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [ln for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def scale(line: str) -> str:
    """The documented command with its sizes scaled down for a test (see the module docstring)."""
    line = re.sub(r"--samples (\d+)", lambda m: f"--samples {min(int(m.group(1)), 160)}", line)
    line = re.sub(r"--eval-samples (\d+)", lambda m: f"--eval-samples {min(int(m.group(1)), 20)}", line)
    line = re.sub(r"--rl-samples (\d+)", lambda m: f"--rl-samples {min(int(m.group(1)), 64)}", line)
    line = re.sub(r"train\.steps=(\d+)", lambda m: f"train.steps={max(2, int(m.group(1)) // 20)}", line)
    words = command_words(line)
    if words[:2] in (["omniweave", "train"], ["omniweave", "rl"]) and "train.steps=" not in line:
        line = _before_comment(line) + " train.steps=2"
    if words[:2] == ["omniweave", "demo"] and "--steps" not in line:
        line = _before_comment(line) + " --steps 2"
    if words[:1] in (["python"], ["python3"]) and len(words) > 1 and re.fullmatch(r"bench/\w+\.py", words[1]):
        line = _before_comment(line) + " --quick --out bench_out"
    return line


def _before_comment(line: str) -> str:
    return re.split(r"\s+#\s", line, maxsplit=1)[0].rstrip()


def command_words(line: str) -> list[str]:
    """The words of one logical line, trailing comment removed (best effort for shell syntax)."""
    try:
        return shlex.split(line, comments=True)
    except ValueError:
        return line.split()


def omniweave_commands(block: Block) -> list[list[str]]:
    """Every ``omniweave …`` command of a block, also inside ``torchrun … -m omniweave …``."""
    out = []
    for line in logical_lines(block.text):
        words = command_words(line)
        for k, w in enumerate(words):
            if w == "omniweave" and (k == 0 or words[k - 1] in ("-m", "&&", ";", "|", "do", "then")):
                out.append(words[k:])
                break
    return out


def python_scripts(block: Block) -> list[list[str]]:
    """``python bench/X.py …`` / ``python path/to/script.py …`` commands of a block."""
    out = []
    for line in logical_lines(block.text):
        words = command_words(line)
        if len(words) > 1 and words[0] in ("python", "python3") and words[1].endswith(".py"):
            out.append(words[1:])
    return out
