"""The planner's predictions checked against what XLA compiles: the best layouts' grad steps
compiled ahead of time on the current (e.g. simulated CPU) devices, their bytes and collective
census set beside the cost model's (``jaxtp plan --verify K``)."""

from __future__ import annotations

from jaxtp.configs import Config, ConfigError, apply_overrides
from jaxtp.inspect.hlo import census, collectives
from jaxtp.inspect.placement import compile_step
from jaxtp.parallel import mesh_shape
from jaxtp.planner import Estimate, Shape, predicted_grad_step
from jaxtp.step import build_engine


def verify(cfg: Config, estimates: list[Estimate], k: int, *,
           activations: str = "jaxtp") -> list[dict]:
    """Compile the grad step of the first ``k`` layouts this version's engine builds (AOT, from
    abstract inputs on the current -- e.g. simulated CPU -- devices) and set each beside its
    prediction. Layouts ranked above them that the engine rejects are returned too, with the
    reason ("not compilable in this version")."""
    s, rows, done = Shape.of(cfg), [], 0
    for rank, est in enumerate(estimates, 1):
        if done == k:
            break
        row = {"rank": rank, "layout": est.layout,
               "predicted": predicted_grad_step(s, est.layout, activations=activations)}
        rows.append(row)
        try:
            eng = build_engine(apply_overrides(cfg, est.layout.overrides()))
        except ConfigError as err:
            row["not_compilable"] = str(err)
            continue
        compiled = compile_step(eng, "grad")
        mem = compiled.memory_analysis()
        row["compiled"] = {"arguments": int(mem.argument_size_in_bytes),
                           "outputs": int(mem.output_size_in_bytes),
                           "temporaries": int(mem.temp_size_in_bytes),
                           "collectives": {(c["kind"], tuple(c["axes"])): c["bytes"]
                                           for c in census(collectives(
                                               compiled.as_text(), mesh_shape(eng.layout.mesh)))}}
        done += 1
    return rows
