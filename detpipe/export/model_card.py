"""The model card (``models/MODEL_CARD.md``) of an export: a Jinja2 template over the checkpoint, the export
report, the dataset's ``meta.json`` and the evaluate stage's metrics."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import jinja2

from detpipe.core.files import folder_sha256
from detpipe.data.meta import read_meta

MODEL_CARD_TEMPLATE = """\
{# Jinja2, rendered by `model_card`; a line ending in a backslash continues on the next (Python's string). #}
# Model card: {{ ckpt['config']['name'] }}

- Trained for {{ ckpt.get('iters') }} iterations{{ ' (EMA weights)' if ckpt.get('ema') else '' }}; \
{{ meta['num_classes'] - 1 }} classes + background (labels 1..{{ meta['num_classes'] - 1 }}).
- Dataset: `{{ meta.get('annotations_file') }}`; Arrow shards manifest sha256 `{{ dataset_sha256 }}`; \
train {{ meta['splits']['train']['images'] }} images, val {{ meta['splits']['val']['images'] }} images.
- Model builder kwargs: `{{ ckpt['config'].get('kwargs', {}) | json }}`

## Metrics (COCO {{ 'bbox and segm' if segm else 'bbox' }} on val)

{% if segm %}
| stat | bbox | segm |
|---|---|---|
{% for stat, value in metrics['bbox'].items() %}
| {{ stat }} | {{ value | fmt('.4f') }} | {{ metrics['segm'][stat] | fmt('.4f') }} |
{% endfor %}
{% elif metrics %}
| stat | value |
|---|---|
{% for stat, value in metrics['bbox'].items() %}
| {{ stat }} | {{ value | fmt('.4f') }} |
{% endfor %}
{% else %}
(no {{ metrics_path }} yet: run the evaluate stage)
{% endif %}

## Training params

```yaml
{% for key, value in ckpt.get('params', {}).items() %}
{{ key }}: {{ value | json }}
{% endfor %}
```

## Files

{% set batched = report.get('batch', {}).get('dynamic') %}
{% if batched %}
{% set image_spec = '`images`: `float32 (B, 3, %d, %d)` RGB in [0, 1], B dynamic (each image resized to %d x %d, \
bilinear)' % (report['batch']['input_size'][0], report['batch']['input_size'][1], report['batch']['input_size'][0],\
 report['batch']['input_size'][1]) %}
{% else %}
{% set image_spec = '`image`: `float32 (3, H, W)` RGB in [0, 1], H and W dynamic' %}
{% endif %}
{% set outputs %}
`boxes` `float32 (N, 4)` XYXY input pixels, `scores` `float32 (N,)`, `labels` `int64 (N,)`\
{{ ', `batch_index` `int64 (N,)` (the image of the batch)' if batched else '' }}\
{{ ', `masks` `float32 (N, 1, H, W)` mask probabilities in [0, 1] at input pixels (> 0.5: in the mask)'\
 if masks else '' }}\
, then the raw pre-NMS head outputs \
{% for name in report['raw_outputs'] %}{{ ', ' if not loop.first else '' }}`{{ name }}`{% endfor %}
{% endset %}
| file | input | output |
|---|---|---|
| `model.onnx` (opset {{ report['opset'] }}) | {{ image_spec }} | {{ outputs }} |
{% if 'torch_export' in report['formats'] %}
| `torch_export/model.pt2` (torch.export) | {{ image_spec }} | {{ outputs }} |
{% endif %}
{% if 'torchscript' in report['formats'] %}
| `torchscript/model.ts` (TorchScript) | `list[Tensor]`, each `float32 (3, H, W)` RGB in [0, 1] | \
`(losses, detections)`; `detections[i]`: `boxes`, `scores`, `labels`{{ ', `masks`' if masks else '' }} as above |
{% endif %}
{% if 'openvino' in report['formats'] and report['formats']['openvino'].get('written', True) %}
| `openvino/model.xml` + `model.bin` (OpenVINO IR, float32, from the ONNX file) | {{ image_spec }} | {{ outputs }} |
{% endif %}
{% if 'int8' in report['formats'] and report['formats']['int8'].get('written', True) %}
| `int8/model.int8.onnx` (int8, QDQ: {{ report['formats']['int8']['quantizer']['method'] }}, \
calibrated on {{ report['formats']['int8']['calibration_images'] }} train images) | {{ image_spec }} | {{ outputs }} |
{% endif %}

Gates, per format:

| format | gate | result |
|---|---|---|
{% for name, r in report['formats'].items() %}
{% if r.get('gate') == 'accuracy' %}
| {{ name }} | accuracy: COCO AP and AP50 on {{ r['val_images'] }} val images within \
{{ r['accuracy']['max_ap_drop'] }} of eager; detections at score >= {{ r['scores']['count_score'] }} within \
x{{ r['scores']['max_count_ratio'] }} of eager's | {{ 'pass' if r['ok'] else 'FAIL' }}: \
AP {{ r['accuracy']['int8']['AP'] | fmt('.4f') }} (eager {{ r['accuracy']['eager']['AP'] | fmt('.4f') }}), \
AP50 {{ r['accuracy']['int8']['AP50'] | fmt('.4f') }} (eager {{ r['accuracy']['eager']['AP50'] | fmt('.4f') }}), \
{{ r['scores']['int8']['count'] }} detections (eager {{ r['scores']['eager']['count'] }})\
{{ '; NOT WRITTEN (export.on_gate_fail: skip)' if r.get('written') is false else '' }} |
{% else %}
| {{ name }} | parity: raw head outputs (before top-k/NMS) on {{ report['images'] }} val images equal within \
{{ report['rtol'] }} of their rms magnitude | {{ 'pass' if r['raw']['ok'] else 'FAIL' }} \
(largest relative difference {{ r['raw']['max_rel_diff'] | fmt('.2g') }}; \
final detections matched {{ r['detections']['match'] | fmt('.3f') }})\
{{ '; NOT WRITTEN (export.on_gate_fail: skip)' if r.get('written') is false else '' }} |
{% endif %}
{% endfor %}
{% for name, r in report['formats'].items() if r.get('written') is false %}

**{{ name }} is not in this export:** {{ r['skipped'] }}.
{% endfor %}
{% if 'int8' in report['formats'] %}
{% set q = report['formats']['int8']['quantizer'] %}

int8 quantizer: {{ q['method'] }}\
{% if 'kept_float' in q %}
; {{ q['quantized_layers'] }} of {{ q['layers'] }} layers int8, kept float: \
{{ q['kept_float'] | join(', ') if q['kept_float'] else 'none' }} (reverted by the accuracy control: \
{{ q['reverted'] | join(', ') if q['reverted'] else 'none' }}; score head by rule: {{ q['score_head'] | join(', ') }})\
{% elif q.get('score_head') %}
; score head kept float by rule: {{ q['score_head'] | join(', ') }}\
{% endif %}
{% if q.get('file') %}
; file written: {{ q['file']['kept'] }} ({{ q['file']['why'] }})\
{% endif %}
. Scores (val, int8 vs eager): {{ report['formats']['int8']['scores']['int8']['count'] }} vs \
{{ report['formats']['int8']['scores']['eager']['count'] }} detections at score >= \
{{ report['formats']['int8']['scores']['count_score'] }}; 90th percentile \
{{ report['formats']['int8']['scores']['int8']['p90'] | fmt('.3f') if report['formats']['int8']['scores']['int8']['p90'] is not none else '-' }} vs \
{{ report['formats']['int8']['scores']['eager']['p90'] | fmt('.3f') if report['formats']['int8']['scores']['eager']['p90'] is not none else '-' }}.
{% endif %}

Classes: the model's output `labels` are training labels; `predict` and `evaluate` report the dataset's own
category ids and names (`category_id_to_label` in `data/arrow/meta.json`; label 0 is the background)\
{% if meta.get('format') %}; {{ meta['format'] }} dataset\
{{ ': ids are the class indices of ' + meta['annotations_file'] if meta['format'] == 'yolo' else '' }}{% endif %}:

| label | category_id | name |
|---|---|---|
{% for cid, label in meta['category_id_to_label'].items() | sort(attribute='1') %}
| {{ label }} | {{ cid }} | {{ meta['label_names'][label] }} |
{% endfor %}

## Run

{% if 'torch_export' in report['formats'] %}
```python
import torch
from PIL import Image
from torchvision.transforms.functional import to_tensor
image = to_tensor(Image.open('image.jpg').convert('RGB'))  # float32 (3, H, W) in [0, 1]
model = torch.export.load('models/torch_export/model.pt2').module()
boxes, scores, labels = model(image)[:3]
```

{% endif %}
```python
import numpy as np, onnxruntime as ort
from PIL import Image
image = np.asarray(Image.open('image.jpg').convert('RGB'), np.float32).transpose(2, 0, 1) / 255
session = ort.InferenceSession('models/model.onnx', providers=['CPUExecutionProvider'])
{% if batched %}
# a batch of images (any sizes), resized to the input size; boxes mapped back to each image's pixels
import torch
from detpipe.export.batched import feed, split
size, images = {{ report['batch']['input_size'] | json }}, [torch.from_numpy(image)]
boxes, scores, labels = split(session.run(None, feed(images, size)), [im.shape[-2:] for im in images], size)[0][:3]
{% else %}
boxes, scores, labels = session.run(['boxes', 'scores', 'labels'], {'image': image})
{% endif %}
```
{% if not batched %}

One image per call: {{ report['batch']['reason'] if 'batch' in report else 'no batched export' }}.
{% endif %}
{% if 'openvino' in report['formats'] %}

```python
import openvino as ov
compiled = ov.Core().compile_model('models/openvino/model.xml', 'CPU', {'INFERENCE_PRECISION_HINT': 'f32'})
result = compiled({'image': image})  # image as for onnxruntime
boxes, scores, labels = (result[compiled.output(name)] for name in ('boxes', 'scores', 'labels'))
```
{% endif %}
{% if 'int8' in report['formats'] and report['formats']['int8'].get('written', True) %}

The int8 file runs like `model.onnx` (`ort.InferenceSession('models/int8/model.int8.onnx', ...)`).
{% endif %}
"""


@functools.cache
def _model_card_template() -> jinja2.Template:
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined, autoescape=False)
    env.filters.update(json=json.dumps, fmt=format)  # json.dumps as is (Jinja's tojson escapes <>&'), format(v, spec)
    return env.from_string(MODEL_CARD_TEMPLATE)


def model_card(ckpt: dict, report: dict, arrow_dir: Path, metrics_path: Path) -> str:
    """Markdown model card, rendered from `MODEL_CARD_TEMPLATE` (Jinja2): dataset hash (manifest sha256 of the
    Arrow shards, `detpipe.core.files.folder_sha256`), training params, COCO metrics (if ``metrics_path`` exists), the
    input/output spec of each exported file, the parity figures and minimal snippets to run the files.

    Args:
        ckpt: the final checkpoint (``models/model.pt``: ``config``, ``iters``, ``ema``, ``params``).
        report: the export report (``models/export_report.json``: ``opset``, ``formats``, ``images``, ``rtol``,
            ``raw_outputs``, ``masks``).
        arrow_dir: the convert stage's output (its ``meta.json`` and shards).
        metrics_path: the evaluate stage's ``metrics/eval.json`` (bbox, and segm for mask models).
    Returns:
        The card's markdown text, ending with one newline.
    Raises:
        detpipe.core.errors.StageError: ``arrow_dir/meta.json`` missing or not JSON (`detpipe.data.meta.read_meta`).
        OSError: ``arrow_dir`` or ``metrics_path`` unreadable.
        jinja2.UndefinedError: ``ckpt``, ``report`` or ``meta.json`` lacks a key the card shows.
    """
    meta = read_meta(Path(arrow_dir) / "meta.json", "convert")
    metrics = json.loads(Path(metrics_path).read_text()) if Path(metrics_path).is_file() else None
    return _model_card_template().render(
        ckpt=ckpt, report=report, meta=meta, metrics=metrics, metrics_path=metrics_path,
        segm=bool(metrics and "segm" in metrics), masks=bool(report.get("masks")),
        dataset_sha256=folder_sha256(Path(arrow_dir)))
