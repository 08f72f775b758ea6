"""Baselines compared with WIDE in §4.1: SkipGPT (dynamic depth) and static width pruning.

* :mod:`wide.baselines.skipgpt`: SkipGPT is ``WideConfig(method="skipgpt")`` (one router per attention /
  FFN module, whole-module gates) run through the same :class:`wide.model.WideModel`, loss and
  calibration; this module adds the router-capacity matching of §4.1.
* :mod:`wide.baselines.static`: calibration-scored structured pruning of GQA head groups and FFN channel
  groups, the same for every token, as a fixed mask and as a physically smaller model.
"""
