"""Every reward of a job: the grader specs and their rule scoring (``graders``, torch-free: the API validates a
spec's ``reward`` with it), scoring with a reward model (``reward_model``) and the job's reward of its samples
(``function``, a grader or a reward model on every rank). Importing this package imports neither."""
