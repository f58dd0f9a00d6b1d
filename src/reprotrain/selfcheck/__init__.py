"""The framework's own tiny job (``experiment=selfcheck``: a small conv net, synthetic images):
what benchmarks, drills, the GPU check and the framework's tests train, never the user's code
(its configs: ``conf/`` here, registered by ``reprotrain.conf``; docs/project-layout.md)."""
