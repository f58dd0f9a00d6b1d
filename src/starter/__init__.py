"""Your room: the reference job as an example to replace.

The task (what a step computes), the models and the datasets of the reference
CIFAR-10/ResNet job live here, and `conf/` points at them. Edit, rename or delete them
freely; the framework (`reprotrain`) never imports this package.
"""
