"""horovod_sbc's benchmarks (not part of the installed package): ``python -m benchmarks.bench``
from the repository root; ``make bench`` runs them all. See ``docs/benchmarks.md``."""
