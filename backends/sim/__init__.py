"""Simulated replicas: the native engine's scheduler and block manager without a model, each step taking the
time a device profile's step-time model gives it (``step_time.py``, ``profile.py``, ``fit.py``), served over
HTTP as any native deployment (``runner.py``) or run many at once on a virtual clock (``virtual.py``)."""
