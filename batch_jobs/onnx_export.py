"""The model as ONNX: the fitted model's graph up to its margin, and the calibration
appended to it, so the served file outputs the calibrated probability.

:func:`lightgbm_margin_onnx` (the converter's tree ensemble without its float32 logistic)
and :func:`tensor_margin_onnx` (the MLP in standard ops the CUDA execution provider runs
whole) end in ``margin`` [N, 1]; :func:`with_calibration` appends the calibration
(``batch_jobs.calibration``) and outputs ``probabilities`` [N, 2] as the service reads;
:func:`onnx_margins` runs a margin graph in ONNX Runtime, so the calibration is fitted on
exactly the numbers the served graph feeds into it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from fraud_scoring.model_repo import Calibration, ModelError

if TYPE_CHECKING:
    import lightgbm as lgb
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler


def onnx_margins(margin_graph: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The graph's ``margin`` output in ONNX Runtime: calibration is fitted on exactly
    the float32 numbers the served graph feeds into it."""
    sess = ort.InferenceSession(
        margin_graph.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    return np.asarray(sess.run(["margin"], {"input": x})[0], np.float64)[:, 0]


def with_platt(margin_graph: onnx.ModelProto, a: float, b: float) -> bytes:
    """:func:`with_calibration` with Platt scaling ``p = sigmoid(a * margin + b)``."""
    now = datetime.now(UTC)
    return with_calibration(
        margin_graph, Calibration(a=a, b=b, fitted_on=(now, now), rows=0, positives=0)
    )


def with_calibration(margin_graph: onnx.ModelProto, cal: Calibration) -> bytes:
    """Append the calibration ``cal`` to a graph whose output is ``margin`` [N, 1] and
    output ``probabilities`` [N, 2] = (1 - p, p), as the service reads.

    Platt: ``z = a * margin + b``. Piecewise: ``z`` is linear between the knots
    (``z_0 + sum_j dz_j * clip((margin - k_j) / (k_{j+1} - k_j), 0, 1)``: Sub, Mul,
    Min, Max, MatMul) with its own slopes beyond the end knots. Then
    ``p = 1 / (1 + exp(-z))``. Standard ops only, so the CUDA provider runs it all.

    This keeps float32 resolution for small probabilities: LightGBM's own export
    computes 1 - (1 - p), which is exactly 0 below about 6e-8."""
    a, b, knots, knot_logits = cal.a, cal.b, cal.knots, cal.knot_logits
    m = onnx.ModelProto()
    m.CopyFrom(margin_graph)
    g = m.graph

    def const(name: str, value: Any) -> None:
        g.initializer.append(numpy_helper.from_array(np.asarray(value, np.float32), name))

    const("platt_one", np.ones((1, 1)))
    if not knots:
        const("platt_a", [[a]])
        const("platt_b", [[b]])
        g.node.extend(
            [
                helper.make_node("Mul", ["margin", "platt_a"], ["platt_scaled"]),
                helper.make_node("Add", ["platt_scaled", "platt_b"], ["platt_logit"]),
            ]
        )
    else:
        k = np.asarray(knots, np.float64)
        z = np.asarray(knot_logits, np.float64)
        const("cal_first_knot", [[k[0]]])
        const("cal_last_knot", [[k[-1]]])
        const("cal_first_logit", [[z[0]]])
        const("cal_slope_below", [[a if cal.slope_below is None else cal.slope_below]])
        const("cal_slope_above", [[a if cal.slope_above is None else cal.slope_above]])
        const("cal_zero", 0.0)
        g.node.extend(
            [
                # Beyond the end knots: the tails' own slopes.
                helper.make_node("Sub", ["margin", "cal_first_knot"], ["cal_below"]),
                helper.make_node("Min", ["cal_below", "cal_zero"], ["cal_below_part"]),
                helper.make_node("Mul", ["cal_below_part", "cal_slope_below"], ["cal_low"]),
                helper.make_node("Sub", ["margin", "cal_last_knot"], ["cal_above"]),
                helper.make_node("Max", ["cal_above", "cal_zero"], ["cal_above_part"]),
                helper.make_node("Mul", ["cal_above_part", "cal_slope_above"], ["cal_high"]),
                helper.make_node("Add", ["cal_low", "cal_high"], ["cal_tail_logit"]),
                helper.make_node("Add", ["cal_tail_logit", "cal_first_logit"], ["cal_base"]),
            ]
        )
        if len(k) > 1:
            const("cal_knots", k[:-1].reshape(1, -1))
            const("cal_inv_width", (1 / np.diff(k)).reshape(1, -1))
            const("cal_rise", np.diff(z).reshape(-1, 1))
            const("cal_one", 1.0)
            g.node.extend(
                [
                    helper.make_node("Sub", ["margin", "cal_knots"], ["cal_from_knot"]),
                    helper.make_node("Mul", ["cal_from_knot", "cal_inv_width"], ["cal_pos"]),
                    # Min/Max, not Clip: LightGBM's graph is opset 9 (Clip-6 has no
                    # tensor bounds).
                    helper.make_node("Min", ["cal_pos", "cal_one"], ["cal_upto_one"]),
                    helper.make_node("Max", ["cal_upto_one", "cal_zero"], ["cal_share"]),
                    helper.make_node("MatMul", ["cal_share", "cal_rise"], ["cal_rised"]),
                    helper.make_node("Add", ["cal_base", "cal_rised"], ["platt_logit"]),
                ]
            )
        else:
            g.node.append(helper.make_node("Identity", ["cal_base"], ["platt_logit"]))
    g.node.extend(
        [
            # 1 / (1 + exp(-z)) rather than Sigmoid: ONNX Runtime's Sigmoid is accurate
            # only to about 1e-7 absolute and returns 0 below that.
            helper.make_node("Neg", ["platt_logit"], ["platt_neg"]),
            helper.make_node("Exp", ["platt_neg"], ["platt_exp"]),
            helper.make_node("Add", ["platt_exp", "platt_one"], ["platt_denominator"]),
            helper.make_node("Reciprocal", ["platt_denominator"], ["p1"]),
            helper.make_node("Sub", ["platt_one", "p1"], ["p0"]),
            helper.make_node("Concat", ["p0", "p1"], ["probabilities"], axis=1),
        ]
    )
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, [None, 2]))
    onnx.checker.check_model(m)
    return bytes(m.SerializeToString())


def tensor_margin_onnx(model: Pipeline, n_features: int) -> onnx.ModelProto:
    """The MLP as a plain ONNX graph of standard ops (Sub, Div, MatMul, Add, Relu) that
    the CUDA execution provider runs in full, ending in the logit ``margin`` [N, 1].
    skl2onnx would emit ai.onnx.ml Scaler/ArrayFeatureExtractor nodes, which run only on
    CPU."""
    scaler: StandardScaler = model.named_steps["scale"]
    mlp: MLPClassifier = model.named_steps["mlp"]
    f32 = np.float32
    inits = [
        numpy_helper.from_array(np.asarray(scaler.mean_, f32), "mean"),
        numpy_helper.from_array(np.asarray(scaler.scale_, f32), "scale"),
    ]
    nodes = [
        helper.make_node("Sub", ["input", "mean"], ["centered"]),
        helper.make_node("Div", ["centered", "scale"], ["h0"]),
    ]
    h = "h0"
    layers = list(zip(mlp.coefs_, mlp.intercepts_, strict=True))
    for k, (w, b) in enumerate(layers):
        inits += [
            numpy_helper.from_array(np.asarray(w, f32), f"w{k}"),
            numpy_helper.from_array(np.asarray(b, f32), f"b{k}"),
        ]
        last = k == len(layers) - 1
        nodes += [
            helper.make_node("MatMul", [h, f"w{k}"], [f"m{k}"]),
            helper.make_node("Add", [f"m{k}", f"b{k}"], ["margin" if last else f"a{k}"]),
        ]
        if not last:
            h = f"h{k + 1}"
            nodes.append(helper.make_node("Relu", [f"a{k}"], [h]))
    graph = helper.make_graph(
        nodes,
        "fraud_mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [None, n_features])],
        [helper.make_tensor_value_info("margin", TensorProto.FLOAT, [None, 1])],
        inits,
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def lightgbm_margin_onnx(model: lgb.LGBMClassifier, n_features: int) -> onnx.ModelProto:
    """LightGBM → ONNX with one float input ``input`` [N, F] and the raw margin (log-odds
    before any sigmoid) as ``margin`` [N, 1].

    The converter's tree ensemble applies its own logistic post-transform, which loses
    small probabilities in float32; it is switched off here (the ensemble then outputs
    ``[-margin, margin]``) and column 1 is taken."""
    from onnxmltools import convert_lightgbm
    from onnxmltools.convert.common.data_types import FloatTensorType

    m = convert_lightgbm(
        model,
        initial_types=[("input", FloatTensorType([None, n_features]))],
        zipmap=False,
        target_opset=15,
    )
    ensembles = [n for n in m.graph.node if n.op_type == "TreeEnsembleClassifier"]
    if len(ensembles) != 1:
        raise ModelError(f"LightGBM export: expected one TreeEnsembleClassifier, got {ensembles}")
    for attr in ensembles[0].attribute:
        if attr.name == "post_transform":
            attr.s = b"NONE"
    # Keep only what leads to the probability tensor; the label output is not served.
    wanted = {"probabilities"}
    kept = []
    for node in reversed(m.graph.node):
        if wanted & set(node.output):
            kept.append(node)
            wanted |= set(node.input)
    del m.graph.node[:]
    m.graph.node.extend(reversed(kept))
    for node in m.graph.node:
        node.output[:] = ["raw_scores" if o == "probabilities" else o for o in node.output]
    m.graph.initializer.append(numpy_helper.from_array(np.asarray([1], np.int64), "fraud_column"))
    m.graph.node.append(
        helper.make_node("Gather", ["raw_scores", "fraud_column"], ["margin"], axis=1)
    )
    del m.graph.output[:]
    m.graph.output.append(helper.make_tensor_value_info("margin", TensorProto.FLOAT, [None, 1]))
    onnx.checker.check_model(m)
    return m
