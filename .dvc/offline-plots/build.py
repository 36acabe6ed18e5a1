"""Rebuild ``.dvc/offline-plots/template.html``: DVC's plots page with vega, vega-lite and vega-embed inlined.

``dvc plots show`` fills an HTML template; DVC's default one loads the three libraries from a public CDN, so on a
machine without internet no curve is drawn. ``.dvc/config`` points ``plots.html_template`` at this file instead.
The libraries are the minified browser builds from the npm registry, fetched with ``npm pack`` (which checks each
tarball against the registry's sha512 integrity) and pinned below: the same major versions DVC's renderer loads
(vega 5, vega-lite 5, vega-embed 6). Run from the repository root when upgrading::

    python .dvc/offline-plots/build.py

The template keeps DVC's placeholders ``{refresh_tag}`` and ``{plot_divs}`` and leaves out ``{scripts}`` (the
CDN ``<script src=...>`` tags DVC would insert). Licenses: all three are BSD-3-Clause (NOTICE.md).
"""
from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# (package, version, file in the tarball, npm dist.integrity)
PACKAGES = [
    ("vega", "5.33.1", "package/build/vega.min.js",
     "sha512-1fArfVDUqVbb5z8n+/nVQb+VNBzx8svY6CrsyTK4Ujm4yrd9I1auoKxBAPXLCavY1LcrbHUskQbGUP8gXOzyQw=="),
    ("vega-lite", "5.23.0", "package/build/vega-lite.min.js",
     "sha512-l4J6+AWE3DIjvovEoHl2LdtCUkfm4zs8Xxx7INwZEAv+XVb6kR6vIN1gt3t2gN2gs/y4DYTs/RPoTeYAuEg6mA=="),
    ("vega-embed", "6.29.0", "package/build/vega-embed.min.js",
     "sha512-PmlshTLtLFLgWtF/b23T1OwX53AugJ9RZ3qPE2c01VFAbgt3/GSNI/etzA/GzdrkceXFma+FDHNXUppKuM0U6Q=="),
]

PAGE = """<!DOCTYPE html>
<html>
<head>
    <meta charset="utf-8">
    {refresh_tag}
    <title>DVC Plot</title>
    <!-- Offline DVC plots template (.dvc/offline-plots/build.py): {provenance}. BSD-3-Clause, see NOTICE.md. -->
{inline_scripts}
    <style>
        table {
            border-spacing: 15px;
        }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def _check_js(name: str, js: str) -> None:
    for bad in ("</script", "{plot_divs}", "{scripts}", "{refresh_tag}"):
        if bad.lower() in js.lower():
            sys.exit(f"error: {name}: contains '{bad}'; it cannot be inlined into DVC's template")


def main() -> None:
    out = Path(__file__).resolve().parent / "template.html"
    scripts, provenance = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, version, member, integrity in PACKAGES:
            got = subprocess.run(["npm", "pack", "--json", f"{name}@{version}"], cwd=tmp, check=True,
                                 capture_output=True, text=True).stdout
            if integrity not in got:
                sys.exit(f"error: {name}@{version}: npm integrity is not the pinned {integrity}")
            with tarfile.open(Path(tmp, f"{name}-{version}.tgz")) as tar:
                js = tar.extractfile(member).read().decode("utf-8")
            _check_js(f"{name}@{version}:{member}", js)
            scripts.append(f'    <script type="text/javascript">/* {name}@{version} {member} */\n{js}\n    </script>')
            provenance.append(f"{name}@{version}")
    page = PAGE.replace("{provenance}", ", ".join(provenance)).replace("{inline_scripts}", "\n".join(scripts))
    out.write_text(page, encoding="utf-8")
    print(f"{out}: {out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
