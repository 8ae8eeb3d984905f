"""One module per method's numerics (``dpo``, ``ppo``, ``grpo``: pure functions of tensors, tested against naive
loops) and one per training loop (``sft``, ``rm``, ``dpo_train``, ``ppo_train``, ``grpo_train``, ``distill``), each
loop on the chassis (engine/core/). A loop imports no other method's loop; it may use another method's numerics."""
