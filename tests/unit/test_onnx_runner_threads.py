"""predict's and serve's onnxruntime sessions (`detpipe.predict.load_runner`) run with intra-op threads that sleep
when idle instead of spin-waiting: spinning burnt ~20 CPU ms per image at one image per call on 2 cores, CPU the
server's decoding threads need (benchmarks/ort_spin.py, docs/serve.md). Checked on the session the runner really
uses, for the float and the int8 loading paths, on a tiny graph with the export stage's output names."""
from __future__ import annotations

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from detpipe.predict.runners import load_runner

SPIN = "session.intra_op.allow_spinning"


def _tiny_graph(path) -> None:
    """A one-image graph: ``image`` float32 (3, H, W) -> ``boxes`` (1, 4), ``scores`` (1,), ``labels`` int64 (1,)."""
    nodes = [helper.make_node("Constant", [], ["boxes"], value=helper.make_tensor("b", TensorProto.FLOAT, [1, 4],
                                                                                   [1.0, 2.0, 3.0, 4.0])),
             helper.make_node("Constant", [], ["scores"], value=helper.make_tensor("s", TensorProto.FLOAT, [1], [0.5])),
             helper.make_node("Constant", [], ["labels"], value=helper.make_tensor("l", TensorProto.INT64, [1], [1]))]
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("image", TensorProto.FLOAT, [3, "h", "w"])],
                              [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [1, 4]),
                               helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1]),
                               helper.make_tensor_value_info("labels", TensorProto.INT64, [1])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))


@pytest.mark.parametrize("name", ["model.onnx", "model.int8.onnx"])
def test_onnx_sessions_do_not_spin(tmp_path, name):
    _tiny_graph(tmp_path / name)
    run, runtime, _ = load_runner(tmp_path / name)
    assert run.session.get_session_options().get_session_config_entry(SPIN) == "0", runtime
    out = run([torch.zeros(3, 8, 8)])[0]          # the session still runs: the graph's constants come back
    assert out["boxes"].tolist() == [[1.0, 2.0, 3.0, 4.0]] and out["labels"].dtype == torch.int64
