"""`dvc plots show` draws every plot with no network: the committed template inlines vega, vega-lite and
vega-embed (.dvc/offline-plots/template.html, set as ``plots.html_template`` in .dvc/config).

Checked in a real headless Chromium (Debian's ``chromium``; .ci/run installs it) whose network is cut: every
host name fails to resolve and every request goes to a proxy on a closed port. A script appended to the page
counts, per vega plot, the coloured (data) pixels of its canvas and, per image plot, whether the image loaded;
Chromium's net log lists every request the page made. DVC's own default template (vega from a CDN) is the
broken variant: under the same conditions it draws nothing and the net log shows its CDN requests.

The error analysis and the label statistics (issue 33: the confusion matrix, the TIDE error bars, the worst
images, the train split's label histograms and the first training batch) are checked on the page of the
session's ``reproduced_repo`` (the evaluate stage's real outputs) by what vega drew: a script placed before the
page's plots keeps each plot's vega view, and the report lists, per plot, the rect marks with a non-empty
bounding box in its scenegraph and the y axis' labels top to bottom. Set ``DETPIPE_PLOTS_SCREENSHOT`` to a
PNG path to keep a screenshot of that page.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dvc_render.html import PAGE_HTML

REPO = Path(__file__).resolve().parents[2]
DVC = str(Path(sys.executable).parent / "dvc")
PAGE_WIDTH = 1400    # CSS pixels: Chromium's window width for the report and the screenshots

# Placed before the page's first plot: keeps each plot's vega view (vegaEmbed's result) for CHECKER's scenegraph
# walk. DVC's default template's vegaEmbed never loads offline: then nothing is kept.
VIEWS_HOOK = """
<script>
window.__views = {};
if (window.vegaEmbed) {
  window.vegaEmbed = (function (embed) {
    return function (el, spec, opt) {
      var done = embed(el, spec, opt);
      done.then(function (result) { window.__views[String(el).replace('#', '')] = result.view; });
      return done;
    };
  })(window.vegaEmbed);
}
</script>
"""

# Appended before the page's last </body>: waits until every vega plot has data pixels (or 20 s of page time),
# then writes the report into <pre id="render-report">, which --dump-dom prints. Per vega plot: the coloured
# pixels of its canvas (``vega``), and from its scenegraph (``marks``) the data rects drawn (role "mark", not
# fully transparent, bounding box wider and taller than 0: bars and heatmap cells), their distinct fills, and the
# labels of the y scale's axis, top to bottom; per image, its natural width (``images``, 0: not loaded) and the
# opaque share of its last pixel row as decoded (``last_rows``: 0 for a truncated file; the page's file:// images
# are readable from a canvas with --allow-file-access-from-files); per plot and image, its box on the page
# (``boxes``: x, y, width, height in CSS pixels, for screenshots).
CHECKER = """
<script>
(function () {
  var VEGA_IDS = %s, t0 = Date.now();
  function marks(view) {
    var out = {rects: 0, fills: {}, y_labels: []};
    function walk(mark, orient) {
      (mark.items || []).forEach(function (item) {
        var o = mark.role === 'axis' && item.datum ? /(^|_)y$/.test(item.datum.scale) : orient;
        if (mark.marktype === 'rect' && mark.role === 'mark' && item.bounds && item.opacity !== 0
            && item.bounds.width() > 0 && item.bounds.height() > 0 && item.fill) {
          out.rects++;
          out.fills[String(item.fill)] = 1;
        }
        if (mark.role === 'axis-label' && o === true) out.y_labels.push([item.y, String(item.text)]);
        if (mark.marktype === 'group') (item.items || []).forEach(function (m) { walk(m, o); });
      });
    }
    walk(view.scenegraph().root, null);
    out.y_labels.sort(function (a, b) { return a[0] - b[0]; });
    out.y_labels = out.y_labels.map(function (l) { return l[1]; });
    out.fills = Object.keys(out.fills).length;
    return out;
  }
  function lastRow(im) {  // the opaque share of the image's last pixel row: 0 for a truncated file
    if (!im.complete || !im.naturalWidth) return 0;
    var c = document.createElement('canvas');
    c.width = im.naturalWidth;
    c.height = im.naturalHeight;
    var g = c.getContext('2d'), n = 0;
    g.drawImage(im, 0, 0);
    try {
      var d = g.getImageData(0, c.height - 1, c.width, 1).data;
    } catch (e) {
      return -1;  // a tainted canvas: Chromium was started without --allow-file-access-from-files
    }
    for (var i = 3; i < d.length; i += 4) if (d[i] > 0) n++;
    return n / c.width;
  }
  function box(el) {
    var r = el.getBoundingClientRect();
    return [r.left + window.scrollX, r.top + window.scrollY, r.width, r.height];
  }
  function coloured(canvas) {  // pixels of the data marks: axes, grid and text are grey, marks are coloured
    if (!canvas || !canvas.width || !canvas.height) return 0;
    var d = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data, n = 0;
    for (var i = 0; i < d.length; i += 4) {
      if (d[i + 3] > 0 && Math.max(d[i], d[i + 1], d[i + 2]) - Math.min(d[i], d[i + 1], d[i + 2]) > 40) n++;
    }
    return n;
  }
  function report() {
    var r = {vega: {}, marks: {}, images: {}, last_rows: {}, boxes: {}, ms: Date.now() - t0};
    VEGA_IDS.forEach(function (id) {
      var div = document.getElementById(id);
      r.vega[id] = coloured(div && div.querySelector('canvas'));
      if (window.__views && window.__views[id]) r.marks[id] = marks(window.__views[id]);
      if (div) r.boxes[id] = box(div);
    });
    document.querySelectorAll('img').forEach(function (im) {
      r.images[im.getAttribute('src')] = im.complete ? im.naturalWidth : 0;
      r.last_rows[im.getAttribute('src')] = lastRow(im);
      r.boxes[im.getAttribute('src')] = box(im);
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


def _chromium_offline(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    """Headless Chromium with the network cut (no name resolves, every request goes to a closed port)."""
    return subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         f"--user-data-dir={tmp / 'profile'}", "--disable-background-networking", "--disable-component-update",
         "--proxy-server=http://127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND",
         "--allow-file-access-from-files", *args],
        capture_output=True, text=True, timeout=180)


def _render_offline(page: Path, tmp: Path) -> tuple[dict, list[str]]:
    """Open ``page`` in headless Chromium with the network cut; returns (render report, page request URLs)."""
    html = page.read_text(encoding="utf-8")
    vega_ids = re.findall(r"vegaEmbed\('#([^']+)'", html)
    first_plot = re.search(r"<script[^>]*>\s*var spec = ", html)  # DVC's first plot: the libraries are above it
    if first_plot:
        html = html[:first_plot.start()] + VIEWS_HOOK + html[first_plot.start():]
    head, body_end, tail = html.rpartition("</body>")  # the last one: the inlined scripts contain "</body>" too
    checked = page.with_name("checked.html")
    checked.write_text(head + CHECKER % json.dumps(vega_ids) + body_end + tail, encoding="utf-8")
    net_log = tmp / "netlog.json"
    proc = _chromium_offline(tmp, f"--window-size={PAGE_WIDTH},1000", f"--log-net-log={net_log}",
                             "--virtual-time-budget=60000", "--dump-dom", checked.as_uri())
    match = re.search(r'<pre id="render-report">(.*?)</pre>', proc.stdout, re.S)
    assert match, f"no render report from chromium (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(match.group(1)), _page_requests(net_log)


def _screenshot(page: Path, png: Path, tmp: Path, height: int) -> Path:
    """A screenshot of the top ``height`` CSS pixels of ``page`` (offline, plots drawn, laid out as
    `_render_offline` lays it out: the report's boxes are where the screenshot shows them) into ``png``."""
    png.parent.mkdir(parents=True, exist_ok=True)
    proc = _chromium_offline(tmp, "--hide-scrollbars", f"--window-size={PAGE_WIDTH},{height}",
                             "--virtual-time-budget=30000", f"--screenshot={png}", page.as_uri())
    assert png.is_file(), f"no screenshot from chromium (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return png


def _plots_show(tmp: Path, template: Path | None = None, repo: Path = REPO) -> Path:
    """``dvc plots show`` of the committed plots (dvclive/, plots/) with the project's config; returns the page."""
    cmd = [DVC, "plots", "show", "-o", str(tmp / "out")]
    if template is not None:
        cmd += ["--html-template", str(template)]
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return tmp / "out" / "index.html"


def _expected_plots(tmp: Path) -> tuple[int, int, set[str]]:
    """(vega plots, image plots) that DVC finds in the committed outputs (`dvc plots show --json`), and the page
    container ids of the plots it cannot load here: DVC-cached outputs (convert's label statistics), which a
    checkout holds only after ``dvc repro`` or ``dvc pull`` -- each asserted to be out of git, so a committed plot
    that fails to load still fails the test."""
    proc = subprocess.run([DVC, "plots", "show", "--json", "-o", str(tmp / "json")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    kinds = [item["type"] for items in shown["data"].values() for item in items]
    absent = {e["source"] for e in shown.get("errors") or [] if e["type"] == "FileNotFoundError"}
    for path in absent:
        tracked = subprocess.run(["git", "ls-files", "--error-unmatch", path], cwd=REPO, capture_output=True)
        assert tracked.returncode != 0, f"{path} is committed but DVC cannot load it"
    return kinds.count("vega"), kinds.count("image"), {p.replace("/", "_").replace(".", "_") for p in absent}


@pytest.mark.parametrize("template", ["committed", "dvc_default_cdn"])
def test_plots_render_offline(tmp_path, template):
    """With the committed config every curve and image is drawn and the page requests nothing but local
    files; DVC's default template (the broken variant) draws no curve and asks a CDN for vega."""
    n_vega, n_images, absent = _expected_plots(tmp_path)
    assert n_vega >= 11 and n_images >= 1, (n_vega, n_images)  # training curves, PR curve, per-class AP, images
    override = None
    if template == "dvc_default_cdn":
        override = tmp_path / "dvc_default.html"
        override.write_text(PAGE_HTML, encoding="utf-8")
    page = _plots_show(tmp_path, override)
    report, requests = _render_offline(page, tmp_path)
    assert all(report["vega"].get(pid, 0) == 0 for pid in absent), report   # an empty box, not a stale plot
    report["vega"] = {pid: pixels for pid, pixels in report["vega"].items() if pid not in absent}

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


def _rows(path: Path) -> list[dict]:
    """The rows of DVC plot file ``path`` (``{"<name>": [row, ...]}``)."""
    (rows,) = json.loads(path.read_text()).values()
    return rows


def test_error_analysis_and_label_plots_are_drawn(reproduced_repo, tmp_path):
    """On the page of the pipeline's own outputs (``reproduced_repo``, drawn offline): the confusion matrix has one
    coloured cell per (actual, predicted) pair of plots/confusion.json and its rows are the ground-truth classes;
    the error bars have one bar per non-zero dAP50 of plots/errors.json, labelled by the error types; every worst
    image and the first training batch decoded to their last pixel row; the label statistics have one bar per non-empty class or bin, the
    histograms' bins top to bottom in numeric order (not as strings: "11.3" after "8")."""
    from support.repos import clone_with_cache

    repo = clone_with_cache(reproduced_repo, tmp_path / "repo")    # `dvc plots show` writes under .dvc/tmp
    page = _plots_show(tmp_path, repo=repo)
    report, requests = _render_offline(page, tmp_path)
    if os.environ.get("DETPIPE_PLOTS_SCREENSHOT"):
        height = max(y + h for x, y, w, h in report["boxes"].values())
        _screenshot(page, Path(os.environ["DETPIPE_PLOTS_SCREENSHOT"]), tmp_path, int(height) + 40)
    assert [url for url in requests if not url.startswith(("file:", "data:", "blob:"))] == []
    not_drawn = {"rects": 0, "fills": 0, "y_labels": []}     # a plot whose vegaEmbed never resolved
    marks = {pid: report["marks"].get(pid, not_drawn) for pid in report["vega"]}

    confusion = _rows(repo / "plots/confusion.json")
    actual, predicted = {r["actual"] for r in confusion}, {r["predicted"] for r in confusion}
    drawn = marks["plots_confusion_json"]
    assert drawn["rects"] > 0 and report["vega"]["plots_confusion_json"] > 0, ("confusion matrix not drawn", drawn)
    # the template's grid: every (actual, predicted) pair of the values seen, an absent one as a 0 count
    assert drawn["rects"] == len(actual) * len(predicted), (drawn, sorted(actual), sorted(predicted))
    assert drawn["y_labels"] == sorted(actual), drawn

    errors = _rows(repo / "plots/errors.json")
    assert {r["error"] for r in errors} == {"cls", "loc", "both", "dupe", "bkg", "miss", "FP", "FN"}
    drawn = marks["plots_errors_json"]
    assert drawn["rects"] > 0 and report["vega"]["plots_errors_json"] > 0, ("error bars not drawn", drawn)
    assert drawn["rects"] == sum(r["dAP50"] != 0 for r in errors), (drawn, errors)
    assert sorted(drawn["y_labels"]) == sorted(r["error"] for r in errors), drawn

    # images decoded to their last row (RGB files: every pixel opaque)
    worst = sorted(p.name for p in (repo / "plots/worst_images").iterdir())
    shown = {src: row for src, row in report["last_rows"].items() if "plots_worst_images_" in src}
    assert worst and len(shown) == len(worst) and set(shown.values()) == {1}, (worst, report["last_rows"])
    batch = [row for src, row in report["last_rows"].items() if src.endswith("plots_train_batch.png")]
    assert batch == [1], report["last_rows"]

    instances = _rows(repo / "plots/labels/instances.json")
    assert marks["plots_labels_instances_json"]["rects"] == sum(r["instances"] > 0 for r in instances) > 0
    for name in ("box_width", "box_height", "aspect_ratio"):
        bins = _rows(repo / f"plots/labels/{name}.json")
        drawn = marks[f"plots_labels_{name}_json"]
        assert drawn["rects"] == sum(r["boxes"] > 0 for r in bins) > 0, (name, drawn)
        labels = [float(label.replace(",", "")) for label in drawn["y_labels"]]
        assert labels == sorted(r["from"] for r in bins), (name, drawn["y_labels"])
