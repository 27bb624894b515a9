"""Sizing: the pure arithmetic of a run, no torch and no transformers.

Preset shapes as data (:mod:`.presets`), model shapes (:mod:`.shapes`), the device table
(:mod:`.devices`), the parallel-layout validator (:mod:`.layout`), communication volume (:mod:`.comm`),
and the analytic memory estimate, plan search and OOM hint built on them (:mod:`.setup`,
:mod:`.activations`, :mod:`.estimator`, :mod:`.plan`, :mod:`.oom`). The bottom layer of canntrain_core:
it imports nothing above ``errors``; the recipe schema, the model builders, the engine and the memory
tools all read it.
"""
