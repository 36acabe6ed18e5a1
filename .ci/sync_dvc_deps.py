"""Rewrite each stage's code deps in dvc.yaml from its real imports (data deps and comments kept).

Run from the repository root after changing imports: python .ci/sync_dvc_deps.py
"""
import re, sys
sys.path.insert(0, ".ci")
from pathlib import Path
from imports import code_closure, ROOT
text = Path("dvc.yaml").read_text().splitlines(keepends=True)
out, stage, in_deps = [], None, False
for line in text:
    m = re.match(r"^  (\w+):\s*$", line)
    if m: stage = m.group(1); in_deps = False
    if re.match(r"^    deps:\s*$", line):
        in_deps = True; out.append(line)
        for p in sorted(code_closure(ROOT/"stages"/f"{stage}.py") - {"detpipe/__init__.py","stages/__init__.py"}):
            out.append(f"      - {p}\n")
        continue
    if in_deps:
        if re.match(r"^      - (stages|detpipe)/\S+\.py", line):
            continue
        if not line.startswith("      -"):
            in_deps = False
    out.append(line)
Path("dvc.yaml").write_text("".join(out))
