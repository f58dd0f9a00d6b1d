"""The framework's own tiny job: a small conv net and synthetic images.

Benchmarks (``make bench``), drills (``make drill``), the GPU check, the DDP self-check and
the framework's tests train this job, never the user's models or datasets, so a project can
replace or delete everything in its own package and these keep working. Its configs live in
``conf/`` next to this file and reach Hydra through the ConfigStore (``reprotrain.conf``):
``experiment=selfcheck`` (with ``dataset=selfcheck_images`` and ``model=selfcheck_net``).
``make selfcheck`` (``__main__.py``) runs it twice, one SIGKILLed and resumed, bitwise."""
