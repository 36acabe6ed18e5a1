"""`dvc plots show` draws every plot with no network: the committed template inlines vega, vega-lite and
vega-embed (.dvc/offline-plots/template.html, set as ``plots.html_template`` in .dvc/config).

Checked in a real headless Chromium (Debian's ``chromium``; .ci/run installs it) whose network is cut: every
host name fails to resolve and every request goes to a proxy on a closed port. A script appended to the page
counts, per vega plot, the coloured (data) pixels of its canvas and, per image plot, whether the image loaded;
Chromium's net log lists every request the page made. DVC's own default template (vega from a CDN) is the
broken variant: under the same conditions it draws nothing and the net log shows its CDN requests.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dvc_render.html import PAGE_HTML

REPO = Path(__file__).resolve().parents[2]
DVC = str(Path(sys.executable).parent / "dvc")

# Appended before the page's last </body>: waits until every vega plot has data pixels (or 20 s of page time),
# then writes the report into <pre id="render-report">, which --dump-dom prints.
CHECKER = """
<script>
(function () {
  var VEGA_IDS = %s, t0 = Date.now();
  function coloured(canvas) {  // pixels of the data marks: axes, grid and text are grey, marks are coloured
    if (!canvas || !canvas.width || !canvas.height) return 0;
    var d = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data, n = 0;
    for (var i = 0; i < d.length; i += 4) {
      if (d[i + 3] > 0 && Math.max(d[i], d[i + 1], d[i + 2]) - Math.min(d[i], d[i + 1], d[i + 2]) > 40) n++;
    }
    return n;
  }
  function report() {
    var r = {vega: {}, images: {}, ms: Date.now() - t0};
    VEGA_IDS.forEach(function (id) {
      var div = document.getElementById(id);
      r.vega[id] = coloured(div && div.querySelector('canvas'));
    });
    document.querySelectorAll('img').forEach(function (im) {
      r.images[im.getAttribute('src')] = im.complete ? im.naturalWidth : 0;
    });
    return r;
  }
  function poll() {
    var r = report();
    if (Object.values(r.vega).every(function (n) { return n > 0; }) || r.ms > 20000) {
      var pre = document.createElement('pre');
      pre.id = 'render-report';
      pre.textContent = JSON.stringify(r);
      document.body.appendChild(pre);
    } else {
      setTimeout(poll, 250);
    }
  }
  setTimeout(poll, 250);
})();
</script>
"""


def _chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("chromium not found: install Debian's chromium (`apt-get install chromium`; .ci/run does)")
    return path


def _page_requests(net_log: Path) -> list[str]:
    """URLs of every request the page (network isolation key file://) asked the network stack for.

    Chromium's own background requests (updates, time) have another isolation key; the proxy and resolver
    rules block them too."""
    log = json.loads(net_log.read_text())
    start_job = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    return [e["params"]["url"] for e in log["events"]
            if e["type"] == start_job and "file://" in e["params"].get("network_isolation_key", "")]


def _render_offline(page: Path, tmp: Path) -> tuple[dict, list[str]]:
    """Open ``page`` in headless Chromium with the network cut; returns (render report, page request URLs)."""
    html = page.read_text(encoding="utf-8")
    vega_ids = re.findall(r"vegaEmbed\('#([^']+)'", html)
    head, body_end, tail = html.rpartition("</body>")  # the last one: the inlined scripts contain "</body>" too
    checked = page.with_name("checked.html")
    checked.write_text(head + CHECKER % json.dumps(vega_ids) + body_end + tail, encoding="utf-8")
    net_log = tmp / "netlog.json"
    proc = subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         f"--user-data-dir={tmp / 'profile'}", "--disable-background-networking", "--disable-component-update",
         "--proxy-server=http://127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND",
         f"--log-net-log={net_log}", "--virtual-time-budget=60000", "--dump-dom", checked.as_uri()],
        capture_output=True, text=True, timeout=180)
    match = re.search(r'<pre id="render-report">(.*?)</pre>', proc.stdout, re.S)
    assert match, f"no render report from chromium (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(match.group(1)), _page_requests(net_log)


def _plots_show(tmp: Path, template: Path | None = None) -> Path:
    """``dvc plots show`` of the committed plots (dvclive/, plots/) with the project's config; returns the page."""
    cmd = [DVC, "plots", "show", "-o", str(tmp / "out")]
    if template is not None:
        cmd += ["--html-template", str(template)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return tmp / "out" / "index.html"


def _expected_plots(tmp: Path) -> tuple[int, int]:
    """(vega plots, image plots) that DVC finds in the committed outputs (`dvc plots show --json`)."""
    proc = subprocess.run([DVC, "plots", "show", "--json", "-o", str(tmp / "json")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    kinds = [item["type"] for items in json.loads(proc.stdout)["data"].values() for item in items]
    return kinds.count("vega"), kinds.count("image")


@pytest.mark.parametrize("template", ["committed", "dvc_default_cdn"])
def test_plots_render_offline(tmp_path, template):
    """With the committed config every curve and image is drawn and the page requests nothing but local
    files; DVC's default template (the broken variant) draws no curve and asks a CDN for vega."""
    n_vega, n_images = _expected_plots(tmp_path)
    assert n_vega >= 11 and n_images >= 1, (n_vega, n_images)  # training curves, PR curve, per-class AP, images
    override = None
    if template == "dvc_default_cdn":
        override = tmp_path / "dvc_default.html"
        override.write_text(PAGE_HTML, encoding="utf-8")
    page = _plots_show(tmp_path, override)
    report, requests = _render_offline(page, tmp_path)

    drawn = [pid for pid, pixels in report["vega"].items() if pixels > 0]
    loaded = [src for src, width in report["images"].items() if width > 0]
    remote = [url for url in requests if not url.startswith(("file:", "data:", "blob:"))]
    assert len(report["vega"]) == n_vega and len(report["images"]) == n_images, report
    if template == "committed":
        assert len(drawn) == n_vega, f"plots not drawn offline: {sorted(set(report['vega']) - set(drawn))}"
        assert len(loaded) == n_images, report["images"]
        assert remote == [], f"the page requested network resources: {remote}"
    else:
        assert drawn == [], report
        assert any("cdn.jsdelivr.net" in url for url in remote), requests
