"""The cold start inside ``agentgym train``: SFT on demonstrations when the starting model
does not follow the env's protocol, then RL from the result.

    agentgym train env=search                              # trainer.cold_start=auto (default)
    agentgym train env=search trainer.cold_start=off       # RL from the model as it is
    agentgym train env=search trainer.cold_start=runs/sft   # a ready SFT run (its newest checkpoint)

GRPO learns from reward differences within a group. A model that never produces a
well-formed answer (the base smollm2-135m on Search-R1's protocol: format-valid 0.01)
earns 0 on every sample, every advantage is 0, and RL has nothing to learn from. With
``trainer.cold_start=auto`` the run first plays ``trainer.cold_start_probe`` training
questions greedily; if the share of format-valid episodes (ended with an answer, no
malformed action) is below ``trainer.cold_start_threshold``, it

1. builds demonstrations with the env's builder (:mod:`agentgym.data.demo_builders`) from the
   training rows until it has ``trainer.cold_start_demos`` that fit the rollout budgets;
2. runs SFT on them (:func:`agentgym.trainers.sft.sft`: ``sft.epochs``, ``sft.batch_size``, lr
   ``trainer.cold_start_lr`` with cosine decay) in ``RUN_DIR/cold_start/`` (its own
   ``metrics.jsonl``, ``loss_curve.png``, TensorBoard events, checkpoints, so a killed
   cold start resumes);
3. probes the SFT result on the same questions (unless RL's step-0 eval measures it on
   the held-out questions: ``trainer.eval_limit`` > 0 and steps to take), and starts RL
   from it.

A mixed run (``env=[search,code]``) probes each env on its own training rows and runs the
cold start when any env is below the threshold: ``trainer.cold_start_demos``
demonstrations per env, from each env's builder, and one SFT over all of them.

The probe's result and the SFT model are cached by content under
``$AGENTGYM_CACHE/cold_start/`` (default ``~/.cache/agentgym``): the key hashes the
starting model's files, the env, the training rows, the corpus or tools the
demonstrations come from, the budgets and the SFT settings, so a second run with the same
inputs reuses them, and any change of input builds anew. ``RUN_DIR/cold_start/
cold_start.json`` records what happened (probe figures, demonstrations, SFT loss, timings,
the model RL started from); a resumed run reads it back.

The stage is :mod:`.stage` (:func:`prepare`, what to do and in which order); the probe and
the held-out "before" eval are :mod:`.probe`; the demonstrations :mod:`.demos`; the SFT
:mod:`.sft_stage`; the cache keys, records and published models :mod:`.records`.
"""

from __future__ import annotations

from agentgym.trainers.cold_start.stage import prepare

__all__ = ["prepare"]
