"""How a policy version travels from the learner to the rollout side: one publisher and one loader interface
(`base.py`), an implementation per transport (`file.py`, `hf_dir.py`, `distributed.py`)."""
