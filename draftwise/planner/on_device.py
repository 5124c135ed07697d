"""A saved plan predicted again with cost models measured on another device: acceptance is a
property of the models and the traffic (measured where the real weights are, e.g. a CPU machine),
costs of the device (measured by `draftwise bench --suite gpu`, random weights of the same shape
suffice). `draftwise plan --from-plan PLAN.json --costs DIR`.

The costs are bare forward passes (no calibration against a real run on that device: there was
none), so absolute tokens/s are optimistic; the ratios to plain decoding are what this predicts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from draftwise.errors import InvalidParameterError
from draftwise.planner.plan import PlanOptions, drafter_footprint, predict, recommend
from draftwise.planner.replay import Replay
from draftwise.planner.simulate import Acceptance, Request
from draftwise.speculative.control.cost_model import CostModel


@dataclass(slots=True)
class DevicePrediction:
    costs_folder: str
    concurrency: tuple[int, ...]
    predictions: dict[str, list[dict]]  # config name -> one Prediction per concurrency
    best: dict[int, dict]
    switch_off_at: int | None
    missing: list[str]  # drafters of the plan without a cost model in the folder


def predict_on_device(plan_path: Path, costs_folder: Path,
                      concurrency: tuple[int, ...] | None = None) -> DevicePrediction:
    """The saved plan predicted again with another device's cost models (at `concurrency`, else the
    plan's levels)."""
    try:
        plan = json.loads(plan_path.read_text())
        requests = [Request(**r) for r in plan["sample_requests"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise InvalidParameterError(f"{plan_path}: not a plan.json written by `draftwise plan` ({error})") from None
    if not requests:
        raise InvalidParameterError(f"{plan_path}: the plan records no sampled requests (written by an older "
                                    f"draftwise: run `draftwise plan` again)")
    plain = CostModel.read(costs_folder / "plain.json")
    if plain is None:
        raise InvalidParameterError(f"{costs_folder}: no plain.json cost model (written by `draftwise bench "
                                    f"--suite gpu`, under <output>/costs)")
    options = PlanOptions(**{**plan["options"], "concurrency": concurrency or tuple(plan["options"]["concurrency"]),
                             "validate": False})  # (a prediction validates nothing: its levels are free)
    costs, acceptance, windows, replays, missing = {}, {}, {}, {}, []
    for facts in plan["drafters"]:
        method = facts["method"]  # an entry with options has no cost model of its own there
        measured = None if ":" in method else CostModel.read(costs_folder / f"{method}.json")
        if measured is None:
            missing.append(method)
            continue
        costs[method] = measured
        acceptance[method] = {segment: Acceptance(tuple(a["conditional"]), a["propose_rate"])
                              for segment, a in facts["acceptance"].items()}
        windows[method] = facts["catch_up_window"]
        if facts.get("matches"):
            replays[method] = Replay(tuple(tuple(m) for m in facts["matches"]))
    predictions = predict(plain, costs, acceptance, windows, requests, options, replays)
    best, switch_off = recommend(predictions, options.concurrency, drafter_footprint(
        {facts["method"]: (facts["weights_bytes"], facts["kv_bytes_per_token"]) for facts in plan["drafters"]}))
    return DevicePrediction(str(costs_folder), options.concurrency, predictions, best, switch_off, missing)


def render_device_prediction(prediction: DevicePrediction) -> str:
    levels = prediction.concurrency
    lines = [f"Predicted with the cost models in {prediction.costs_folder} (speedup over plain decoding at each "
             f"concurrency, the plan's traffic and acceptance):", "",
             "| config | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---|" * len(levels)]
    for name, points in prediction.predictions.items():
        cells = [f"{p['tokens_per_second'] / prediction.predictions['plain'][i]['tokens_per_second']:.2f}x"
                 for i, p in enumerate(points)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Best per concurrency: " + "; ".join(f"c={c}: {b['config']} {b['speedup']:.2f}x"
                                                       for c, b in prediction.best.items())]
    if prediction.switch_off_at is not None:
        lines.append(f"Speculation stops paying at concurrency {prediction.switch_off_at}.")
    if prediction.missing:
        lines.append(f"Not predicted (no cost model measured on the device): {', '.join(prediction.missing)}.")
    return "\n".join(lines)
