"""``hydra/sweeper=optuna`` on a current optuna: the framework's own Hydra sweeper plugin.

Hydra finds plugins in the ``hydra_plugins`` namespace package; this one registers the
``hydra/sweeper=optuna`` config (and its ``hydra/sweeper/sampler`` group) and the sweeper
class. The study itself is ``reprotrain.tools.sweeps.optuna_sweeper``. It stands in for
hydra-optuna-sweeper, whose releases (1.2, 1.3) require optuna<3, until a release serves.
"""
