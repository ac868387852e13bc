"""Every composition through ``jaxtp train``'s real loop (issue 37).

The matrix is generated (:func:`jaxtp.testing.composition_layouts`: every layout over pipeline x
schedule, data, fsdp, context, expert, model, sequence parallelism, ZeRO stage and mode that the
validator accepts on 8 devices). CI runs its covering subset, in which every pair of axes and
every schedule, SP, ZeRO stage and mode occur at least once, and the pipeline example of
docs/pipelines.md (issue 37's deadlock) in both modes; each layout is a
real ``jaxtp train`` subprocess on 8 simulated devices (prefetch, metrics, checkpoints at 2 and 4,
evals at 2, 4 and 6), stopped at step 4 and resumed to step 6 by the same command, compared step
by step with the one-device run of the same model and batch. ``experiments/composition_matrix.py``
runs all of it.

Tolerance: fp32, |loss - one-device loss| <= 2e-4 at every step (train and eval) -- reductions
run in a different order over the mesh; measured differences are ~1e-6.
"""

import itertools

import pytest

from jaxtp.testing import (
    MATRIX_PAIRED,
    MATRIX_STEPS,
    README_PIPELINE,
    README_PIPELINE_EXPLICIT,
    composition_layouts,
    covering_subset,
    run_matrix_layout,
    train_env,
)

LOSS_ATOL = 2e-4
ACCEPTED, REFUSED = composition_layouts(8)
SUBSET = covering_subset(ACCEPTED)


def test_the_matrix_and_its_covering_subset():
    assert len(ACCEPTED) > 400 and {README_PIPELINE, README_PIPELINE_EXPLICIT} <= set(SUBSET)
    names = [x.name for x in ACCEPTED]
    assert len(names) == len(set(names))
    # the refused layouts are exactly the compositions a pipeline cannot run yet (issue 40),
    # each with the validator's one-line error naming the key
    for layout, error in REFUSED:
        d = layout.degree
        assert d["pipeline"] > 1 and (d["context"] > 1 or d["expert"] > 1), layout.name
        assert error.startswith("parallel.pipeline=") and "\n" not in error
    # every pair of paired features that some accepted layout has, the subset has too
    def pairs(layout):
        f = sorted(g for g in layout.features() if g.split("=")[0] in MATRIX_PAIRED)
        return set(itertools.combinations(f, 2))

    want = set().union(*map(pairs, ACCEPTED))
    assert want <= set().union(*map(pairs, SUBSET))
    assert {("data", "model"), ("context", "expert"), ("fsdp", "pipeline")} <= want
    every = set().union(*(x.features() for x in ACCEPTED))
    assert every == set().union(*(x.features() for x in SUBSET))
    assert {"schedule=zb1", "schedule=interleaved", "zero=3", "sequence_parallel",
            "mode=explicit"} <= every
    assert len(SUBSET) <= 10  # what the test budget holds


@pytest.fixture(scope="module")
def matrix_root(tmp_path_factory):
    return tmp_path_factory.mktemp("matrix")


@pytest.mark.parametrize("layout", SUBSET, ids=[x.name for x in SUBSET])
def test_layout_through_the_loop_matches_one_device(layout, matrix_root):
    # LLVM at -O0, as conftest.py sets for in-process compiles: a third less compile time, and
    # nothing here is timed
    result = run_matrix_layout(layout, matrix_root,
                               train_env(XLA_FLAGS="--xla_backend_optimization_level=0"))
    assert "error" not in result, result
    assert result["steps"] == list(range(1, MATRIX_STEPS[-1] + 1))
    assert result["resumed"], "the second run did not resume from step 4's checkpoint"
    assert result["max_loss_diff"] <= LOSS_ATOL, result
    assert result["max_eval_diff"] <= LOSS_ATOL, result
