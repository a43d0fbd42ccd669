"""quern where people already train: PyTorch (:mod:`quern.interop.torch`) and grain (:mod:`quern.interop.grain`).

The adapters live here, not at the package root, because the repository root is the
package ``quern``: a root ``torch.py`` or ``grain.py`` would shadow the real libraries
for anyone running Python in the checkout. Neither library is imported until its
adapter is (``pip install 'quern[torch]'``; grain is a dependency of the benchmarks and
tests, ``pip install grain``).
"""
