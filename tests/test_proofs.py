"""The write protocol's model (proofs/lease.pml) holds, its broken variants
give counterexamples, and proofs/README.md still maps every model step to code
that exists, so the model cannot drift from the code unnoticed."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from tests.ci import unavailable

ROOT = Path(__file__).resolve().parent.parent
PROOFS = ROOT / "proofs"
CHECKS = (
    "model",
    "frozen-call",
    "lost-lease-keeps-writing",
    "lost-lease-two-writers",
    "keeper-lets-go-at-cancel",
    "frozen-call-strict",
)


def test_spin_finds_no_counterexample_in_the_model_and_one_in_each_broken_variant() -> None:
    for tool in ("make", "spin", "gcc"):
        if shutil.which(tool) is None:
            unavailable(tool, "apt-get install make spin gcc, then make proofs")
    done = subprocess.run(
        ["make", "--no-print-directory", "proofs"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0, f"make proofs failed:\n{said}"
    for check in CHECKS:
        assert re.search(rf"^ok   {re.escape(check)} ", done.stdout, re.M), said
    assert "errors: 0" in done.stdout


def _model_names() -> tuple[set[str], set[str]]:
    """(steps: labels, inlines and proctypes; all names a row may use, macros too)."""
    text = (PROOFS / "lease.pml").read_text()
    labels = set(re.findall(r"^\s*([A-Za-z_]\w*):(?!:)", text, re.M)) - {"end"}
    inlines = set(re.findall(r"^inline (\w+)\(", text, re.M))
    proctypes = set(re.findall(r"^proctype (\w+)\(", text, re.M))
    macros = set(re.findall(r"^#define (\w+)", text, re.M))
    steps = labels | inlines | proctypes
    return steps, steps | macros


def _mapping() -> list[tuple[list[str], str, list[str]]]:
    text = (PROOFS / "README.md").read_text()
    table = text.split("## Model steps and the code that implements them", 1)[1]
    table = table.split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        steps = re.findall(r"`(\w+)`", cells[0])
        file = cells[1].strip("`")
        functions = re.findall(r"`(\w+)`", cells[2])
        rows.append((steps, file, functions))
    return rows


def test_the_readme_maps_each_model_step_to_code_that_exists() -> None:
    rows = _mapping()
    assert len(rows) > 20, "the mapping table of proofs/README.md was not found"
    steps, names = _model_names()
    mapped = {step for row_steps, _, _ in rows for step in row_steps}
    assert not mapped - names, f"proofs/README.md names steps lease.pml lacks: {mapped - names}"
    assert not steps - mapped, f"lease.pml steps missing from proofs/README.md: {steps - mapped}"
    for row_steps, file, functions in rows:
        if file == "—":
            assert not functions, f"{row_steps}: functions without a file"
            continue
        path = ROOT / file
        assert path.is_file(), f"{row_steps}: {file} does not exist"
        source = path.read_text()
        assert functions, f"{row_steps}: no function named for {file}"
        for name in functions:
            defined = re.search(rf"^\s*(?:async\s+def|def|class)\s+{name}\b", source, re.M)
            assert defined, f"{row_steps}: {file} defines no {name}"
