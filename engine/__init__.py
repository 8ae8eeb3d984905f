"""The training engine: one loop per job type on a shared chassis, checkpoints and generation.

- ``spec/``: torch-free, what the API validates and the workers read: the job spec, the hyperparameter configs and
  the job-type registry (``config``), dataset rows, model references, hub access, the policy-loss registry.
- ``rewards/``: every reward: the torch-free grader specs and rule scoring (``graders``), scoring with a reward
  model (``reward_model``) and the job's reward of its samples (``function``).
- ``core/``: the chassis every method uses: the learner, rollouts, the online methods' shared stages, the run's
  bookkeeping (``loop``), models, generation, data, checkpoints, the ranks of a job, tensor ops, the collapse monitor.
- ``methods/``: one module per method's numerics (``dpo``, ``ppo``, ``grpo``: pure functions of tensors) and one per
  loop (``sft``, ``rm``, ``dpo_train``, ``ppo_train``, ``grpo_train``, ``distill``).
- ``session/``: a training session's operations for the Tinker-compatible API, on the chassis: the SDK's protobuf
  bodies as tensors (``wire``), Tinker's losses as sums over tokens on the registry's policy losses (``losses``),
  its sampling (``sampler``), a trained model and its per-step AdamW (``models``).
- the harness, here: ``run`` (a job to its loop), ``cli`` (``python -m engine.cli``), ``demo``, ``callbacks``,
  ``tracking`` (experiment trackers) and ``builtin/`` (the built-in model, tokenizer and tasks).

It imports nothing of the service (no web, queue or database code) and reads no environment:
config comes in as arguments and results leave through :class:`engine.callbacks.Callbacks`.
"""
