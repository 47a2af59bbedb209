"""The split planner: how to place trainer ranks and rollout agents on N GPUs, predicted from measured rates
(`predict`, pure), and the `asyncrl plan` command that prints it (`command`). A running job logs the same
prediction from its own busy times (`asyncrl.runtime.plan_view`).
"""

from asyncrl.planning.predict import (ADVICE_GAIN, WORKLOADS, Knobs, Layout, ModelShape, Plan, Prediction, Rates,
                                      Workload, engine_tok_s, layout_of, layouts, memory_gib, plan, predict,
                                      recommend, sync_seconds, timeline, trainer_scale)

__all__ = ["ModelShape", "Workload", "WORKLOADS", "Rates", "Knobs", "Layout", "Prediction", "Plan", "engine_tok_s",
           "memory_gib", "sync_seconds", "layouts", "predict", "recommend", "plan", "layout_of", "timeline",
           "trainer_scale", "ADVICE_GAIN"]
