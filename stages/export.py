"""Export stage: the trained model as a torch.export ExportedProgram and ONNX (TorchScript on request), each
checked against the eager model.

``python -m stages.export`` reads ``models/model.pt`` and ``data/cache/val`` and writes ``models/torch_export/``,
``models/model.onnx``, ``models/torchscript/``, ``models/export_report.json`` and ``models/model_card.md``
(params section ``export``), nothing unless every parity check passes. The work is
`detpipe.export.stage.export` (see its module docstring for the files' inputs and outputs and the parity gate).
"""
from __future__ import annotations

from detpipe.core.errors import run_program
from detpipe.export.stage import export
from detpipe.params import load


def main() -> None:
    """``python -m stages.export`` with params section ``export``."""
    export(load("export"))


if __name__ == "__main__":
    run_program(main)
